"""The Mamba2 mixer operator (graph operator ``mamba2``, slot mixer; parameters in
``surface.operators.mamba2``). Its state is two fixed float32 buffers, ``ssm`` [heads,
head_dim, state] and ``conv`` [conv_dim, kernel], plus whether the layer has run. The numerics
live in vindex3.exec.ops.mamba2.

Which arithmetic runs mirrors transformers 5.24.0's ``Mamba2Mixer`` exactly:

* a pass of more than one position, or the very first pass of a layer whatever its length,
  runs the chunk form (``mamba2_prefill``: Δ clamped to ``time_step_limit``);
* a one-position pass on a layer that has already run runs the recurrent form
  (``mamba2_step``: Δ not clamped), as transformers does once the layer's cache holds state.

With the default limits (0, ∞) the clamp is a no-op and the two forms are one function; with a
finite limit they differ in transformers and here alike. The state remembers whether its layer
has run (``started``), so the choice depends on nothing but the state itself, and a snapshot and
restore carry it along.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from ..continuation import Geometry, buffer
from ..errors import GraphSchemaError
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
class Mamba2Params(DataParams):
    """The facts of one Mamba2 layer, validated once and handed to the kernels as they are. The
    graph writes the derived widths out for readers (checked against the head counts) and states
    the one activation and norm order the kernel runs; `kernel_facts` builds the whole from the
    facts a kernel caller knows."""

    hidden_size: PositiveInt
    num_heads: PositiveInt
    head_dim: PositiveInt
    state_size: PositiveInt
    n_groups: PositiveInt
    conv_kernel: PositiveInt
    chunk_size: PositiveInt
    intermediate_size: PositiveInt  # num_heads * head_dim
    conv_dim: PositiveInt  # intermediate + 2 * n_groups * state_size: the conv's [x | B | C] channels
    in_proj_dim: PositiveInt  # intermediate + conv_dim + num_heads: [z | xBC | dt]
    time_step_limit: Annotated[tuple[float, float], Field(strict=False)]  # a JSON list; its numbers stay strict
    activation: Literal["silu"]
    norm_eps: NonNegative  # gated RMSNorm eps
    norm_before_gate: Literal[False]
    use_conv_bias: bool
    use_bias: bool

    @field_validator("time_step_limit")
    @classmethod
    def _limit(cls, v: tuple[float, float]) -> tuple[float, float]:
        lo, hi = v
        if math.isnan(lo) or math.isnan(hi) or math.isinf(lo) or lo < 0 or hi < lo:
            raise ValueError(f"must be 0 <= lower <= upper (upper may be inf), found {list(v)}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Mamba2Params:
        if self.num_heads % self.n_groups:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of n_groups ({self.n_groups})")
        inter = self.num_heads * self.head_dim
        conv = inter + 2 * self.n_groups * self.state_size
        for key, want in (("intermediate_size", inter), ("conv_dim", conv), ("in_proj_dim", inter + conv + self.num_heads)):
            if getattr(self, key) != want:
                raise ValueError(f"{key} is {getattr(self, key)}, but the other widths make it {want}")
        return self

    @classmethod
    def kernel_facts(cls, *, num_heads: int, head_dim: int, n_groups: int, state_size: int, **facts) -> Mamba2Params:
        """The params from the facts a kernel caller states: the written-out widths computed,
        the activation and norm order the kernel runs (SiLU, norm after the gate) stated."""
        inter = num_heads * head_dim if isinstance(num_heads, int) and isinstance(head_dim, int) else 0
        conv = inter + 2 * n_groups * state_size if isinstance(n_groups, int) and isinstance(state_size, int) else 0
        derived = {"intermediate_size": inter, "conv_dim": conv, "in_proj_dim": inter + conv + (num_heads if inter else 0),
                   "activation": "silu", "norm_before_gate": False}
        return cls(num_heads=num_heads, head_dim=head_dim, n_groups=n_groups, state_size=state_size, **{**derived, **facts})

    @property
    def intermediate(self) -> int:
        return self.intermediate_size

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.n_groups

    @property
    def norm_group_size(self) -> int:
        """Channels per gated-RMSNorm group (transformers: ``intermediate // n_groups``)."""
        return self.intermediate_size // self.n_groups

    def buffers(self) -> list[tuple[str, tuple[int, ...], str]]:
        return [("ssm", (self.num_heads, self.head_dim, self.state_size), "f32"),
                ("conv", (self.conv_dim, self.conv_kernel), "f32")]


class Mamba2State(RecurrentState):
    """ssm [heads, head_dim, state], conv [conv_dim, kernel] (the last inputs, oldest first), and
    whether the layer has run (transformers' "the cache holds a state for this layer")."""

    names = ("ssm", "conv")


# The operands, declared once: closure's roles and the kernel's operand record.
ROLES = (
    RoleSpec("in_proj", "in_proj_dim hidden_size"),
    RoleSpec("in_proj_bias", "in_proj_dim", ARRAY, when="use_bias"),
    RoleSpec("conv_weight", "conv_dim 1 conv_kernel", ARRAY, view="conv_dim conv_kernel"),
    RoleSpec("conv_bias", "conv_dim", ARRAY, when="use_conv_bias"),
    RoleSpec("A_log", "num_heads", ARRAY),
    RoleSpec("D", "num_heads", ARRAY),
    RoleSpec("dt_bias", "num_heads", ARRAY),
    RoleSpec("gated_norm", "intermediate_size", ARRAY, field="norm_weight"),
    RoleSpec("out_proj", "hidden_size intermediate_size"),
    RoleSpec("out_proj_bias", "hidden_size", ARRAY, when="use_bias"),
)

Mamba2Weights = operands_class("Mamba2Weights", ROLES, """Operands of one Mamba2 mixer, one field per role
    (`ROLES`; the gated norm's weight is ``norm_weight``). The two projections are float32 arrays or weight
    objects (vindex3.codecs: ``mm(x) = x @ W.T``, any encoding); the rest are float32 arrays, the conv weight
    [conv_dim, kernel] or [conv_dim, 1, kernel]. May be read-only memory-mapped views: never written.""")


class Mamba2(Operator):
    name = "mamba2"
    slot = MIXER
    selects = "mamba2"
    operator_group = "mamba2"
    Params = Mamba2Params

    def params(self, surface, layer) -> Mamba2Params:
        m = surface.get("operators", {}).get("mamba2") if isinstance(surface.get("operators"), dict) else None
        if not isinstance(m, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs mamba2 but surface.operators has no mamba2 group")
        return parse_params(Mamba2Params, {**m, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (mamba2)")

    def roles(self, p: Mamba2Params) -> list[Role]:
        return roles_of(ROLES, p)

    def geometry(self, p: Mamba2Params) -> Geometry:
        return Geometry(tuple(buffer(name, shape, dtype) for name, shape, dtype in p.buffers()))

    def new_state(self, p: Mamba2Params) -> Mamba2State:
        return Mamba2State.zeros(p)

    def summary(self, p: Mamba2Params) -> dict:
        return {k: p[k] for k in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel")}

    def work_bytes(self, p: Mamba2Params, positions: int, keys: int) -> int:
        T, gn = positions, p.n_groups * p.state_size
        # the projection, the conv input window and output, B and C, x·dt, y and its D skip, the
        # gated norm's output, the output projection
        return 4 * (T * p.in_proj_dim + (2 * T + p.conv_kernel) * p.conv_dim + 2 * T * gn
                    + 4 * T * p.intermediate_size + T * p.hidden_size + 4 * T * p.num_heads)

    def bind(self, p: Mamba2Params, operands: dict) -> Kernel:
        from ..exec.ops import mamba2 as k

        return RecurrentKernel(p, Mamba2Weights.of(operands), k.mamba2_prefill, k.mamba2_step)


register(Mamba2)
