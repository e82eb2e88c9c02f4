"""Griffin's recurrent block (graph operator ``rg_lru``, slot mixer; parameters in
``surface.operators.rg_lru``): two branches from the normed input, a GELU gate and a conv1d
followed by the RG-LRU, multiplied and projected back (RecurrentGemma's recurrent layers).

Its state is two fixed float32 buffers: ``rg_lru`` [lru_width], the recurrence, and ``conv``
[conv_kernel − 1, lru_width], the conv window; both roll back only through a snapshot. The
recurrence resets at the sequence's position 0, so the kernel reads the position it starts at.
Numerics: vindex3.exec.ops.rg_lru.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from ..continuation import Geometry, buffer
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register
from .mamba1 import operator_group


class RgLruParams(Params):
    hidden_size: int = Field(gt=0)
    lru_width: int = Field(gt=0)
    num_heads: int = Field(gt=0)  # blocks of the block-diagonal gates
    conv_kernel: int = Field(gt=0)
    activation: Literal["gelu_tanh"]  # of the y branch
    log_decay_scale: float = Field(gt=0, allow_inf_nan=False)  # c in log a = -c · r · softplus(Λ)

    @model_validator(mode="after")
    def _blocks(self) -> RgLruParams:
        if self.lru_width % self.num_heads:
            raise ValueError(f"lru_width ({self.lru_width}) must be a multiple of num_heads ({self.num_heads})")
        return self


class RgLruState(BufferState):
    """rg_lru [lru_width] (the recurrence), conv [conv_kernel − 1, lru_width] (past inputs, oldest first)."""

    names = ("rg_lru", "conv")


class _Bound(Kernel):
    def __init__(self, p: RgLruParams, operands: dict):
        from ..exec.ops import rg_lru as k

        self.k, self.p, self.w = k, p, k.Prepared(p, operands)

    def prefill(self, x: np.ndarray, state: RgLruState, p0: int) -> np.ndarray:
        return self.k.rg_lru_forward(x, self.p, self.w, state.rg_lru, state.conv, p0)


class RgLru(Operator):
    name = "rg_lru"
    slot = MIXER
    selects = "rg_lru"
    operator_group = "rg_lru"
    Params = RgLruParams

    def params(self, surface, layer) -> RgLruParams:
        g = operator_group(surface, layer, "rg_lru")
        return parse_params(RgLruParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (rg_lru)")

    def roles(self, p: RgLruParams) -> list[Role]:
        H, W, nh = p.hidden_size, p.lru_width, p.num_heads
        bw = W // nh
        return [
            Role("linear_y", (W, H)),
            Role("linear_y_bias", (W,), True, ARRAY),
            Role("linear_x", (W, H)),
            Role("linear_x_bias", (W,), True, ARRAY),
            Role("conv_weight", (W, 1, p.conv_kernel), True, ARRAY),
            Role("conv_bias", (W,), True, ARRAY),
            Role("input_gate_weight", (nh, bw, bw), True, ARRAY),
            Role("input_gate_bias", (nh, bw), True, ARRAY),
            Role("recurrent_gate_weight", (nh, bw, bw), True, ARRAY),
            Role("recurrent_gate_bias", (nh, bw), True, ARRAY),
            Role("recurrent_param", (W,), True, ARRAY),
            Role("linear_out", (H, W)),
            Role("linear_out_bias", (H,), True, ARRAY),
        ]

    def geometry(self, p: RgLruParams) -> Geometry:
        return Geometry((buffer("rg_lru", (p.lru_width,)), buffer("conv", (p.conv_kernel - 1, p.lru_width))))

    def new_state(self, p: RgLruParams) -> RgLruState:
        return RgLruState(rg_lru=np.zeros(p.lru_width, np.float32), conv=np.zeros((p.conv_kernel - 1, p.lru_width), np.float32))

    def summary(self, p: RgLruParams) -> dict:
        return {k: p[k] for k in ("lru_width", "num_heads", "conv_kernel")}

    def work_bytes(self, p: RgLruParams, positions: int, keys: int) -> int:
        T, W = positions, p.lru_width
        # y, x, the conv window and output, the two gates and their copies, a, the multiplier, the
        # input, the states, the output projection
        return 4 * (12 * T * W + p.conv_kernel * W + T * p.hidden_size)

    def bind(self, p: RgLruParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(RgLru)
