"""The Gated DeltaNet mixer operator (graph operator ``gated_delta``, slot mixer; facts in
``surface.operators.gated_delta``). The linear-attention layers of Qwen3-Next and Qwen3.5.

Per value head the layer keeps a [key_head_dim, value_head_dim] matrix updated by the gated delta
rule, and a causal conv keeps the last ``conv_kernel`` inputs of its [q | k | v] channels: two
fixed float32 buffers, ``recurrent`` [value heads, dk, dv] and ``conv`` [conv_dim, kernel], plus
whether the layer has run. The numerics (both projection layouts, the chunked prefill and the
single step) live in vindex3.exec.ops.gated_delta, whose docstring states them.

Which form runs mirrors transformers 5.24.0 (``Qwen3NextGatedDeltaNet`` /
``Qwen3_5GatedDeltaNet``, torch path) exactly:

* a pass of more than one position, or the very first pass of a layer whatever its length,
  runs the chunked form (``gated_delta_prefill``, chunks of ``chunk_size`` counted from the
  pass's first position, continuing from the state the layer holds);
* a one-position pass on a layer that has already run runs the single-step recurrence
  (``gated_delta_step``), as transformers does once its cache holds the layer's state.

The two forms are one function up to float32 rounding (the reference's own two paths differ by
~1e-5 on outputs of size ~10); the state remembers whether its layer has run (``started``), so
the choice depends on the state alone, and a snapshot and restore carry it along. A recurrence
cannot be truncated: it rolls back by snapshot.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from ..continuation import Geometry, buffer
from ..errors import GraphSchemaError, UnsupportedOperator
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register

NAME = "gated_delta"
LAYOUT_GROUPED = "qkvz_ba_grouped"  # Qwen3-Next: in_proj_qkvz + in_proj_ba, grouped per key head
LAYOUT_SPLIT = "qkv_z_b_a"  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a


class GatedDeltaParams(Params):
    hidden_size: int = Field(gt=0)
    num_key_heads: int = Field(gt=0)
    num_value_heads: int = Field(gt=0)
    key_head_dim: int = Field(gt=0)
    value_head_dim: int = Field(gt=0)
    key_dim: int = Field(gt=0)  # num_key_heads * key_head_dim, written out for readers
    value_dim: int = Field(gt=0)  # num_value_heads * value_head_dim
    conv_dim: int = Field(gt=0)  # 2 * key_dim + value_dim: the conv's [q | k | v] channels
    conv_kernel: int = Field(gt=0)
    conv_activation: Literal["silu"]
    conv_bias: Literal[False]  # neither family has one; a bias would need a role and a kernel
    chunk_size: int = Field(gt=0)  # the prefill's chunk length (the reference's 64)
    projection_layout: Literal["qkvz_ba_grouped", "qkv_z_b_a"]
    head_mapping: Literal["repeat_interleave"]  # value head h reads key head h // (Hv / Hk)
    qk_l2norm_eps: float = Field(ge=0, allow_inf_nan=False)
    norm_eps: float = Field(ge=0, allow_inf_nan=False)  # the gated output norm's
    norm_weight_offset: Literal[0.0]  # the gated norm's weight is plain (not 1 + w)
    norm_before_gate: Literal[True]  # rms_norm(o) * w * silu(z)

    @model_validator(mode="after")
    def _consistent(self) -> GatedDeltaParams:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                             f"({self.num_key_heads})")
        kd, vd = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        for key, want in (("key_dim", kd), ("value_dim", vd), ("conv_dim", 2 * kd + vd)):
            if getattr(self, key) != want:
                raise ValueError(f"{key} is {getattr(self, key)}, but the head counts and widths make it {want}")
        return self


class GatedDeltaState(BufferState):
    """recurrent [Hv, dk, dv] (the delta-rule matrix of each value head), conv [conv_dim, K]
    (the last K conv inputs, oldest first), and whether the layer has run (transformers' "the
    cache holds a state for this layer")."""

    names = ("recurrent", "conv")

    def __init__(self, recurrent: np.ndarray, conv: np.ndarray, started: bool = False):
        super().__init__(recurrent=recurrent, conv=conv)
        self.started = started

    def _extra(self) -> dict:
        return {"started": self.started}


# role -> GatedDeltaWeights field
ROLE_TO_FIELD = {
    "in_proj_qkvz": "in_proj_qkvz",
    "in_proj_ba": "in_proj_ba",
    "in_proj_qkv": "in_proj_qkv",
    "in_proj_z": "in_proj_z",
    "in_proj_b": "in_proj_b",
    "in_proj_a": "in_proj_a",
    "conv_weight": "conv_weight",
    "A_log": "A_log",
    "dt_bias": "dt_bias",
    "gated_norm": "norm_weight",
    "out_proj": "out_proj",
}


class _Bound(Kernel):
    def __init__(self, p: GatedDeltaParams, operands: dict):
        from ..exec.ops import gated_delta as k

        self.k = k
        try:
            self.g = k.GatedDeltaGeometry(
                hidden_size=p.hidden_size, num_key_heads=p.num_key_heads, num_value_heads=p.num_value_heads,
                key_head_dim=p.key_head_dim, value_head_dim=p.value_head_dim, conv_kernel=p.conv_kernel,
                chunk_size=p.chunk_size, norm_eps=p.norm_eps, qk_l2norm_eps=p.qk_l2norm_eps,
                projection_layout=p.projection_layout, conv_activation=p.conv_activation)
        except ValueError as e:
            raise UnsupportedOperator(f"{NAME} operator geometry is not executable: {e}") from None
        self.w = k.GatedDeltaWeights(**{f: operands.get(role) for role, f in ROLE_TO_FIELD.items()})

    def prefill(self, x: np.ndarray, state: GatedDeltaState, p0: int) -> np.ndarray:
        if x.shape[0] == 1 and state.started:
            y = self.k.gated_delta_step(x[0], self.w, self.g, state)[None]
        else:
            y = self.k.gated_delta_prefill(x, self.w, self.g, state)
        state.started = True
        return y


class GatedDelta(Operator):
    name = NAME
    slot = MIXER
    selects = NAME
    operator_group = NAME
    Params = GatedDeltaParams

    def params(self, surface, layer) -> GatedDeltaParams:
        ops = surface.get("operators")
        g = ops.get(NAME) if isinstance(ops, dict) else None
        if not isinstance(g, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs {NAME} but surface.operators has no "
                                   f"{NAME} group")
        return parse_params(GatedDeltaParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} ({NAME})")

    def roles(self, p: GatedDeltaParams) -> list[Role]:
        """The chosen layout's input projections only: the other layout's are not roles of this op,
        so closure refuses them by name if a checkpoint carries them."""
        H, nv = p.hidden_size, p.num_value_heads
        if p.projection_layout == LAYOUT_GROUPED:
            proj = [Role("in_proj_qkvz", (2 * p.key_dim + 2 * p.value_dim, H)), Role("in_proj_ba", (2 * nv, H))]
        else:
            proj = [Role("in_proj_qkv", (p.conv_dim, H)), Role("in_proj_z", (p.value_dim, H)),
                    Role("in_proj_b", (nv, H)), Role("in_proj_a", (nv, H))]
        return proj + [
            Role("conv_weight", (p.conv_dim, 1, p.conv_kernel), True, ARRAY),
            Role("A_log", (nv,), True, ARRAY),
            Role("dt_bias", (nv,), True, ARRAY),
            Role("gated_norm", (p.value_head_dim,), True, ARRAY),
            Role("out_proj", (H, p.value_dim)),
        ]

    def geometry(self, p: GatedDeltaParams) -> Geometry:
        return Geometry((buffer("recurrent", (p.num_value_heads, p.key_head_dim, p.value_head_dim)),
                         buffer("conv", (p.conv_dim, p.conv_kernel))))

    def new_state(self, p: GatedDeltaParams) -> GatedDeltaState:
        return GatedDeltaState(np.zeros((p.num_value_heads, p.key_head_dim, p.value_head_dim), np.float32),
                               np.zeros((p.conv_dim, p.conv_kernel), np.float32))

    def summary(self, p: GatedDeltaParams) -> dict:
        return {k: p[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel")}

    def bind(self, p: GatedDeltaParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(GatedDelta)
