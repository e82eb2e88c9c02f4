"""The Kimi Delta Attention mixer (graph operator ``kda``, slot mixer; parameters in
``surface.operators.kda``). The numerics live in vindex3.exec.ops.kda (its docstring has the
formulas, the chunked form and the tensor tables).

Facts (`KdaParams`), every one recorded in the graph, none defaulted here:

* ``num_heads`` H, ``head_dim`` D (keys and values), ``conv_kernel`` K;
* ``forget_rank`` and ``gate_rank``: the inner ranks of the forget gate (``f_a_proj`` rows) and
  of the output gate (``g_a_proj`` rows). Admission reads them from the tensors' shapes and
  closure checks every layer's tensors against them; they are never assumed equal to D (the
  reference builds them at D, a checkpoint need not);
* ``norm_eps`` (the output gated RMSNorm, the layer's rms_norm_eps), ``conv_activation``
  (silu: the only one with an executor);
* ``l2norm_eps`` (1e-6, the reference kernel's constant in its q/k L2 norm) and ``chunk_size``
  (64, the reference's prefill tiling, which changes rounding only): values no config states,
  recorded as judgments of the family (``judgments`` names them and why).

**The state is float32, by the reference's own choice.** transformers casts q, k, v, g and β
to float32 inside both KDA kernels and stores ``last_recurrent_state.to(torch.float32)`` in its
cache after every call, whatever the model's dtype: the recurrent matrix of a KDA layer is
float32 by the reference's judgment ("states are more susceptible to rounding errors"), and so
it is here. Parts, all fixed size, rolled back by snapshot only (a recurrence cannot be
truncated): ``recurrent`` [H, D, D] (keys × values) and the three conv windows ``conv_q``,
``conv_k``, ``conv_v`` [K − 1, H·D] (the raw projection rows the causal convs still need).

**Which form runs** mirrors transformers 5.24.0's ``KimiLinearDeltaAttention``: a pass of one
position on a layer that has already run (its cache holds a recurrent state) runs the
recurrence itself (``kda_step``); any other pass — several positions, or the very first pass of
a layer even if it is one position — runs the chunked form (``kda_prefill``). The two compute
one function and differ only in rounding; the state remembers whether its layer has run
(``started``) so that the choice depends on nothing but the state, and snapshots carry it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field, model_validator

from ..continuation import Geometry, buffer
from ..errors import GraphSchemaError, UnsupportedOperator
from ..exec.state import BufferState
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register


class KdaParams(Params):
    HIDDEN = frozenset({"hidden_size", "judgments"})

    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)
    forget_rank: int = Field(gt=0)
    gate_rank: int = Field(gt=0)
    chunk_size: int = Field(gt=0)
    norm_eps: float = Field(ge=0, allow_inf_nan=False)
    l2norm_eps: float = Field(ge=0, allow_inf_nan=False)
    conv_activation: Literal["silu"]
    judgments: dict[str, str]  # fact -> why the family fixed it (no config states it)

    @model_validator(mode="after")
    def _judged_facts_exist(self) -> KdaParams:
        unknown = sorted(set(self.judgments) - (set(type(self).model_fields) - {"judgments"}))
        if unknown:
            raise ValueError(f"judgments name facts this operator does not have: {', '.join(unknown)}")
        return self

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim


class KdaState(BufferState):
    """recurrent [H, D, D], conv_q / conv_k / conv_v [K − 1, H·D], float32, and whether the
    layer has run (transformers' "the cache holds a state for this layer")."""

    names = ("recurrent", "conv_q", "conv_k", "conv_v")

    def __init__(self, started: bool = False, **buffers: np.ndarray):
        super().__init__(**buffers)
        self.started = started

    def _extra(self) -> dict:
        return {"started": self.started}


class _Bound(Kernel):
    def __init__(self, p: KdaParams, operands: dict):
        from ..exec.ops import kda as k

        self.k = k
        try:
            self.g = k.KdaGeometry(
                hidden_size=p.hidden_size, num_heads=p.num_heads, head_dim=p.head_dim, conv_kernel=p.conv_kernel,
                forget_rank=p.forget_rank, gate_rank=p.gate_rank, chunk_size=p.chunk_size, norm_eps=p.norm_eps,
                l2norm_eps=p.l2norm_eps, conv_activation=p.conv_activation)
        except ValueError as e:
            raise UnsupportedOperator(f"kda operator geometry is not executable: {e}") from None
        self.w = k.KdaWeights(**{name: operands.get(name) for name in k.KdaWeights.__dataclass_fields__})

    def prefill(self, x: np.ndarray, state: KdaState, p0: int) -> np.ndarray:
        if x.shape[0] == 1 and state.started:
            y = self.k.kda_step(x[0], self.w, self.g, state)[None]
        else:
            y = self.k.kda_prefill(x, self.w, self.g, state)
        state.started = True
        return y


class Kda(Operator):
    name = "kda"
    slot = MIXER
    selects = "kda"
    operator_group = "kda"
    Params = KdaParams

    def params(self, surface, layer) -> KdaParams:
        ops = surface.get("operators")
        g = ops.get("kda") if isinstance(ops, dict) else None
        if not isinstance(g, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs kda but surface.operators has no kda group")
        return parse_params(KdaParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (kda)")

    def roles(self, p: KdaParams) -> list[Role]:
        H, hid, kd, K = p.num_heads, p.hidden_size, p.key_dim, p.conv_kernel
        return [
            Role("q_proj", (kd, hid)),
            Role("k_proj", (kd, hid)),
            Role("v_proj", (kd, hid)),
            Role("q_conv", (kd, 1, K), True, ARRAY),
            Role("k_conv", (kd, 1, K), True, ARRAY),
            Role("v_conv", (kd, 1, K), True, ARRAY),
            Role("f_a_proj", (p.forget_rank, hid)),
            Role("f_b_proj", (kd, p.forget_rank)),
            Role("A_log", (1, 1, H, 1), True, ARRAY),  # per head, in the checkpoint's layout
            Role("dt_bias", (kd,), True, ARRAY),  # per channel
            Role("b_proj", (H, hid)),
            Role("g_a_proj", (p.gate_rank, hid)),
            Role("g_b_proj", (kd, p.gate_rank)),
            Role("o_norm", (p.head_dim,), True, ARRAY),
            Role("o_proj", (hid, kd)),
        ]

    def geometry(self, p: KdaParams) -> Geometry:
        H, D, kd, w = p.num_heads, p.head_dim, p.key_dim, p.conv_kernel - 1
        return Geometry((buffer("recurrent", (H, D, D)), buffer("conv_q", (w, kd)), buffer("conv_k", (w, kd)),
                         buffer("conv_v", (w, kd))))

    def new_state(self, p: KdaParams) -> KdaState:
        return KdaState(**{part.name: np.zeros(part.shape, np.float32) for part in self.geometry(p).parts})

    def summary(self, p: KdaParams) -> dict:
        return {k: p[k] for k in ("num_heads", "head_dim", "conv_kernel", "forget_rank", "gate_rank")}

    def bind(self, p: KdaParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(Kda)
