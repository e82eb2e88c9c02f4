"""OPEN / USE / OPEN DEFAULT: bind a container to the session."""

from __future__ import annotations

from .. import planner
from .. import results as R
from ..binding import mix, vindex3
from . import command


@command(planner.Open)
def open_container(session, node: planner.Open) -> R.OpenResult:
    v = vindex3()
    rebuilt = None
    if node.default:
        from vindex3 import default_model

        ensured = default_model.ensure_detailed(session.on_progress, notice=session.on_notice)
        path, rebuilt = ensured.path, ensured.rebuilt_because
    else:
        path = node.path
    c = v.open(path)
    cleared = session.draft_depth
    session.bind(c, default_model=node.default, shards=node.shards)
    comp = c.graph.component
    return R.OpenResult(
        name=c.name, path=str(c.path), default_model=session.default_model, component=comp.name, role=comp.role,
        layers=c.graph.num_layers, operator_mix=mix(c), tokenizer=c.has_tokenizer,
        generation=c.generation, draft_reset=cleared, shards=node.shards, rebuilt=rebuilt,
    )
