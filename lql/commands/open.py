"""OPEN / USE / OPEN DEFAULT: bind a container to the session."""

from __future__ import annotations

import importlib
import inspect

from .. import planner
from .. import results as R
from ..binding import vindex3
from ..errors import NotAvailable
from . import command


def mix(container) -> list[R.MixEntry]:
    return [R.MixEntry(label=label, count=n) for label, n in container.graph.operator_mix()]


@command(planner.Open)
def open_container(session, node: planner.Open) -> R.OpenResult:
    v = vindex3()
    if node.default:
        try:
            default_model = importlib.import_module("vindex3.default_model")
        except ImportError as e:
            raise NotAvailable(f"OPEN DEFAULT is not available in this build (vindex3.default_model "
                               f"cannot be imported: {e})") from None
        ensure = default_model.ensure
        if "progress" in inspect.signature(ensure).parameters:
            path = ensure(progress=session.on_progress)
        else:
            path = ensure()
    else:
        path = node.path
    c = v.open(path)
    cleared = session.draft_depth
    session.bind(c, default_model=node.default)
    comp = c.graph.component
    return R.OpenResult(
        name=c.name, path=str(c.path), default_model=session.default_model, component=comp.name, role=comp.role,
        layers=c.graph.num_layers, operator_mix=mix(c), tokenizer=c.has_tokenizer,
        generation=c.generation, draft_reset=cleared,
    )
