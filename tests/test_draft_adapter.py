"""Fitted exit adapters (tuned lens): the closed-form ridge fit agrees with numpy's lstsq, an
identity adapter changes no bit (Draft(L) with it equals Full), and a fitted adapter is refused
on another container or depth."""

from pathlib import Path

import numpy as np
import pytest

import vindex3
from vindex3.draft.adapter import (
    RIDGE_GRID,
    ExitAdapter,
    adapter_executor,
    choose_ridge,
    fit_adapter,
    hidden_pairs,
    ridge_fit,
)
from vindex3.errors import DerivedStale, VindexError
from vindex3.exec.engine import small_pass_threads

PROMPT = [1, 5, 9, 33, 100, 7]
CORPUS = [list(range(3, 200, 7)), [5, 17, 99, 3, 250, 42, 7, 7, 123, 310, 64, 1, 200, 11], list(range(300, 20, -9))]


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    x = tiny_llama_container
    return vindex3.open(x) if isinstance(x, (str, Path)) else x


def test_ridge_fit_without_ridge_equals_lstsq():
    rng = np.random.default_rng(7)
    X = rng.standard_normal((200, 12)).astype(np.float32)
    Y = (X @ rng.standard_normal((12, 12)) + rng.standard_normal(12) + 0.1 * rng.standard_normal((200, 12))).astype(np.float32)
    W, b = ridge_fit(X, Y, 0.0)
    Xa = np.hstack([X.astype(np.float64), np.ones((200, 1))])
    M, *_ = np.linalg.lstsq(Xa, Y.astype(np.float64), rcond=None)
    # both solve the same float64 problem (cond(Xa) = 1.50) by different factorizations; measured
    # max |Δ| = 4.4e-15 on coefficients up to 2.6: the bound 1e-10 leaves room for other BLAS orders
    assert np.allclose(W, M[:-1], rtol=0, atol=1e-10) and np.allclose(b, M[-1], rtol=0, atol=1e-10)


def test_ridge_fit_equals_lstsq_on_the_augmented_problem():
    rng = np.random.default_rng(8)
    X = rng.standard_normal((50, 10))
    Y = rng.standard_normal((50, 10))
    lam = 3.0
    W, b = ridge_fit(X, Y, lam)
    # ridge as plain least squares: rows sqrt(lam) I under X (with 0 for the bias column) and 0 under Y
    Xa = np.vstack([np.hstack([X, np.ones((50, 1))]), np.hstack([np.sqrt(lam) * np.eye(10), np.zeros((10, 1))])])
    Ya = np.vstack([Y, np.zeros((10, 10))])
    M, *_ = np.linalg.lstsq(Xa, Ya, rcond=None)
    # measured max |Δ| = 3.9e-16 (cond 2.03); 1e-10 as above
    assert np.allclose(W, M[:-1], rtol=0, atol=1e-10) and np.allclose(b, M[-1], rtol=0, atol=1e-10)


@pytest.mark.parametrize("bad, needle", [((np.zeros((0, 3)), np.zeros((0, 3)), 0.0), "N ≥ 1"),
                                         ((np.zeros((2, 3)), np.zeros((2, 3)), -1.0), "ridge must be")])
def test_ridge_fit_refusals(bad, needle):
    with pytest.raises(VindexError, match=needle):
        ridge_fit(*bad)


def test_identity_adapter_at_full_depth_is_bit_identical_to_full(c):
    L = c.graph.num_layers
    ex, _ = adapter_executor(c, L, ExitAdapter.identity(c, L))
    full = c.executor()
    a, f = ex.start(), full.start()
    assert np.array_equal(a.prefill(PROMPT), f.prefill(PROMPT))
    for tok in (3, 17, 250):
        assert np.array_equal(a.step(tok), f.step(tok))


def test_identity_adapter_changes_no_bit_of_a_draft(c):
    ex, _ = adapter_executor(c, 2, ExitAdapter.identity(c, 2))
    d = c.executor(slice=vindex3.Draft(2))
    assert np.array_equal(ex.start().prefill(PROMPT), d.start().prefill(PROMPT))


def test_fitted_adapter_reduces_the_residual_gap_and_maps_as_fitted(c, tmp_path):
    ad = fit_adapter(c, 2, CORPUS, corpus="toy", ridge=1e-3)
    f = ad.facts
    assert f.positions == sum(map(len, CORPUS)) and f.depth == 2 and f.corpus == "toy"
    assert f.fit_residual < f.identity_residual  # least squares can only do better than W = I, b = 0
    X, _ = hidden_pairs(c, 2, CORPUS[:1])
    ex, _ = adapter_executor(c, 2, ad)
    got = ex.start().prefill(CORPUS[0])
    with small_pass_threads():  # BLAS at the thread count the executor's own passes hold it to (same bytes)
        want = c.executor().readout(X @ ad.W + ad.b)  # the full model's own readout of the adapted residual
    assert np.array_equal(got, want)
    ad.save(tmp_path / "a.npz")
    again = ExitAdapter.load(tmp_path / "a.npz")
    assert np.array_equal(again.W, ad.W) and again.facts == ad.facts


def test_adapter_refused_on_another_container_or_depth(c, containers):
    ad = ExitAdapter.identity(c, 2)
    with pytest.raises(VindexError, match="fitted at depth 2, not 1"):
        adapter_executor(c, 1, ad)
    with pytest.raises(DerivedStale, match="exit adapter was fitted on container"):
        adapter_executor(vindex3.open(containers("qwen3")), 2, ad)


