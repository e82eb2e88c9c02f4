"""Prompt-lookup speculation: proposals come from earlier n-grams of the context, never from
weights, and the output is the full model's greedy continuation, also where state recurs and
rejected proposals are rolled back by snapshot and replay."""

from pathlib import Path

import pytest

import lql
import vindex3
from vindex3.draft import LookupIndex, greedy_generate, lookup_generate
from vindex3.draft.costs import PassCosts, pass_costs
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
    # a fixed cost curve: which drafts are proposed must not depend on the machine here
    r = lookup_generate(c, PROMPT, N, lookahead, ngram, policy=policy, verify_cost=VERIFY_COST)
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


def _best_k(d, n, cap):
    """The k maximizing E(k) - rate * cost(k + 1), by brute force over the closed form."""
    p, q, lam = d.acceptance(n), d.continuation(n), d.rate
    value = [1 + sum(p * q ** i for i in range(k)) - lam * d.costs.cost(k + 1) for k in range(cap + 1)]
    return max(range(cap + 1), key=lambda k: (value[k], -k))


def test_adaptive_lookup_proposes_as_far_as_a_draft_is_expected_to_pay():
    # a long copy: an 8-token match's prior acceptance is high, so the whole lookahead is proposed
    text = list(range(10, 30))
    d = LookupDrafter(8, 6)
    first = _replay(d, text + text[:8], text[8:16] + [99])[0][0]  # the first pick, text[8], extends the match
    assert first == text[9:15]
    assert _best_k(d, 8, 6) == 6 == d.worth(8, 6)
    # a one-token match is a guess below what a verified position costs: a plain step instead
    d1 = LookupDrafter(8, 6)
    assert d1.worth(1, 6) == 0 == _best_k(d1, 1, 6)
    assert _replay(d1, [5, 6, 7, 5], [8, 9])[0][0] == []


def test_cheaper_verification_raises_the_lookahead_by_itself():
    # the same match statistics, three cost curves: the proposal grows as a position gets cheaper
    ks = []
    for c in (0.6, 0.3, 0.1, 0.02):
        d = LookupDrafter(8, 8, verify_cost=c)
        ks.append(d.worth(3, 8))
        assert ks[-1] == _best_k(d, 3, 8)
    assert ks == sorted(ks) and ks[0] < ks[-1] == 8
    # a measured curve is read as it is: cost(2) dear, cost(3..) barely dearer proposes past 1
    steep = LookupDrafter(8, 4, verify_cost=[1.0, 1.9, 1.95, 2.0, 2.05])
    assert steep.worth(3, 4) == _best_k(steep, 3, 4) == 4


def test_pass_costs_curve_and_refusals():
    pc = PassCosts([1.0, 1.4, 1.3, 1.9])
    assert pc.curve() == [1.0, 1.4, 1.4, 1.9]  # a pass over more positions never costs less
    assert pc.cost(6) == pytest.approx(1.9 + 2 * 0.5)  # the last increment continues
    assert PassCosts.linear(0.25).curve(3) == [1.0, 1.25, 1.5]
    for bad in ([2.0, 3.0], [], [1.0, float("nan")], [1.0, -1.0]):
        with pytest.raises(VindexError, match="pass-cost curve starts at cost"):
            PassCosts(bad)
    with pytest.raises(VindexError, match="verify_cost must be a number in"):
        LookupDrafter(verify_cost=1.5)
    with pytest.raises(VindexError, match="verify_cost must be a number, a cost curve or None"):
        LookupDrafter(verify_cost="cheap")


