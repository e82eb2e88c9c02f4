"""TRACE: run the prompt one position at a time; per position, the layers that ran, the operand
bytes that step touched and the token predicted next; with EXPERTS, which experts each routed
layer used there and with what weights (read from the stream's trace: vindex3's
``routing_from_trace``)."""

from __future__ import annotations

import numpy as np

from .. import planner
from .. import results as R
from ..errors import StatementError
from . import command
from .explain import prompt_info


@command(planner.Trace)
def trace(session, node: planner.Trace) -> R.TraceResult:
    c = session.container
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    if node.experts is not None:
        from vindex3.shards import ShardedModel

        if isinstance(c, ShardedModel):
            raise StatementError("TRACE ... EXPERTS reads the routing each layer records, and a sharded model's layers "
                                 "record it in their actors, not here", hint="SET shards = 0 (or OPEN without SHARDS)")
    ex, _ = session.executor(node.slice.depth, node.intervention)
    labels = [lp.label() for lp in c.graph.layers]
    st = ex.start()
    rows = []
    for pos, tok in enumerate(prompt.ids):
        logits = np.asarray(st.step(tok))  # one position at a time: the trace of that position
        ran = [int(i) for i in st.trace.executed_layers]
        nxt = int(np.argmax(logits))
        rows.append(R.TraceRow(position=pos, token_id=tok, token=cat.token_text(tok), layers=ran,
                               operators=[labels[i] for i in ran], next_id=nxt, next_token=cat.token_text(nxt)))
    step_bytes = list(getattr(st.trace, "step_bytes", []) or [])
    if len(step_bytes) == len(rows):
        for row, n in zip(rows, step_bytes):
            row.bytes_read = int(n)
    shown = None
    if node.experts is not None:
        from vindex3.operators.moe_ffn import routing_from_trace

        picks: dict[int, list[R.ExpertPick]] = {r.position: [] for r in rows}
        shown = []
        for lr in routing_from_trace(st.trace, ex.plan):
            if lr.layer not in node.experts:
                continue
            shown.append(R.ExpertLayerInfo(layer=lr.layer, experts=lr.experts, top_k=lr.top_k, router=lr.router))
            for p in lr.positions:
                picks[p.position].append(R.ExpertPick(layer=lr.layer, experts=p.experts, weights=p.weights))
        for row in rows:
            row.experts = picks[row.position]
    return R.TraceResult(slice=node.slice.label, depth=node.slice.depth, model_layers=c.graph.num_layers,
                         prompt=prompt, rows=rows, expert_layers=shown,
                         intervention=node.intervention.record() if node.intervention is not None else None)
