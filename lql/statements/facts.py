"""Facts that read no tensor data: STATS (of the bound container or another), SHOW LAYERS,
SHOW COMPONENTS, SHOW REPRESENTATIONS, SHOW PROVENANCE, SHOW OPERANDS."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from .. import ast, files
from ..ast import dialect
from ..binding import mix, placement_info, reads_info, slice_of
from ..errors import NoContainer
from ..layouts import flatten, placement, reads, short
from ..planner import Context, Node, positive
from ..registry import family
from ..results import MixEntry, PlacementInfo, ReadsInfo, Result, dump
from ..syntax import Children
from ..text import (
    fields,
    fmt_bpw,
    fmt_bytes,
    fmt_int,
    fmt_mix,
    fmt_mixed,
    fmt_shape,
    fmt_value,
    num,
    table,
)

_LONG_LIST = 8  # a provenance list longer than this is summarised in text (JSON keeps every entry)

fam = family("facts", module=__name__, statements=(
    "stats_stmt", "stats_path", "show_layers", "show_layers_bare", "show_components", "show_representations",
    "show_provenance", "show_operands"), grammar=r"""
stats_stmt: STATS [AT INT POSITIONS]
stats_path: STATS (STRING | DEFAULT) [AT INT POSITIONS]
show_layers: SHOW LAYERS [RANGE layer_range]
show_layers_bare: SHOW LAYERS layer_range       // the reference's SHOW LAYERS a-b
show_components: SHOW COMPONENTS
show_representations: SHOW REPRESENTATIONS [STRING]
show_provenance: SHOW PROVENANCE
show_operands: SHOW OPERANDS [LAYER INT]
""")

fam.doc('STATS',
        "STATS ['path' | DEFAULT] [AT n POSITIONS]",
        "the container's facts: layers, operator mix, objects, continuation state in bytes",
        'STATS AT 4096 POSITIONS;', order=20)
fam.doc('SHOW LAYERS',
        'SHOW LAYERS [[RANGE] a-b]',
        'the per-layer policy and continuation geometry',
        'SHOW LAYERS RANGE 0-1;', order=40)
fam.doc('SHOW COMPONENTS',
        'SHOW COMPONENTS',
        "the graph's components and their roles",
        'SHOW COMPONENTS;', order=50)
fam.doc('SHOW REPRESENTATIONS',
        "SHOW REPRESENTATIONS ['filter']",
        'physical representations: segment files, tensor counts, bytes, hashes',
        "SHOW REPRESENTATIONS 'embedding';", order=60)
fam.doc('SHOW PROVENANCE',
        'SHOW PROVENANCE',
        'where the container came from',
        'SHOW PROVENANCE;', order=70)
fam.doc('SHOW OPERANDS',
        'SHOW OPERANDS [LAYER n]',
        'the tensors each op reads, with dtype, shape and bytes',
        'SHOW OPERANDS LAYER 0;', order=80)


@fam.rule
def stats_stmt(c: Children) -> Stats:
    return Stats(positions=c.int("AT"))


@fam.rule
def stats_path(c: Children) -> Stats:
    if c.has("DEFAULT"):  # STATS DEFAULT: the built-in default model, as OPEN DEFAULT opens it
        return Stats(default=True, positions=c.int("AT"))
    return Stats(path=c.string("STATS"), positions=c.int("AT"))


@fam.rule
def show_layers(c: Children) -> ShowLayers:
    start, end = c.get("RANGE") or (None, None)
    return ShowLayers(start=start, end=end)


@fam.rule
def show_layers_bare(c: Children) -> ShowLayers:
    start, end = c.get("LAYERS")
    return ShowLayers(start=start, end=end)


@fam.rule
def show_components(c: Children) -> ShowComponents:
    return ShowComponents()


@fam.rule
def show_representations(c: Children) -> ShowRepresentations:
    return ShowRepresentations(filter=c.string("REPRESENTATIONS"))


@fam.rule
def show_provenance(c: Children) -> ShowProvenance:
    return ShowProvenance()


@fam.rule
def show_operands(c: Children) -> ShowOperands:
    return ShowOperands(layer=c.int("LAYER"))


class Stats(ast.Statement):
    keyword: ClassVar[str] = "STATS"
    paths: ClassVar[tuple[str, ...]] = ("path",)  # STATS 'path' opens another container: confined on a server
    read_only: ClassVar[bool | str] = True
    kind: Literal["stats"] = "stats"
    positions: int | None = None
    path: str | None = dialect(None)  # STATS 'path' (the reference dialect): another container's facts
    default: bool = dialect(False)  # STATS DEFAULT: the built-in default model's (encoded on first use)

    def refused_read_only(self) -> str | None:
        if self.default:
            return files.default_refusal("STATS")
        return super().refused_read_only()


class ShowLayers(ast.Statement):
    keyword: ClassVar[str] = "SHOW LAYERS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_layers"] = "show_layers"
    start: int | None = None  # inclusive
    end: int | None = None  # inclusive

    def check(self) -> None:
        if self.start is not None and self.end is not None and self.end < self.start:
            raise self.error(f"RANGE {self.start}-{self.end} runs backwards", hint=f"write RANGE {self.end}-{self.start}")


class ShowComponents(ast.Statement):
    keyword: ClassVar[str] = "SHOW COMPONENTS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_components"] = "show_components"


class ShowRepresentations(ast.Statement):
    keyword: ClassVar[str] = "SHOW REPRESENTATIONS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_representations"] = "show_representations"
    filter: str | None = None


class ShowProvenance(ast.Statement):
    keyword: ClassVar[str] = "SHOW PROVENANCE"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_provenance"] = "show_provenance"


class ShowOperands(ast.Statement):
    keyword: ClassVar[str] = "SHOW OPERANDS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_operands"] = "show_operands"
    layer: int | None = None


class ObjectRow(BaseModel):
    object: str
    representation: str
    tensors: int
    parameters: int
    bytes: int
    encodings: dict[str, int] = {}  # encoding -> tensors stored in it (several when mixed)
    bits_per_weight: float | None = None  # 8 x stored tensor bytes / parameters


class ContinuationSummary(BaseModel):
    layers: int
    kv_layers: int
    kv_bytes_per_position: int
    windowed_kv_layers: int
    latent_layers: int
    latent_bytes_per_position: int
    recurrent_layers: int
    recurrent_bytes: int
    stateless_layers: int


class StatsResult(Result):
    kind: Literal["stats"] = "stats"
    name: str
    path: str
    generation: int
    digest: str
    component: str
    role: str
    layers: int
    operator_mix: list[MixEntry]
    objects: list[ObjectRow]
    parameters: int
    bytes: int
    vocab: int
    head_tied: bool
    tokenizer: bool
    continuation: ContinuationSummary
    positions: int | None = None
    state_bytes_at_positions: int | None = None
    placement: PlacementInfo | None = None  # when the model runs as shards
    reads: ReadsInfo | None = None  # what a position reads (expert banks apart from always-read bytes)
    # the session's DRAFT DEPTH (None: the full model): {"depth": d, "adapter": the exit adapter read, or None}
    session_draft: dict[str, Any] | None = None


class LayerRow(BaseModel):
    layer: int
    operator: str
    span: str | None
    window: int | None
    position: str | None
    ffn: str | None
    continuation: str
    bytes_per_position: int
    fixed_bytes: int


class LayersResult(Result):
    kind: Literal["show_layers"] = "show_layers"
    model_layers: int
    layers: list[LayerRow]


class ComponentRow(BaseModel):
    name: str
    role: str
    objects: list[str]
    executes: bool


class ComponentsResult(Result):
    kind: Literal["show_components"] = "show_components"
    components: list[ComponentRow]


class RepresentationRow(BaseModel):
    key: str
    object: str
    encoding: str | None
    segment: str
    tensors: int | None
    payload_bytes: int | None
    payload_sha256: str | None
    segment_sha256: str | None
    encodings: dict[str, int] = {}  # encoding -> tensors stored in it
    bits_per_weight: float | None = None
    executable: bool = True  # every tensor's encoding has a codec in this build


class DerivedRepresentationRow(BaseModel):
    """Derived data recorded in index.json (feature metadata...): what it is, what it was
    derived from, and whether it still fits this container (``fresh``; ``stale`` says why not)."""

    key: str
    kind: str
    version: int | None
    authority: str
    method: str | None
    params: dict[str, Any]
    source_digest: str | None
    fresh: bool
    stale: str | None = None  # why it no longer fits (None when fresh)
    files: int
    bytes: int
    summary: str | None


class RepresentationsResult(Result):
    kind: Literal["show_representations"] = "show_representations"
    filter: str | None
    representations: list[RepresentationRow]
    derived: list[DerivedRepresentationRow] = Field(default_factory=list)


class ProvenanceResult(Result):
    kind: Literal["show_provenance"] = "show_provenance"
    provenance: dict[str, Any]


class OperandRow(BaseModel):
    stage: str  # "embedding" | "layer" | "final_norm" | "head"
    layer: int | None
    op: str
    op_role: str  # what the op is for in its layer (attn_norm, mixer, ffn...)
    role: str  # the operand's role within the op (weight, q_proj...)
    object: str
    tensor: str
    dtype: str
    shape: list[int]
    bytes: int


class OperandsResult(Result):
    kind: Literal["show_operands"] = "show_operands"
    layer: int | None
    operands: list[OperandRow]
    total_bytes: int


@dataclass(frozen=True, eq=False)
class StatsPlan(Node):
    positions: int | None


@dataclass(frozen=True, eq=False)
class StatsOf(Node):
    """STATS 'path' (or DEFAULT, path None): the facts of another container, opened for the
    statement only."""

    path: str | None
    positions: int | None


@dataclass(frozen=True, eq=False)
class ShowLayersPlan(Node):
    layers: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ShowComponentsPlan(Node):
    pass


@dataclass(frozen=True, eq=False)
class ShowRepresentationsPlan(Node):
    filter: str | None


@dataclass(frozen=True, eq=False)
class ShowProvenancePlan(Node):
    pass


@dataclass(frozen=True, eq=False)
class ShowOperandsPlan(Node):
    layer: int | None


@fam.plans(Stats)
def plan_stats(s: Stats, ctx: Context) -> Node:
    positive(s, s.positions, "STATS AT ... POSITIONS", "STATS AT 4096 POSITIONS")
    if s.path is not None or s.default:  # STATS 'path' (the reference dialect) or DEFAULT: that container's facts
        return StatsOf(s, path=s.path, positions=s.positions)
    if not ctx.bound:
        raise NoContainer("STATS needs an open container, and none is open",
                          hint="OPEN 'path/to/model.vindex3' (or OPEN DEFAULT) first, or STATS 'path'",
                          line=s.line, column=s.column, statement=s.source)
    return StatsPlan(s, positions=s.positions)


@fam.plans(ShowLayers)
def plan_show_layers(s: ShowLayers, ctx: Context) -> Node:
    n = ctx.catalog.num_layers
    if s.start is None:
        return ShowLayersPlan(s, layers=tuple(range(n)))
    ctx.catalog.check_layer(s.start)
    ctx.catalog.check_layer(s.end)
    return ShowLayersPlan(s, layers=tuple(range(s.start, s.end + 1)))


@fam.plans(ShowComponents)
def plan_show_components(s: ShowComponents, ctx: Context) -> Node:
    return ShowComponentsPlan(s)


@fam.plans(ShowRepresentations)
def plan_show_representations(s: ShowRepresentations, ctx: Context) -> Node:
    return ShowRepresentationsPlan(s, filter=s.filter)


@fam.plans(ShowProvenance)
def plan_show_provenance(s: ShowProvenance, ctx: Context) -> Node:
    return ShowProvenancePlan(s)


@fam.plans(ShowOperands)
def plan_show_operands(s: ShowOperands, ctx: Context) -> Node:
    if s.layer is not None:
        ctx.catalog.check_layer(s.layer)
    return ShowOperandsPlan(s, layer=s.layer)


@fam.runs(StatsPlan)
def run_stats(session, node: StatsPlan) -> StatsResult:
    c = session.container
    comp = c.graph.component
    op_plan = c.op_plan()
    objects = [ObjectRow(object=o["object"], representation=o.get("representation", "-"),
                           tensors=o.get("tensors", 0), parameters=o["parameters"], bytes=o["bytes"],
                           encodings=o.get("encodings", {}), bits_per_weight=o.get("bits_per_weight"))
               for o in c.objects()]
    geoms = c.continuation()
    positions = node.positions
    return StatsResult(
        name=c.name, path=str(c.path), generation=c.generation, digest=c.digest, component=comp.name,
        role=comp.role, layers=c.graph.num_layers, operator_mix=mix(c), objects=objects,
        parameters=sum(o.parameters for o in objects), bytes=sum(o.bytes for o in objects),
        vocab=op_plan.vocab, head_tied=bool(op_plan.head.params.get("tied")), tokenizer=c.has_tokenizer,
        continuation=continuation_summary(geoms), positions=positions,
        state_bytes_at_positions=None if positions is None else sum(g.bytes_at(positions) for g in geoms),
        placement=placement_info(c, slice_of(None), positions or 0), reads=reads_info(op_plan),
        session_draft=_session_draft(session),
    )


def _session_draft(session) -> dict[str, Any] | None:
    """The session's DRAFT DEPTH and, with WITH ADAPTER, the stored exit adapter it reads through."""
    if session.draft_depth is None:
        return None
    row = None
    if getattr(session, "draft_adapter", False):
        from vindex3.draft.store import adapter_key, components

        from .drafts import adapter_facts

        key = adapter_key(session.draft_depth)
        row = adapter_facts(next((x for x in components(session.base_container) if x["key"] == key), None))
    return {"depth": session.draft_depth, "adapter": row}


