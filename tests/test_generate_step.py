"""One generate step (vindex3.generate.generate_step) under every decode loop: it reproduces,
token for token, what INFER ... GENERATE / TOP, TRACE, the server's completions (greedy and
seeded nucleus sampling, stop ids) and plain greedy decoding produce."""

from __future__ import annotations

import re

import numpy as np
import pytest

import lql
import vindex3
from vindex3.errors import VindexError
from vindex3.generate import Sampler, Step, generate_step

PROMPT = [5, 17, 99, 3, 42, 8, 61]


def _records(path, ids, **kw) -> list[Step]:
    return list(generate_step(vindex3.open(path).executor().start(), ids, **kw))


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_infer_generate_and_top_are_one_generate_step(containers, family):
    path = containers(family)
    s = lql.connect(path)
    toks = ", ".join(map(str, PROMPT))
    (r,) = s.execute(f"INFER TOKENS ({toks}) TOP 5 GENERATE 12 EXACTLY")
    recs = _records(path, PROMPT, sampler=Sampler.greedy(), max_tokens=12, logits=True, top=5)
    assert [x.token for x in recs] == r.generated_ids and len(recs) == 12
    assert np.array_equal(recs[0].logits, r._logits)  # the prefill row INFER reports TOP from
    assert [(c.id, c.probability) for c in r.top] == list(recs[0].top)
    assert [x.bytes_read for x in recs] == [r.prefill_bytes, *r.decode_bytes]
    assert recs[0].fed == tuple(PROMPT) and recs[0].prompt and all(x.fed == (y.token,) for x, y in zip(recs[1:], recs))
    assert [x.position for x in recs] == list(range(len(PROMPT), len(PROMPT) + 12))
    (bare,) = s.execute(f"INFER TOKENS ({toks}) TOP 3")
    (only,) = _records(path, PROMPT, sampler=Sampler.greedy(), max_tokens=0, logits=True)
    assert only.token is None and np.array_equal(only.logits, bare._logits)


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_trace_is_the_prompt_fed_one_position_at_a_time(containers, family):
    path = containers(family)
    (t,) = lql.connect(path).execute(f"TRACE TOKENS ({', '.join(map(str, PROMPT))})")
    recs = _records(path, PROMPT, sampler=Sampler.greedy(), max_tokens=0, feed="step", logits=True)
    assert len(recs) == len(t.rows) == len(PROMPT) and all(x.token is None and x.prompt for x in recs)
    for row, x in zip(t.rows, recs):
        assert (row.position + 1, row.token_id, row.next_id) == (x.position, x.fed[0], int(np.argmax(x.logits)))
        assert (row.layers, row.bytes_read) == (list(x.executed_layers), x.bytes_read)


class _Catalog:
    """A tokenizer that spells every id, so the server's text deltas give back the ids."""

    has_tokenizer = True

    @staticmethod
    def decode(ids):
        return "".join(f"<{i}>" for i in ids)


class _Host:
    def __init__(self, path):
        self.container = vindex3.open(path)
        self.catalog = _Catalog()

    def executor(self, depth):
        return self.container.executor(slice=vindex3.Draft(depth) if depth else None)


def _server(path, **gen):
    from lql.server.completions import Generation, run

    g = Generation(ids=list(PROMPT), stops=[], **gen)
    events = list(run(_Host(path), g, None))
    text = "".join(e["delta"] for e in events)
    return [int(i) for i in re.findall(r"<(\d+)>", text)], events[-1]


@pytest.mark.parametrize("temperature, top_p, seed, depth", [(0.0, 1.0, None, None), (0.9, 1.0, 3, None),
                                                             (1.3, 0.8, 11, None), (0.7, 0.5, 2, 2)])
