"""Prompt-lookup speculation: proposals come from earlier n-grams of the context, never from
weights, and the output is the full model's greedy continuation, also where state recurs and
rejected proposals are rolled back by snapshot and replay."""

from pathlib import Path

import pytest

import lql
import vindex3
from vindex3.draft import LookupIndex, greedy_generate, lookup_generate
from vindex3.draft.lookup import DEFAULT_NGRAM, VERIFY_COST, LookupDrafter
from vindex3.errors import VindexError

# a prompt that repeats itself, so lookup has something to propose from the first round
PROMPT = [1, 5, 9, 33, 100, 7, 1, 5, 9, 33, 12, 7, 1, 5]
N = 24


def _open(x):
    return vindex3.open(x) if isinstance(x, (str, Path)) else x


def test_index_proposes_the_continuation_of_the_longest_recent_match():
    ix = LookupIndex(3)
    ix.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    # the suffix (1, 2, 3) occurred at 0..2, followed by 4, 9, 2
    assert ix.propose(3) == [4, 9, 2]
    ix.extend([7])
    # (3, 7), (7) never occurred before: nothing to propose
    assert ix.propose(4) == []
    ix.extend([2, 3])
    # (7, 2, 3) and no longer match; (2, 3) most recently at 10..11, followed by 7, 2, 3
    assert ix.propose(2) == [7, 2]
    assert ix.propose(0) == []


def test_index_prefers_the_longer_ngram_over_the_more_recent_one():
    ix = LookupIndex(2)
    ix.extend([8, 5, 1, 9, 5, 2, 8, 5])
    # (8, 5) occurred at 0..1 (followed by 1); 5 alone most recently at 4 (followed by 2)
    assert ix.propose(1) == [1]
    assert LookupIndex(1).propose(3) == []


def test_index_never_proposes_past_the_context():
    ix = LookupIndex(3)
    ix.extend([4, 4])
    assert ix.propose(5) == [4]  # (4) at 0, followed by the one token there is


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    return _open(tiny_llama_container)


@pytest.mark.parametrize("ngram", [1, 2, 3, 8])
@pytest.mark.parametrize("lookahead", [1, 3, 6])
@pytest.mark.parametrize("policy", ["adaptive", "fixed"])
def test_lookup_output_equals_greedy(c, ngram, lookahead, policy):
    want = greedy_generate(c, PROMPT, N).tokens
    r = lookup_generate(c, PROMPT, N, lookahead, ngram, policy=policy)
    assert r.tokens == want
    assert r.drafter == "lookup" and r.depth is None and r.ngram == ngram
    assert r.rollback == "truncate" and r.draft_steps == 0
    # the repeated prompt gives lookup something to verify (adaptive: not on one-token matches,
    # whose prior acceptance is below what a verified position costs)
    assert r.proposed > 0 or (policy == "adaptive" and ngram == 1)
    assert sum(r.accepted_histogram) == r.rounds
    assert r.accepted == sum(j * n for j, n in enumerate(r.accepted_histogram))
    # a round without a match is one plain step, so every full-model call emits 1 + accepted tokens
    assert 1 + (r.full_model_calls - 1) + r.accepted == N


def test_lookup_compare_plain(c):
    r = lookup_generate(c, PROMPT, N, 4, compare_plain=True)
    assert r.matches_plain is True
    assert r.speedup == pytest.approx(r.plain.seconds / r.seconds)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_lookup_short_generations(c, n):
    assert lookup_generate(c, PROMPT, n, 4).tokens == greedy_generate(c, PROMPT, n).tokens


@pytest.mark.parametrize("kwargs, needle", [
    ({"ngram": 0}, "NGRAM must be an integer ≥ 1"),
    ({"lookahead": 0}, "LOOKAHEAD must be an integer ≥ 1"),
    ({"n": -1}, "GENERATE count must be a non-negative integer"),
    ({"token_ids": []}, "at least one prompt token"),
])
def test_lookup_refusals(c, kwargs, needle):
    args = {"token_ids": PROMPT, "n": 4} | kwargs
    with pytest.raises(VindexError, match=needle):
        lookup_generate(c, **args)


