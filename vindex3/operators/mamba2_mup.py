"""The ``mamba2_mup`` mixer operator (graph operator ``mamba2_mup``, slot mixer; parameters in
``surface.operators.mamba2_mup``): a Mamba2 mixer whose input projection carries per-section µP
multipliers (gate, x, B, C, dt) and whose gated norm is optional — Falcon-H1's SSM branch, which
the ``mamba2`` operator (always a gated norm, no multipliers) does not express.

Its state is that of Mamba2: ``ssm`` [heads, head_dim, state] and a conv window ``conv``
[kernel − 1, conv_dim], fixed float32 buffers rolled back by snapshot, plus whether the layer has
run: as in the reference, a layer's first pass and every pass of more than one position run the
chunk form (Δ clamped to ``time_step_limit``), a one-position pass after that the recurrent form
(Δ not clamped). Numerics: vindex3.exec.ops.mamba2_mup.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
from pydantic import Field, field_validator, model_validator

from ..continuation import Geometry, buffer
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register
from .mamba1 import operator_group


class Mamba2MupParams(Params):
    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    state_size: int = Field(gt=0)
    n_groups: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    chunk_size: int = Field(gt=0)  # the reference's tiling of its chunked form (carried, not needed)
    intermediate_size: int = Field(gt=0)
    conv_dim: int = Field(gt=0)
    in_proj_dim: int = Field(gt=0)
    time_step_limit: tuple[float, float] = Field(strict=False)  # a JSON list; its numbers stay strict
    activation: Literal["silu"]
    projection_multipliers: tuple[float, float, float, float, float] = Field(strict=False)  # gate, x, B, C, dt
    gated_norm: Literal["none", "gate_then_norm", "norm_then_gate"]
    norm_eps: float | None = Field(ge=0, allow_inf_nan=False)
    use_conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool

    @field_validator("time_step_limit")
    @classmethod
    def _limit(cls, v: tuple[float, float]) -> tuple[float, float]:
        lo, hi = v
        if math.isnan(lo) or math.isnan(hi) or math.isinf(lo) or lo < 0 or hi < lo:
            raise ValueError(f"must be 0 <= lower <= upper (upper may be inf), found {list(v)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Mamba2MupParams:
        inter = self.num_heads * self.head_dim
        conv = inter + 2 * self.n_groups * self.state_size
        for key, want in (("intermediate_size", inter), ("conv_dim", conv), ("in_proj_dim", inter + conv + self.num_heads)):
            if getattr(self, key) != want:
                raise ValueError(f"{key} is {getattr(self, key)}, but the other widths make it {want}")
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        if (self.gated_norm == "none") != (self.norm_eps is None):
            raise ValueError("norm_eps is stated exactly when there is a gated norm")
        if any(not math.isfinite(m) for m in self.projection_multipliers):
            raise ValueError(f"projection_multipliers must be finite, found {list(self.projection_multipliers)}")
        return self


class Mamba2MupState(BufferState):
    """ssm [heads, head_dim, state], conv [kernel − 1, conv_dim], and whether the layer has run."""

    names = ("ssm", "conv")

    def __init__(self, ssm: np.ndarray, conv: np.ndarray, started: bool = False):
        super().__init__(ssm=ssm, conv=conv)
        self.started = started

    def _extra(self) -> dict:
        return {"started": self.started}


class _Bound(Kernel):
    def __init__(self, p: Mamba2MupParams, operands: dict):
        from ..exec.ops import mamba2_mup as k

        self.k, self.p, self.w = k, p, k.Prepared(p, operands)

    def prefill(self, x: np.ndarray, state: Mamba2MupState, p0: int) -> np.ndarray:
        chunk = x.shape[0] > 1 or not state.started
        y = self.k.mamba2_mup_forward(x, self.p, self.w, state.ssm, state.conv, chunk)
        state.started = True
        return y


class Mamba2Mup(Operator):
    name = "mamba2_mup"
    slot = MIXER
    selects = "mamba2_mup"
    operator_group = "mamba2_mup"
    Params = Mamba2MupParams

    def params(self, surface, layer) -> Mamba2MupParams:
        g = operator_group(surface, layer, "mamba2_mup")
        return parse_params(Mamba2MupParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (mamba2_mup)")

    def roles(self, p: Mamba2MupParams) -> list[Role]:
        H, inter, conv, nh = p.hidden_size, p.intermediate_size, p.conv_dim, p.num_heads
        return [
            Role("in_proj", (p.in_proj_dim, H)),
            Role("in_proj_bias", (p.in_proj_dim,), p.in_proj_bias, ARRAY),
            Role("conv_weight", (conv, 1, p.conv_kernel), True, ARRAY),
            Role("conv_bias", (conv,), p.use_conv_bias, ARRAY),
            Role("A_log", (nh,), True, ARRAY),
            Role("D", (nh,), True, ARRAY),
            Role("dt_bias", (nh,), True, ARRAY),
            Role("gated_norm", (inter,), p.gated_norm != "none", ARRAY),
            Role("out_proj", (H, inter)),
            Role("out_proj_bias", (H,), p.out_proj_bias, ARRAY),
        ]

    def geometry(self, p: Mamba2MupParams) -> Geometry:
        return Geometry((buffer("ssm", (p.num_heads, p.head_dim, p.state_size)),
                         buffer("conv", (p.conv_kernel - 1, p.conv_dim))))

    def new_state(self, p: Mamba2MupParams) -> Mamba2MupState:
        return Mamba2MupState(np.zeros((p.num_heads, p.head_dim, p.state_size), np.float32),
                              np.zeros((p.conv_kernel - 1, p.conv_dim), np.float32))

    def summary(self, p: Mamba2MupParams) -> dict:
        return {k: p[k] for k in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "gated_norm")}

    def work_bytes(self, p: Mamba2MupParams, positions: int, keys: int) -> int:
        T = positions
        return 4 * (2 * T * p.in_proj_dim + (2 * T + p.conv_kernel) * p.conv_dim + 5 * T * p.intermediate_size
                    + T * p.hidden_size + 4 * T * p.num_heads)

    def bind(self, p: Mamba2MupParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(Mamba2Mup)