def test_pass_costs_learn_from_the_rounds_run():
    pc = PassCosts([1.0, 1.5, 2.0], "measured", learns=True)
    pc.observe(3, 0.012)  # no plain step seen yet: nothing to divide by
    for _ in range(3):
        pc.observe(1, 0.010)
        pc.observe(3, 0.012)  # verifying 3 positions now costs 1.2 steps
    assert pc.cost(3) == pytest.approx(1.5)  # 1.2, raised to the unseen T = 2's measured 1.5
    for step in (0.010, 0.020, 0.040):  # the machine slows down between rounds of T = 2
        for _ in range(3):
            pc.observe(1, step)
        pc.observe(2, 1.1 * step)
    # each round is divided by the steps just before it: the slowdown cancels
    assert pc.curve() == pytest.approx([1.0, 1.1, 1.2])
    pc.observe(3, 1.0)  # one descheduled round does not move the median
    assert pc.cost(3) == pytest.approx(1.2)
    fixed = PassCosts([1.0, 1.5, 2.0])
    for _ in range(3):
        fixed.observe(1, 0.010)
        fixed.observe(3, 0.012)
    assert fixed.curve() == [1.0, 1.5, 2.0]  # a curve given by value never learns


def test_lookup_reads_this_process_measured_cost_curve(c):
    r = lookup_generate(c, PROMPT, N, 4, 3)  # verify_cost None: measured here, once per process
    assert r.tokens == greedy_generate(c, PROMPT, N).tokens
    assert r.verify_costs is not None and len(r.verify_costs) == 5 and r.verify_costs[0] == 1.0
    assert r.verify_costs == sorted(r.verify_costs)
    ex = c.executor()
    first = pass_costs(c, ex, 5)
    assert pass_costs(c, ex, 3) is first and first.source == "measured" and first.learns
    assert r.prefill_seconds is not None and 0 < r.prefill_seconds <= r.seconds


def test_adaptive_lookup_learns_from_rejections_within_the_generation():
    # a 2-token match starts above the cost; after its first drafts are rejected it stops proposing
    d = LookupDrafter(2, 4)
    assert d.worth(2, 4) > 0
    for _ in range(6):
        d.tried[2] += 1  # rounds at match length 2 whose first draft was rejected
    assert d.worth(2, 4) == 0
    d.index.extend([1, 2, 3, 1, 2])
    assert d.propose(4) == []
    assert LookupDrafter(2, 4, policy="fixed").index.ngram == 2


def test_measured_cost_curve_fits_a_tight_position_limit(tiny_llama_container):
    # the measurement holds a short context before its passes: it must stay inside the run's own
    # position limit, never refuse a generation that fits
    from vindex3.draft import costs

    c = vindex3.open(tiny_llama_container)
    prompt = [5, 17, 42, 7, 5, 17]
    costs._CACHE.clear()
    r = lookup_generate(c, prompt, 6, 4, 3, max_positions=len(prompt) + 6 - 1)
    assert r.tokens == greedy_generate(c, prompt, 6).tokens


# ---- a corpus outside the context (CorpusIndex) -------------------------------------------------


def test_corpus_index_chains_the_most_frequent_continuations_with_their_cells():
    from vindex3.draft.lookup import CorpusIndex, corpus_cell

    corpus = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 4, 5], [7, 8, 1, 2, 3]]
    ix = CorpusIndex(corpus, ngram=3)
    # (2, 3) was followed by 4 three times of three; then (2, 3, 4) by 5 twice and 6 once; (3, 4, 5)
    # ends two lines and is followed by nothing, so the chain stops
    assert ix.next([0, 2, 3]) == (4, 2, 3, 3)
    assert ix.chain([0, 2, 3], 4) == [(4, corpus_cell(2, 3, 3)), (5, corpus_cell(3, 2, 3))]
    assert corpus_cell(2, 3, 3) == (0, 4, 1) and corpus_cell(3, 2, 3) == (1, 2, 1)
    # the longest held suffix decides: (1, 2, 3) was followed by 4 twice of two
    assert ix.next([1, 2, 3]) == (4, 3, 2, 2)
    # a continuation seen once is still a proposal; its cell says how little that is worth
    assert ix.next([7, 8]) == (1, 2, 1, 1) and corpus_cell(2, 1, 1) == (0, 4, 0)
    # a one-token suffix is never used, and an unknown one proposes nothing
    assert ix.next([3]) is None and ix.chain([3], 4) == [] and ix.chain([42, 43], 4) == []
    assert ix.chain([0, 2, 3], 1) == [(4, (0, 4, 1))]
    # suffixes of six tokens and more share a row; shares fall in the bins their edges say
    assert corpus_cell(9, 10, 40)[0] == corpus_cell(6, 10, 40)[0] == 4 and corpus_cell(9, 10, 40)[1:] == (0, 2)
    assert [corpus_cell(2, c, 10)[1] for c in (2, 3, 5, 7, 9, 10)] == [0, 1, 2, 3, 4, 4]
    # a continuation seen once never falls in the 0.7-0.9 share bin (CORPUS_PRIOR's comment)
    assert {corpus_cell(2, 1, total)[1] for total in range(1, 50)} == {0, 1, 2, 4}


