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

import dataclasses
import math

from pydantic import field_validator

from ..continuation import Geometry, buffer
from ..errors import GraphSchemaError, UnsupportedOperator
from ..exec.state import RecurrentState
from .base import (
    ARRAY,
    MIXER,
    DataParams,
    Kernel,
    NonNegative,
    Operator,
    PositiveInt,
    RecurrentKernel,
    Role,
    RoleSpec,
    operands_class,
    params_dataclass,
    parse_params,
    register,
    roles_of,
)


@params_dataclass
class KdaParams(DataParams):
    """The facts of one KDA layer, validated once (when the graph loads, or when a caller builds
    them) and handed to the kernels as they are; the derived widths are properties."""

    hidden_size: PositiveInt
    num_heads: PositiveInt  # H
    head_dim: PositiveInt  # D (keys and values)
    conv_kernel: PositiveInt  # K
    forget_rank: PositiveInt  # f_a_proj rows = f_b_proj columns (read from the tensor's shape)
    gate_rank: PositiveInt  # g_a_proj rows = g_b_proj columns (read from the tensor's shape)
    chunk_size: PositiveInt  # prefill tiling (the reference: 64); changes rounding only
    norm_eps: NonNegative  # o_norm (gated RMSNorm over D) eps: the layer's rms_norm_eps
    l2norm_eps: NonNegative  # q/k L2-norm eps: the reference kernel's constant 1e-6
    conv_activation: str  # the config's hidden_act; only "silu" has an executor

    @field_validator("conv_activation")
    @classmethod
    def _executable(cls, v: str) -> str:
        if v != "silu":
            raise UnsupportedOperator(f"kda conv activation {v!r} has no executor (supported: silu)")
        return v

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_window(self) -> int:
        """Raw projection rows each conv keeps between calls (K − 1)."""
        return self.conv_kernel - 1

    def buffers(self) -> list[tuple[str, tuple[int, ...], str]]:
        """The state parts: (name, shape, dtype), all fixed size."""
        kd, w = self.key_dim, self.conv_window
        return [("recurrent", (self.num_heads, self.head_dim, self.head_dim), "f32"),
                ("conv_q", (w, kd), "f32"), ("conv_k", (w, kd), "f32"), ("conv_v", (w, kd), "f32")]

    def state_nbytes(self) -> int:
        return sum(4 * math.prod(shape) for _, shape, _ in self.buffers())


# The operands, declared once: closure's roles, the kernel's operand record and its checks.
ROLES = (
    RoleSpec("q_proj", "key_dim hidden_size"),
    RoleSpec("k_proj", "key_dim hidden_size"),
    RoleSpec("v_proj", "key_dim hidden_size"),
    RoleSpec("q_conv", "key_dim 1 conv_kernel", ARRAY, view="key_dim conv_kernel"),
    RoleSpec("k_conv", "key_dim 1 conv_kernel", ARRAY, view="key_dim conv_kernel"),
    RoleSpec("v_conv", "key_dim 1 conv_kernel", ARRAY, view="key_dim conv_kernel"),
    RoleSpec("f_a_proj", "forget_rank hidden_size"),
    RoleSpec("f_b_proj", "key_dim forget_rank"),
    RoleSpec("A_log", "1 1 num_heads 1", ARRAY, view="num_heads"),  # per head, in the checkpoint's layout
    RoleSpec("dt_bias", "key_dim", ARRAY),  # per channel
    RoleSpec("b_proj", "num_heads hidden_size"),
    RoleSpec("g_a_proj", "gate_rank hidden_size"),
    RoleSpec("g_b_proj", "key_dim gate_rank"),
    RoleSpec("o_norm", "head_dim", ARRAY),
    RoleSpec("o_proj", "hidden_size key_dim"),
)

KdaWeights = operands_class("KdaWeights", ROLES, """Operands of one KDA mixer, one field per role
    (`ROLES`). Matrices are weight objects (``w.mm(x) = x @ W.T``, see vindex3.codecs); the small
    tensors are float32 arrays, possibly read-only memory-mapped views, in the checkpoint's layout
    or the kernel's: nothing here is ever written.""")


class KdaState(RecurrentState):
    """recurrent [H, D, D], conv_q / conv_k / conv_v [K − 1, H·D] (oldest row first), float32,
    and whether the layer has run (transformers' "the cache holds a state for this layer")."""

    names = ("recurrent", "conv_q", "conv_k", "conv_v")


JUDGMENTS = "judgments"  # fact -> why the family fixed it (no config states it): provenance, not a kernel fact


class Kda(Operator):
    name = "kda"
    slot = MIXER
    selects = "kda"
    operator_group = "kda"
    Params = KdaParams

    def params(self, surface, layer) -> KdaParams:
        ops = surface.get("operators")
        g = ops.get("kda") if isinstance(ops, dict) else None
        where = f"layer {layer.index} (kda)"
        if not isinstance(g, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs kda but surface.operators has no kda group")
        facts = dict(g)
        judged = facts.pop(JUDGMENTS, None)
        if not isinstance(judged, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in judged.items()):
            what = "is missing (absence is not a default)" if JUDGMENTS not in g else f"must map facts to reasons (found {judged!r})"
            raise GraphSchemaError(f"system_graph.json: {where}: '{JUDGMENTS}' {what}")
        p = parse_params(KdaParams, {**facts, "hidden_size": surface.get("hidden_size")}, where)
        unknown = sorted(set(judged) - {f.name for f in dataclasses.fields(p)})
        if unknown:
            raise GraphSchemaError(f"system_graph.json: {where}: judgments name facts this operator does not have: "
                                   f"{', '.join(unknown)}")
        return p

    def roles(self, p: KdaParams) -> list[Role]:
        return roles_of(ROLES, p)

    def geometry(self, p: KdaParams) -> Geometry:
        return Geometry(tuple(buffer(name, shape, dtype) for name, shape, dtype in p.buffers()))

    def new_state(self, p: KdaParams) -> KdaState:
        return KdaState.zeros(p)

    def summary(self, p: KdaParams) -> dict:
        return {k: p[k] for k in ("num_heads", "head_dim", "conv_kernel", "forget_rank", "gate_rank")}

    def bind(self, p: KdaParams, operands: dict) -> Kernel:
        from ..exec.ops import kda as k

        return RecurrentKernel(p, KdaWeights.of(operands), k.kda_prefill, k.kda_step)


register(Kda)
