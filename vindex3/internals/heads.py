"""Per-head attribution of a softmax layer's attention write (DECOMPOSE HEADS).

A softmax mixer writes ``m · (W_o z + b_o)`` to the residual, with ``z`` [heads · head_dim] the
heads' outputs side by side, ``m`` the layer's residual multiplier and ``b_o`` the output bias
(if any). ``W_o z`` is linear in ``z``, so head ``h``'s write is ``m · W_o[:, h] z_h`` (the
projection of a ``z`` that holds head ``h`` alone) and the heads' writes plus ``m · b_o`` sum to
the layer's write up to float32 rounding (``residue`` says by how much; `HEAD_BOUND` is what
rounding explains).

A layer whose write passes a post-norm (pre_post placement) is not a sum over heads: it is
refused by name, as are attention operators whose heads have no executor here (MLA) and
parallel layers (attention beside an SSM, whose write joins the residual with the other
member's)."""

from __future__ import annotations

import math

import numpy as np

from ..errors import QueryRefused
from ..exec.engine import Executor, slot_operands
from ..exec.intervention import heads_op
from .capture import CapturedRun

# The residue float32 rounding explains between the layer's write and its heads' writes plus the
# bias, relative to the sum of their absolute values: W_o z is one dot product of heads · head_dim
# terms per output, the heads' writes the same terms in partial sums, so the two differ by a few
# ulps of sum |terms| (eps32 = 1.19e-7). 1e-5 is ~84 ulps; measured at most 1.2e-7 of it on the
# fixture families and SmolLM2 (tests/test_interventions_heads.py).
HEAD_BOUND = 1e-5


def _mixer_multiplier(ex: Executor, layer: int, what: str) -> np.float32:
    """The residual multiplier of the layer's mixer write; a post-norm or a parallel fork between
    the attention and the residual refused by name."""
    lo = ex.plan.layers[layer]
    ops = list(lo.ops)
    k = next(i for i, o in enumerate(ops) if o.role == "mixer" and o.operator is not None)
    for o in ops[k + 1:]:
        if o.kind == "residual_add":
            return np.float32(o.params.multiplier)
        if o.kind == "parallel_fork":
            raise QueryRefused(f"{what}: layer {layer} runs its attention in parallel with another mixer; their "
                               "writes join the residual together, which this build does not split by head")
        if getattr(o.params, "post", False):
            raise QueryRefused(f"{what}: layer {layer}'s attention write passes a post-norm ({o.kind}), so it is not "
                               "a sum over its heads; this build does not split it")
    raise QueryRefused(f"{what}: layer {layer} adds no mixer write to the residual")


def head_writes(ex: Executor, layer: int, z: np.ndarray, what: str = "DECOMPOSE HEADS"):
    """Head by head, the layer's write for the heads' outputs ``z`` [heads, head_dim] at one
    position: (writes [heads, hidden] float32, the bias's write [hidden] or None)."""
    op = heads_op(ex.plan, layer, what)
    m = _mixer_multiplier(ex, layer, what)
    p = op.params
    nh, hd = p.heads, p.head_dim
    w = slot_operands(op, ex.prepared)
    block = np.zeros((nh, nh, hd), np.float32)  # row h: head h's output alone
    block[np.arange(nh), np.arange(nh)] = z
    writes = w["o_proj"].mm(block.reshape(nh, nh * hd))
    bias = w.get("o_bias")
    if m != 1:
        writes = writes * m
        bias = bias * m if bias is not None else None
    return writes.astype(np.float32, copy=False), (None if bias is None else np.asarray(bias, np.float32))


def split_heads(ex: Executor, run: CapturedRun, dec, what: str = "DECOMPOSE HEADS"):
    """``dec`` (a `vindex3.internals.lens.Decomposition` of ``run``) with each softmax layer's
    mixer part replaced by one part per head and, when the layer has an output bias, a bias part.
    ``run`` must have kept the mixers' inputs (capture(..., inputs=True)). The parts read through
    the same frozen final norm as the rest, so they still sum to the logit."""
    from .attention import replay_attention
    from .lens import ROUNDING_BOUND, Part

    ro = ex.readout
    p = dec.position
    s = np.float32(dec.scale)
    u = ro.norm_weight * ro.head.take(np.asarray([dec.token_id]))[0]
    if ro.multiplier != 1:
        u = u * ro.multiplier
    attention = [i for i in run.executed if ex.plan.layers[i].operator in ("softmax", "mla")]
    if not attention:
        ops = sorted({ex.plan.layers[i].operator for i in run.executed})
        raise QueryRefused(f"{what}: no layer that the {ex.slice.describe()} runs has attention heads "
                           f"(its layers are {', '.join(ops)} layers)")
    parts, residues = [], []
    for part in dec.parts:
        if part.site != "mixer" or part.layer not in attention:
            parts.append(part)
            continue
        i = part.layer
        heads_op(ex.plan, i, what)  # MLA refused by name here
        x = run.inputs[(i, "mixer")]
        z = replay_attention(ex, i, x[: p + 1], what)[1][p]  # causal: positions after p change nothing at p
        writes, bias = head_writes(ex, i, z, what)
        logits = (writes @ u) * s
        op = part.operator
        for h, v in enumerate(logits):
            parts.append(Part(name=f"L{i} head {h} ({op})", layer=i, site="head", operator=op, logit=float(v),
                              share=None))
        total = math.fsum(float(v) for v in logits)
        absum = math.fsum(abs(float(v)) for v in logits)
        if bias is not None:
            b = float(np.dot(bias, u) * s)
            parts.append(Part(name=f"L{i} output bias ({op})", layer=i, site="bias", operator=op, logit=b, share=None))
            total += b
            absum += abs(b)
        residues.append((i, part.logit - total, HEAD_BOUND * max(absum, abs(part.logit))))
    base = dec.logit_before_softcap if dec.logit_before_softcap is not None else dec.final_logit
    for part in parts:
        part.share = float(part.logit) / base if base else None
    total = math.fsum(x.logit for x in parts)
    bound = ROUNDING_BOUND * math.fsum(abs(x.logit) for x in parts)
    notes = list(dec.notes)
    worst = max(residues, key=lambda r: abs(r[1]) - r[2])
    if abs(worst[1]) > worst[2]:
        notes.append(f"layer {worst[0]}: its heads and bias differ from its attention write by {worst[1]:.1e}, more "
                     f"than float32 rounding's {worst[2]:.1e}")
    notes.append("attention layers are split by head: head h's part is its output alone through the output "
                 "projection (and the layer's multiplier), read like the other parts")
    return dec.model_copy(update={"parts": parts, "sum_of_parts": total, "unexplained": base - total, "bound": bound,
                                  "notes": notes})
