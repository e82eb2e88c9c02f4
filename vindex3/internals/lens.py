"""TRACE ... FOR: the logit lens and the direct attribution of a token's logit, and SAVE INTO.

**Lens.** After each executed layer, the model's own final norm and head (and its multiplier and
softcap) read the residual: the target token's rank (strictly greater logits) and probability,
and the top-1 token. After the last layer this is the model's own output.

**Decomposition.** The final residual is the embedding plus every write (each mixer's and each
FFN's, after post-norms and the residual multiplier): ``h = e + Σ w``. Freezing the final norm's
RMS scale ``s = 1 / sqrt(mean(h²) + eps)`` at that residual, the readout is linear in h, so the
target's logit is the sum of

    part = s · head_multiplier · W_head[t] · (final_norm_weight ⊙ w)

over the embedding and every write. The parts sum to the final logit up to float32 rounding
(``unexplained`` says by how much, and ``bound`` is what float32 rounding can explain: a residue
within it is rounding, one past it is a bug); with a logit softcap they sum to the logit before it, and
the result says so. A layer without an FFN (a Mamba2 mixer-only layer) contributes its mixer
write only, and a note says so.
"""

from __future__ import annotations

import io
import json
import math
import os
from collections.abc import Iterable
from typing import Literal

import numpy as np
from pydantic import BaseModel

from ..errors import QueryRefused, SliceError
from ..exec.engine import Executor
from ..paths import hidden_sibling
from .capture import CapturedRun
from .common import Prompt, layer_list, output_path
from .model import ModelView

# The residue float32 rounding can explain, relative to the parts' absolute sum. The final residual
# is P float32 additions of the writes (P <= ~200 layers' mixer and FFN writes) and the readout one
# dot product of H terms; each rounds at eps32 = 1.19e-7 of its running magnitude, so the residue is
# at most a few dozen ulps of sum |part| in practice. 1e-5 is ~84 ulps: the residues measured on
# the thirteen fixture families are 2e-9 to 1.2e-7 of sum |part| under both the host (AVX2) and
# NUMBA_CPU_NAME=generic builds (tests/test_internals_trace.py prints them), and a part left out or
# counted twice is ~1e-2 of it.
ROUNDING_BOUND = 1e-5

METHOD = ("part = s * head_multiplier * W_head[t] . (final_norm_weight * write), s = 1/sqrt(mean(h_final^2) + eps) "
          "frozen at the final residual; parts: the embedding and every mixer and FFN write")


class LensRow(BaseModel):
    layer: int | None  # None: the embedding, before the first layer
    operator: str  # the layer's mixer (or "embedding")
    position: int
    rank: int  # of the target: how many tokens have a strictly greater logit
    prob: float
    logit: float
    top_id: int
    top_token: str | None
    top_prob: float


class Part(BaseModel):
    name: str
    layer: int | None  # None for the embedding
    site: Literal["embedding", "mixer", "ffn", "head", "bias"]  # head / bias: DECOMPOSE HEADS splits an attention write
    operator: str | None
    logit: float
    share: float | None  # logit / the decomposed logit (None when that is 0)


class Decomposition(BaseModel):
    token_id: int
    token: str | None
    position: int
    final_logit: float  # the model's own logit for the token
    logit_before_softcap: float | None  # set only when the head has a softcap: what the parts sum to
    sum_of_parts: float
    unexplained: float  # decomposed logit minus the sum of parts (float32 rounding)
    bound: float  # ROUNDING_BOUND of the parts' absolute sum: the most float32 rounding explains
    scale: float  # the frozen 1/RMS of the final residual
    parts: list[Part]
    notes: list[str]
    method: str = METHOD


class SavedFile(BaseModel):
    path: str
    arrays: list[str]
    bytes: int


class TraceResult(BaseModel):
    kind: Literal["trace_for"] = "trace_for"
    prompt: Prompt
    target_id: int
    target: str | None
    positions: Literal["last", "all"]
    slice: str
    executed_layers: list[int]
    intervention: dict | None
    rows: list[LensRow]
    final: LensRow  # the model's own output at the last position
    decomposition: Decomposition | None
    saved: SavedFile | None
    seconds: float


READOUT_ROWS = 64  # residuals read through the head per GEMM (the head is read once per block)


