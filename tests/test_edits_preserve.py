"""MEMIT's preservation keys (held-out subjects of the edited relations kept in place by the closed
form), the neighbor rule of SCORE EDITS for edits fitted together, and the data files: the tuning
set and the preservation corpus share no prompt or subject with the scored edits, and nothing reads
them by default."""

from __future__ import annotations

import json
from pathlib import Path

import edits_fixtures
import numpy as np
import pytest

import vindex3
from vindex3.edits import EditedModel, FitSettings, Patch, memit_solve
from vindex3.edits.fit import make_edits, preservation, probe, request, subject_position
from vindex3.edits.score import Case, load_cases, score
from vindex3.errors import QueryRefused

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).parents[1]
PROMPT = "The capital of France is"


def test_preserving_closed_form_is_the_numpy_least_squares():
    rng = np.random.default_rng(1)
    I, H, n, m, N = 24, 8, 2, 5, 40
    X = rng.standard_normal((N, I))
    C = X.T @ X / N
    K = rng.standard_normal((I, n)).astype(np.float32)
    R = rng.standard_normal((H, n)).astype(np.float32)
    Kp = rng.standard_normal((I, m)).astype(np.float32)
    lam, ridge, mu = 2.0, 0.01, 3.0
    left, A = memit_solve(K, R, C, lam, ridge, Kp, mu)
    got = left.astype(np.float64) @ A.astype(np.float64)
    # the same objective solved another way: |dW K - R|² + lam tr(dW reg dW^T) + mu |dW Kp|² is the
    # least squares of dW [K, sqrt(lam) L, sqrt(mu) Kp] = [R, 0, 0] with reg = L L^T (Cholesky)
    reg = C + ridge * np.mean(np.diag(C)) * np.eye(I)
    L = np.linalg.cholesky(reg)
    Kd, Pd = K.astype(np.float64), Kp.astype(np.float64)
    big = np.concatenate([Kd, np.sqrt(lam) * L, np.sqrt(mu) * Pd], axis=1)  # [I, n + I + m]
    rhs = np.concatenate([R.astype(np.float64), np.zeros((H, I + m))], axis=1)
    want = np.linalg.lstsq(big.T, rhs.T, rcond=None)[0].T
    # A is rounded to float32 once: its relative error (6e-8) times |R| bounds the difference (measured 1e-7 here)
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))
    # mu = 0 (or no keys) is MEMIT's closed form unchanged
    assert np.array_equal(memit_solve(K, R, C, lam, ridge, Kp, 0.0)[1], memit_solve(K, R, C, lam, ridge)[1])
    # a heavy weight keeps the preserved keys' outputs: |dW Kp| falls with mu
    kept = [np.abs(np.matmul(*memit_solve(K, R, C, lam, ridge, Kp, w)).astype(np.float64) @ Pd).max()
            for w in (0.0, 1.0, 1e4)]
    assert kept[0] > kept[1] > kept[2] and kept[2] < 1e-3 * kept[0]


@pytest.fixture(autouse=True, scope="module")
def small_bank(tmp_path_factory):
    with edits_fixtures.small_bank(tmp_path_factory.mktemp("bank")) as path:
        yield path


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    return vindex3.open(tiny_llama_container)


def _corpus(path: Path, lines) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


