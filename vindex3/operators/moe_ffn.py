"""The routed-expert FFN (graph ``ffn: "routed"``, slot ffn; facts in ``surface.operators.moe_ffn``).

A router picks ``top_k`` of ``num_experts`` experts per position; the picked experts' gated MLPs
run, their outputs are summed with the router's weights, and an optional shared expert is added.
The numerics (routers, torch-exact top-k, grouped expert execution) live in
``vindex3.exec.ops.moe`` / ``moe_router`` / ``moe_topk``; this module owns the op's facts, its
operand roles, its read profile and its binding.

Facts (every one recorded in the graph, none defaulted; a fact that does not apply is null):

=====================  =====================================================================
router                 ``softmax_topk`` (softmax over E, top-k, optional renormalisation),
                       ``topk_softmax`` (top-k raw logits, softmax over the k),
                       ``sigmoid_group_topk`` (sigmoid scores, correction bias for selection,
                       group-limited top-k, renormalisation, routed scaling factor)
renormalize            divide the k weights by their sum (softmax_topk, sigmoid_group_topk)
router_bias            the router linear has a bias
correction_bias        e_score_correction_bias (sigmoid_group_topk only)
n_group, topk_group,   sigmoid_group_topk only
routed_scaling_factor
expert_act             silu | gelu | gelu_tanh | swiglu_clamped (with swiglu_limit, _alpha)
gate_up                how the banks hold gate and up: ``fused_halves`` ([E, 2I, H], gate
                       rows first), ``fused_interleaved`` (gate = even rows) or ``separate``
expert_bias            biases on the fused gate_up [E, 2I] and on down [E, H]
shared                 ``none`` | ``plain`` (added) | ``sigmoid_gated`` (times
                       sigmoid(x @ shared_expert_gate.T)), with shared_intermediate,
                       shared_act and shared_gate_up (``fused_halves`` | ``separate``)
=====================  =====================================================================

Expert banks are stacked matrices [E, out, in] (``x @ W[e].T``), one container tensor per
projection, whatever layout the checkpoint used (admission stacks, transposes and
de-interleaves; see vindex3.families). A bank is a weight object that hands out one expert with
``expert(e)``, so an encoding with a codec runs unchanged.

The op keeps no state. Its kernel reports every call (`vindex3.operators.OpRecord`): the experts
and weights per position and the bytes read (router, shared expert, and only the experts that
ran); the executor puts that record in the stream's trace (`ExecutionTrace.calls("moe_ffn")`).
``expert_routing`` turns a prompt's routing into plain data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..errors import GraphSchemaError
from .base import (
    ARRAY,
    FFN,
    Kernel,
    Operator,
    OpRecord,
    Params,
    ReadProfile,
    Role,
    parse_params,
    register,
)

if TYPE_CHECKING:
    from ..exec.trace import ExecutionTrace

NAME = "moe_ffn"
BANK_ROLES = ("moe_gate_up", "moe_gate", "moe_up", "moe_down", "moe_gate_up_bias", "moe_down_bias")


class MoeFfnParams(Params):
    HIDDEN = frozenset({"hidden_size"})

    hidden_size: int = Field(gt=0)
    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_intermediate: int = Field(gt=0)
    router: Literal["softmax_topk", "topk_softmax", "sigmoid_group_topk"]
    renormalize: bool
    router_bias: bool
    correction_bias: bool
    n_group: int | None = Field(gt=0)
    topk_group: int | None = Field(gt=0)
    routed_scaling_factor: float | None = Field(allow_inf_nan=False)
    expert_act: Literal["silu", "gelu", "gelu_tanh", "swiglu_clamped"]
    swiglu_limit: float | None = Field(allow_inf_nan=False)
    swiglu_alpha: float | None = Field(allow_inf_nan=False)
    gate_up: Literal["fused_halves", "fused_interleaved", "separate"]
    expert_bias: bool
    shared: Literal["none", "plain", "sigmoid_gated"]
    shared_intermediate: int | None = Field(gt=0)
    shared_act: Literal["silu", "gelu", "gelu_tanh"] | None
    shared_gate_up: Literal["fused_halves", "separate"] | None

    @model_validator(mode="after")
    def _consistent(self) -> MoeFfnParams:
        if (self.shared == "none") != (self.shared_gate_up is None):
            given = "null" if self.shared_gate_up is None else repr(self.shared_gate_up)
            raise ValueError(f"shared_gate_up is given exactly when there is a shared expert (shared is {self.shared!r}, "
                             f"shared_gate_up is {given})")
        self.geometry()  # the kernel's own validation: each fact that applies is given, no other
        return self

    def geometry(self):
        from ..exec.ops.moe import MoeGeometry

        facts = self.model_dump()
        facts.pop("shared_gate_up")
        try:
            return MoeGeometry(**facts, expert_layout="out_in")
        except (TypeError, ValueError) as e:
            raise ValueError(str(e).replace("MoeGeometry.", "")) from None


class RouterFacts(BaseModel):
    """How a routed layer picks and weighs its experts: the router facts of one op, typed and
    JSON-able, so that a reader (SHOW EXPERTS, EXPLAIN) never looks parameters up by name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    router: Literal["softmax_topk", "topk_softmax", "sigmoid_group_topk"]
    renormalize: bool
    router_bias: bool
    correction_bias: bool
    n_group: int | None  # sigmoid_group_topk: groups the experts fall into
    topk_group: int | None  # sigmoid_group_topk: groups kept
    routed_scaling_factor: float | None  # multiplies the routed weights

    @classmethod
    def of(cls, p: MoeFfnParams) -> RouterFacts:
        return cls(router=p.router, renormalize=p.renormalize, router_bias=p.router_bias,
                   correction_bias=p.correction_bias, n_group=p.n_group, topk_group=p.topk_group,
                   routed_scaling_factor=p.routed_scaling_factor)

    def phrase(self) -> str:
        """'softmax_topk, renormalised', 'sigmoid_group_topk, 2 of 4 groups, correction bias,
        renormalised, x2.5'."""
        parts = [self.router]
        if self.router_bias:
            parts.append("bias")
        if self.n_group is not None:
            parts.append(f"{self.topk_group} of {self.n_group} groups")
        if self.correction_bias:
            parts.append("correction bias")
        if self.renormalize:
            parts.append("renormalised")
        if self.routed_scaling_factor is not None:
            parts.append(f"x{self.routed_scaling_factor:g}")
        return ", ".join(parts)


