"""A softmax layer's attention as the model computes it (sliding windows, sinks, softcapping
and all): the layer's own kernel run again on the input the run gave it, with a tap that sees
each block's weights and the heads' output before the output projection. The run itself is the
executor's; the values are the same bytes the run computed."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..exec.engine import Executor, slot_operands
from ..exec.intervention import heads_op
from ..operators import MIXER


def _softmax_op(ex: Executor, layer: int, what: str):
    return heads_op(ex.plan, layer, what)


def replay_attention(ex: Executor, layer: int, x: np.ndarray, what: str = "SHOW ATTENTION"):
    """(weights [heads, T, T] float32, heads [T, heads, head_dim] float32) of ``layer`` for the
    mixer input ``x`` [T, hidden] of a one-pass prefill from position 0."""
    from ..exec.ops.softmax import make_attention

    op = _softmax_op(ex, layer, what)
    p = op.params
    T = x.shape[0]
    weights = np.zeros((p.kv_heads, p.heads // p.kv_heads, T, T), np.float32)
    got: dict = {}

    def tap(kind, *args):
        if kind == "weights":
            q0, k0, w = args
            weights[:, :, q0:q0 + w.shape[2], k0:k0 + w.shape[3]] = w
        else:
            got["heads"] = np.array(args[1], dtype=np.float32, copy=True)

    run = make_attention(p, slot_operands(op, ex.prepared), tap=tap)
    run(x, op.operator.new_state(p), 0)
    return weights.reshape(p.heads, T, T), got["heads"].reshape(T, p.heads, p.head_dim)


def attention(ex: Executor, ids: Sequence[int], layer: int, what: str = "SHOW ATTENTION"):
    """Prefill ``ids`` and return layer ``layer``'s (weights [heads, T, T], heads' output [T,
    heads, head_dim]); a layer without attention heads is refused by name."""
    from .capture import capture

    _softmax_op(ex, layer, what)
    if layer not in ex.layers:
        from ..errors import QueryRefused

        raise QueryRefused(f"{what} names layer {layer}, which {ex.slice.describe()} does not execute")
    run = capture(ex, ids, inputs=True)
    return replay_attention(ex, layer, run.inputs[(layer, MIXER)], what)