@pytest.mark.parametrize("family", ["mamba2", "granitemoehybrid"])
def test_lookup_rolls_back_recurrent_state_exactly(containers, family):
    fc = vindex3.open(containers(family))
    want = greedy_generate(fc, PROMPT, N).tokens
    r = lookup_generate(fc, PROMPT, N, 4, 2, policy="fixed")  # fixed: rejections to roll back
    assert r.rollback == "snapshot"
    assert r.tokens == want
    # some proposal was rejected after another was kept, so a restore replayed accepted tokens
    assert r.proposed > r.accepted


def test_lql_speculate_lookup(c, tiny_llama_container):
    s = lql.Session()
    s.execute(f"OPEN '{tiny_llama_container}'")
    toks = ", ".join(map(str, PROMPT))
    (plain,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 16")
    (r,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 16 SPECULATE DRAFTER LOOKUP NGRAM 2 LOOKAHEAD 3")
    assert r.kind == "speculate" and r.drafter == "lookup" and r.ngram == 2 and r.depth is None
    assert r.generated_ids == plain.generated_ids and r.matches_plain is True
    (r,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 16 SPECULATE DRAFTER LOOKUP")
    assert r.ngram == DEFAULT_NGRAM and r.lookahead == 4 and r.generated_ids == plain.generated_ids
    assert "prompt lookup" in r.to_text()


def test_index_min_ngram_ignores_short_matches():
    ix = LookupIndex(3, 2)
    ix.extend([4, 1, 9, 1])
    assert ix.propose(2) == []  # only the unigram (1) recurs
    ix.extend([9])
    assert ix.propose(2) == [1, 9]  # (1, 9) at 1..2, followed by 1, 9


def test_lookup_with_min_ngram_equals_greedy(c):
    r = lookup_generate(c, PROMPT, N, 4, 3, min_ngram=2)
    assert r.tokens == greedy_generate(c, PROMPT, N).tokens
    with pytest.raises(VindexError, match="shortest lookup match"):
        lookup_generate(c, PROMPT, N, 4, 2, min_ngram=3)


def _replay(drafter, prompt, tokens):
    """(proposals, emitted) per round when ``tokens`` is what the full model picks (as
    vindex3.generate's drafted loop feeds a drafter)."""
    drafter.begin(prompt)
    drafter.accept(tokens[:1])
    done, rounds = 1, []
    while done < len(tokens):
        props = drafter.propose(len(tokens) - done - 1)
        j = 0
        while j < len(props) and props[j] == tokens[done + j]:
            j += 1
        emitted = props[:j] + [tokens[done + j]]
        rounds.append((props, emitted))
        done += len(emitted)
        drafter.accept(emitted)
    return rounds


def test_adaptive_lookup_proposes_as_far_as_a_draft_is_expected_to_pay():
    # a long copy: an 8-token match's prior acceptance is high, so the whole lookahead is proposed
    text = list(range(10, 30))
    d = LookupDrafter(8, 6)
    first = _replay(d, text + text[:8], text[8:16] + [99])[0][0]  # the first pick, text[8], extends the match
    assert first == text[9:15]
    # each further draft is proposed only while P(all of the first j accepted) > VERIFY_COST
    n = 8
    p, q, k = d.acceptance(n), d.continuation(n), 0
    while k < 6 and p > VERIFY_COST:
        k, p = k + 1, p * q
    assert k == 6
    # a one-token match is a guess below what a verified position costs: a plain step instead
    d1 = LookupDrafter(8, 6)
    assert d1.acceptance(1) <= VERIFY_COST
    assert _replay(d1, [5, 6, 7, 5], [8, 9])[0][0] == []


def test_adaptive_lookup_learns_from_rejections_within_the_generation():
    # a 2-token match starts above the cost; after its first drafts are rejected it stops proposing
    d = LookupDrafter(2, 4)
    assert d.acceptance(2) > VERIFY_COST
    for _ in range(6):
        d.tried[2] += 1  # rounds at match length 2 whose first draft was rejected
    assert d.acceptance(2) <= VERIFY_COST
    d.index.extend([1, 2, 3, 1, 2])
    assert d.propose(4) == []
    assert LookupDrafter(2, 4, policy="fixed").index.ngram == 2
