"""The non-gated dense FFN (graph ``ffn: "mlp"``, slot ffn): down(act(up(x) + b_up)) + b_down,
the two-matrix MLP of GPT-2, GPT-NeoX (Pythia) and Phi-2, with the SiLU / erf-GELU /
tanh-GELU activations (``gelu_new`` is the tanh form) and optional biases. It keeps no state.

It opts into features (`FeatureFfn`): feature f is up row f (its key) and down column f (its
value), written with activation act(up_f · x + b_f); ablating a feature zeroes that activation."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..errors import GraphSchemaError
from .base import (
    ARRAY,
    FFN,
    FeatureFfn,
    FeatureFfnKernel,
    FeatureView,
    Kernel,
    Operator,
    Params,
    Role,
    parse_params,
    register,
)


class MlpFfnParams(Params):
    HIDDEN = frozenset({"hidden_size", "kind"})

    hidden_size: int = Field(gt=0)
    kind: Literal["mlp"]
    activation: Literal["silu", "gelu", "gelu_tanh"]
    intermediate_size: int = Field(gt=0)
    bias: bool


class _Bound(FeatureFfnKernel):
    def __init__(self, p: MlpFfnParams, w: dict):
        from ..exec.ops.ffn import activation

        self.act = activation(p.activation)
        self.up, self.down = w["ffn_up"], w["ffn_down"]
        self.up_b, self.down_b = w.get("ffn_up_bias"), w.get("ffn_down_bias")

    def _activations(self, x: np.ndarray) -> np.ndarray:
        u = self.up.mm(x)
        if self.up_b is not None:
            u = u + self.up_b
        return self.act(u)


class MlpFfn(Operator, FeatureFfn):
    name = "mlp_ffn"
    slot = FFN
    selects = "mlp"
    surface_group = "ffn"
    Params = MlpFfnParams

    def params(self, surface, layer) -> MlpFfnParams:
        f = surface.get("ffn")
        if not isinstance(f, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} has an mlp FFN but the surface has no ffn group")
        return parse_params(MlpFfnParams, {**f, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (mlp_ffn)")

    def roles(self, p: MlpFfnParams) -> list[Role]:
        H, I, b = p.hidden_size, p.intermediate_size, p.bias
        return [
            Role("ffn_up", (I, H)),
            Role("ffn_down", (H, I)),
            Role("ffn_up_bias", (I,), b, ARRAY),
            Role("ffn_down_bias", (H,), b, ARRAY),
        ]

    def summary(self, p: MlpFfnParams) -> dict:
        return {"activation": p.activation, "intermediate_size": p.intermediate_size}

    def work_bytes(self, p: MlpFfnParams, positions: int, keys: int) -> int:
        # up, its activation, the down projection
        return 4 * positions * (2 * p.intermediate_size + p.hidden_size)

    def bind(self, p: MlpFfnParams, operands: dict) -> Kernel:
        return _Bound(p, operands)

    # -- features (FeatureFfn) --
    def feature_count(self, p: MlpFfnParams) -> int:
        return p.intermediate_size

    def feature_view(self, p: MlpFfnParams, operands: dict) -> FeatureView:
        b = _Bound(p, operands)
        return FeatureView(operands["ffn_up"].dense(), operands["ffn_down"].dense(), b.activations)

    def bind_ablated(self, p: MlpFfnParams, operands: dict, features: np.ndarray) -> Kernel:
        return _Bound(p, operands).ablated(features)


register(MlpFfn)
