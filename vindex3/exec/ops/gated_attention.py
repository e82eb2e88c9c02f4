"""Gated softmax attention (the full-attention layers of Qwen3-Next and Qwen3.5): the pieces
that differ from plain softmax attention, float32 end to end.

Semantics follow transformers 5.24.0 ``Qwen3NextAttention`` / ``Qwen3_5Attention``:

1. ``q_proj`` is doubled, [2·heads·head_dim, hidden], and grouped per head: its output viewed
   as [heads, 2·head_dim] holds head h's query in the first head_dim columns and its gate in
   the next head_dim (``split_query_gate``).
2. Zero-centred RMSNorm on q and k per head over head_dim: x · rsqrt(mean(x²) + eps) · (1 + w)
   (``qk_norm``; the offset is a geometry fact, 1.0 for these families).
3. Partial rotary embedding, rotate-half, on the first ``rotary_dims`` = int(head_dim ·
   partial_rotary_factor) dimensions of each head; the remaining dimensions pass unchanged
   (``PartialRope``). The inverse frequencies are built over ``rotary_dims``, not head_dim.
4. The plain softmax core (GQA, causal, scale head_dim^−½) runs between ``project_qkv`` and
   ``gate_output``; it is the softmax operator's, not this module's.
5. The core's output [T, heads·head_dim] is multiplied by sigmoid(gate), then ``o_proj``
   (``finish``).

``project_qkv`` (steps 1-3) and ``finish`` (step 5) are the two hooks a softmax operator needs
around its core to run these layers; the KV it caches are the normed, rotated k and the raw v.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from vindex3.errors import ClosureError

from . import rope as rope_mod
from .norm import make_weight, rms_norm

__all__ = [
    "GatedAttentionGeometry",
    "GatedAttentionWeights",
    "PartialRope",
    "finish",
    "gate_output",
    "project_qkv",
    "qk_norm",
    "split_query_gate",
]

F32 = np.float32


@dataclass(frozen=True)
class GatedAttentionGeometry:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # explicit in these configs (class default 256), never hidden / heads
    rotary_dims: int  # int(head_dim * partial_rotary_factor); even, <= head_dim
    rope_theta: float
    qk_norm_eps: float
    qk_norm_offset: float  # 1.0: the q/k norms scale by (1 + w)
    attention_bias: bool  # q/k/v/o projections carry biases

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "num_kv_heads", "head_dim", "rotary_dims"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GatedAttentionGeometry.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"GatedAttentionGeometry: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.rotary_dims > self.head_dim or self.rotary_dims % 2:
            raise ValueError(
                f"GatedAttentionGeometry.rotary_dims must be even and at most head_dim "
                f"({self.head_dim}), got {self.rotary_dims} (rotate-half pairs dimension i with "
                f"i + rotary_dims/2)"
            )
        for name in ("rope_theta", "qk_norm_eps", "qk_norm_offset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise ValueError(f"GatedAttentionGeometry.{name} must be a number, got {v!r}")
            object.__setattr__(self, name, float(v))
        if not self.rope_theta > 0.0:
            raise ValueError(f"GatedAttentionGeometry.rope_theta must be > 0, got {self.rope_theta}")
        if not self.qk_norm_eps >= 0.0:
            raise ValueError(f"GatedAttentionGeometry.qk_norm_eps must be >= 0, got {self.qk_norm_eps}")
        if not isinstance(self.attention_bias, bool):
            raise TypeError(
                f"GatedAttentionGeometry.attention_bias must be a bool, got {self.attention_bias!r}"
            )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_shape(self) -> tuple[int, int]:
        """Per position and layer, K and V each hold [kv_heads, head_dim] float32."""
        return (self.num_kv_heads, self.head_dim)


@dataclass
class GatedAttentionWeights:
    """Matrices are weight objects (``mm(x)`` = x @ W.T); norms and biases float32 arrays."""

    q_proj: object  # Weight [2 * heads * head_dim, hidden], per head [query | gate]
    k_proj: object  # Weight [kv_heads * head_dim, hidden]
    v_proj: object  # Weight [kv_heads * head_dim, hidden]
    o_proj: object  # Weight [hidden, heads * head_dim]
    q_norm: np.ndarray  # [head_dim], applied as (offset + w)
    k_norm: np.ndarray  # [head_dim]
    q_bias: np.ndarray | None = None  # [2 * heads * head_dim]   iff attention_bias
    k_bias: np.ndarray | None = None  # [kv_heads * head_dim]
    v_bias: np.ndarray | None = None  # [kv_heads * head_dim]
    o_bias: np.ndarray | None = None  # [hidden]


def check(w: GatedAttentionWeights, g: GatedAttentionGeometry) -> None:
    """Refuse operands that do not match the geometry, naming every defect."""
    defects: list[str] = []
    for name, shape in (
        ("q_proj", (2 * g.q_dim, g.hidden_size)),
        ("k_proj", (g.kv_dim, g.hidden_size)),
        ("v_proj", (g.kv_dim, g.hidden_size)),
        ("o_proj", (g.hidden_size, g.q_dim)),
    ):
        m = getattr(w, name)
        if m is None or not callable(getattr(m, "mm", None)):
            defects.append(f"{name}: expected a weight object {list(shape)}, got {type(m).__name__}")
        elif tuple(m.shape) != shape:
            defects.append(f"{name}: shape {list(m.shape)}, expected {list(shape)}")
    arrays = [("q_norm", (g.head_dim,), True), ("k_norm", (g.head_dim,), True)]
    arrays += [
        ("q_bias", (2 * g.q_dim,), g.attention_bias),
        ("k_bias", (g.kv_dim,), g.attention_bias),
        ("v_bias", (g.kv_dim,), g.attention_bias),
        ("o_bias", (g.hidden_size,), g.attention_bias),
    ]
    for name, shape, wanted in arrays:
        a = getattr(w, name)
        if not wanted:
            if a is not None:
                defects.append(f"{name}: present, but the geometry declares no attention bias")
            continue
        if not isinstance(a, np.ndarray) or a.dtype != F32 or a.shape != shape:
            desc = f"{a.dtype} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            defects.append(f"{name}: {desc}, expected float32 {list(shape)}")
    if defects:
        raise ClosureError("gated attention operands do not match the layer geometry", defects)


# --------------------------------------------------------------------------- the pieces


def split_query_gate(qg: np.ndarray, g: GatedAttentionGeometry) -> tuple[np.ndarray, np.ndarray]:
    """The doubled q_proj output [T, 2·heads·head_dim] -> query [T, heads, head_dim] and gate
    [T, heads·head_dim] (per head: first head_dim columns query, next head_dim gate)."""
    T = qg.shape[0]
    v = qg.reshape(T, g.num_heads, 2 * g.head_dim)
    return v[:, :, : g.head_dim], v[:, :, g.head_dim :].reshape(T, g.q_dim)


def qk_norm(x: np.ndarray, weight: np.ndarray, g: GatedAttentionGeometry) -> np.ndarray:
    """RMSNorm over the last axis (head_dim) with weight (offset + w), float32."""
    return rms_norm(x, make_weight(weight, g.qk_norm_offset), F32(g.qk_norm_eps))


class PartialRope:
    """Rotate-half RoPE on the first ``rotary_dims`` of each head; cos/sin rows per absolute
    position, grown on demand."""

    def __init__(self, g: GatedAttentionGeometry, scaling: dict | None = None):
        self.rd = g.rotary_dims
        self.table = rope_mod.RopeTable(g.rope_theta, g.rotary_dims, scaling)

    def apply(self, x: np.ndarray, p0: int) -> np.ndarray:
        """x [T, heads, head_dim] at absolute positions p0 .. p0+T-1 -> rotated copy."""
        cos, sin = self.table.rows(p0, x.shape[0])
        rd = self.rd
        out = np.empty(x.shape, F32)
        out[..., :rd] = rope_mod.apply(x[..., :rd], cos, sin)
        out[..., rd:] = x[..., rd:]
        return out


def gate_output(attn: np.ndarray, gate: np.ndarray) -> np.ndarray:
    """attn [T, heads·head_dim] * sigmoid(gate), float32."""
    return attn * (F32(1.0) / (F32(1.0) + np.exp(-gate)))


# --------------------------------------------------------------------------- the two hooks


def project_qkv(
    x: np.ndarray, w: GatedAttentionWeights, g: GatedAttentionGeometry, rope: PartialRope, p0: int
):
    """Everything before the softmax core, for x [T, hidden] at positions p0.. :
    returns q [T, heads, head_dim] (normed, rotated), k [T, kv_heads, head_dim] (normed,
    rotated), v [T, kv_heads, head_dim] and gate [T, heads·head_dim]."""
    T = x.shape[0]
    qg = w.q_proj.mm(x)
    k = w.k_proj.mm(x)
    v = w.v_proj.mm(x)
    if g.attention_bias:
        qg = qg + w.q_bias
        k = k + w.k_bias
        v = v + w.v_bias
    q, gate = split_query_gate(qg, g)
    q = rope.apply(qk_norm(q, w.q_norm, g), p0)
    k = rope.apply(qk_norm(k.reshape(T, g.num_kv_heads, g.head_dim), w.k_norm, g), p0)
    return q, k, v.reshape(T, g.num_kv_heads, g.head_dim), gate


def finish(attn: np.ndarray, gate: np.ndarray, w: GatedAttentionWeights, g: GatedAttentionGeometry):
    """Everything after the core: attn [T, heads·head_dim] -> o_proj(attn · sigmoid(gate))."""
    y = w.o_proj.mm(gate_output(attn, gate))
    if g.attention_bias:
        y = y + w.o_bias
    return y
