"""Vocabulary-cut draft heads: the kept tokens are the corpus's most frequent ids, the cut head's
logits equal the full head's on them bit for bit, cut tokens are never proposed, and speculation
with a cut draft still yields the full model's greedy tokens."""

from pathlib import Path

import numpy as np
import pytest

import vindex3
from vindex3.draft import greedy_generate, speculative_generate
from vindex3.draft.bank import default_bank, load_prompts
from vindex3.draft.seeds import SEED_TEXTS
from vindex3.draft.vocab import VocabCut, count_tokens, cut_executor, fit_vocab_cut
from vindex3.errors import DerivedStale, VindexError

ROOT = Path(__file__).resolve().parents[1]
CORPUS = [[1, 5, 5, 9, 9, 9, 33, 33, 33, 33, 7], [9, 100, 100, 2, 5]]
PROMPT = [1, 5, 9, 33, 100, 7]
N = 16


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    x = tiny_llama_container
    return vindex3.open(x) if isinstance(x, (str, Path)) else x


def test_seed_corpus_is_not_the_prompt_bank():
    bank = [p.text for p in load_prompts(default_bank(ROOT)) if p.text]
    assert not any(s.startswith(b) or b.startswith(s) for s in SEED_TEXTS for b in bank)


def test_kept_ids_are_the_most_frequent_ties_to_the_lower_id(c):
    counts = count_tokens(c, CORPUS)
    assert counts[33] == 4 and counts[9] == 4 and counts[5] == 3 and counts.sum() == 16
    cut = fit_vocab_cut(c, 4, CORPUS, corpus="toy")
    # 9 and 33 (4 each), 5 (3), then 100 (2)
    assert cut.kept == [5, 9, 33, 100]
    assert cut.k == 4 and cut.tokens_counted == 16 and cut.kept_share == pytest.approx(13 / 16)
    assert cut.container_digest == c.digest and cut.corpus == "toy" and cut.texts == 2
    # a 1-count tie between 1, 2 and 7: the lower id is kept
    assert fit_vocab_cut(c, 5, CORPUS).kept == [1, 5, 9, 33, 100]


@pytest.mark.parametrize("depth", [1, 2, None])
def test_cut_logits_equal_the_full_heads_on_kept_tokens_bit_for_bit(c, depth):
    cut = fit_vocab_cut(c, 40, [list(range(0, 200, 3))])
    kept = cut.ids()
    full_ex = c.executor(slice=vindex3.Draft(depth) if depth else vindex3.Full())
    cut_ex, _ = cut_executor(c, depth, cut)
    fs, cs = full_ex.start(), cut_ex.start()
    fs.prefill(PROMPT)
    cs.prefill(PROMPT)
    for tok in (3, 17, 250, 8):
        a, b = fs.step(tok), cs.step(tok)
        assert b.shape == (40,)
        assert np.array_equal(a[kept], b)


def test_cut_draft_never_proposes_a_cut_token_and_speculation_equals_greedy(c):
    cut = fit_vocab_cut(c, 24, [list(range(0, 120, 5))])
    want = greedy_generate(c, PROMPT, N).tokens
    # the draft's logits have one column per kept token: its argmax can only name a kept id
    ex, _ = cut_executor(c, 2, cut)
    st = ex.start()
    assert st.prefill(PROMPT).shape == (len(PROMPT), 24)
    r = speculative_generate(c, PROMPT, N, 2, 3, vocab_cut=cut)
    assert r.tokens == want
    assert r.vocab_top == 24 and r.draft_steps > 0


def test_recurrent_cut_speculation_equals_greedy(containers):
    fc = vindex3.open(containers("granitemoehybrid"))
    cut = fit_vocab_cut(fc, 64, [list(range(0, 320, 2))])
    r = speculative_generate(fc, PROMPT, N, 1, 3, vocab_cut=cut)
    assert r.rollback == "snapshot" and r.tokens == greedy_generate(fc, PROMPT, N).tokens


def test_cut_is_refused_on_another_container(c, containers, tmp_path):
    cut = fit_vocab_cut(c, 8, CORPUS)
    cut.save(tmp_path / "cut.json")
    again = VocabCut.load(tmp_path / "cut.json")
    assert again == cut
    other = vindex3.open(containers("qwen3"))
    with pytest.raises(DerivedStale, match="vocabulary cut was counted on container"):
        cut_executor(other, 1, again)


@pytest.mark.parametrize("k, needle", [(0, "VOCAB TOP must be an integer ≥ 1"), (10**6, "more than the vocabulary")])
def test_impossible_cuts_are_refused(c, k, needle):
    with pytest.raises(VindexError, match=needle):
        fit_vocab_cut(c, k, CORPUS)


def test_default_corpus_is_the_seed_list_with_provenance(c):
    cut = fit_vocab_cut(c, 16)
    assert cut.corpus == "seeds" and cut.texts == len(SEED_TEXTS) and cut.tokens_counted > 0


def test_lql_speculate_with_a_vocabulary_cut(c, tiny_llama_container):
    import lql

    s = lql.Session()
    s.execute(f"OPEN '{tiny_llama_container}'")
    (plain,) = s.execute("INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12")
    (r,) = s.execute("INFER TOKENS (1, 5, 9, 33, 100, 7) GENERATE 12 SPECULATE DEPTH 2 VOCAB TOP 64 LOOKAHEAD 3")
    assert r.generated_ids == plain.generated_ids and r.matches_plain is True
    assert r.vocab_top == 64 and r.vocab_cut["corpus"] == "seeds" and r.vocab_cut["texts"] == len(SEED_TEXTS)
    assert "head over the 64 most frequent tokens" in r.to_text()
    for bad, needle in [("GENERATE 4 SPECULATE DRAFTER LOOKUP VOCAB TOP 8", "syntax error"),
                        ("GENERATE 4 VOCAB TOP 8", "syntax error"),
                        ("GENERATE 4 SPECULATE DEPTH 1 VOCAB TOP 0", "VOCAB TOP must be at least 1")]:
        with pytest.raises(lql.LqlError, match=needle):
            s.execute(f"INFER TOKENS (1, 2) {bad}")
