"""The Gated DeltaNet mixer operator (graph operator ``gated_delta``, slot mixer; facts in
``surface.operators.gated_delta``). The linear-attention layers of Qwen3-Next and Qwen3.5.

Per value head the layer keeps a [key_head_dim, value_head_dim] matrix updated by the gated delta
rule, and a causal conv keeps the last ``conv_kernel`` inputs of its [q | k | v] channels: two
fixed float32 buffers, ``recurrent`` [value heads, dk, dv] and ``conv`` [conv_dim, kernel], plus
whether the layer has run. The numerics (both projection layouts, the chunked prefill and the
single step) live in vindex3.exec.ops.gated_delta, whose docstring states them.

Which form runs mirrors transformers 5.24.0 (``Qwen3NextGatedDeltaNet`` /
``Qwen3_5GatedDeltaNet``, torch path) exactly:

* a pass of more than one position, or the very first pass of a layer whatever its length,
  runs the chunked form (``gated_delta_prefill``, chunks of ``chunk_size`` counted from the
  pass's first position, continuing from the state the layer holds);
* a one-position pass on a layer that has already run runs the single-step recurrence
  (``gated_delta_step``), as transformers does once its cache holds the layer's state.

The two forms are one function up to float32 rounding (the reference's own two paths differ by
~1e-5 on outputs of size ~10); the state remembers whether its layer has run (``started``), so
the choice depends on the state alone, and a snapshot and restore carry it along. A recurrence
cannot be truncated: it rolls back by snapshot.
"""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

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

NAME = "gated_delta"
LAYOUT_GROUPED = "qkvz_ba_grouped"  # Qwen3-Next: in_proj_qkvz + in_proj_ba, grouped per key head
LAYOUT_SPLIT = "qkv_z_b_a"  # Qwen3.5: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
LAYOUTS = (LAYOUT_GROUPED, LAYOUT_SPLIT)
ACTIVATIONS = ("silu",)