def test_speculation_with_a_fitted_adapter_equals_greedy(c, containers):
    from vindex3.draft import greedy_generate, speculative_generate
    from vindex3.draft.vocab import fit_vocab_cut

    want = greedy_generate(c, PROMPT, 16).tokens
    ad = fit_adapter(c, 2, CORPUS, ridge=1e-3)
    r = speculative_generate(c, PROMPT, 16, 2, 3, adapter=ad)
    assert r.tokens == want and r.adapter is True
    cut = fit_vocab_cut(c, 64, [list(range(0, 320, 2))])
    assert speculative_generate(c, PROMPT, 16, 2, 3, adapter=ad, vocab_cut=cut).tokens == want
    fc = vindex3.open(containers("granitemoehybrid"))
    r = speculative_generate(fc, PROMPT, 16, 1, 3, adapter=fit_adapter(fc, 1, CORPUS, ridge=1e-3))
    assert r.rollback == "snapshot" and r.tokens == greedy_generate(fc, PROMPT, 16).tokens


def _cv_by_hand(X, Y, text_of, head, grid, folds):
    """choose_ridge's table recomputed in the plainest way: fold k holds the texts whose rank
    among the distinct texts is k mod folds; every position is evaluated."""
    texts = sorted(set(text_of.tolist()))
    fold = np.array([texts.index(t) % folds for t in text_of])
    want = (Y @ head).argmax(-1)
    table = {}
    for r in grid:
        hit = 0
        for k in range(folds):
            tr, he = fold != k, fold == k
            W, b = ridge_fit(X[tr], Y[tr], r)
            hit += int((((X[he] @ W + b) @ head).argmax(-1) == want[he]).sum())
        table[f"{r:g}"] = hit / len(X)
    return table


def test_choose_ridge_is_held_out_top1_over_folds_of_texts():
    rng = np.random.default_rng(7)
    N, H, V = 240, 6, 11
    X = rng.standard_normal((N, H)).astype(np.float32)
    Y = (X @ rng.standard_normal((H, H)) + 0.8 * rng.standard_normal((N, H))).astype(np.float32)
    head = rng.standard_normal((H, V)).astype(np.float32)
    text_of = np.repeat(np.arange(12), 20)
    grid = (0.0, 1.0, 30.0, 1e3, 1e5)
    best, table = choose_ridge(X, Y, text_of, lambda h: h @ head, grid=grid, folds=4)
    by_hand = _cv_by_hand(X, Y, text_of, head, grid, 4)
    assert table.keys() == by_hand.keys()
    assert all(abs(table[k] - by_hand[k]) <= 1.5 / N for k in table)  # float32 readout vs float64: at most a near-tie flips
    top = max(table.values())
    assert best == max(r for r in grid if table[f"{r:g}"] == top)  # the best, ties to the larger ridge
    assert table["100000"] < top  # a ridge that crushes W to 0 predicts only the bias: it must lose here


def test_choose_ridge_refuses_a_corpus_of_fewer_texts_than_folds():
    X = np.ones((8, 3), np.float32)
    with pytest.raises(VindexError, match="needs at least 5 texts in the corpus; it holds 2"):
        choose_ridge(X, X, np.array([0, 0, 0, 0, 1, 1, 1, 1]), lambda h: h)


def test_fit_without_a_ridge_chooses_it_on_the_corpus_and_records_how(c):
    corpus = CORPUS + [list(range(7, 300, 11)), list(range(250, 2, -13)), [9, 8, 7, 6, 5, 4, 3, 2, 1, 40, 41, 42]]
    ad = fit_adapter(c, 2, corpus, corpus="toy")
    f = ad.facts
    assert f.ridge in RIDGE_GRID and f.ridge_choice.startswith("5-fold cross-validation")
    assert set(f.cv_top1) == {f"{r:g}" for r in RIDGE_GRID}
    assert f.cv_top1[f"{f.ridge:g}"] == max(f.cv_top1.values())
    given = fit_adapter(c, 2, corpus, corpus="toy", ridge=f.ridge)  # the same fit, the ridge given
    assert np.array_equal(given.W, ad.W) and given.facts.ridge_choice == "given" and given.facts.cv_top1 is None


def test_seed_continuations_are_reproducible_samples_after_each_seed(c):
    from vindex3.draft.seeds import SEED_TEXTS, seed_continuations

    a = seed_continuations(c, 6, rounds=2, seed=3)
    assert a == seed_continuations(c, 6, rounds=2, seed=3)  # seeded per round and text
    assert len(a) == 2 * len(SEED_TEXTS)
    for k, ids in enumerate(a):
        head = list(c.tokenizer.encode(SEED_TEXTS[k % len(SEED_TEXTS)]))
        assert ids[:len(head)] == head and len(head) < len(ids) <= len(head) + 6
    assert a[:len(SEED_TEXTS)] != a[len(SEED_TEXTS):]  # the rounds draw differently
    with pytest.raises(VindexError, match="rounds >= 1"):
        seed_continuations(c, 6, rounds=0)


def test_a_fitting_corpus_with_an_id_outside_the_vocabulary_is_refused_by_name(c):
    V = int(c.graph.vocab_size)
    with pytest.raises(VindexError, match=f"corpus token id {V} is outside the vocabulary \\[0, {V}\\)"):
        fit_adapter(c, 2, [[1, 2, 3], [4, V, 5]], ridge=1.0)
