"""The Mamba2 mixer operator (graph operator ``mamba2``, slot mixer; parameters in
``surface.operators.mamba2``). Its state is two fixed float32 buffers, ``ssm`` [heads,
head_dim, state] and ``conv`` [conv_dim, kernel], plus whether the layer has run. The numerics
live in vindex3.exec.ops.mamba2.

Which arithmetic runs mirrors transformers 5.24.0's ``Mamba2Mixer`` exactly:

* a pass of more than one position, or the very first pass of a layer whatever its length,
  runs the chunk form (``mamba2_prefill``: Δ clamped to ``time_step_limit``);
* a one-position pass on a layer that has already run runs the recurrent form
  (``mamba2_step``: Δ not clamped), as transformers does once the layer's cache holds state.

With the default limits (0, ∞) the clamp is a no-op and the two forms are one function; with a
finite limit they differ in transformers and here alike. The state remembers whether its layer
has run (``started``), so the choice depends on nothing but the state itself, and a snapshot and
restore carry it along.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..continuation import Geometry, buffer
from ..errors import GraphSchemaError, UnsupportedOperator
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register


class Mamba2Params(Params):
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    state_size: int = Field(gt=0)
    n_groups: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    chunk_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    conv_dim: int = Field(gt=0)
    in_proj_dim: int = Field(gt=0)
    time_step_limit: tuple[float, float] = Field(strict=False)  # a JSON list; its numbers stay strict
    activation: Literal["silu"]
    norm_eps: float = Field(ge=0, allow_inf_nan=False)
    norm_before_gate: Literal[False]
    use_conv_bias: bool
    use_bias: bool

    @field_validator("time_step_limit")
    @classmethod
    def _limit(cls, v: tuple[float, float]) -> tuple[float, float]:
        lo, hi = v
        if math.isnan(lo) or math.isnan(hi) or math.isinf(lo) or lo < 0 or hi < lo:
            raise ValueError(f"must be 0 <= lower <= upper (upper may be inf), found {list(v)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Mamba2Params:
        inter = self.num_heads * self.head_dim
        conv = inter + 2 * self.n_groups * self.state_size
        for key, want in (("intermediate_size", inter), ("conv_dim", conv), ("in_proj_dim", inter + conv + self.num_heads)):
            if getattr(self, key) != want:
                raise ValueError(f"{key} is {getattr(self, key)}, but the other widths make it {want}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        return self


class Mamba2State(BufferState):
    """ssm [heads, head_dim, state], conv [conv_dim, kernel] (the last inputs, oldest first), and
    whether the layer has run (transformers' "the cache holds a state for this layer")."""

    names = ("ssm", "conv")

    def __init__(self, ssm: np.ndarray, conv: np.ndarray, started: bool = False):
        super().__init__(ssm=ssm, conv=conv)
        self.started = started

    def _extra(self) -> dict:
        return {"started": self.started}


ROLE_TO_FIELD = {
    "in_proj": "in_proj",
    "in_proj_bias": "in_proj_bias",
    "conv_weight": "conv_weight",
    "conv_bias": "conv_bias",
    "A_log": "A_log",
    "D": "D",
    "dt_bias": "dt_bias",
    "gated_norm": "norm_weight",
    "out_proj": "out_proj",
    "out_proj_bias": "out_proj_bias",
}


class _Bound(Kernel):
    def __init__(self, p: Mamba2Params, operands: dict):
        from ..exec.ops import mamba2 as k

        self.k = k
        try:
            self.g = k.Mamba2Geometry(
                hidden_size=p.hidden_size, num_heads=p.num_heads, head_dim=p.head_dim, state_size=p.state_size,
                n_groups=p.n_groups, conv_kernel=p.conv_kernel, chunk_size=p.chunk_size,
                time_step_limit=p.time_step_limit, norm_eps=p.norm_eps, use_conv_bias=p.use_conv_bias,
                use_bias=p.use_bias)
        except ValueError as e:
            raise UnsupportedOperator(f"mamba2 operator geometry is not executable: {e}") from None
        self.w = k.Mamba2Weights(**{f: operands.get(role) for role, f in ROLE_TO_FIELD.items()})

    def prefill(self, x: np.ndarray, state: Mamba2State, p0: int) -> np.ndarray:
        if x.shape[0] == 1 and state.started:
            y = self.k.mamba2_step(x[0], self.w, self.g, state)[None]
        else:
            y = self.k.mamba2_prefill(x, self.w, self.g, state)
        state.started = True
        return y


class Mamba2(Operator):
    name = "mamba2"
    slot = MIXER
    selects = "mamba2"
    operator_group = "mamba2"
    Params = Mamba2Params

    def params(self, surface, layer) -> Mamba2Params:
        m = surface.get("operators", {}).get("mamba2") if isinstance(surface.get("operators"), dict) else None
        if not isinstance(m, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs mamba2 but surface.operators has no mamba2 group")
        return parse_params(Mamba2Params, {**m, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (mamba2)")

    def roles(self, p: Mamba2Params) -> list[Role]:
        H, inter, conv, nh = p.hidden_size, p.intermediate_size, p.conv_dim, p.num_heads
        return [
            Role("in_proj", (p.in_proj_dim, H)),
            Role("in_proj_bias", (p.in_proj_dim,), p.use_bias, ARRAY),
            Role("conv_weight", (conv, 1, p.conv_kernel), True, ARRAY),
            Role("conv_bias", (conv,), p.use_conv_bias, ARRAY),
            Role("A_log", (nh,), True, ARRAY),
            Role("D", (nh,), True, ARRAY),
            Role("dt_bias", (nh,), True, ARRAY),
            Role("gated_norm", (inter,), True, ARRAY),
            Role("out_proj", (H, inter)),
            Role("out_proj_bias", (H,), p.use_bias, ARRAY),
        ]

    def geometry(self, p: Mamba2Params) -> Geometry:
        return Geometry((buffer("ssm", (p.num_heads, p.head_dim, p.state_size)), buffer("conv", (p.conv_dim, p.conv_kernel))))

    def new_state(self, p: Mamba2Params) -> Mamba2State:
        return Mamba2State(np.zeros((p.num_heads, p.head_dim, p.state_size), np.float32),
                           np.zeros((p.conv_dim, p.conv_kernel), np.float32))

    def summary(self, p: Mamba2Params) -> dict:
        return {k: p[k] for k in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")}

    def work_bytes(self, p: Mamba2Params, positions: int, keys: int) -> int:
        T, gn = positions, p.n_groups * p.state_size
        # the projection, the conv input window and output, B and C, x·dt, y and its D skip, the
        # gated norm's output, the output projection
        return 4 * (T * p.in_proj_dim + (2 * T + p.conv_kernel) * p.conv_dim + 2 * T * gn
                    + 4 * T * p.intermediate_size + T * p.hidden_size + 4 * T * p.num_heads)

    def bind(self, p: Mamba2Params, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(Mamba2)