def _row(view: ModelView, row: np.ndarray, target: int, layer: int | None, operator: str, p: int) -> LensRow:
    e = np.exp(row - row.max())
    z = e.sum(dtype=np.float32)
    top = int(np.argmax(row))
    return LensRow(layer=layer, operator=operator, position=p, rank=int(np.count_nonzero(row > row[target])),
                   prob=float(e[target] / z), logit=float(row[target]), top_id=top, top_token=view.text(top),
                   top_prob=float(e[top] / z))


def lens(view: ModelView, ex: Executor, run: CapturedRun, target: int, *, layers: Iterable[int] | None = None,
         positions: Literal["last", "all"] = "last") -> tuple[list[LensRow], LensRow]:
    """Lens rows (the embedding first when no layers are chosen, then each chosen layer) and the
    model's own final row."""
    if positions not in ("last", "all"):
        raise QueryRefused(f"TRACE POSITIONS must be LAST or ALL, got {positions!r}")
    T = len(run.ids)
    pos = [T - 1] if positions == "last" else list(range(T))
    labels = {lo.index: lo.operator for lo in ex.plan.layers}
    wanted: list[tuple[int | None, str, np.ndarray]] = []  # (layer, operator, residual [T, hidden])
    if layers is None:
        chosen = list(run.executed)
        wanted.append((None, "embedding", run.embedding))
    else:
        chosen = layer_list(layers, len(ex.plan.layers), "TRACE LAYERS")
        not_run = [i for i in chosen if i not in run.executed]
        if not_run:
            raise QueryRefused(f"TRACE LAYERS: layer {not_run[0]} is not executed by {ex.slice.describe()}")
    wanted += [(i, labels[i], run.after(i)) for i in chosen]
    keys = [(layer, op, p) for layer, op, _ in wanted for p in pos]
    hs = np.concatenate([h[pos] for _, _, h in wanted])
    rows: list[LensRow] = []
    for b in range(0, hs.shape[0], READOUT_ROWS):
        logits = ex.readout(hs[b:b + READOUT_ROWS])
        rows += [_row(view, logits[r], target, *keys[b + r]) for r in range(logits.shape[0])]
    last = run.executed[-1] if run.executed else None
    final = _row(view, run.logits[T - 1], target, last, labels[last] if last is not None else "embedding", T - 1)
    return rows, final


def decompose_arrays(ex: Executor, run: CapturedRun, target: int, position: int):
    """(names, layers, sites, operators, part logits float32, scale, decomposed logit)."""
    ro = ex.readout
    readout_is_rms_linear(ro, "DECOMPOSE")
    h = run.final[position]
    var = np.mean(np.square(h), dtype=np.float32)
    s = np.float32(1.0) / np.sqrt(var + ro.eps)  # as rms_norm computes it
    u = ro.norm_weight * ro.head.take(np.asarray([target]))[0]
    if ro.multiplier != 1:
        u = u * ro.multiplier
    names, layers, sites, ops = ["embedding"], [None], ["embedding"], [None]
    vecs = [run.embedding[position]]
    for w in run.writes:
        names.append(f"L{w.layer} {w.site} ({w.operator})")
        layers.append(w.layer)
        sites.append(w.site)
        ops.append(w.operator)
        vecs.append(w.write[position])
    parts = (np.stack(vecs) @ u) * s
    pre = np.dot(ro.normed(h[None])[0], ro.head.take(np.asarray([target]))[0])  # the logit before any softcap
    if ro.multiplier != 1:
        pre = pre * ro.multiplier
    return names, layers, sites, ops, parts.astype(np.float32), s, np.float32(pre)