def continuation_summary(geoms: list) -> ContinuationSummary:
    """Per kind of state part: the layers that keep one and their bytes (rows per position, or
    fixed), summed over the parts; nothing here asks which operator a layer runs."""
    from vindex3.continuation import KV, LATENT, RECURRENT

    def rows(kind: str) -> int:
        return sum(p.row_bytes for g in geoms for p in g.of(kind))

    return ContinuationSummary(
        layers=len(geoms), kv_layers=sum(g.has(KV) for g in geoms), kv_bytes_per_position=rows(KV),
        windowed_kv_layers=sum(any(p.window for p in g.of(KV)) for g in geoms),
        latent_layers=sum(g.has(LATENT) for g in geoms), latent_bytes_per_position=rows(LATENT),
        recurrent_layers=sum(g.has(RECURRENT) for g in geoms),
        recurrent_bytes=sum(p.fixed_bytes for g in geoms for p in g.of(RECURRENT)),
        stateless_layers=sum(g.stateless for g in geoms),
    )


@fam.runs(ShowLayersPlan)
def run_show_layers(session, node: ShowLayersPlan) -> LayersResult:
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
        rows.append(LayerRow(
            layer=lp.index, operator=lp.operator, span=lp.span, window=lp.window, position=pos_text,
            ffn=lp.ffn, continuation=g.describe(), bytes_per_position=g.bytes_per_position,
            fixed_bytes=g.fixed_bytes,
        ))
    return LayersResult(model_layers=c.graph.num_layers, layers=rows)