def test_server_completions_are_one_generate_step(containers, temperature, top_p, seed, depth):
    path = containers("llama")
    host = _Host(path)
    sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)
    free = list(generate_step(host.executor(depth).start(), PROMPT, sampler=sampler, max_tokens=16))
    ids, last = _server(path, max_tokens=16, temperature=temperature, top_p=top_p, seed=seed, stop_ids=(),
                        depth=depth)
    assert ids == [x.token for x in free] and last["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 16
    # a stop id ends both where it is first picked: counted, never spelled, never fed
    stop = free[9].token
    first = next(i for i, x in enumerate(free) if x.token == stop)
    recs = list(generate_step(host.executor(depth).start(), PROMPT, sampler=sampler, max_tokens=16, stop_ids=[stop]))
    ids, last = _server(path, max_tokens=16, temperature=temperature, top_p=top_p, seed=seed, stop_ids=(stop,),
                        depth=depth)
    assert len(recs) == first + 1 and recs[-1].stop and not any(x.stop for x in recs[:-1])
    assert ids == [x.token for x in recs[:-1]] and last["finish_reason"] == "stop"
    assert last["usage"]["completion_tokens"] == len(recs)


def test_greedy_generate_runs_on_generate_step(containers):
    from vindex3.draft import greedy_generate

    path = containers("mamba2")
    seen: list[int] = []
    out = greedy_generate(path, PROMPT, 9, on_token=seen.append)
    assert out.tokens == seen == [x.token for x in _records(path, PROMPT, sampler=Sampler.greedy(), max_tokens=9)]


def test_a_caller_that_stops_early_costs_no_call_and_observe_sees_every_record(containers):
    ex = vindex3.open(containers("llama")).executor()
    st = ex.start()
    seen: list[Step] = []
    gen = generate_step(st, PROMPT, sampler=Sampler.greedy(), max_tokens=50, observe=seen.append)
    assert st.position == 0  # nothing runs until the first record is asked for
    got = [next(gen) for _ in range(3)]
    gen.close()
    assert st.position == len(PROMPT) + 2 and seen == got  # the third pick was never fed


def test_refusals_name_the_argument(containers):
    st = vindex3.open(containers("llama")).executor().start()
    with pytest.raises(VindexError, match="temperature"):
        Sampler(temperature=-1.0)
    with pytest.raises(VindexError, match="top_p"):
        Sampler(temperature=1.0, top_p=0.0)
    with pytest.raises(VindexError, match="seed"):
        Sampler(temperature=1.0, seed=1.5)
    with pytest.raises(VindexError, match="max_tokens"):
        generate_step(st, PROMPT, sampler=Sampler.greedy(), max_tokens=-1)
    with pytest.raises(VindexError, match="prompt token"):
        generate_step(st, [], sampler=Sampler.greedy(), max_tokens=1)
    with pytest.raises(VindexError, match="feed"):
        generate_step(st, PROMPT, sampler=Sampler.greedy(), max_tokens=1, feed="batch")
    assert Sampler.greedy().describe() == "greedy"
    assert Sampler(temperature=0.7, top_p=0.9, seed=3).describe() == "temperature 0.7, top_p 0.9, seed 3"


class _Oracle:
    """A drafter that knows the greedy continuation and proposes it, wrong every third round
    (its proposal's second token is replaced), so rounds both keep and reject drafts."""

    name = "oracle"

    def __init__(self, want: list[int], k: int):
        self.want, self.k, self.ctx, self.rounds = want, k, 0, 0

    def begin(self, prompt):
        self.prompt = list(prompt)

    def accept(self, tokens):
        self.ctx += len(tokens)

    def propose(self, limit):
        self.rounds += 1
        props = self.want[self.ctx:self.ctx + min(self.k, limit)]
        if self.rounds % 3 == 0 and len(props) > 1:
            props[1] = (props[1] + 1) % 64
        return props


@pytest.mark.parametrize("family", ["llama", "mamba2"])
def test_drafted_generation_is_the_greedy_generation(containers, family):
    path = containers(family)
    want = [x.token for x in _records(path, PROMPT, sampler=Sampler.greedy(), max_tokens=20)]
    st = vindex3.open(path).executor().start()
    recs = list(generate_step(st, PROMPT, sampler=Sampler.greedy(), max_tokens=20, drafter=_Oracle(want, 4)))
    assert [t for r in recs for t in r.emitted] == want
    assert any(r.accepted for r in recs) and any(r.proposed and len(r.accepted) < len(r.proposed) for r in recs)
    # the stream holds the prompt and every generated token but the last
    assert st.position == len(PROMPT) + len(want) - 1 == recs[-1].position
    # rollback is asked of the state parts: mamba2's recurrence snapshots and replays
    assert any(r.calls == 2 for r in recs) == (family == "mamba2")


def test_a_stop_id_inside_accepted_drafts_ends_the_generation_there(containers):
    path = containers("llama")
    want = [x.token for x in _records(path, PROMPT, sampler=Sampler.greedy(), max_tokens=12)]
    stop = want[3]
    first = want.index(stop)
    recs = list(generate_step(vindex3.open(path).executor().start(), PROMPT, sampler=Sampler.greedy(),
                              max_tokens=12, stop_ids=[stop], drafter=_Oracle(want, 8)))
    assert [t for r in recs for t in r.emitted] == want[:first + 1] and recs[-1].stop


def test_drafting_refuses_a_sampler_that_is_not_greedy(containers):
    st = vindex3.open(containers("llama")).executor().start()
    with pytest.raises(VindexError, match="verifies drafts greedily"):
        generate_step(st, PROMPT, sampler=Sampler(temperature=0.5, seed=1), max_tokens=4, drafter=_Oracle([], 2))
    with pytest.raises(VindexError, match="feed 'step'"):
        generate_step(st, PROMPT, sampler=Sampler.greedy(), max_tokens=4, feed="step", drafter=_Oracle([], 2))