@params_dataclass
class GatedDeltaParams(DataParams):
    """The facts of one Gated DeltaNet layer, validated once and handed to the kernels as they
    are. The graph writes the derived widths out for readers (checked against the head counts)
    and states the constants the kernel runs with; `kernel_facts` builds the whole from the facts
    a kernel caller knows."""

    hidden_size: PositiveInt
    num_key_heads: PositiveInt
    num_value_heads: PositiveInt
    key_head_dim: PositiveInt
    value_head_dim: PositiveInt
    key_dim: PositiveInt  # num_key_heads * key_head_dim, written out for readers
    value_dim: PositiveInt  # num_value_heads * value_head_dim
    conv_dim: PositiveInt  # 2 * key_dim + value_dim: the conv's [q | k | v] channels
    conv_kernel: PositiveInt
    conv_activation: str  # only "silu" has an executor
    conv_bias: Literal[False]  # neither family has one; a bias would need a role and a kernel
    chunk_size: PositiveInt  # the prefill's chunk length (the reference's 64)
    projection_layout: str  # LAYOUT_GROUPED | LAYOUT_SPLIT
    head_mapping: Literal["repeat_interleave"]  # value head h reads key head h // (Hv / Hk)
    qk_l2norm_eps: NonNegative  # the q/k L2 normalisation's eps (1e-6 in the reference)
    norm_eps: NonNegative  # the gated output norm's
    norm_weight_offset: Literal[0.0]  # the gated norm's weight is plain (not 1 + w)
    norm_before_gate: Literal[True]  # rms_norm(o) * w * silu(z)

    @field_validator("conv_activation")
    @classmethod
    def _activation(cls, v: str) -> str:
        if v not in ACTIVATIONS:
            raise UnsupportedOperator(f"{NAME} conv activation {v!r} has no executor (supported: {', '.join(ACTIVATIONS)})")
        return v

    @field_validator("projection_layout")
    @classmethod
    def _layout(cls, v: str) -> str:
        if v not in LAYOUTS:
            raise UnsupportedOperator(f"{NAME} projection layout {v!r} has no executor (supported: {', '.join(LAYOUTS)})")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> GatedDeltaParams:
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"num_value_heads ({self.num_value_heads}) must be a multiple of num_key_heads "
                             f"({self.num_key_heads})")
        kd, vd = self.num_key_heads * self.key_head_dim, self.num_value_heads * self.value_head_dim
        for key, want in (("key_dim", kd), ("value_dim", vd), ("conv_dim", 2 * kd + vd)):
            if getattr(self, key) != want:
                raise ValueError(f"{key} is {getattr(self, key)}, but the head counts and widths make it {want}")
        return self

    @classmethod
    def kernel_facts(cls, **facts) -> GatedDeltaParams:
        """The params from the facts a kernel caller states: the written-out widths computed, the
        constants the kernel runs with (no conv bias, repeat-interleaved heads, a plain norm
        weight, norm before gate) stated."""
        try:
            kd = facts["num_key_heads"] * facts["key_head_dim"]
            vd = facts["num_value_heads"] * facts["value_head_dim"]
            widths = {"key_dim": kd, "value_dim": vd, "conv_dim": 2 * kd + vd}
        except (KeyError, TypeError):
            widths = {}  # the constructor names what is missing or ill-typed
        constants = {"conv_bias": False, "head_mapping": "repeat_interleave", "norm_weight_offset": 0.0,
                     "norm_before_gate": True}
        return cls(**{**widths, **constants, **facts})

    @property
    def grouped(self) -> bool:
        return self.projection_layout == LAYOUT_GROUPED

    @property
    def split(self) -> bool:
        return self.projection_layout == LAYOUT_SPLIT

    @property
    def heads_per_key(self) -> int:
        """r: value heads served by one key head."""
        return self.num_value_heads // self.num_key_heads

    @property
    def qkvz_dim(self) -> int:
        return 2 * self.key_dim + 2 * self.value_dim

    @property
    def ba_dim(self) -> int:
        return 2 * self.num_value_heads

    def projections(self) -> dict[str, tuple[int, int]]:
        """The input projections this layout reads, with their shapes [out, hidden]."""
        return {s.name: s.dims(self) for s in ROLES if s.when == ("grouped" if self.grouped else "split")}

    def buffers(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [("recurrent", (self.num_value_heads, self.key_head_dim, self.value_head_dim), "f32"),
                ("conv", (self.conv_dim, self.conv_kernel), "f32")]


class GatedDeltaState(RecurrentState):
    """recurrent [Hv, dk, dv] (the delta-rule matrix of each value head), conv [conv_dim, K]
    (the last K conv inputs, oldest first), and whether the layer has run (transformers' "the
    cache holds a state for this layer")."""

    names = ("recurrent", "conv")


# The operands, declared once: closure's roles (the chosen layout's input projections only: the
# other layout's are not roles of this op, so closure refuses them by name if a checkpoint
# carries them) and the kernel's operand record.
ROLES = (
    RoleSpec("in_proj_qkvz", "qkvz_dim hidden_size", when="grouped"),
    RoleSpec("in_proj_ba", "ba_dim hidden_size", when="grouped"),
    RoleSpec("in_proj_qkv", "conv_dim hidden_size", when="split"),
    RoleSpec("in_proj_z", "value_dim hidden_size", when="split"),
    RoleSpec("in_proj_b", "num_value_heads hidden_size", when="split"),
    RoleSpec("in_proj_a", "num_value_heads hidden_size", when="split"),
    RoleSpec("conv_weight", "conv_dim 1 conv_kernel", ARRAY, view="conv_dim conv_kernel"),
    RoleSpec("A_log", "num_value_heads", ARRAY),
    RoleSpec("dt_bias", "num_value_heads", ARRAY),
    RoleSpec("gated_norm", "value_head_dim", ARRAY, field="norm_weight"),
    RoleSpec("out_proj", "hidden_size value_dim"),
)

GatedDeltaWeights = operands_class("GatedDeltaWeights", ROLES, """Operands of one Gated DeltaNet mixer,
    one field per role (`ROLES`; the gated norm's weight is ``norm_weight``). Matrices are weight objects
    (``vindex3.codecs``: ``mm(x)`` is x @ W.T); the small tensors are float32 arrays, possibly read-only
    memory-mapped views: never written. Exactly the projections of the params' layout are present.""")


class GatedDelta(Operator):
    name = NAME
    slot = MIXER
    selects = NAME
    operator_group = NAME
    Params = GatedDeltaParams

    def params(self, surface, layer) -> GatedDeltaParams:
        ops = surface.get("operators")
        g = ops.get(NAME) if isinstance(ops, dict) else None
        if not isinstance(g, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs {NAME} but surface.operators has no "
                                   f"{NAME} group")
        return parse_params(GatedDeltaParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} ({NAME})")

    def roles(self, p: GatedDeltaParams) -> list[Role]:
        return [r for r in roles_of(ROLES, p) if r.required]  # the other layout's projections are no roles

    def geometry(self, p: GatedDeltaParams) -> Geometry:
        return Geometry(tuple(buffer(name, shape, dtype) for name, shape, dtype in p.buffers()))

    def new_state(self, p: GatedDeltaParams) -> GatedDeltaState:
        return GatedDeltaState.zeros(p)

    def summary(self, p: GatedDeltaParams) -> dict:
        return {k: p[k] for k in ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel")}

    def bind(self, p: GatedDeltaParams, operands: dict) -> Kernel:
        from ..exec.ops import gated_delta as k

        return RecurrentKernel(p, GatedDeltaWeights.of(operands), k.gated_delta_prefill, k.gated_delta_step)


register(GatedDelta)
