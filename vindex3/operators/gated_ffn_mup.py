"""A gated dense FFN with µP multipliers (graph ``ffn: "dense_mup"``, slot ffn; facts in
``surface.operators.gated_ffn_mup``): ``down_multiplier · down(act(gate_multiplier · gate(x)) ·
up(x))``, Falcon-H1's FFN (its ``mlp_multipliers``), which the plain ``gated_ffn`` (no
multipliers) does not express. Gate, up and down are stored apart, biases optional. It keeps no
state.

It does not expose features: its write scales the down projection's bias too, which the feature
view's "values times activations plus the down bias" does not state.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, field_validator

from .base import ARRAY, FFN, Kernel, Operator, Params, Role, parse_params, register
from .mamba1 import operator_group


class GatedFfnMupParams(Params):
    hidden_size: int = Field(gt=0)
    activation: Literal["silu", "gelu", "gelu_tanh"]
    intermediate_size: int = Field(gt=0)
    bias: bool
    gate_multiplier: float = Field(allow_inf_nan=False)
    down_multiplier: float = Field(allow_inf_nan=False)

    @field_validator("gate_multiplier", "down_multiplier")
    @classmethod
    def _nonzero(cls, v: float) -> float:
        if v == 0:
            raise ValueError("a multiplier of 0 erases the FFN")
        return v


class _Bound(Kernel):
    def __init__(self, p: GatedFfnMupParams, w: dict):
        from ..exec.ops.ffn import activation

        self.act = activation(p.activation)
        self.gm, self.dm = np.float32(p.gate_multiplier), np.float32(p.down_multiplier)
        self.gate, self.up, self.down = w["ffn_gate"], w["ffn_up"], w["ffn_down"]
        self.gate_b, self.up_b, self.down_b = w.get("ffn_gate_bias"), w.get("ffn_up_bias"), w.get("ffn_down_bias")

    def prefill(self, x: np.ndarray, state, p0: int) -> np.ndarray:
        g, u = self.gate.mm(x), self.up.mm(x)
        if self.gate_b is not None:
            g, u = g + self.gate_b, u + self.up_b
        y = self.down.mm(u * self.act(g * self.gm))
        if self.down_b is not None:
            y = y + self.down_b
        return y * self.dm


class GatedFfnMup(Operator):
    name = "gated_ffn_mup"
    slot = FFN
    selects = "dense_mup"
    operator_group = "gated_ffn_mup"
    no_features = "its down multiplier scales the down projection's bias too, which the feature view does not state"
    Params = GatedFfnMupParams

    def params(self, surface, layer) -> GatedFfnMupParams:
        g = operator_group(surface, layer, "gated_ffn_mup")
        return parse_params(GatedFfnMupParams, {**g, "hidden_size": surface.get("hidden_size")},
                            f"layer {layer.index} (gated_ffn_mup)")

    def roles(self, p: GatedFfnMupParams) -> list[Role]:
        H, I, b = p.hidden_size, p.intermediate_size, p.bias
        return [
            Role("ffn_gate", (I, H)),
            Role("ffn_up", (I, H)),
            Role("ffn_down", (H, I)),
            Role("ffn_gate_bias", (I,), b, ARRAY),
            Role("ffn_up_bias", (I,), b, ARRAY),
            Role("ffn_down_bias", (H,), b, ARRAY),
        ]

    def summary(self, p: GatedFfnMupParams) -> dict:
        return {"activation": p.activation, "intermediate_size": p.intermediate_size,
                "gate_multiplier": p.gate_multiplier, "down_multiplier": p.down_multiplier}

    def work_bytes(self, p: GatedFfnMupParams, positions: int, keys: int) -> int:
        return 4 * positions * (5 * p.intermediate_size + 2 * p.hidden_size)

    def bind(self, p: GatedFfnMupParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(GatedFfnMup)
