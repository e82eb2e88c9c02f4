"""The Mamba1 mixer operator (graph operator ``mamba1``, slot mixer; parameters in
``surface.operators.mamba1``): the selective scan of Mamba and Falcon-Mamba.

Its state is two fixed float32 buffers: ``ssm`` [inner, state] (one state row per channel, a
shape of its own: Mamba2 keeps [heads, head_dim, state]) and ``conv`` [conv_kernel − 1, inner],
the window of past conv inputs. Both roll back only through a snapshot. The numerics live in
vindex3.exec.ops.mamba1; Falcon-Mamba is the same operator with ``bcdt_rms_eps`` set (weightless
RMS norms on Δ, B and C), null for Mamba.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..continuation import Geometry, buffer
from ..errors import GraphSchemaError
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register


class Mamba1Params(Params):
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    state_size: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    time_step_rank: int = Field(gt=0)
    activation: Literal["silu"]
    use_bias: bool
    use_conv_bias: bool
    bcdt_rms_eps: float | None = Field(ge=0, allow_inf_nan=False)  # Falcon-Mamba's mixer norms; null: none


class Mamba1State(BufferState):
    """ssm [inner, state] and conv [conv_kernel − 1, inner] (past conv inputs, oldest first)."""

    names = ("ssm", "conv")


class _Bound(Kernel):
    def __init__(self, p: Mamba1Params, operands: dict):
        from ..exec.ops import mamba1 as k

        self.k, self.p, self.w = k, p, k.Prepared(operands)

    def prefill(self, x: np.ndarray, state: Mamba1State, p0: int) -> np.ndarray:
        return self.k.mamba1_forward(x, self.p, self.w, state.ssm, state.conv)


def operator_group(surface, layer, name: str) -> dict:
    """``surface.operators.<name>`` of a layer that runs it, or a named refusal."""
    ops = surface.get("operators")
    group = ops.get(name) if isinstance(ops, dict) else None
    if not isinstance(group, dict):
        raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs {name} but surface.operators has no {name} group")
    return group


class Mamba1(Operator):
    name = "mamba1"
    slot = MIXER
    selects = "mamba1"
    operator_group = "mamba1"
    Params = Mamba1Params

    def params(self, surface, layer) -> Mamba1Params:
        m = operator_group(surface, layer, "mamba1")
        return parse_params(Mamba1Params, {**m, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (mamba1)")

    def roles(self, p: Mamba1Params) -> list[Role]:
        H, D, N, R = p.hidden_size, p.intermediate_size, p.state_size, p.time_step_rank
        return [
            Role("in_proj", (2 * D, H)),
            Role("in_proj_bias", (2 * D,), p.use_bias, ARRAY),
            Role("conv_weight", (D, 1, p.conv_kernel), True, ARRAY),
            Role("conv_bias", (D,), p.use_conv_bias, ARRAY),
            Role("x_proj", (R + 2 * N, D)),
            Role("dt_proj", (D, R)),
            Role("dt_proj_bias", (D,), True, ARRAY),
            Role("A_log", (D, N), True, ARRAY),
            Role("D", (D,), True, ARRAY),
            Role("out_proj", (H, D)),
            Role("out_proj_bias", (H,), p.use_bias, ARRAY),
        ]

    def geometry(self, p: Mamba1Params) -> Geometry:
        return Geometry((buffer("ssm", (p.intermediate_size, p.state_size)),
                         buffer("conv", (p.conv_kernel - 1, p.intermediate_size))))

    def new_state(self, p: Mamba1Params) -> Mamba1State:
        return Mamba1State(ssm=np.zeros((p.intermediate_size, p.state_size), np.float32),
                           conv=np.zeros((p.conv_kernel - 1, p.intermediate_size), np.float32))

    def summary(self, p: Mamba1Params) -> dict:
        return {k: p[k] for k in ("intermediate_size", "state_size", "conv_kernel", "time_step_rank", "bcdt_rms_eps")}

    def work_bytes(self, p: Mamba1Params, positions: int, keys: int) -> int:
        T, D, N, R = positions, p.intermediate_size, p.state_size, p.time_step_rank
        # the projection, the conv window and output, x_proj's output, Δ, y, the output projection
        return 4 * (2 * T * D + (T + p.conv_kernel) * D + T * (R + 2 * N) + 3 * T * D + T * p.hidden_size)

    def bind(self, p: Mamba1Params, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(Mamba1)
