"""SHOW EXPERTS: the expert bank of each routed layer, from the plan (no tensor data read): E, k,
the router and its facts, the experts' and the shared expert's widths, the bytes of one expert,
of the bank and of what every position reads; and, for the whole model, what a position reads
(the expert banks apart from the always-read bytes). The routing of a prompt is TRACE ...
EXPERTS (the infer family)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel

from vindex3.operators.moe_ffn import RouterFacts

from .. import ast
from ..binding import expert_ops, reads_info
from ..layouts import reads
from ..planner import Context, Node, routed_or_refuse
from ..registry import family
from ..results import ReadsInfo, Result, dump, flat
from ..syntax import Children
from ..text import fmt_int, num, table

fam = family("experts", module=__name__, statements=("show_experts",), grammar=r"""
show_experts: SHOW EXPERTS [AT LAYER INT]     // the expert banks of routed layers
""")

fam.doc('SHOW EXPERTS',
        'SHOW EXPERTS [AT LAYER n]',
        "each routed layer's expert bank: experts, top k, router, bytes per expert, always-read bytes",
        'SHOW EXPERTS AT LAYER 0;', order=90, aliases=('EXPERTS',))


@fam.rule
def show_experts(c: Children) -> ShowExperts:
    return ShowExperts(layer=c.int("LAYER"))


class ShowExperts(ast.Statement):
    """SHOW EXPERTS [AT LAYER n]: the expert bank of each routed layer (or of layer n), from the
    plan: E, k, the router, widths, bytes per expert, bank and always-read bytes."""

    keyword: ClassVar[str] = "SHOW EXPERTS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_experts"] = "show_experts"
    layer: int | None = None


class ExpertBankRow(BaseModel):
    """One routed layer's expert bank, from the plan (no tensor data read)."""

    layer: int
    op: str  # the FFN operator (moe_ffn)
    experts: int  # E
    top_k: int  # k: experts a position reads
    router: str  # the router kind (softmax_topk, topk_softmax, sigmoid_group_topk)
    router_facts: dict[str, Any]  # renormalize, router_bias, correction_bias, n_group, topk_group, routed_scaling_factor
    expert_width: int  # one expert's intermediate width
    expert_act: str
    shared: str  # none | plain | sigmoid_gated
    shared_width: int | None
    bytes_per_expert: int  # one expert's matrices (and biases), stored bytes
    expert_bank_bytes: int  # all E experts
    always_bytes: int  # read for every position: router (+ biases), shared expert (+ its gate)
    bytes_per_position: int  # always + k x bytes per expert


class ExpertsResult(Result):
    """SHOW EXPERTS: the expert banks of the routed layers (or of one), and what a position reads
    of the whole model."""

    kind: Literal["show_experts"] = "show_experts"
    model_layers: int
    layer: int | None  # AT LAYER n
    banks: list[ExpertBankRow]
    reads: ReadsInfo


@dataclass(frozen=True, eq=False)
class ShowExpertsPlan(Node):
    """SHOW EXPERTS: the expert banks of ``layers`` (routed layers, in order)."""

    layers: tuple[int, ...]
    layer: int | None  # AT LAYER n, as asked


@fam.plans(ShowExperts)
def plan_show_experts(s: ShowExperts, ctx: Context) -> Node:
    routed = routed_or_refuse(s, ctx, s.layer, "SHOW EXPERTS")
    return ShowExpertsPlan(s, layers=(s.layer,) if s.layer is not None else tuple(routed), layer=s.layer)


def bank_row(layer: int, op) -> ExpertBankRow:
    d = op.reads.detail
    p = dict(op.params)
    return ExpertBankRow(
        layer=layer, op=op.kind, experts=int(d["experts"]), top_k=int(d["top_k"]), router=str(d["router"]),
        router_facts=op.operator.router_facts(op.params).model_dump(mode="json", exclude={"router"}),
        expert_width=int(p["expert_intermediate"]), expert_act=str(p["expert_act"]), shared=str(p.get("shared", "none")),
        shared_width=p.get("shared_intermediate"), bytes_per_expert=int(d["bytes_per_expert"]),
        expert_bank_bytes=int(d["expert_bank_bytes"]), always_bytes=int(d["always_bytes"]),
        bytes_per_position=int(d["bytes_per_position"]),
    )


@fam.runs(ShowExpertsPlan)
def run_show_experts(session, node: ShowExpertsPlan) -> ExpertsResult:
    c = session.container
    op_plan = c.op_plan()
    banks = [bank_row(i, op) for i in node.layers for op in expert_ops(op_plan.layers[i])]
    return ExpertsResult(model_layers=c.graph.num_layers, layer=node.layer, banks=banks, reads=reads_info(op_plan))


def router_phrase(router: str, facts: dict[str, Any]) -> str:
    """The router in words, as the operator phrases its typed facts (`RouterFacts.phrase`):
    'softmax_topk, renormalised', 'sigmoid_group_topk, 2 of 4 groups, correction bias, ...'."""
    return RouterFacts(router=router, **facts).phrase()


@fam.layout(ExpertsResult)
def layout_experts(r: ExpertsResult, timing: bool) -> list[str]:
    out = table(
        [num("layer"), num("experts"), num("top k"), "router", "expert width", "shared", num("bytes/expert"), num("bank bytes"), num("always bytes"),
         num("bytes/position")],
        [[str(b.layer), str(b.experts), str(b.top_k), router_phrase(b.router, b.router_facts),
          f"{b.expert_width} {b.expert_act}", b.shared if b.shared_width is None else f"{b.shared} {b.shared_width}",
          fmt_int(b.bytes_per_expert), fmt_int(b.expert_bank_bytes), fmt_int(b.always_bytes),
          fmt_int(b.bytes_per_position)] for b in r.banks],
    )
    return out + reads(r.reads, f"the whole model ({r.model_layers} layers), per position")[1:]


@fam.records(ExpertsResult)
def records_experts(r: ExpertsResult) -> list[dict[str, Any]]:
    return [flat(dump(b)) for b in r.banks]