@pytest.mark.numeric
def test_preservation_keeps_the_held_out_subjects_keys(c, tmp_path):
    held = [{"prompt": "The capital of Italy is", "subject": "Italy"},
            {"prompt": "The capital of Spain is", "subject": "Spain"}]
    corpus = _corpus(tmp_path / "keep.jsonl", held)
    r = request(c, PROMPT, " Rome", entity="France")
    outs = {}
    for mu in (0.0, 1e6):
        st = FitSettings(lam_subject=10.0, contexts=0, preserve=corpus if mu else None, preserve_weight=mu)
        p = Patch(name="x", base_digest=c.digest, base_name=c.name)
        make_edits(c, p, [request(c, r.prompt, r.target, r.entity)], "memit", [1, 2], st)
        outs[mu] = p
    rec = outs[1e6].edits[0].fit["preservation"]
    assert rec["corpus"] == "keep.jsonl" and rec["keys"] == 2 and rec["weight"] == 1e6
    assert outs[0.0].edits[0].fit["preservation"] is None
    # each layer's term applied to the held-out subjects' keys (read before the writes, as the fit does)
    from vindex3.edits.overlay import dec

    keys = preservation(c, [r], [1, 2], FitSettings(preserve=corpus, preserve_weight=1.0))[0]
    out = {}
    for mu, p in outs.items():
        out[mu] = []
        for layer, w in zip([1, 2], p.edits[0].writes):
            dW = dec(w.left, (w.shape[0], w.rank)).astype(np.float64) @ dec(w.right, (w.rank, w.shape[1]))
            out[mu].append(float(np.abs(dW @ keys[layer]).max()))
    # measured: the unpreserved terms move the held-out keys' outputs by 4e-3 and 2e-3, the preserved
    # ones by 4e-11 and 2e-10 (below 1e-7 of that); 1e-3 of it separates them with room for any BLAS
    assert all(k < 1e-3 * u for k, u in zip(out[1e6], out[0.0])), out
    # and the edit is still written: its own subject's residual moves at the value's layer
    ids, pos = subject_position(c.tokenizer, PROMPT, "France")
    assert np.abs(probe(EditedModel(c, [outs[1e6]]).executor(), ids, [2]).h[2][pos]
                  - probe(c.executor(), ids, [2]).h[2][pos]).max() > 1e-2


@pytest.mark.parametrize(("lines", "weight", "says"), [
    ([{"prompt": PROMPT, "subject": "France"}], 1.0, "holds the edited prompt 'The capital of France is'"),
    ([{"prompt": "The capital of Italy is", "subject": "Italy"}], 0.0, "with weight 0 keeps nothing"),
    ([{"prompt": "The capital of Italy is"}], 1.0, 'line 1: a preservation line is {"prompt": text, "subject": text}'),
    ([{"prompt": "The capital of Italy is", "subject": "Rome"}], 1.0, "the entity 'Rome' does not occur"),
])
def test_a_bad_preservation_corpus_is_refused_by_name(c, tmp_path, lines, weight, says):
    st = FitSettings(preserve=_corpus(tmp_path / "keep.jsonl", lines), preserve_weight=weight)
    with pytest.raises(QueryRefused) as e:
        preservation(c, [request(c, PROMPT, " Rome", entity="France")], [1, 2], st)
    assert says in e.value.message


def test_a_neighbor_the_batch_edits_expects_the_batch_target(c):
    # France -> ' Rome' and Italy -> ' Berlin' fitted together: Italy's prompt, France's neighbor,
    # is expected to give ' Berlin' (what the batch asked), not the file's unedited answer
    cases = [Case(prompt=PROMPT, subject="France", target="Rome", original="Paris",
                  neighbors=[{"prompt": "The capital of Italy is", "answer": "Madrid"},
                             {"prompt": "The capital of Spain is", "answer": "Madrid"}]),
             Case(prompt="The capital of Italy is", subject="Italy", target="Berlin", original="Madrid",
                  neighbors=[{"prompt": PROMPT, "answer": "Paris"}]),
             Case(prompt="The capital of Spain is", subject="Spain", target="Rome", original="Madrid",
                  neighbors=[{"prompt": "The capital of Japan is", "answer": "Tokyo"}])]
    st = FitSettings(lam_subject=10.0, contexts=0)
    p = Patch(name="all", base_digest=c.digest, base_name=c.name)
    make_edits(c, p, [request(c, x.prompt, x.target, x.subject) for x in cases], "memit", [1, 2], st)
    r = score(c, EditedModel(c, [p]), cases, kl=False)
    # case 0: Italy's neighbor is edited (-> ' Berlin'); Spain's is edited to 'Rome', case 0's own
    # target's token, so it cannot be told apart and is left out
    assert (r.cases[0].neighbors_edited, r.cases[0].neighbors_undecidable) == (2, 1)
    assert (r.cases[1].neighbors_edited, r.cases[1].neighbors_undecidable) == (1, 0)
    assert (r.cases[2].neighbors_edited, r.neighbors_edited, r.neighbors_undecidable) == (0, 3, 1)
    # the rule applies only to what the overlay edits: the unedited model scores every neighbor as written
    assert score(c, c, cases, kl=False).neighbors_edited == 0