def test_the_corpus_gate_reads_the_table_and_learns_from_the_generation():
    """The adaptive policy proposes a corpus link only where the `CORPUS_PRIOR` cell's chance pays
    for its verification, and each verified link moves its cell's estimate."""
    from vindex3.draft import lookup as L

    cell_weak, cell_strong = L.corpus_cell(2, 1, 8), L.corpus_cell(6, 9, 9)
    # at 0.3 steps a verified position and a rate of one token a step, a link pays above 0.3
    assert L.CORPUS_PRIOR[cell_weak[0]][cell_weak[1]][cell_weak[2]] < 0.3
    assert L.CORPUS_PRIOR[cell_strong[0]][cell_strong[1]][cell_strong[2]] > 0.3
    weak = L.CorpusIndex([[1, 2, 3]] + [[1, 2, 10 + i] for i in range(7)], ngram=3)  # (1, 2) -> 3 once of 8
    d = L.LookupDrafter(8, 4, verify_cost=0.3, corpus=weak)
    d.begin([50, 1])
    d.accept((2,))  # the prefill's pick: the context, 50 1 2, repeats nothing
    assert d.propose(4) == []  # a one-in-eight continuation does not pay for a verified position
    strong = L.CorpusIndex([[7, 1, 2, 3, 4, 5, 6, 8]] * 9, ngram=8)
    d = L.LookupDrafter(8, 4, verify_cost=0.3, corpus=strong)
    d.begin([60, 1, 2, 3, 4, 5, 6])
    assert d.propose(4)[:1] == [8]
    before = d.corpus_chance(cell_strong)
    d.accept((9,))  # the full model disagreed
    assert d.corpus_tried[cell_strong] == 1 and d.corpus_kept[cell_strong] == 0
    assert d.corpus_chance(cell_strong) < before
    assert d.corpus_proposed >= 1 and d.corpus_accepted == 0


def test_corpus_index_is_bounded_before_it_is_built(monkeypatch):
    from vindex3.draft import lookup as L

    monkeypatch.setattr(L, "CORPUS_MAX_TOKENS", 10)
    with pytest.raises(VindexError, match=r"lookup corpus big\.jsonl holds 12 tokens; a corpus index holds at most 10"):
        L.CorpusIndex([[1] * 6, [2] * 6], source="big.jsonl")


