"""The gated short convolution operator (graph operator ``short_conv``, slot mixer; parameters in
``surface.operators.short_conv``): LFM2's conv layers, out_proj(C · conv(B · x)).

Its state is the smallest recurrent state there is: one fixed buffer ``conv`` [conv_kernel − 1,
hidden], the window of past B·x values, which rolls back only through a snapshot. The numerics
live in vindex3.exec.ops.short_conv.
"""

from __future__ import annotations

import numpy as np
from pydantic import Field

from ..continuation import Geometry, buffer
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register
from .mamba1 import operator_group


class ShortConvParams(Params):
    hidden_size: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    bias: bool  # on in_proj, the conv and out_proj alike (LFM2's conv_bias)


class ShortConvState(BufferState):
    """conv [conv_kernel − 1, hidden]: past B·x values, oldest first."""

    names = ("conv",)


class _Bound(Kernel):
    def __init__(self, p: ShortConvParams, operands: dict):
        from ..exec.ops import short_conv as k

        self.k, self.p, self.w = k, p, k.Prepared(operands)

    def prefill(self, x: np.ndarray, state: ShortConvState, p0: int) -> np.ndarray:
        return self.k.short_conv_forward(x, self.p, self.w, state.conv)


class ShortConv(Operator):
    name = "short_conv"
    slot = MIXER
    selects = "short_conv"
    operator_group = "short_conv"
    Params = ShortConvParams

    def params(self, surface, layer) -> ShortConvParams:
        g = operator_group(surface, layer, "short_conv")
        return parse_params(ShortConvParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (short_conv)")

    def roles(self, p: ShortConvParams) -> list[Role]:
        H = p.hidden_size
        return [
            Role("in_proj", (3 * H, H)),
            Role("in_proj_bias", (3 * H,), p.bias, ARRAY),
            Role("conv_weight", (H, 1, p.conv_kernel), True, ARRAY),
            Role("conv_bias", (H,), p.bias, ARRAY),
            Role("out_proj", (H, H)),
            Role("out_proj_bias", (H,), p.bias, ARRAY),
        ]

    def geometry(self, p: ShortConvParams) -> Geometry:
        return Geometry((buffer("conv", (p.conv_kernel - 1, p.hidden_size)),))

    def new_state(self, p: ShortConvParams) -> ShortConvState:
        return ShortConvState(conv=np.zeros((p.conv_kernel - 1, p.hidden_size), np.float32))

    def summary(self, p: ShortConvParams) -> dict:
        return {"conv_kernel": p.conv_kernel}

    def work_bytes(self, p: ShortConvParams, positions: int, keys: int) -> int:
        T, H = positions, p.hidden_size
        # the projection, B·x, the conv window and output, C·conv, the output projection
        return 4 * (3 * T * H + 2 * T * H + (T + p.conv_kernel) * H + T * H)

    def bind(self, p: ShortConvParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(ShortConv)
