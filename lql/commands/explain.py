"""EXPLAIN: the plan without running a token. It renders the very slice plan object the
planner bound (and, for EXPLAIN INFER, the node INFER runs): executed layers, their ops and
operands, state geometry and the operand reads."""

from __future__ import annotations

from .. import planner
from .. import results as R
from ..binding import jsonable, placement_info, reads_info, slice_of
from . import command


def op_info(op) -> R.OpInfo:
    return R.OpInfo(
        kind=op.kind, role=op.role, params=jsonable(dict(op.params)),
        operands=[R.Operand(role=role, object=ref.object, tensor=ref.tensor, dtype=ref.dtype, shape=list(ref.shape),
                            bytes=ref.nbytes) for role, ref in op.operands.items()],
    )


def prompt_info(p: planner.BoundPrompt) -> R.PromptInfo:
    return R.PromptInfo(text=p.text, ids=list(p.ids), chat=p.chat)


@command(planner.Explain)
def explain(session, node: planner.Explain) -> R.ExplainResult:
    c = session.container
    sl = node.slice
    sp = sl.plan
    op_plan = c.op_plan()
    steps = [R.ExplainStep(stage="embedding", ops=[op_info(op_plan.embedding)])]
    for i in sp.executed_layers:
        lo = op_plan.layers[i]
        g = lo.geometry
        steps.append(R.ExplainStep(
            stage="layer", layer=lo.index, operator=c.graph.layers[i].label(), params=dict(lo.params),
            geometry=g.describe(), bytes_per_position=g.bytes_per_position, fixed_bytes=g.fixed_bytes,
            ops=[op_info(op) for op in lo.ops], reads=jsonable(lo.reads.to_data()),
        ))
    steps.append(R.ExplainStep(stage="final_norm", ops=[op_info(op_plan.final_norm)]))
    steps.append(R.ExplainStep(stage="head", ops=[op_info(op_plan.head)]))
    prompt = state = None
    target = node.target
    if target is not None:
        prompt = prompt_info(target.prompt)
        state = sum(op_plan.layers[i].geometry.bytes_at(len(prompt.ids)) for i in sp.executed_layers)
    executed = sl.executed_layers
    return R.ExplainResult(
        slice=sl.label, depth=sl.depth, model_layers=c.graph.num_layers,
        executed_layers=executed, skipped_layers=[i for i in range(c.graph.num_layers) if i not in executed],
        prompt=prompt, state_bytes_after_prompt=state,
        operation=target.describe() if target is not None else None, steps=steps, reads=sl.reads,
        placement=placement_info(c, slice_of(sl.depth), len(prompt.ids) if prompt is not None else 0),
        per_position=reads_info(op_plan, executed),
    )
