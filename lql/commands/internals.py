"""Looking inside (issue 15): WALK, DESCRIBE, SELECT ... FROM FEATURES, SHOW FEATURES, EXPLAIN
INFER ... FEATURES, TRACE ... FOR, OBSERVE and BUILD FEATURES, each one call on the session's
`vindex3.internals.Internals` (one per bound container), whose pydantic result becomes the LQL
result of the same shape (lql.results mirrors it field for field).

Feature metadata is built on demand (the REPL draws a progress bar through the session's
``on_progress``) and kept in the container as derived data; the ``stale`` setting says whether
metadata built from another state of the container is rebuilt or refused. Output files go
through vindex3's path helper before anything runs: never inside the open container, never over
an existing file unless the plan says ``overwrite``."""

from __future__ import annotations

from typing import Any

from .. import planner
from .. import results as R
from . import command


def _ix(session):
    ix = session.internals()
    ix.metadata.on_stale = session.settings.stale
    ix.metadata.persist = session.writes_derived  # a read-only server keeps built metadata in memory
    return ix


def _data(x) -> dict[str, Any]:
    """An internals result as the fields of its LQL mirror."""
    return x.model_dump(exclude={"kind"})


def _query(prompt: planner.BoundPrompt):
    """What the internals API takes for a bound query: the text (it tokenises it the same way,
    without BOS) or the ids given as TOKENS."""
    return prompt.text if prompt.text is not None else list(prompt.ids)


def _with_text(d: dict[str, Any], prompt: planner.BoundPrompt) -> dict[str, Any]:
    """Runs take bound ids (the chat template may have wrapped the text); show the text as given."""
    d["prompt"]["text"] = prompt.text
    return d


def _output(session, path: str, what: str, overwrite: bool) -> None:
    """Refuse a bad output path before anything runs (vindex3's path helper)."""
    from vindex3.paths import output_file

    output_file(path, what, overwrite=overwrite, forbid_inside=[session.base_container.path])


@command(planner.Walk)
def walk(session, node: planner.Walk) -> R.WalkResult:
    r = _ix(session).walk(_query(node.prompt), top=node.top, layers=node.layers)
    return R.WalkResult.model_validate({**_data(r), "notes": list(node.notes)})


@command(planner.Describe)
def describe(session, node: planner.Describe) -> R.DescribeResult:
    r = _ix(session).describe(node.entity, layers=node.layers, top=node.top, threshold=node.threshold)
    return R.DescribeResult.model_validate({**_data(r), "notes": list(node.notes)})


@command(planner.SelectFeatures)
def select(session, node: planner.SelectFeatures) -> R.SelectFeaturesResult:
    from vindex3.internals import Condition, FeatureQuery

    q = FeatureQuery(columns=list(node.columns), layers=list(node.layers) if node.layers is not None else None,
                     nearest_to=_query(node.nearest) if node.nearest is not None else None,
                     where=[Condition(column=w.column, op=w.op, value=w.value) for w in node.where],
                     order_by=node.order_by, descending=node.descending, limit=node.limit)
    r = _ix(session).select(q)
    return R.SelectFeaturesResult.model_validate(_data(r))


@command(planner.ShowFeatures)
def show_features(session, node: planner.ShowFeatures) -> R.ShowFeaturesResult:
    r = _ix(session).show_features(node.layer, limit=node.limit)
    return R.ShowFeaturesResult.model_validate(_data(r))


@command(planner.ExplainFeatures)
def explain_features(session, node: planner.ExplainFeatures) -> R.FeatureActivityResult:
    r = _ix(session).feature_activity(list(node.prompt.ids), top=node.top, layers=node.layers,
                                      slice=node.slice.depth, intervention=node.intervention)
    return R.FeatureActivityResult.model_validate(_with_text(_data(r), node.prompt))


@command(planner.TraceFor)
def trace_for(session, node: planner.TraceFor) -> R.TraceForResult:
    if node.save is not None:
        _output(session, node.save, "TRACE ... SAVE INTO", node.overwrite)
    r = _ix(session).trace(list(node.prompt.ids), node.target, layers=node.layers, positions=node.positions,
                           decompose=node.decompose, save=node.save, overwrite=node.overwrite,
                           slice=node.slice.depth, intervention=node.intervention)
    return R.TraceForResult.model_validate(_with_text(_data(r), node.prompt))


@command(planner.Observe)
def observe(session, node: planner.Observe) -> R.ObserveResult:
    _output(session, node.into, "OBSERVE ... RECORD INTO", node.overwrite)
    r = _ix(session).observe(list(node.prompt.ids), node.into, generate=node.generate, lens_tokens=list(node.lens),
                             overwrite=node.overwrite, slice=node.slice.depth, intervention=node.intervention)
    return R.ObserveResult.model_validate(_with_text(_data(r), node.prompt))


@command(planner.BuildFeatures)
def build_features(session, node: planner.BuildFeatures) -> R.BuildFeaturesResult:
    from vindex3.internals.metadata import DIRECTORY, KIND

    ix = _ix(session)
    note = ix.build_metadata(node.layers)
    infos = session.catalog.feature_layers
    chosen = node.layers if node.layers is not None else range(len(infos))
    entry = ((ix.container.index.get("derived") or {}).get(KIND) or {}) if note.cached else {}
    recorded = entry.get("layers") or {}
    built = set(note.built_layers)
    rows, skipped = [], []
    for i in chosen:
        x = infos[i]
        if not x.has_features:
            skipped.append(R.SkippedLayer(layer=i, operator=x.mixer, reason=x.reason or "no features"))
            continue
        secs = (recorded.get(str(i)) or {}).get("seconds")
        rows.append(R.BuiltLayer(layer=i, mixer=x.mixer, ffn=x.ffn or "-", features=int(x.features), built=i in built,
                                 seconds=float(secs) if isinstance(secs, (int, float)) else None))
    row = next((d for d in ix.container.derived if d.key == KIND), None) if note.cached else None
    return R.BuildFeaturesResult(
        metadata=R.MetadataNote.model_validate(note.model_dump()), layers=rows, skipped=skipped, directory=DIRECTORY,
        files=row.files if row is not None else 0, bytes=row.bytes if row is not None else 0,
        summary=row.summary if row is not None else None, ffn_layers=sum(x.has_features for x in infos))


