"""A batched decode pass attends all its streams in one compiled call per layer
(vindex3.exec.ops.decode_many through softmax attention's ``attend.rows``), and every stream
still gets the bytes of its lone step: with windows that have released KV rows, with sinks,
with the decode kernels off (the per-stream path), and when one stream's refusal sends the
layer back to attending stream by stream."""

from __future__ import annotations

import numpy as np
import pytest
from test_server_batch import PROMPTS, _lone_and_batched, _same_streams

import vindex3
from vindex3.exec import batch
from vindex3.exec.batch import ROWS, step_many
from vindex3.exec.ops import decode_many


def _count_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = decode_many.attend_many

    def counted(q, *args, **kw):
        calls.append(q.shape[0])
        return real(q, *args, **kw)

    monkeypatch.setattr(decode_many, "attend_many", counted)
    return calls


@pytest.mark.numeric
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt_oss"])
def test_batched_attention_is_one_call_per_layer_and_bit_identical(containers, monkeypatch, family):
    ex = vindex3.open(containers(family)).executor()
    calls = _count_calls(monkeypatch)
    steps = 3
    rows_l, rows_b, lone, together = _lone_and_batched(ex, PROMPTS[:ROWS], steps=steps)
    softmax_layers = sum(1 for ops in batch.split_ops(ex).values() for st in ops if st is not None)
    assert calls == [ROWS] * (softmax_layers * steps)
    assert all(np.array_equal(a, b) for rl, rb in zip(rows_l, rows_b) for a, b in zip(rl, rb))
    _same_streams(lone, together)


@pytest.mark.numeric
def test_batched_attention_after_a_window_released_rows(containers):
    # mistral's fixture window is 5: past 2 * (window + slack) rows a stream's KV rows are
    # compacted, so the streams' rows start at different positions inside their arrays
    from vindex3.operators.softmax import WINDOW_SLACK

    ex = vindex3.open(containers("mistral")).executor()
    rng = np.random.default_rng(5)
    long = 2 * (5 + WINDOW_SLACK) - 2
    prompts = [list(rng.integers(3, 300, long + 3 * i)) for i in range(4)]
    rows_l, rows_b, lone, together = _lone_and_batched(ex, prompts, steps=8)
    assert all(np.array_equal(a, b) for rl, rb in zip(rows_l, rows_b) for a, b in zip(rl, rb))
    assert any(s.state.layers[i].ops["mixer"].start > 0 for s in together for i in ex.layers)
    _same_streams(lone, together)


@pytest.mark.numeric
def test_batched_attention_with_the_decode_kernels_off_attends_per_stream(containers, monkeypatch):
    from vindex3.exec.ops import decode

    ex = vindex3.open(containers("qwen2")).executor()
    calls = _count_calls(monkeypatch)
    decode.set_enabled(False)
    try:
        rows_l, rows_b, lone, together = _lone_and_batched(ex, PROMPTS[:4], steps=3)
    finally:
        decode.set_enabled(None)
    assert calls == []
    assert all(np.array_equal(a, b) for rl, rb in zip(rows_l, rows_b) for a, b in zip(rl, rb))
    _same_streams(lone, together)


def test_a_stream_refused_inside_attention_fails_alone(containers):
    from vindex3.errors import StateError

    ex = vindex3.open(containers("mistral")).executor()
    streams = [ex.start() for _ in range(3)]
    for s in streams:
        s.prefill([5, 6, 7])
    ref = ex.start()
    ref.prefill([5, 6, 7])
    want = ref.step(9)
    kv = streams[1].state.layers[ex.layers[0]].ops["mixer"]
    kv.start = 1  # its rows claim to begin past the window's first position: refused
    out = step_many(streams, [9, 9, 9])
    assert isinstance(out[1], StateError) and "released" in str(out[1])
    assert np.array_equal(out[0], want) and np.array_equal(out[2], want)
    assert streams[0].position == streams[2].position == 4 and streams[1].position == 3
