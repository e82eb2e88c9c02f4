"""Batched decoding (vindex3.exec.batch): several streams of one executor stepped together give,
per stream, the bytes of its own lone step -- logits, state position, trace -- on attention
(full and sliding), hybrid recurrent, routed-expert and low-bit models; more streams than one
pass takes are cut into passes; a stream's refusal is its own."""

from __future__ import annotations

import numpy as np
import pytest

import vindex3
from vindex3.exec.batch import ROWS, Prefetched, prefetch, step_many

PROMPTS = [[5, 9, 23], [7], [40, 41, 42, 43, 44, 45, 46], [11, 12], [99, 3, 17, 18, 60], [250, 251, 30, 31], [8, 8, 8],
           [70, 71, 72, 73, 74, 75, 76, 77, 78, 79], [2, 33], [14, 15, 16, 61, 62, 63]]


def _lone_and_batched(ex, prompts, steps):
    """Greedy decoding of every prompt twice: each stream alone (step) and all together
    (step_many); the logits of every step of both, and the streams."""
    lone, together = [ex.start() for _ in prompts], [ex.start() for _ in prompts]
    toks_l = [int(np.argmax(s.prefill(p)[-1])) for s, p in zip(lone, prompts)]
    toks_b = [int(np.argmax(s.prefill(p)[-1])) for s, p in zip(together, prompts)]
    assert toks_l == toks_b
    rows_l, rows_b = [], []
    for _ in range(steps):
        rl = [s.step(t) for s, t in zip(lone, toks_l)]
        rb = step_many(together, toks_b)
        rows_l.append(rl)
        rows_b.append(rb)
        toks_l = [int(np.argmax(r)) for r in rl]
        toks_b = [int(np.argmax(r)) for r in rb]
    return rows_l, rows_b, lone, together


def _same_streams(lone, together):
    for a, b in zip(lone, together):
        assert a.position == b.position
        assert a.trace.executed_layers == b.trace.executed_layers
        assert a.trace.step_bytes == b.trace.step_bytes
        assert a.trace.positions == b.trace.positions
        assert [c.to_data() for c in a.trace.op_calls] == [c.to_data() for c in b.trace.op_calls]
        assert np.array_equal(a.last_hidden, b.last_hidden)


@pytest.mark.numeric
@pytest.mark.parametrize("family", ["llama", "mistral", "granitemoehybrid", "mixtral", "qwen2", "qwen3", "olmoe", "gpt_oss"])
def test_batched_steps_are_bit_identical_to_lone_steps(containers, family):
    ex = vindex3.open(containers(family)).executor()
    prompts = PROMPTS[:5]
    rows_l, rows_b, lone, together = _lone_and_batched(ex, prompts, steps=6)
    for rl, rb in zip(rows_l, rows_b):
        for a, b in zip(rl, rb):
            assert isinstance(b, np.ndarray) and b.dtype == np.float32
            assert np.array_equal(a, b)
    _same_streams(lone, together)


@pytest.mark.numeric
@pytest.mark.parametrize("encoding", ["int8", "q4"])
def test_batched_steps_are_bit_identical_on_low_bit_weights(containers, tmp_path, encoding):
    from vindex3.represent import represent

    out = tmp_path / f"llama-{encoding}.vindex3"
    represent(containers("llama"), out, encoding)
    ex = vindex3.open(out).executor()
    rows_l, rows_b, lone, together = _lone_and_batched(ex, PROMPTS[:4], steps=4)
    assert all(np.array_equal(a, b) for rl, rb in zip(rows_l, rows_b) for a, b in zip(rl, rb))
    _same_streams(lone, together)


