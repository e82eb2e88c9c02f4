"""SHOW EXPERTS: the expert bank of each routed layer, from the plan (no tensor data read): E, k,
the router and its facts, the experts' and the shared expert's widths, the bytes of one expert,
of the bank and of what every position reads; and, for the whole model, what a position reads
(the expert banks apart from the always-read bytes). The routing of a prompt is TRACE ...
EXPERTS (lql.commands.trace)."""

from __future__ import annotations

from .. import planner
from .. import results as R
from ..binding import expert_ops, reads_info
from . import command
from .explain import jsonable

ROUTER_FACTS = ("renormalize", "router_bias", "correction_bias", "n_group", "topk_group", "routed_scaling_factor")


def bank_row(layer: int, op) -> R.ExpertBankRow:
    d = op.reads.detail
    p = dict(op.params)
    return R.ExpertBankRow(
        layer=layer, op=op.kind, experts=int(d["experts"]), top_k=int(d["top_k"]), router=str(d["router"]),
        router_facts={k: jsonable(p[k]) for k in ROUTER_FACTS if k in p},
        expert_width=int(p["expert_intermediate"]), expert_act=str(p["expert_act"]), shared=str(p.get("shared", "none")),
        shared_width=p.get("shared_intermediate"), bytes_per_expert=int(d["bytes_per_expert"]),
        expert_bank_bytes=int(d["expert_bank_bytes"]), always_bytes=int(d["always_bytes"]),
        bytes_per_position=int(d["bytes_per_position"]),
    )


@command(planner.ShowExperts)
def show_experts(session, node: planner.ShowExperts) -> R.ExpertsResult:
    c = session.container
    op_plan = c.op_plan()
    banks = [bank_row(i, op) for i in node.layers for op in expert_ops(op_plan.layers[i])]
    return R.ExpertsResult(model_layers=c.graph.num_layers, layer=node.layer, banks=banks, reads=reads_info(op_plan))
