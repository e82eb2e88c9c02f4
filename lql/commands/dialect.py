"""The reference dialect's statements that have a meaning here (issue 19): STATS 'path', USE
MODEL 'dir', SHOW MODELS, SHOW PATCHES / SHOW COMPACT STATUS, COMPILE ... INTO VINDEX. The
other reference spellings plan into the nodes of the statements they mean (WALK, DESCRIBE,
SELECT, TRACE ... FOR, ENCODE, DIFF) and run through those commands."""

from __future__ import annotations

import os
from pathlib import Path

from .. import planner
from .. import results as R
from . import command


@command(planner.ShowModels)
def show_models(session, node: planner.ShowModels) -> R.ModelsResult:
    import vindex3
    from vindex3.errors import VindexError

    rows = []
    base = Path(node.directory)
    for entry in sorted(base.iterdir(), key=lambda p: p.name):
        if not entry.is_dir() or not (entry / "index.json").is_file():
            continue
        try:
            c = vindex3.open(entry)
            size = sum(o["bytes"] for o in c.objects())
            rows.append(R.ModelRow(path=entry.name, name=c.name, layers=c.graph.num_layers, generation=c.generation,
                                   bytes=size))
        except VindexError as e:  # a directory that does not open is listed with the reason
            rows.append(R.ModelRow(path=entry.name, name=None, layers=None, generation=None, bytes=None,
                                   problem=str(e).splitlines()[0]))
    return R.ModelsResult(directory=os.fspath(base), models=rows)


@command(planner.Note)
def note(session, node: planner.Note) -> R.NoteResult:
    return R.NoteResult(topic=node.topic, lines=list(node.lines))

