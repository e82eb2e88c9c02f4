"""The softmax attention operator (graph operator ``softmax``, slot mixer).

GQA with repeat_interleave head mapping, RoPE (default, linear, llama3 or yarn scaling) or NoPE,
optional QK-norm (per head, or over the whole q / k projection as OLMoE does) and biases, an
optional clamp of q, k and v (OLMoE's ``clip_qkv``), optional learned attention sinks (one logit
per query head that joins every softmax and is then dropped, as gpt-oss), full or sliding span
(a window of w keys including the query), query scale and score scale kept separate. Its state is
one `KvRows` per layer: a K and a V row per position. The kernel lives in
vindex3.exec.ops.softmax.

Gated attention (Qwen3-Next, Qwen3.5) is facts of this operator, not another one: with
``output_gate`` the q projection is doubled and grouped per head (rows [2·h·d, 2·h·d + d) the
query of head h, the next d rows its gate) and the output is o_proj(attn · sigmoid(gate));
``rotary_dims`` below head_dim rotates the first rotary_dims dims of each head (rotate-half) and
passes the rest; zero-centred q/k norms are ``qk_norm.weight_offset = 1.0``."""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..continuation import Geometry, kv_rows
from ..errors import GraphSchemaError, StateError
from ..exec.state import OpState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register

# Rows kept beyond a sliding window, so that a speculative rollback of a few positions still
# finds the keys it needs.
WINDOW_SLACK = 64