def _f32_weight(a: np.ndarray):
    from ..codecs.f32 import DenseF32

    return DenseF32(np.asarray(a, dtype=np.float32))


class _Bound(Kernel):
    reports = True

    def __init__(self, prepared):
        from ..exec.ops.moe import moe_prefill

        self.p = prepared
        self._run = moe_prefill

    def prefill(self, x: np.ndarray, state, p0: int):
        y, rec = self._run(x, self.p)
        return y, OpRecord(rec.bytes_read, rec)


class MoeFfn(Operator):
    name = NAME
    slot = FFN
    selects = "routed"
    operator_group = NAME
    Params = MoeFfnParams
    no_features = ("a router picks k of its experts per token, so the layer's write is not one fixed set of "
                   "features; the feature statements read dense FFN layers")

    def params(self, surface, layer) -> MoeFfnParams:
        where = f"layer {layer.index} ({NAME})"
        group = (surface.get("operators") or {}).get(NAME)
        if not isinstance(group, dict):
            raise GraphSchemaError(f"system_graph.json: {where}: the layer's ffn is routed but surface.operators has "
                                   f"no '{NAME}' group")
        return parse_params(MoeFfnParams, {**group, "hidden_size": surface.get("hidden_size")}, where)

    def roles(self, p: MoeFfnParams) -> list[Role]:
        E, H, In = p.num_experts, p.hidden_size, p.expert_intermediate
        fused = p.gate_up != "separate"
        S = p.shared_intermediate or 0
        shared, sfused = p.shared != "none", p.shared_gate_up == "fused_halves"
        return [
            Role("moe_router", (E, H)),
            Role("moe_router_bias", (E,), p.router_bias, ARRAY),
            Role("moe_correction_bias", (E,), p.correction_bias, ARRAY),
            Role("moe_gate_up", (E, 2 * In, H), fused),
            Role("moe_gate", (E, In, H), not fused),
            Role("moe_up", (E, In, H), not fused),
            Role("moe_down", (E, H, In)),
            Role("moe_gate_up_bias", (E, 2 * In), p.expert_bias, ARRAY),
            Role("moe_down_bias", (E, H), p.expert_bias, ARRAY),
            Role("shared_gate_up", (2 * S, H), shared and sfused),
            Role("shared_gate", (S, H), shared and not sfused),
            Role("shared_up", (S, H), shared and not sfused),
            Role("shared_down", (H, S), shared),
            Role("shared_expert_gate", (1, H), p.shared == "sigmoid_gated"),
        ]

    def summary(self, p: MoeFfnParams) -> dict:
        return {"experts": p.num_experts, "top_k": p.top_k, "router": p.router}

    def router_facts(self, p: MoeFfnParams) -> RouterFacts:
        """The layer's router, as a typed object (what SHOW EXPERTS phrases)."""
        return RouterFacts.of(p)

    def read_profile(self, p: MoeFfnParams, operands) -> ReadProfile:
        """Always read: the router (+ biases) and the shared expert (+ its gate). Banks: every
        expert's matrices and biases; a position reads ``top_k`` experts of them."""
        E, k = p.num_experts, p.top_k
        bank = {r.label: r.nbytes for role, r in operands.items() if role in BANK_ROLES}
        always = {r.label: r.nbytes for role, r in operands.items() if role not in BANK_ROLES}
        bank_bytes, always_bytes = sum(bank.values()), sum(always.values())
        per_expert = sum(n // E for n in bank.values())
        per_position = always_bytes + k * per_expert
        detail = {"operator": NAME, "experts": E, "top_k": k, "router": p.router, "always_bytes": always_bytes,
                  "expert_bank_bytes": bank_bytes, "bytes_per_expert": per_expert, "bytes_per_position": per_position}
        return ReadProfile(always_bytes, bank_bytes, per_position, detail)

    def bind(self, p: MoeFfnParams, operands: dict) -> Kernel:
        from ..exec.ops.moe import ExpertBank, MoeWeights, SharedExpert, prepare_moe

        def w(role: str, array: bool = False):
            v = operands.get(role)
            return None if v is None else (_f32_weight(v) if array else v)

        shared = None
        if p.shared != "none":
            shared = SharedExpert(down=w("shared_down"), gate_up=w("shared_gate_up"), gate=w("shared_gate"),
                                  up=w("shared_up"))
        weights = MoeWeights(
            router=w("moe_router"),
            experts=ExpertBank(down=w("moe_down"), gate_up=w("moe_gate_up"), gate=w("moe_gate"), up=w("moe_up"),
                               gate_up_bias=w("moe_gate_up_bias", True), down_bias=w("moe_down_bias", True)),
            router_bias=w("moe_router_bias", True),
            correction_bias=w("moe_correction_bias", True),
            shared=shared,
            shared_gate=w("shared_expert_gate"),
        )
        return _Bound(prepare_moe(weights, p.geometry()))


register(MoeFfn)


# ---- routing as plain data (SHOW EXPERTS, TRACE ... EXPERTS) -----------------------------------


class RoutedPosition(BaseModel):
    position: int
    experts: list[int]  # the router's order (the reference's)
    weights: list[float]


class LayerRouting(BaseModel):
    layer: int
    experts: int  # E
    top_k: int
    router: str
    positions: list[RoutedPosition]
    ran: list[int]  # experts whose matrices were multiplied, over all recorded calls, ascending
    bytes_read: int  # operand bytes those calls read (router, shared expert, the experts that ran)


class ExpertRouting(BaseModel):
    """Which experts each position used, with what weights, per routed layer."""

    tokens: list[int]
    layers: list[LayerRouting]


def routing_from_trace(trace: ExecutionTrace, plan, layer: int | None = None) -> list[LayerRouting]:
    """The routing a stream's trace recorded (every call of the routed FFN, in order; a position
    a speculative rollback re-ran appears once per run), per layer, ascending."""
    by_layer: dict[int, LayerRouting] = {}
    for c in trace.calls(op=NAME, layer=layer):
        p = plan.layers[c.layer].ops
        params = next(op.params for op in p if op.kind == NAME)
        lr = by_layer.get(c.layer)
        if lr is None:
            lr = by_layer[c.layer] = LayerRouting(layer=c.layer, experts=params.num_experts, top_k=params.top_k,
                                                  router=params.router, positions=[], ran=[], bytes_read=0)
        rec = c.detail
        for t in range(c.positions):
            lr.positions.append(RoutedPosition(position=c.position + t, experts=[int(e) for e in rec.experts[t]],
                                               weights=[float(x) for x in rec.weights[t]]))
        lr.ran = sorted(set(lr.ran) | set(rec.ran))
        lr.bytes_read += int(c.bytes_read)
    return [by_layer[i] for i in sorted(by_layer)]


def expert_routing(source: Any, token_ids, layer: int | None = None, slice=None) -> ExpertRouting:
    """Run ``token_ids`` as one prefill through a fresh stream and return the routing of every
    routed layer (or of ``layer``) per position. ``source`` is a `vindex3.Container` or an
    `Executor`; ``slice`` (a Container only) chooses the layers that run (default: all)."""
    from ..errors import SliceError

    ex = source.executor(slice=slice) if hasattr(source, "op_plan") else source
    ids = [int(t) for t in np.asarray(token_ids, dtype=np.int64).reshape(-1)]
    if layer is not None:
        lo = ex.plan.layers[layer] if 0 <= layer < len(ex.plan.layers) else None
        if lo is None:
            raise SliceError(f"layer {layer} is outside the model's layers [0, {len(ex.plan.layers)})")
        if not any(op.kind == NAME for op in lo.ops):
            routed = [i for i, lo2 in enumerate(ex.plan.layers) if any(op.kind == NAME for op in lo2.ops)]
            raise SliceError(f"layer {layer} has no routed experts (routed layers: {routed or 'none'})")
        if layer not in ex.layers:
            raise SliceError(f"layer {layer} is not executed by {ex.slice.describe()}")
    st = ex.start()
    st.prefill(ids, last_only=True)
    return ExpertRouting(tokens=ids, layers=routing_from_trace(st.trace, ex.plan, layer))