@pytest.mark.numeric
@pytest.mark.parametrize("encoding", ["f32", "bf16", "f16", "int8", "q4", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4",
                                      "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("activations", ["exact", "q8"])
def test_attention_products_give_each_of_up_to_rows_rows_the_bytes_of_that_row_alone(encoding, activations):
    """What batching the attention projections rests on: the fused q/k/v products and the output
    projection compute each of up to ROWS activation rows exactly as they compute that row alone."""
    from vindex3 import codecs
    from vindex3.codecs.base import products

    rng = np.random.default_rng(31)
    c = codecs.get(encoding)

    def weight(rows, cols):
        if encoding in ("q4_k", "q5_k", "q6_k"):  # carried from GGUF files only: random blocks
            from test_codecs_ggml import random_blocks, readonly

            w = c.weight(readonly(random_blocks(encoding, rows, cols)), (rows, cols))
        else:
            w = c.weight(c.encode(rng.standard_normal((rows, cols)).astype(np.float32)), (rows, cols))
        return w.with_activations(activations)

    hidden, q, kv = 256, 256, 128  # widths that every block size divides (k-quants: 256)
    qkv = products((weight(q, hidden), weight(kv, hidden), weight(kv, hidden)))
    wo = weight(hidden, q)
    for n in range(2, ROWS + 1):
        x = rng.standard_normal((n, hidden)).astype(np.float32)
        heads = rng.standard_normal((n, q)).astype(np.float32)
        together, out = qkv(x), wo.mm(heads)
        for r in range(n):
            alone = qkv(x[r:r + 1])
            assert all(np.array_equal(a[0], b[r]) for a, b in zip(alone, together))
            assert np.array_equal(wo.mm(heads[r:r + 1])[0], out[r])


def test_softmax_attention_runs_its_projections_over_all_streams_rows(containers):
    from vindex3.exec.batch import split_ops

    ex = vindex3.open(containers("llama")).executor()
    staged = {i: [(st[0], op.kind) for st, op in zip(ops, ex.plan.layers[i].ops) if st is not None]
              for i, ops in split_ops(ex).items()}
    assert staged == {i: [("mixer", "softmax")] for i in ex.layers}


@pytest.mark.numeric
@pytest.mark.parametrize(("encoding", "activations"), [("bf16", "exact"), ("int8", "q8"), ("q4", "q8")])
def test_batched_steps_are_bit_identical_under_bf16_and_quantized_activations(containers, tmp_path, encoding,
                                                                               activations):
    from vindex3.represent import represent

    out = tmp_path / f"llama-{encoding}.vindex3"
    represent(containers("llama"), out, encoding)
    ex = vindex3.open(out).executor(activations=activations)
    rows_l, rows_b, lone, together = _lone_and_batched(ex, PROMPTS[:ROWS], steps=4)
    assert all(np.array_equal(a, b) for rl, rb in zip(rows_l, rows_b) for a, b in zip(rl, rb))
    _same_streams(lone, together)


@pytest.mark.numeric
def test_more_streams_than_one_pass_takes_are_cut_into_passes(containers):
    ex = vindex3.open(containers("llama")).executor()
    assert len(PROMPTS) > ROWS
    rows_l, rows_b, lone, together = _lone_and_batched(ex, PROMPTS, steps=3)
    assert all(np.array_equal(a, b) for rl, rb in zip(rows_l, rows_b) for a, b in zip(rl, rb))
    _same_streams(lone, together)


def test_a_refused_stream_fails_alone(containers):
    from vindex3.errors import SliceError

    ex = vindex3.open(containers("llama")).executor()
    a, b, c = ex.start(), ex.start(), ex.start()
    for s in (a, b, c):
        s.prefill([5, 6])
    ref = ex.start()
    ref.prefill([5, 6])
    want = ref.step(9)
    out = step_many([a, b, c], [9, 10_000, 9])
    assert isinstance(out[1], SliceError) and "10000" in str(out[1]) and "vocabulary" in str(out[1])
    assert np.array_equal(out[0], want) and np.array_equal(out[2], want)
    assert b.position == 2 and a.position == c.position == 3


def test_step_many_refuses_what_it_cannot_batch(containers):
    from vindex3.errors import VindexError
    from vindex3.exec.engine import Observer

    c = vindex3.open(containers("llama"))
    ex, other = c.executor(), c.executor()
    s, t = ex.start(), other.start()
    with pytest.raises(VindexError, match="one executor"):
        step_many([s, t], [1, 1])
    with pytest.raises(VindexError, match="one token per stream"):
        step_many([s], [1, 2])
    with pytest.raises(VindexError, match="observer"):
        step_many([ex.start(observer=Observer())], [1])


def test_prefetched_stream_serves_its_batched_row_to_the_decode_loop(containers):
    from vindex3.errors import VindexError
    from vindex3.generate import Sampler, generate_step

    ex = vindex3.open(containers("llama")).executor()
    want = [r.token for r in generate_step(ex.start(), [5, 9, 23], sampler=Sampler.greedy(), max_tokens=6)]
    p = Prefetched(ex.start())
    got = []
    calls = generate_step(p, [5, 9, 23], sampler=Sampler.greedy(), max_tokens=6)
    for rec in calls:
        got.append(rec.token)
        if len(got) < 6:
            p.wants = rec.token
            assert prefetch([p]) == [1] and p.ready
    assert got == want
    # a row prefetched for one token is never served for another
    q = Prefetched(ex.start())
    q.prefill([5])
    q.wants = 7
    prefetch([q])
    with pytest.raises(VindexError, match="prefetched"):
        q.step(8)


# ---- the server: concurrent completions share passes; n choices ---------------------------------


def _no_eos(catalog, ids):
    stop = set(catalog.eos_ids())
    cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return catalog.decode(list(ids[:cut]))


def test_eight_concurrent_streams_share_batched_passes_and_each_equals_greedy(tiny_llama_container, monkeypatch):
    import json
    import threading

    httpx = pytest.importorskip("httpx", reason="SKIPPED LOUDLY: httpx is a dev dependency")
    from server_fixtures import config, live_server, slow_steps

    import lql

    s = lql.connect(tiny_llama_container)
    prompts = ["Water", "The capital", "def add", "Once upon", "1 + 1", "Paris", "boils at", "small model"]
    want = {p: _no_eos(s.catalog, s.execute_one(f"INFER {p!r} GENERATE 24").generated_ids) for p in prompts}
    with slow_steps(monkeypatch, 0.01) as seen, live_server(config(tiny_llama_container, max_concurrent=8)) as (url, app):
        worker = app.state.server.hosts["tiny"].worker
        got: dict[str, str] = {}
        start = threading.Barrier(len(prompts))

        def stream(p):
            body = {"model": "tiny", "prompt": p, "max_tokens": 24, "temperature": 0, "stream": True}
            start.wait(10)
            text = ""
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        text += json.loads(line[6:])["choices"][0]["text"]
            got[p] = text

        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == want  # every stream's greedy text is the lone INFER's
        assert seen["batched"] > 0
        assert max(worker.batches) > 1  # passes computed several streams' steps at once
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert 'lql_batched_steps_total{model="tiny",rows="' in metrics
        busy = {line.split('work="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                for line in metrics.splitlines() if line.startswith('lql_worker_seconds_total{model="tiny"')}
        assert set(busy) == {"batched", "steps", "calls"} and busy["batched"] > 0 and busy["steps"] > 0


def test_n_choices(tiny_llama_container):
    from server_fixtures import config
    from starlette.testclient import TestClient

    from lql.server.app import create_app

    with TestClient(create_app(config(tiny_llama_container))) as c:
        one = c.post("/v1/completions", json={"prompt": "Water", "max_tokens": 8, "temperature": 0}).json()
        three = c.post("/v1/completions", json={"prompt": "Water", "max_tokens": 8, "temperature": 0, "n": 3}).json()
        assert [ch["index"] for ch in three["choices"]] == [0, 1, 2]
        assert {ch["text"] for ch in three["choices"]} == {one["choices"][0]["text"]}  # greedy: three times the same
        assert three["usage"]["prompt_tokens"] == one["usage"]["prompt_tokens"]
        assert three["usage"]["completion_tokens"] == 3 * one["usage"]["completion_tokens"]

        # sampled: choice i is the n=1 request with seed + i
        body = {"prompt": "Water", "max_tokens": 10, "temperature": 1.5, "seed": 41}
        many = c.post("/v1/completions", json={**body, "n": 4}).json()["choices"]
        lone = [c.post("/v1/completions", json={**body, "seed": 41 + i}).json()["choices"][0]["text"] for i in range(4)]
        assert [ch["text"] for ch in many] == lone
        assert len(set(lone)) > 1  # the seeds differ, and so do the samples

        # streamed, every chunk names its choice; chat sends each choice's role first
        r = c.post("/v1/completions", json={**body, "n": 2, "stream": True})
        from server_fixtures import sse_events

        chunks = [__import__("json").loads(e) for e in sse_events(r.text)[:-1]]
        texts = ["", ""]
        for ch in chunks:
            texts[ch["choices"][0]["index"]] += ch["choices"][0]["text"]
        assert texts == lone[:2]
        assert sum(1 for ch in chunks if ch["choices"][0]["finish_reason"]) == 2

        r = c.post("/v1/completions", json={"prompt": "x", "n": 2, "speculate": {"depth": 2}, "temperature": 0})
        assert r.status_code == 400 and "speculate" in r.json()["error"]["message"]


def test_a_client_that_disconnects_stops_its_worker_job_and_releases_its_stream(tiny_llama_container, monkeypatch):
    """Three streams decode in batched passes; one client closes its connection mid-stream: its
    generation stops within a few steps (the worker steps it no more), its slot is given back,
    its stream and KV state are freed, and the other two finish with the lone greedy text."""
    import gc
    import threading
    import time
    import weakref

    httpx = pytest.importorskip("httpx", reason="SKIPPED LOUDLY: httpx is a dev dependency")
    from server_fixtures import config, live_server, slow_steps

    import lql
    from lql.server import completions as C

    s = lql.connect(tiny_llama_container)
    want = _no_eos(s.catalog, s.execute_one("INFER 'Water' GENERATE 60").generated_ids)
    opened: list[weakref.ref] = []
    real_open = C.open_stream

    def open_stream(host, g):
        st = real_open(host, g)
        opened.append(weakref.ref(st.stream))
        return st

    monkeypatch.setattr(C, "open_stream", open_stream)
    with slow_steps(monkeypatch, 0.03) as seen, live_server(config(tiny_llama_container, max_concurrent=4)) as (url, app):
        srv = app.state.server
        worker = srv.hosts["tiny"].worker
        texts: dict[int, str] = {}

        def full(k):
            body = {"model": "tiny", "prompt": "Water", "max_tokens": 60, "temperature": 0}
            texts[k] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]

        others = [threading.Thread(target=full, args=(k,)) for k in range(2)]
        for t in others:
            t.start()
        deadline = time.monotonic() + 10
        while worker.active_generations < 2 and time.monotonic() < deadline:  # both admitted first
            time.sleep(0.005)
        body = {"model": "tiny", "prompt": "Water", "max_tokens": 400, "temperature": 0, "stream": True}
        t0 = time.monotonic()
        with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            next(it)
            next(it)
            assert worker.active_generations == 3  # the other two are still generating
        gone = time.monotonic()
        deadline = gone + 5
        while worker.active_generations > 2 and time.monotonic() < deadline:  # the other two may still run
            time.sleep(0.01)
        stopped_after = time.monotonic() - gone
        for t in others:
            t.join(60)
        assert texts == {0: want, 1: want}
        assert worker.active_generations == 0 and srv.gate.running == 0  # every slot given back
        steps = seen["steps"]
        time.sleep(0.3)
        assert seen["steps"] == steps  # nothing is stepped after every request ended
        assert steps < 2 * 60 + 100  # the 400-token stream stopped far short of its 400 steps
        assert stopped_after < 2.0  # within a few steps of 0.03 s, not at the end of its 400
        assert seen["batched"] > 0  # it was stopped out of batched passes
        gc.collect()
        assert len(opened) == 3 and all(ref() is None for ref in opened)  # streams and their KV rows are freed
        assert time.monotonic() - t0 < 30


def test_n_chat_choices(tiny_llama_container, tmp_path):
    import json

    from server_fixtures import chat_container, config, sse_events
    from starlette.testclient import TestClient

    from lql.server.app import create_app

    path = chat_container(tiny_llama_container, tmp_path)
    body = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 6, "temperature": 1.2, "seed": 7}
    with TestClient(create_app(config(path))) as c:
        two = c.post("/v1/chat/completions", json={**body, "n": 2}).json()
        lone = [c.post("/v1/chat/completions", json={**body, "seed": 7 + i}).json()["choices"][0]["message"]["content"]
                for i in range(2)]
        assert [ch["message"]["content"] for ch in two["choices"]] == lone
        assert [ch["index"] for ch in two["choices"]] == [0, 1]
        r = c.post("/v1/chat/completions", json={**body, "n": 2, "stream": True})
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        roles = [ch["choices"][0]["index"] for ch in chunks if ch["choices"][0]["delta"].get("role") == "assistant"]
        assert roles == [0, 1]  # each choice opens with its role
        texts = ["", ""]
        for ch in chunks:
            texts[ch["choices"][0]["index"]] += ch["choices"][0]["delta"].get("content") or ""
        assert texts == lone