class SoftmaxParams(Params):
    HIDDEN = frozenset({"hidden_size", "bias"})

    hidden_size: int = Field(gt=0)
    heads: int = Field(gt=0)
    kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    output_gate: bool  # q_proj doubled, per head [query | gate]; output o_proj(attn * sigmoid(gate))
    head_mapping: Literal["repeat_interleave"]
    span: Literal["full", "sliding"]
    window: int | None = Field(gt=0)
    position: Literal["rope", "none"]
    rope_theta: float | None = Field(gt=0, allow_inf_nan=False)
    rotary_dims: int | None = Field(gt=0)
    rope_scaling: dict | None
    query_scale: float = Field(gt=0, allow_inf_nan=False)
    score_scale: float = Field(gt=0, allow_inf_nan=False)
    bias: dict[Literal["q", "k", "v", "o"], bool]
    qk_norm_eps: float | None = Field(ge=0, allow_inf_nan=False)
    qk_norm_offset: float | None = Field(allow_inf_nan=False)
    qk_norm_scope: Literal["head", "projection"] | None  # per head_dim, or over the whole q / k width
    qkv_clip: float | None = Field(gt=0, allow_inf_nan=False)  # q, k, v clamped to [-c, c] after the norms
    sinks: Literal["learned"] | None  # one learned logit per query head joins each softmax
    # scores (after the score scale) are softcapped: c · tanh(s / c) (Gemma 2). Graphs written
    # before this fact existed have no key: no softcap.
    logit_softcap: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @field_validator("bias")
    @classmethod
    def _bias(cls, v: dict) -> dict:
        if set(v) != {"q", "k", "v", "o"}:
            raise ValueError(f"bias states q, k, v and o, found {sorted(v)}")
        return v

    @field_validator("rope_scaling")
    @classmethod
    def _scaling(cls, v: dict | None) -> dict | None:
        if v is None:
            return v
        need = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"),
                "yarn": ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "attention_factor")}
        flags = {"yarn": ("truncate",)}
        kind = v.get("type")
        if kind not in need:
            raise ValueError(f"rope scaling type {kind!r} is not one of {', '.join(need)}")
        for k in need[kind]:
            x = v.get(k)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
                raise ValueError(f"rope scaling {kind} needs a positive finite {k}, found {x!r}")
        for k in flags.get(kind, ()):
            if not isinstance(v.get(k), bool):
                raise ValueError(f"rope scaling {kind} needs a boolean {k}, found {v.get(k)!r}")  # noqa: TRY004 (pydantic)
        extra = sorted(set(v) - {"type", *need[kind], *flags.get(kind, ())})
        if extra:
            raise ValueError(f"rope scaling {kind} has unknown keys {', '.join(extra)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SoftmaxParams:
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if (self.span == "sliding") != (self.window is not None):
            raise ValueError(f"span {self.span!r} with window {self.window!r}: a window exists exactly for sliding layers")
        if self.position == "rope":
            if self.rope_theta is None or self.rotary_dims is None:
                raise ValueError("rope position needs rope_theta and rotary_dims")
            if self.rotary_dims % 2 or self.rotary_dims > self.head_dim:
                raise ValueError(f"rotary_dims {self.rotary_dims} must be even and at most head_dim {self.head_dim}")
        elif self.rope_theta is not None or self.rotary_dims is not None or self.rope_scaling is not None:
            raise ValueError("a layer without rope carries no rope parameters")
        if not ((self.qk_norm_eps is None) == (self.qk_norm_offset is None) == (self.qk_norm_scope is None)):
            raise ValueError("qk_norm_eps, qk_norm_offset and qk_norm_scope come together")
        return self


class KvRows(OpState):
    """K and V rows of one layer, grown geometrically: V as [kv_heads, rows, head_dim], K stored
    transposed as ``kt`` [kv_heads, head_dim, rows] so that the decode kernel's scores run along
    contiguous keys (vindex3.exec.ops.decode). `view` gives both as [kv_heads, rows, head_dim]."""

    def __init__(self, kv_heads: int, head_dim: int, window: int | None):
        self.kv_heads, self.head_dim, self.window = kv_heads, head_dim, window
        cap = 64
        self.kt = np.empty((kv_heads, head_dim, cap), np.float32)
        self.v = np.empty((kv_heads, cap, head_dim), np.float32)
        self.start = 0  # absolute position of row 0
        self.end = 0  # absolute position one past the last row

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: [T, kv_heads, head_dim]."""
        T = k.shape[0]
        lo = self.reserve(T)
        hi = lo + T
        self.kt[:, :, lo:hi] = k.transpose(1, 2, 0)
        self.v[:, lo:hi] = v.transpose(1, 0, 2)
        self.end += T

    def reserve(self, T: int) -> int:
        """Room for T more rows (releasing rows a window no longer reaches first): the row
        index the next position goes to. The caller writes rows [lo, lo + T) of ``kt`` and ``v``
        and then advances ``end`` by T."""
        self._compact()
        lo = self.end - self.start
        hi = lo + T
        if hi > self.v.shape[1]:
            cap = max(hi, 2 * self.v.shape[1])
            nk = np.empty((self.kv_heads, self.head_dim, cap), np.float32)
            nv = np.empty((self.kv_heads, cap, self.head_dim), np.float32)
            nk[:, :, :lo] = self.kt[:, :, :lo]
            nv[:, :lo] = self.v[:, :lo]
            self.kt, self.v = nk, nv
        return lo

    def _compact(self) -> None:
        if self.window is None:
            return
        keep = self.window + WINDOW_SLACK
        rows = self.end - self.start
        if rows > 2 * keep:
            drop = rows - keep
            self.kt[:, :, : rows - drop] = self.kt[:, :, drop:rows].copy()
            self.v[:, : rows - drop] = self.v[:, drop:rows].copy()
            self.start += drop

    def view(self, from_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """K and V of positions from_pos .. end-1, each [kv_heads, rows, head_dim] (K a
        transposed view of the stored layout)."""
        if from_pos < self.start:
            raise StateError(f"KV rows before position {self.start} were released (asked for {from_pos})")
        a, b = from_pos - self.start, self.end - self.start
        return self.kt[:, :, a:b].transpose(0, 2, 1), self.v[:, a:b]

    def truncate(self, pos: int) -> None:
        if pos > self.end:
            raise StateError(f"cannot truncate KV rows forward to {pos} (they end at {self.end})")
        if pos < self.start:
            raise StateError(f"cannot roll KV rows back to {pos}: rows before {self.start} were released by the window")
        self.end = pos

    @property
    def nbytes(self) -> int:
        return 2 * (self.end - self.start) * self.kv_heads * self.head_dim * 4

    def snapshot(self) -> int:
        # Rows before ``end`` are never rewritten in place, so the end position is the snapshot.
        return self.end

    def restore(self, snap: int) -> None:
        self.truncate(snap)


class _Bound(Kernel):
    def __init__(self, run):
        self.run = run
        self.stages = run.stages  # (project, attend, output): see vindex3.exec.ops.softmax

    def prefill(self, x: np.ndarray, state: KvRows, p0: int) -> np.ndarray:
        return self.run(x, state, p0)


class Softmax(Operator):
    name = "softmax"
    slot = MIXER
    selects = "softmax"
    surface_group = "attention"
    Params = SoftmaxParams

    def params(self, surface, layer) -> SoftmaxParams:
        where = f"layer {layer.index} (softmax)"
        a = surface.get("attention")
        if not isinstance(a, dict):
            raise GraphSchemaError(f"system_graph.json: {where}: the surface has no attention group")
        gate = a.get("output_gate", ...)
        if gate is ...:
            raise GraphSchemaError(f"system_graph.json: {where}: attention has no 'output_gate' (false when absent)")
        a = {k: v for k, v in a.items() if k != "output_gate"}
        pos = layer.position
        if not isinstance(pos, dict) or "kind" not in pos:
            raise GraphSchemaError(f"system_graph.json: {where}: no position policy (rope or none)")
        rope = pos["kind"] == "rope"
        keys = {"kind", "theta", "rotary_dims", "scaling"} if rope else {"kind"}
        unknown = sorted(set(pos) - keys)
        if unknown:
            raise GraphSchemaError(f"system_graph.json: {where}: position has unknown keys {', '.join(unknown)}")
        missing = sorted(keys - set(pos))
        if missing:
            raise GraphSchemaError(f"system_graph.json: {where}: position has no {', '.join(missing)} "
                                   "(absence is not a default; scaling is null when there is none)")
        qk = a.get("qk_norm", ...)
        if qk is ...:
            raise GraphSchemaError(f"system_graph.json: {where}: attention has no 'qk_norm' (null when absent)")
        if qk is not None and (not isinstance(qk, dict) or qk.get("kind") != "rms" or set(qk) != {"kind", "eps", "weight_offset", "scope"}):
            raise GraphSchemaError(f"system_graph.json: {where}: qk_norm must be null or {{kind: rms, eps, weight_offset, scope}}, "
                                   f"found {qk!r}")
        known = {"heads", "kv_heads", "head_dim", "head_mapping", "query_scale", "score_scale", "bias", "qk_norm",
                 "qkv_clip", "sinks", "logit_softcap"}
        extra = sorted(set(a) - known)
        if extra:
            raise GraphSchemaError(f"system_graph.json: surface.attention has unknown keys {', '.join(extra)}")
        raw: dict[str, Any] = {k: a[k] for k in known - {"qk_norm"} if k in a}
        raw.update(
            output_gate=gate,
            hidden_size=surface.get("hidden_size"),
            span=layer.span,
            window=layer.window,
            position=pos["kind"],
            rope_theta=pos.get("theta") if rope else None,
            rotary_dims=pos.get("rotary_dims") if rope else None,
            rope_scaling=pos.get("scaling") if rope else None,
            qk_norm_eps=qk["eps"] if qk else None,
            qk_norm_offset=qk["weight_offset"] if qk else None,
            qk_norm_scope=qk["scope"] if qk else None,
        )
        return parse_params(SoftmaxParams, raw, where)

    def roles(self, p: SoftmaxParams) -> list[Role]:
        H, q, kv = p.hidden_size, p.heads * p.head_dim, p.kv_heads * p.head_dim
        qw = 2 * q if p.output_gate else q  # the gate's rows sit inside q_proj, per head
        b, qk = p.bias, p.qk_norm_eps is not None
        whole = p.qk_norm_scope == "projection"
        return [
            Role("q_proj", (qw, H)),
            Role("k_proj", (kv, H)),
            Role("v_proj", (kv, H)),
            Role("o_proj", (H, q)),
            Role("q_bias", (qw,), b["q"], ARRAY),
            Role("k_bias", (kv,), b["k"], ARRAY),
            Role("v_bias", (kv,), b["v"], ARRAY),
            Role("o_bias", (H,), b["o"], ARRAY),
            Role("q_norm", (q,) if whole else (p.head_dim,), qk, ARRAY),
            Role("k_norm", (kv,) if whole else (p.head_dim,), qk, ARRAY),
            Role("sinks", (p.heads,), p.sinks is not None, ARRAY),
        ]

    def geometry(self, p: SoftmaxParams) -> Geometry:
        return Geometry((kv_rows(p.kv_heads * p.head_dim, p.window),))

    def new_state(self, p: SoftmaxParams) -> KvRows:
        return KvRows(p.kv_heads, p.head_dim, p.window)

    def summary(self, p: SoftmaxParams) -> dict:
        return {k: p[k] for k in ("heads", "kv_heads", "head_dim", "span", "window", "position", "rope_theta")}

    def work_bytes(self, p: SoftmaxParams, positions: int, keys: int) -> int:
        from ..exec.ops.softmax import QUERY_BLOCK

        T, nh, nkv, hd = positions, p.heads, p.kv_heads, p.head_dim
        # q, k, v projections and their biased / rotated copies; the grouped query copy and the
        # output with its transposed copy; the output projection
        rows = 2 * T * (nh + 2 * nkv) * hd + 3 * T * nh * hd + T * p.hidden_size
        # one causal block of scores at a time: [heads, block, keys in reach] and its mask
        n = min(T, QUERY_BLOCK)
        reach = keys if p.window is None else min(keys, p.window + n)
        return 4 * rows + 4 * nh * n * reach + 2 * n * reach

    def bind(self, p: SoftmaxParams, operands: dict) -> Kernel:
        from ..exec.ops.softmax import make_attention

        return _Bound(make_attention(p, operands))


register(Softmax)