@fam.runs(ShowComponentsPlan)
def run_show_components(session, node: ShowComponentsPlan) -> ComponentsResult:
    g = session.container.graph
    return ComponentsResult(components=[
        ComponentRow(name=x.name, role=x.role, objects=list(x.objects),
                     executes=x.role == "primary_text" or (x.role == "drafter" and _runs_as_drafter(g, x)))
        for x in g.components
    ])


def _runs_as_drafter(g, comp) -> bool:
    """A drafter component this build runs (an MTP head: vindex3.draft.mtp, SPECULATE DRAFTER MTP)."""
    from vindex3.draft.mtp import KIND, drafter_objects

    found = drafter_objects(g)
    return any(found.get(o, {}).get("kind") == KIND for o in comp.objects)


@fam.runs(ShowRepresentationsPlan)
def run_show_representations(session, node: ShowRepresentationsPlan) -> RepresentationsResult:
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
        rows.append(RepresentationRow(
            key=key, object=r.get("object", "-"), encoding=r.get("encoding"), segment=r.get("segment", "-"),
            tensors=r.get("tensors"), payload_bytes=r.get("payload_bytes"),
            payload_sha256=r.get("payload_sha256"), segment_sha256=r.get("segment_sha256"),
            encodings=encs, bits_per_weight=o.get("bits_per_weight"),
            executable=all(codecs.is_known(e) for e in encs),
        ))

    return RepresentationsResult(filter=flt, representations=rows, derived=derived_rows(session, flt))