def decompose(view: ModelView, ex: Executor, run: CapturedRun, target: int, position: int = -1) -> Decomposition:
    T = len(run.ids)
    p = position if position >= 0 else T + position
    if not 0 <= p < T:
        raise QueryRefused(f"DECOMPOSE position {position} is outside the prompt's {T} positions")
    names, layers, sites, ops, parts, s, pre = decompose_arrays(ex, run, target, p)
    final = float(run.logits[p, target])
    total = math.fsum(float(x) for x in parts)
    bound = ROUNDING_BOUND * math.fsum(abs(float(x)) for x in parts)
    notes = []
    for i in run.executed:
        if not any(w.layer == i and w.site == "ffn" for w in run.writes):
            notes.append(f"layer {i} ({ex.plan.layers[i].operator}) has no FFN: only its mixer writes")
    softcap = ex.readout.softcap
    if softcap:
        notes.append(f"the head softcaps logits at {softcap}: the parts sum to the logit before the softcap")
    base = float(pre) if softcap else final
    return Decomposition(
        token_id=target, token=view.text(target), position=p, final_logit=final,
        logit_before_softcap=float(pre) if softcap else None, sum_of_parts=total, unexplained=base - total, bound=bound,
        scale=float(s),
        parts=[Part(name=n, layer=l, site=st, operator=o, logit=float(v), share=(float(v) / base if base else None))
               for n, l, st, o, v in zip(names, layers, sites, ops, parts)],
        notes=notes)


def save(path, *, ex: Executor, run: CapturedRun, target: int, rows: list[LensRow], dec: Decomposition,
         provenance: dict, overwrite: bool = False) -> SavedFile:
    """The residual stream, the lens rows and the parts as arrays in an .npz (numpy only, no
    pickles); refuses an existing file unless ``overwrite`` and any path inside a container."""
    p = output_path(path, suffix=".npz", what="TRACE ... SAVE INTO", overwrite=overwrite)
    if not run.writes:
        raise SliceError("nothing to save: the run executed no layer")
    layers = list(run.executed)
    ffn = [w for w in run.writes if w.site == "ffn"]
    mixer = [w for w in run.writes if w.site == "mixer"]
    arrays = {
        "token_ids": np.asarray(run.ids, dtype=np.int64),
        "target_id": np.asarray(target, dtype=np.int64),
        "layers": np.asarray(layers, dtype=np.int64),
        "embedding": run.embedding,
        "residual": np.stack([run.after(i) for i in layers]),  # [layers, T, hidden], after each layer
        "mixer_layers": np.asarray([w.layer for w in mixer], dtype=np.int64),
        "mixer_write": np.stack([w.write for w in mixer]),
        "ffn_layers": np.asarray([w.layer for w in ffn], dtype=np.int64),  # layers with an FFN only
        "ffn_write": np.stack([w.write for w in ffn]) if ffn else np.zeros((0,) + run.embedding.shape, np.float32),
        "logits": run.logits,
        "lens_layer": np.asarray([-1 if r.layer is None else r.layer for r in rows], dtype=np.int64),  # -1: embedding
        "lens_position": np.asarray([r.position for r in rows], dtype=np.int64),
        "lens_rank": np.asarray([r.rank for r in rows], dtype=np.int64),
        "lens_prob": np.asarray([r.prob for r in rows], dtype=np.float32),
        "lens_logit": np.asarray([r.logit for r in rows], dtype=np.float32),
        "lens_top_id": np.asarray([r.top_id for r in rows], dtype=np.int64),
        "part_name": np.asarray([x.name for x in dec.parts]),
        "part_layer": np.asarray([-1 if x.layer is None else x.layer for x in dec.parts], dtype=np.int64),
        "part_site": np.asarray([x.site for x in dec.parts]),
        "part_logit": np.asarray([x.logit for x in dec.parts], dtype=np.float32),
        "part_position": np.asarray(dec.position, dtype=np.int64),
        "final_logit": np.asarray(dec.final_logit, dtype=np.float32),
        "part_scale": np.asarray(dec.scale, dtype=np.float32),
        "provenance": np.asarray(json.dumps(provenance, sort_keys=True)),
    }
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    tmp = hidden_sibling(p, f".tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        tmp.unlink(missing_ok=True)
    return SavedFile(path=str(p), arrays=sorted(arrays), bytes=len(data))


def readout_is_rms_linear(ro, what: str) -> None:
    """Refuse by name a readout these attributions do not model: they take the final norm as an
    RMS scale times a weight and the head as linear (no LayerNorm centring, no head bias)."""
    if ro.norm_kind != "rms":
        raise QueryRefused(f"{what} splits the logit through an RMS final norm; this model's final norm is a LayerNorm "
                           "(its centring is not a per-position scale), which this build does not attribute")
    if ro.head_bias is not None:
        raise QueryRefused(f"{what} splits the logit through a linear head; this model's head adds a bias, which this "
                           "build does not attribute")