def test_a_corpus_proposes_where_the_context_has_nothing_and_the_output_is_greedys(c, tmp_path):
    """A prompt that never repeats itself gives prompt lookup nothing to copy; a corpus holding
    the model's own continuation of a similar text proposes it, and the tokens are still the
    full model's greedy ones."""
    import json

    from vindex3.draft.lookup import corpus_index

    prompt = [3, 14, 15, 92, 65, 35]
    want = greedy_generate(c, prompt, N).tokens
    path = tmp_path / "corpus.jsonl"
    # the continuation twice, after other openings
    path.write_text("".join(json.dumps({"token_ids": [40 + i, 41 + i] + want}) + "\n" for i in range(2)))
    ix = corpus_index(c, str(path))
    assert ix.source == "corpus.jsonl" and ix.tokens == 2 * (2 + N) and len(ix.digest) == 64
    for policy in ("adaptive", "fixed"):
        plain = lookup_generate(c, prompt, N, 4, policy=policy, verify_cost=VERIFY_COST)
        r = lookup_generate(c, prompt, N, 4, policy=policy, verify_cost=VERIFY_COST, corpus=ix)
        assert r.tokens == want == plain.tokens
        assert r.corpus == "corpus.jsonl" and r.corpus_sha256 == ix.digest
        assert r.corpus_accepted > 0 and r.corpus_proposed >= r.corpus_accepted
        assert r.accepted >= r.corpus_accepted
        assert r.full_model_calls < plain.full_model_calls  # the corpus's copies saved model calls
        assert 1 + (r.full_model_calls - 1) + r.accepted == N


@pytest.mark.parametrize("line, needle", [
    ('{"token_ids": [1, 2, 999999]}', "token id 999999 is outside the vocabulary"),
    ('{"ids": [1, 2]}', 'line 1 holds neither a string "text" nor a non-empty list'),
    ("not json", "line 1 is not JSON"),
])
def test_a_corpus_is_refused_by_name(c, tmp_path, line, needle):
    from vindex3.draft.lookup import corpus_index

    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(VindexError, match=needle):
        corpus_index(c, str(path))