@fam.runs(ShowProvenancePlan)
def run_show_provenance(session, node: ShowProvenancePlan) -> ProvenanceResult:
    return ProvenanceResult(provenance=dict(session.container.provenance))


@fam.runs(ShowOperandsPlan)
def run_show_operands(session, node: ShowOperandsPlan) -> OperandsResult:
    op_plan = session.container.op_plan()
    layer = node.layer
    rows: list[OperandRow] = []

    def add(stage: str, idx: int | None, op) -> None:
        for role, ref in op.operands.items():
            rows.append(OperandRow(stage=stage, layer=idx, op=op.kind, op_role=op.role,
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
    return OperandsResult(layer=layer, operands=rows, total_bytes=sum(distinct.values()))


@fam.runs(StatsOf)
def run_stats_of(session, node: StatsOf) -> StatsResult:
    from ..session import Session

    path = files.container_or_default(session, node.path)  # STATS DEFAULT: encoded on first use, as OPEN DEFAULT
    other = Session(path)  # its own session: the bound container stays bound
    try:
        return other.execute_statement(Stats(positions=node.positions, source=node.statement.source))
    finally:
        other.close()


@fam.layout(StatsResult)
def layout_stats(r: StatsResult, timing: bool) -> list[str]:
    return _stats_facts(r) + reads(r.reads, "reads per position") + placement(r.placement)


def _draft_words(d: dict[str, Any] | None) -> str | None:
    if d is None:
        return None
    if d.get("adapter") is None:
        return f"depth {d['depth']}"
    from .drafts import adapter_words

    return f"depth {d['depth']} through exit adapter {adapter_words(d['adapter'])}"


def _stats_facts(r: StatsResult) -> list[str]:
    c = r.continuation
    out = fields([
        ("model", r.name),
        ("path", r.path),
        ("generation", str(r.generation)),
        ("digest", r.digest),
        ("component", f"{r.component} ({r.role})"),
        ("layers", str(r.layers)),
        ("operators", fmt_mix(r.operator_mix)),
        ("parameters", fmt_int(r.parameters)),
        ("weights", fmt_bytes(r.bytes)),
        ("output head", f"vocab {r.vocab:,}, " + ("tied to the embedding" if r.head_tied else "its own weights")),
        ("tokenizer", "yes" if r.tokenizer else "no"),
        ("session draft", _draft_words(r.session_draft)),
    ])
    out += [""] + table(
        ["object", "representation", num("tensors"), num("parameters"), num("bytes"), num("bits/weight")],
        [[o.object, o.representation + fmt_mixed(o.encodings), fmt_int(o.tensors), fmt_int(o.parameters),
          fmt_int(o.bytes), fmt_bpw(o.bits_per_weight)] for o in r.objects],
    )
    if not c.kv_layers and not c.latent_layers and c.recurrent_layers:
        # Nothing grows with the sequence: say so, and print no KV line at all.
        out += ["", "continuation state: recurrent only"]
        rows = [("  recurrent", f"{fmt_bytes(c.recurrent_bytes)} over {c.recurrent_layers} layer(s), constant in sequence length")]
        if c.stateless_layers:
            rows.append(("  stateless", f"{c.stateless_layers} layer(s)"))
        if r.positions is not None:
            rows.append((f"  at {r.positions:,} positions", fmt_bytes(r.state_bytes_at_positions)))
        return out + fields(rows)
    out += ["", "continuation state"]
    kv = (
        f"{fmt_bytes(c.kv_bytes_per_position)} per position over {c.kv_layers} layer(s)"
        + (f", {c.windowed_kv_layers} of them windowed" if c.windowed_kv_layers else "")
        if c.kv_layers else "none (no layer keeps KV)"
    )
    latent = f"{fmt_bytes(c.latent_bytes_per_position)} per position over {c.latent_layers} layer(s)" if c.latent_layers else "none"
    rec = (f"{fmt_bytes(c.recurrent_bytes)} fixed over {c.recurrent_layers} layer(s), constant in sequence length"
           if c.recurrent_layers else "none")
    rows = [("  kv", kv), ("  latent", latent), ("  recurrent", rec)]
    if c.stateless_layers:
        rows.append(("  stateless", f"{c.stateless_layers} layer(s)"))
    if r.positions is not None:
        rows.append((f"  at {r.positions:,} positions", fmt_bytes(r.state_bytes_at_positions)))
    out += fields(rows)
    return out


@fam.layout(LayersResult)
def layout_layers(r: LayersResult, timing: bool) -> list[str]:
    return table(
        [num("layer"), "operator", "span", num("window"), "position", "ffn", "state", num("bytes/position"), num("fixed bytes")],
        [[str(x.layer), x.operator, x.span or "-", fmt_int(x.window), x.position or "-", x.ffn or "-",
          x.continuation, fmt_int(x.bytes_per_position), fmt_int(x.fixed_bytes)] for x in r.layers],
    )


@fam.layout(ComponentsResult)
def layout_components(r: ComponentsResult, timing: bool) -> list[str]:
    return table(
        ["component", "role", "objects", "executes"],
        [[c.name, c.role, ", ".join(c.objects) or "-",
          ("yes" if c.role == "primary_text" else "yes, as a drafter (SPECULATE DRAFTER MTP)") if c.executes
          else f"no ({c.role} is not executable in this build)"] for c in r.components],
    )


@fam.layout(RepresentationsResult)
def layout_reps(r: RepresentationsResult, timing: bool) -> list[str]:
    if not r.representations and not r.derived:
        return [f"no representation matches {r.filter!r}" if r.filter else "no representations"]
    out: list[str] = []
    if r.representations:
        out += table(
            ["representation", "object", "encoding", "segment", num("tensors"), num("payload bytes"), num("bits/weight"), "payload sha256"],
            [[x.key, x.object, (x.encoding or "-") + fmt_mixed(x.encodings), x.segment, fmt_int(x.tensors),
              fmt_int(x.payload_bytes), fmt_bpw(x.bits_per_weight), (x.payload_sha256 or "-")[:16]] for x in r.representations],
        )
    for x in r.representations:
        if not x.executable:
            bad = ", ".join(e for e in x.encodings if e not in _known_encodings())
            out.append(f"{x.key}: encoding {bad} has no codec in this build (carried; INFER refuses it at preparation)")
    if r.derived:
        out += ([""] if out else []) + table(
            ["derived", "kind", "summary", num("files"), num("bytes"), "fresh"],
            [[d.key, d.kind, d.summary or "-", fmt_int(d.files), fmt_int(d.bytes),
              "yes" if d.fresh else f"no: {d.stale or 'built from another state of the container'}"] for d in r.derived],
        )
    return out


def _known_encodings() -> set[str]:
    from vindex3 import codecs

    return set(codecs.known())


@fam.layout(ProvenanceResult)
def layout_provenance(r: ProvenanceResult, timing: bool) -> list[str]:
    if not r.provenance:
        return ["no provenance recorded"]
    return fields((k, provenance_value(k, v)) for k, v in flatten(r.provenance))


def provenance_value(key: str, v: Any) -> str:
    """Provenance as text: the (long) lists of assembled and dropped tensors summarised by how
    and why, every other value as it is."""
    if key == "assembled_tensors" and isinstance(v, list) and v and all(isinstance(a, dict) for a in v):
        sources = sum(len(a.get("sources") or []) for a in v)
        how: dict[str, int] = {}
        for a in v:
            steps = " + ".join(a.get("transform") or []) or "as stored"
            how[steps] = how.get(steps, 0) + 1
        return (f"{len(v)} tensors from {sources} source tensors ("
                + ", ".join(f"{steps}: {n}" for steps, n in how.items()) + "; JSON lists each)")
    if key == "dropped_tensors" and isinstance(v, list) and len(v) > _LONG_LIST and all(isinstance(a, dict) for a in v):
        why: dict[str, int] = {}
        for a in v:
            w = str(a.get("why", "?"))
            why[w] = why.get(w, 0) + 1
        top = sorted(why.items(), key=lambda kv: -kv[1])
        more = f"; {len(top) - 3} more reasons" if len(top) > 3 else ""
        return (f"{len(v)} tensors (" + "; ".join(f"{n}: {short(w, 80)}" for w, n in top[:3]) + more
                + "; JSON lists each)")
    return fmt_value(v)


@fam.layout(OperandsResult)
def layout_operands(r: OperandsResult, timing: bool) -> list[str]:
    out = table(
        ["layer", "op", "operand", "tensor", "dtype", "shape", num("bytes")],
        [[str(o.layer) if o.layer is not None else o.stage.replace("_", " "),
          f"{o.op} ({o.op_role})" if o.op_role and o.op_role != o.op else o.op, o.role,
          f"{o.object}/{o.tensor}", o.dtype, fmt_shape(o.shape), fmt_int(o.bytes)] for o in r.operands],
    )
    return out + [f"{len(r.operands)} operands, {fmt_bytes(r.total_bytes)}"]


@fam.records(LayersResult)
def records_layers(r: LayersResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.layers]


@fam.records(ComponentsResult)
def records_components(r: ComponentsResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.components]


@fam.records(RepresentationsResult)
def records_reps(r: RepresentationsResult) -> list[dict[str, Any]]:
    """Representations, then derived data (whose rows carry ``authority: derived``)."""
    return [dump(x) for x in r.representations] + [dump(d) for d in r.derived]


@fam.records(ProvenanceResult)
def records_provenance(r: ProvenanceResult) -> list[dict[str, Any]]:
    return [{"key": k, "value": v} for k, v in flatten(r.provenance)] if r.provenance else []


@fam.records(OperandsResult)
def records_operands(r: OperandsResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.operands]


@fam.records(StatsResult)
def records_stats(r: StatsResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.objects]


def derived_rows(session, flt: str | None) -> list[DerivedRepresentationRow]:
    """Derived data in the bound container's index, each with whether it still fits: for
    feature metadata the same judgment WALK makes (source digest, method version, k)."""
    rows = []
    for d in session.base_container.derived:
        if flt is not None:
            pat = flt.lower()
            hay = f"{d.key} {d.kind}".lower()
            if any(ch in pat for ch in "*?["):
                if not (fnmatch.fnmatch(d.key.lower(), pat) or fnmatch.fnmatch(d.kind.lower(), pat)):
                    continue
            elif pat not in hay:
                continue
        stale = None if d.fresh else (f"the container changed since it was built (source digest "
                                      f"{str(d.source_digest)[:12]}…)")
        if d.kind == "feature_tokens":
            status = session.internals().metadata.status()
            stale = status.get("why") if status.get("state") == "stale" else None
        rows.append(DerivedRepresentationRow(**d.model_dump(exclude={"fresh"}), fresh=stale is None, stale=stale))
    return rows
