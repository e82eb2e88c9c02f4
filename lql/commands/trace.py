"""TRACE: run the prompt one position at a time; per position, the layers that ran and the
token predicted next."""

from __future__ import annotations

import numpy as np

from .. import planner
from .. import results as R
from . import command
from .explain import prompt_info


@command(planner.Trace)
def trace(session, node: planner.Trace) -> R.TraceResult:
    c = session.container
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    ex, _ = session.executor(node.slice.depth, node.intervention)
    labels = [lp.label() for lp in c.graph.layers]
    st = ex.start()
    rows = []
    for pos, tok in enumerate(prompt.ids):
        logits = np.asarray(st.step(tok))  # one position at a time: the trace of that position
        ran = [int(i) for i in ex.trace.executed_layers]
        nxt = int(np.argmax(logits))
        rows.append(R.TraceRow(position=pos, token_id=tok, token=cat.token_text(tok), layers=ran,
                               operators=[labels[i] for i in ran], next_id=nxt, next_token=cat.token_text(nxt)))
    return R.TraceResult(slice=node.slice.label, depth=node.slice.depth, model_layers=c.graph.num_layers,
                         prompt=prompt, rows=rows,
                         intervention=node.intervention.record() if node.intervention is not None else None)