def test_lql_speculate_lookup_with_a_corpus(c, tiny_llama_container, tmp_path):
    import json

    prompt = [3, 14, 15, 92, 65, 35]
    want = greedy_generate(c, prompt, 16).tokens
    path = tmp_path / "own.jsonl"
    path.write_text("".join(json.dumps({"token_ids": [50 + i] + want}) + "\n" for i in range(6)))
    s = lql.Session()
    s.execute(f"OPEN '{tiny_llama_container}'")
    toks = ", ".join(map(str, prompt))
    (r,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 16 SPECULATE DRAFTER LOOKUP CORPUS '{path}' LOOKAHEAD 3")
    assert r.generated_ids == want and r.drafter == "lookup"
    assert r.corpus["file"] == "own.jsonl" and r.corpus["tokens"] == 6 * 17 and r.corpus["accepted"] > 0
    assert "corpus 'own.jsonl'" in r.to_text()
    (e,) = s.execute(f"EXPLAIN INFER TOKENS ({toks}) GENERATE 16 SPECULATE DRAFTER LOOKUP CORPUS '{path}'")
    assert "corpus 'own.jsonl'" in e.to_text()
    with pytest.raises(lql.LqlError, match="SPECULATE DRAFTER LOOKUP corpus"):
        s.execute(f"INFER TOKENS ({toks}) GENERATE 4 SPECULATE DRAFTER LOOKUP CORPUS '{tmp_path / 'missing.jsonl'}'")


def test_a_server_confines_the_lookup_corpus_to_its_data_directory(c, tiny_llama_container, tmp_path):
    pytest.importorskip("starlette", reason="SKIPPED LOUDLY: the server extra is not installed (pip install -e '.[dev]')")
    import json

    from server_fixtures import config
    from starlette.testclient import TestClient

    from lql.server.app import create_app

    prompt = [3, 14, 15, 92, 65, 35]
    line = "".join(json.dumps({"token_ids": [50 + i] + greedy_generate(c, prompt, 8).tokens}) + "\n" for i in range(6))
    data = tmp_path / "data"
    data.mkdir()
    (data / "own.jsonl").write_text(line)
    (tmp_path / "outside.jsonl").write_text(line)
    toks = ", ".join(map(str, prompt))
    with TestClient(create_app(config(tiny_llama_container, data_dir=data))) as client:
        def ask(corpus):
            q = f"INFER TOKENS ({toks}) GENERATE 8 SPECULATE DRAFTER LOOKUP CORPUS '{corpus}';"
            return client.post("/v1/query", json={"lql": q}).json()["results"][0]

        for outside in (str(tmp_path / "outside.jsonl"), "../outside.jsonl"):
            res = ask(outside)
            assert not res["ok"] and res["error"]["type"] == "PathRefusal", res
        res = ask("own.jsonl")
        assert res["ok"], res
        got = res["result"]["corpus"]
        # the corpus inside was read (whether its proposals pay depends on this process's measured
        # pass costs; tests above check what the corpus proposes)
        assert got["file"] == "own.jsonl" and got["tokens"] == 6 * 9 and got["proposed"] >= got["accepted"] >= 0


def test_a_corpus_file_is_bounded_and_must_be_regular_before_it_is_read(c, tmp_path, monkeypatch):
    """The reader FIT ADAPTER, FIT VOCAB CUT and the lookup corpus share refuses a file over its
    size bound, and a FIFO (which would block a reader forever), without reading them."""
    import os

    from vindex3.draft import adapter, lookup
    from vindex3.draft.lookup import corpus_index
    from vindex3.errors import PathRefused

    big = tmp_path / "big.jsonl"
    big.write_text('{"token_ids": [1, 2, 3]}\n' * 10)
    monkeypatch.setattr(adapter, "CORPUS_MAX_BYTES", 100)  # every corpus reader's bound
    with pytest.raises(PathRefused, match=r"corpus .*big\.jsonl.*at most 100 are read") as e:
        adapter.read_corpus(big)
    assert e.value.reason == "too_large"
    monkeypatch.setattr(lookup, "CORPUS_MAX_BYTES", 120)  # the lookup corpus's own, tighter one
    assert len(adapter.read_corpus(big, max_bytes=1000)) == 10
    with pytest.raises(PathRefused, match=r"at most 120 are read"):
        corpus_index(c, str(big))
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(PathRefused) as e:
        corpus_index(c, str(fifo))
    assert "pipe.jsonl" in str(e.value)


def test_a_lookup_corpus_without_lookup_is_refused_by_name():
    from lql.parser import parse_one

    s = parse_one("INFER 'x' GENERATE 4 SPECULATE DEPTH 2")
    bad = s.model_copy(update={"lookup_corpus": "c.jsonl"})
    with pytest.raises(lql.LqlError, match="a lookup CORPUS belongs to SPECULATE DRAFTER LOOKUP"):
        bad.check()
    parse_one("INFER 'x' GENERATE 4 SPECULATE DRAFTER LOOKUP CORPUS 'c.jsonl'").check()


def test_the_context_copy_and_the_corpus_chain_compete_by_expected_gain():
    """A one-token context match (first-token prior 0.26) loses to a corpus link held nine times
    of nine behind a three-token suffix; against a corpus link seen once of eight it wins."""
    from vindex3.draft import lookup as L

    prompt = [60, 6, 71, 2, 5]  # then 6: the context's longest recurring suffix is (6,), which copies 71
    strong = L.CorpusIndex([[9, 2, 5, 6, 8]] * 9, ngram=8)  # (2, 5, 6) -> 8, nine of nine
    weak = L.CorpusIndex([[9, 2, 5, 6, 8]] + [[9, 2, 5, 6, 20 + i] for i in range(7)], ngram=8)
    picks = {}
    for name, ix in (("strong", strong), ("weak", weak), ("none", None)):
        d = L.LookupDrafter(8, 4, verify_cost=0.05, corpus=ix)
        d.begin(prompt)
        d.accept((6,))
        picks[name] = (d.propose(4)[:1], d._from_corpus is not None)
    assert picks["none"] == ([71], False)
    assert picks["strong"] == ([8], True)
    assert picks["weak"] == ([71], False)
