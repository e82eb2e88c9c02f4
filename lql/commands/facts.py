"""STATS and SHOW LAYERS / COMPONENTS / REPRESENTATIONS / PROVENANCE / OPERANDS: the bound
container's facts, read from its index, graph and op plan (no tensor data)."""

from __future__ import annotations

import fnmatch

from .. import planner
from .. import results as R
from ..binding import placement_info, reads_info, slice_of
from . import command
from .open import mix


@command(planner.Stats)
def stats(session, node: planner.Stats) -> R.StatsResult:
    c = session.container
    comp = c.graph.component
    op_plan = c.op_plan()
    objects = [R.ObjectRow(object=o["object"], representation=o.get("representation", "-"),
                           tensors=o.get("tensors", 0), parameters=o["parameters"], bytes=o["bytes"],
                           encodings=o.get("encodings", {}), bits_per_weight=o.get("bits_per_weight"))
               for o in c.objects()]
    geoms = c.continuation()
    positions = node.positions
    return R.StatsResult(
        name=c.name, path=str(c.path), generation=c.generation, digest=c.digest, component=comp.name,
        role=comp.role, layers=c.graph.num_layers, operator_mix=mix(c), objects=objects,
        parameters=sum(o.parameters for o in objects), bytes=sum(o.bytes for o in objects),
        vocab=op_plan.vocab, head_tied=bool(op_plan.head.params.get("tied")), tokenizer=c.has_tokenizer,
        continuation=continuation_summary(geoms), positions=positions,
        state_bytes_at_positions=None if positions is None else sum(g.bytes_at(positions) for g in geoms),
        placement=placement_info(c, slice_of(None), positions or 0), reads=reads_info(op_plan),
    )


def continuation_summary(geoms: list) -> R.ContinuationSummary:
    """Per kind of state part: the layers that keep one and their bytes (rows per position, or
    fixed), summed over the parts; nothing here asks which operator a layer runs."""
    from vindex3.continuation import KV, LATENT, RECURRENT

    def rows(kind: str) -> int:
        return sum(p.row_bytes for g in geoms for p in g.of(kind))

    return R.ContinuationSummary(
        layers=len(geoms), kv_layers=sum(g.has(KV) for g in geoms), kv_bytes_per_position=rows(KV),
        windowed_kv_layers=sum(any(p.window for p in g.of(KV)) for g in geoms),
        latent_layers=sum(g.has(LATENT) for g in geoms), latent_bytes_per_position=rows(LATENT),
        recurrent_layers=sum(g.has(RECURRENT) for g in geoms),
        recurrent_bytes=sum(p.fixed_bytes for g in geoms for p in g.of(RECURRENT)),
        stateless_layers=sum(g.stateless for g in geoms),
    )




@command(planner.ShowLayers)
def show_layers(session, node: planner.ShowLayers) -> R.LayersResult:
    c = session.container
    geoms = c.continuation()
    rows = []
    for i in node.layers:
        lp, g = c.graph.layers[i], geoms[i]
        pos = lp.position
        pos_text = None
        if pos is not None:
            pos_text = pos.get("kind")
            if pos_text == "rope" and pos.get("theta") is not None:
                pos_text = f"rope theta={pos['theta']:g}"
                hd = (c.graph.surface.get("attention") or {}).get("head_dim")
                if pos.get("rotary_dims") is not None and hd is not None and pos["rotary_dims"] != hd:
                    pos_text += f" rotary {pos['rotary_dims']}/{hd}"  # partial rotary: the first dims of each head
        rows.append(R.LayerRow(
            layer=lp.index, operator=lp.operator, span=lp.span, window=lp.window, position=pos_text,
            ffn=lp.ffn, continuation=g.describe(), bytes_per_position=g.bytes_per_position,
            fixed_bytes=g.fixed_bytes,
        ))
    return R.LayersResult(model_layers=c.graph.num_layers, layers=rows)


@command(planner.ShowComponents)
def show_components(session, node: planner.ShowComponents) -> R.ComponentsResult:
    g = session.container.graph
    return R.ComponentsResult(components=[
        R.ComponentRow(name=x.name, role=x.role, objects=list(x.objects), executes=x.role == "primary_text")
        for x in g.components
    ])


@command(planner.ShowRepresentations)
def show_representations(session, node: planner.ShowRepresentations) -> R.RepresentationsResult:
    from vindex3 import codecs

    flt = node.filter
    rows = []
    per_object = {o["object"]: o for o in session.container.objects()}
    for r in session.container.representations:
        key = r["key"]
        if flt is not None:
            pat = flt.lower()
            hay = f"{key} {r.get('object', '')} {r.get('segment', '')}".lower()
            if any(ch in pat for ch in "*?["):
                if not (fnmatch.fnmatch(key.lower(), pat) or fnmatch.fnmatch(r.get("object", "").lower(), pat)):
                    continue
            elif pat not in hay:
                continue
        o = per_object.get(r.get("object"), {})
        encs = o.get("encodings", {})
        rows.append(R.RepresentationRow(
            key=key, object=r.get("object", "-"), encoding=r.get("encoding"), segment=r.get("segment", "-"),
            tensors=r.get("tensors"), payload_bytes=r.get("payload_bytes"),
            payload_sha256=r.get("payload_sha256"), segment_sha256=r.get("segment_sha256"),
            encodings=encs, bits_per_weight=o.get("bits_per_weight"),
            executable=all(codecs.is_known(e) for e in encs),
        ))
    from .internals import derived_rows

    return R.RepresentationsResult(filter=flt, representations=rows, derived=derived_rows(session, flt))


@command(planner.ShowProvenance)
def show_provenance(session, node: planner.ShowProvenance) -> R.ProvenanceResult:
    return R.ProvenanceResult(provenance=dict(session.container.provenance))


@command(planner.ShowOperands)
def show_operands(session, node: planner.ShowOperands) -> R.OperandsResult:
    op_plan = session.container.op_plan()
    layer = node.layer
    rows: list[R.OperandRow] = []

    def add(stage: str, idx: int | None, op) -> None:
        for role, ref in op.operands.items():
            rows.append(R.OperandRow(stage=stage, layer=idx, op=op.kind, op_role=op.role,
                                     role=role, object=ref.object, tensor=ref.tensor, dtype=ref.dtype,
                                     shape=list(ref.shape), bytes=ref.nbytes))

    if layer is not None:
        for op in op_plan.layers[layer].ops:
            add("layer", layer, op)
    else:
        add("embedding", None, op_plan.embedding)
        for lo in op_plan.layers:
            for op in lo.ops:
                add("layer", lo.index, op)
        add("final_norm", None, op_plan.final_norm)
        add("head", None, op_plan.head)
    # a tied head reads the embedding again: a second read, not new bytes
    distinct = {f"{r.object}/{r.tensor}": r.bytes for r in rows}
    return R.OperandsResult(layer=layer, operands=rows, total_bytes=sum(distinct.values()))