def _subjects_and_prompts(cases):
    subjects = {x.subject for x in cases}
    prompts = {x.prompt for x in cases} | {q for x in cases for q in x.paraphrases}
    neighbors = {n.prompt for x in cases for n in x.neighbors}
    return subjects, prompts, neighbors


def test_the_tuning_set_and_the_preservation_corpus_are_held_out_from_the_scored_edits():
    scored = load_cases(DATA / "edits_smollm2.jsonl")
    tune = load_cases(DATA / "edits_smollm2_tune.jsonl")
    keep = [json.loads(x) for x in (DATA / "edits_smollm2_preserve.jsonl").read_text().splitlines() if x.strip()]
    s_sub, s_prompts, s_nb = _subjects_and_prompts(scored)
    t_sub, t_prompts, t_nb = _subjects_and_prompts(tune)
    k_sub, k_prompts = {x["subject"] for x in keep}, {x["prompt"] for x in keep}
    assert len(tune) == 10 and all(len(x.paraphrases) == 2 and len(x.neighbors) == 3 for x in tune)
    assert not t_sub & s_sub and not (t_prompts | t_nb) & (s_prompts | s_nb)  # tuning: other subjects, other prompts
    assert not k_prompts & (s_prompts | s_nb | t_prompts | t_nb)  # preservation: none of the scored or tuning prompts
    assert not any(s in p for s in k_sub for p in s_prompts | s_nb | t_prompts | t_nb)  # nor their subjects


def test_nothing_reads_the_held_out_files_by_default():
    st = FitSettings()
    assert st.preserve is None  # preservation is named or absent
    for f in [*(ROOT / "vindex3").rglob("*.py"), *(ROOT / "lql").rglob("*.py")]:
        text = f.read_text()
        assert "edits_smollm2_tune" not in text and "edits_smollm2_preserve" not in text, f
    bench = (ROOT / "bench" / "edits_smollm2.py").read_text()
    assert 'default="tests/data/edits_smollm2.jsonl"' in bench and "edits_smollm2_tune" not in bench


def test_score_edits_names_the_neighbors_its_overlay_edits(tiny_llama_container, tmp_path, monkeypatch):
    import shutil

    import lql

    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    monkeypatch.chdir(tmp_path)
    lines = [{"prompt": PROMPT, "subject": "France", "target": "Rome", "original": "Paris",
              "neighbors": [{"prompt": "The capital of Italy is", "answer": "Madrid"}]},
             {"prompt": "The capital of Italy is", "subject": "Italy", "target": "Berlin", "original": "Madrid"}]
    (tmp_path / "edits.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = lql.Session(str(tmp_path / "tiny.vindex3"))
    r = s.execute_one("SCORE EDITS ON 'edits.jsonl' MODE MEMIT LAYERS 1-2")
    assert (r.neighbors_edited, r.rows[0].neighbors_edited, r.neighbors_undecidable) == (1, 1, 0)
    assert "1 neighbor prompt(s) are edited by the overlay itself" in r.to_text()
    assert s.execute_one("SCORE EDITS ON 'edits.jsonl'").neighbors_edited == 0  # nothing fitted: as written


def test_lql_preserve_names_its_corpus(tiny_llama_container, tmp_path, monkeypatch):
    import shutil

    import lql
    from lql.errors import LqlError

    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    monkeypatch.chdir(tmp_path)
    _corpus(tmp_path / "keep.jsonl", [{"prompt": "The capital of Italy is", "subject": "Italy"}])
    s = lql.Session(str(tmp_path / "tiny.vindex3"))
    r = s.execute_one("INSERT INTO EDGES (prompt, target, entity) VALUES ('The capital of France is', ' Rome', 'France') "
                      "LAYERS 1-2 MODE MEMIT PRESERVE 'keep.jsonl'")
    rec = r.edits[0].fit["preservation"]
    assert rec["corpus"] == "keep.jsonl" and rec["keys"] == 1 and rec["weight"] == FitSettings().preserve_weight
    with pytest.raises(LqlError) as e:
        s.execute_one("INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Rome') MODE KNN "
                      "PRESERVE 'keep.jsonl'")
    assert "PRESERVE names keys MEMIT's closed form keeps; MODE KNN has no closed form" in e.value.message
