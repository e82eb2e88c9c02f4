"""The gated dense FFN (graph ``ffn: "dense"``, slot ffn): down(act(gate(x)) * up(x)), with the
gate and up projections stored apart or fused into one matrix (gate rows first), optional
biases, and the SiLU / erf-GELU / tanh-GELU activations. It keeps no state.

It opts into features (`FeatureFfn`): feature f is gate row f (its key) and down column f (its
value), written with activation act(gate_f · x + b) · (up_f · x + b); ablating a feature zeroes
that activation."""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..codecs.base import products
from ..errors import GraphSchemaError
from ..exec.ops.norm import DECODE, SMALL_ROWS, decode_kernels, prefill_kernels
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


class GatedFfnParams(Params):
    HIDDEN = frozenset({"hidden_size", "kind"})

    hidden_size: int = Field(gt=0)
    kind: Literal["gated"]
    activation: Literal["silu", "gelu", "gelu_tanh"]
    intermediate_size: int = Field(gt=0)
    bias: bool
    fused_gate_up: bool


class _Bound(FeatureFfnKernel):
    def __init__(self, p: GatedFfnParams, w: dict):
        from ..exec.ops.ffn import activation

        self.act = activation(p.activation)
        self.silu = p.activation == "silu"
        self.gate, self.up, self.gate_up, self.down = (w.get(n) for n in ("ffn_gate", "ffn_up", "ffn_gate_up", "ffn_down"))
        self.gate_b, self.up_b, self.gate_up_b, self.down_b = (
            w.get(n) for n in ("ffn_gate_bias", "ffn_up_bias", "ffn_gate_up_bias", "ffn_down_bias"))
        # gate and up in one launch where the encoding has a fused kernel (the same bytes)
        self.gate_and_up = products((self.gate, self.up)) if self.gate_up is None else None

    def _activations(self, x: np.ndarray) -> np.ndarray:
        if self.gate_up is not None:
            gu = self.gate_up.mm(x)
            if self.gate_up_b is not None:
                gu = gu + self.gate_up_b
            half = gu.shape[-1] // 2
            g, u = gu[..., :half], gu[..., half:]
        else:
            g, u = self.gate_and_up(x)
            if self.gate_b is not None:
                g = g + self.gate_b
            if self.up_b is not None:
                u = u + self.up_b
        if (DECODE.on and self.silu and g.ndim == 2 and g.shape[0] <= SMALL_ROWS and g.dtype == u.dtype == np.float32
                and (k := DECODE.mod or decode_kernels())):
            return k.silu_mul(g, u)  # a decode-sized pass: one compiled call
        if (self.silu and g.ndim == 2 and g.shape[0] > SMALL_ROWS and g.dtype == u.dtype == np.float32
                and (k := prefill_kernels()) is not None):
            return k.silu_mul(g, u)  # a prefill-sized pass: rows split over the threads
        return self.act(g) * u


class GatedFfn(Operator, FeatureFfn):
    name = "gated_ffn"
    slot = FFN
    selects = "dense"
    surface_group = "ffn"
    Params = GatedFfnParams

    def params(self, surface, layer) -> GatedFfnParams:
        f = surface.get("ffn")
        if not isinstance(f, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} has a dense FFN but the surface has no ffn group")
        return parse_params(GatedFfnParams, {**f, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (gated_ffn)")

    def roles(self, p: GatedFfnParams) -> list[Role]:
        H, I, b, fused = p.hidden_size, p.intermediate_size, p.bias, p.fused_gate_up
        return [
            Role("ffn_gate", (I, H), not fused),
            Role("ffn_up", (I, H), not fused),
            Role("ffn_gate_up", (2 * I, H), fused),
            Role("ffn_down", (H, I)),
            Role("ffn_gate_bias", (I,), b and not fused, ARRAY),
            Role("ffn_up_bias", (I,), b and not fused, ARRAY),
            Role("ffn_gate_up_bias", (2 * I,), b and fused, ARRAY),
            Role("ffn_down_bias", (H,), b, ARRAY),
        ]

    def summary(self, p: GatedFfnParams) -> dict:
        return {"activation": p.activation, "intermediate_size": p.intermediate_size}

    def work_bytes(self, p: GatedFfnParams, positions: int, keys: int) -> int:
        # gate and up (or the fused pair), the activation, the product, the down projection
        return 4 * positions * (4 * p.intermediate_size + p.hidden_size)

    def bind(self, p: GatedFfnParams, operands: dict) -> Kernel:
        return _Bound(p, operands)

    # -- features (FeatureFfn) --
    def feature_count(self, p: GatedFfnParams) -> int:
        return p.intermediate_size

    def feature_view(self, p: GatedFfnParams, operands: dict) -> FeatureView:
        b = _Bound(p, operands)
        keys = operands["ffn_gate_up"].dense()[: p.intermediate_size] if p.fused_gate_up else operands["ffn_gate"].dense()
        return FeatureView(keys, operands["ffn_down"].dense(), b.activations)

    def bind_ablated(self, p: GatedFfnParams, operands: dict, features: np.ndarray) -> Kernel:
        return _Bound(p, operands).ablated(features)


register(GatedFfn)
