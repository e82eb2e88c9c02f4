"""The reference dialect's facts: SHOW MODELS, SHOW COMPACT STATUS, and its knowledge-graph
views (SHOW ENTITIES, SHOW RELATIONS, SELECT ... FROM EDGES | ENTITIES), refused by name where
this build has no honest meaning for them (SELECT ... FROM EDGES lists the session's patches'
edges: the edits family plans and runs it)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, Field

from .. import ast
from ..planner import Context, Node, err
from ..registry import family
from ..results import Result
from ..syntax import Children, Clause
from ..text import fmt_bytes, num, table
from .features import select_fields

fam = family("dialect", module=__name__, statements=("show_models", "show_compact_status", "show_entities",
                                                      "show_relations", "select_graph"), grammar=r"""
show_models: SHOW MODELS
show_compact_status: SHOW COMPACT STATUS
show_entities: SHOW ENTITIES [INT | AT LAYER INT] [limit_clause]
show_relations: SHOW RELATIONS relations_option*

?relations_option: at_layer_clause
                 | with_examples_clause
                 | detail_clause
with_examples_clause: WITH EXAMPLES

select_graph: SELECT select_list FROM (EDGES | ENTITIES) [nearest_clause] [where_clause] [order_clause] [limit_clause]
""")

fam.doc('SHOW MODELS',
        'SHOW MODELS',
        "the containers in the current directory and in the cache ($VINDEX3_CACHE), the default model's marked",
        'SHOW MODELS;', order=330, aliases=('MODELS',))
fam.doc('SHOW COMPACT STATUS',
        'SHOW COMPACT STATUS',
        'edits waiting to be compacted: none, ever: edits stay an overlay over the container until COMPILE writes a new one',
        'SHOW COMPACT STATUS;', order=350)
fam.doc('SHOW ENTITIES',
        'SHOW ENTITIES [n | AT LAYER n] [LIMIT n]',
        "refused: the reference system's knowledge-graph entities; this build keeps FFN features (SHOW FEATURES n, DESCRIBE)",
        'SHOW FEATURES 0 LIMIT 5;', order=360)
fam.doc('SHOW RELATIONS',
        'SHOW RELATIONS [AT LAYER n] [WITH EXAMPLES] [VERBOSE | BRIEF | RAW]',
        "refused: this build's feature metadata carries no relation labels",
        "DESCRIBE 'France';", order=370)


@fam.rule
def show_models(c: Children) -> ShowModels:
    return ShowModels()


@fam.rule
def show_compact_status(c: Children) -> ShowCompactStatus:
    return ShowCompactStatus()


@fam.rule
def show_entities(c: Children) -> ShowEntities:
    # SHOW ENTITIES [INT | AT LAYER INT] [limit_clause]
    layer = c.int("ENTITIES") if c.get("ENTITIES") is not None else c.int("LAYER")
    return ShowEntities(layer=layer, limit=c.options("SHOW ENTITIES").get("limit"))


@fam.rule
def show_relations(c: Children) -> ShowRelations:
    fields = c.options("SHOW RELATIONS")
    if "at_layer" in fields:
        fields["layer"] = fields.pop("at_layer")
    return ShowRelations(**fields)


@fam.rule
def with_examples_clause(c: Children) -> Clause:
    return c.clause("examples", True)


@fam.rule
def select_graph(c: Children) -> SelectGraph:
    # SELECT list FROM EDGES | ENTITIES [nearest] [where] [order] [limit]
    opts = c.options("SELECT")
    fields = select_fields(c, opts)
    nearest = opts.get("nearest")
    if isinstance(nearest, tuple):
        fields["nearest"], fields["nearest_layer"] = nearest
    else:
        fields["nearest"] = nearest
    return SelectGraph(table=c.which("EDGES", "ENTITIES"), **fields)


# ---- statements -------------------------------------------------------------------------


class ShowModels(ast.Statement):
    keyword: ClassVar[str] = "SHOW MODELS"
    paths: ClassVar[tuple[str, ...]] = ()  # lists the server's directories: refused by the read-only profile
    read_only: ClassVar[bool | str] = "it lists the server's working directory and cache"
    kind: Literal["show_models"] = "show_models"


class ShowCompactStatus(ast.Statement):
    keyword: ClassVar[str] = "SHOW COMPACT STATUS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    kind: Literal["show_compact_status"] = "show_compact_status"


class ShowEntities(ast.Statement):
    keyword: ClassVar[str] = "SHOW ENTITIES"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True  # ENTITIES: refused at planning; EDGES: reads the session's patches
    kind: Literal["show_entities"] = "show_entities"
    layer: int | None = None
    limit: int | None = None


class ShowRelations(ast.Statement):
    keyword: ClassVar[str] = "SHOW RELATIONS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True  # ENTITIES: refused at planning; EDGES: reads the session's patches
    kind: Literal["show_relations"] = "show_relations"
    layer: int | None = None
    examples: bool = False
    detail: ast.Detail | None = None


class SelectGraph(ast.Statement):
    """SELECT ... FROM EDGES | ENTITIES: the reference's knowledge-graph tables."""

    keyword: ClassVar[str] = "SELECT"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True  # ENTITIES: refused at planning; EDGES: reads the session's patches
    kind: Literal["select_graph"] = "select_graph"
    table: Literal["edges", "entities"]
    columns: list[ast.Column] | None = None
    nearest: str | None = None
    nearest_layer: int | None = None
    where: list[ast.Condition] = Field(default_factory=list)
    order_by: ast.Column | None = None
    descending: bool | None = None
    limit: int | None = None


# ---- results ----------------------------------------------------------------------------


class ModelRow(BaseModel):
    path: str  # relative to the current directory; absolute in the cache
    where: Literal["here", "cache"] = "here"
    default: bool = False  # the built-in default model: what OPEN DEFAULT (and ... AGAINST DEFAULT) opens
    name: str | None
    layers: int | None
    generation: int | None
    bytes: int | None
    problem: str | None = None  # why a directory with an index.json does not open


class ModelsResult(Result):
    """SHOW MODELS: the containers in the current directory, then those in the cache (the
    directory $VINDEX3_CACHE names, where OPEN DEFAULT encodes the default model), to two levels."""

    kind: Literal["show_models"] = "show_models"
    directory: str
    models: list[ModelRow]
    cache: str | None = None
    default_encoded: bool = False  # whether the default model's container is in the cache yet

    def records(self) -> list[dict]:
        return [m.model_dump(mode="json") for m in self.models]


class NoteResult(Result):
    """A statement whose answer is a fact in words (SHOW PATCHES, SHOW COMPACT STATUS)."""

    kind: Literal["note"] = "note"
    topic: str
    lines: list[str]


# ---- plans ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShowModelsPlan(Node):
    directory: str
    cache: str


@dataclass(frozen=True, eq=False)
class NotePlan(Node):
    """A fact in words, decided at planning (also the edits family's SHOW PATCHES)."""

    topic: str
    lines: tuple[str, ...]


@fam.plans(ShowModels)
def plan_show_models(s: ShowModels, ctx: Context) -> Node:
    from vindex3 import default_model

    return ShowModelsPlan(s, directory=os.getcwd(), cache=os.fspath(default_model.cache_dir()))


@fam.plans(ShowCompactStatus)
def plan_show_compact_status(s: ShowCompactStatus, ctx: Context) -> Node:
    lines = [("nothing to compact: edits stay a patch overlay over the open container (SHOW PATCHES), never "
              "written into it; COMPILE CURRENT INTO VINDEX 'dir' writes a new container with them baked in "
              "(COMPACT MINOR | MAJOR are refused by name)")]
    if ctx.bound:
        lines.append(f"COMPACT INTO 'dir' copies {ctx.catalog.name}'s referenced files and lists what it leaves behind")
    return NotePlan(s, topic="compact status", lines=tuple(lines))


@fam.plans(ShowEntities)
def plan_show_entities(s: ShowEntities, ctx: Context) -> Node:
    raise err(s, "SHOW ENTITIES lists the entities of the reference system's knowledge graph (the subjects its "
               "probes labelled), and this build keeps FFN features, not a graph of entities",
               hint="SHOW FEATURES n lists a layer's features and the tokens they write; DESCRIBE 'entity' its edges")


@fam.plans(ShowRelations)
def plan_show_relations(s: ShowRelations, ctx: Context) -> Node:
    raise err(s, "SHOW RELATIONS lists the relation labels of the reference system's knowledge graph, and this "
               "build's feature metadata carries no relation labels",
               hint="DESCRIBE 'entity' shows the edges entity -> token through the features it opens")


@fam.plans(SelectGraph)
def plan_select_graph(s: SelectGraph, ctx: Context) -> Node:
    if s.table == "edges":  # the session's patches' edges (the edits family)
        from .edits import plan_select_edges

        return plan_select_edges(s, ctx)
    table = s.table.upper()
    what = "labelled edges: entity, relation, target" if table == "EDGES" else "its entities"
    raise err(s, f"SELECT ... FROM {table} reads the reference system's knowledge graph ({what}), and this build "
               "keeps FFN features, not a graph", hint="SELECT ... FROM FEATURES is the table here (layer, feature, "
               "token, score); DESCRIBE 'entity' gives edges entity -> token")


# ---- runners ----------------------------------------------------------------------------


@fam.runs(ShowModelsPlan)
def run_show_models(session, node: ShowModelsPlan) -> ModelsResult:
    from vindex3 import default_model

    base, cache = Path(node.directory), Path(node.cache)
    default = default_model.container_path()
    rows = [_model_row(e, e.name, "here", default) for e in _containers(base, depth=1)]
    seen = {os.path.realpath(base / r.path) for r in rows}
    if cache.is_dir():
        rows += [_model_row(e, os.fspath(e), "cache", default) for e in _containers(cache, depth=2)
                 if os.path.realpath(e) not in seen]
    return ModelsResult(directory=os.fspath(base), models=rows, cache=os.fspath(cache),
                        default_encoded=any(r.default for r in rows))


def _containers(base: Path, depth: int) -> list[Path]:
    """Directories holding an index.json under ``base``, ``depth`` levels down at most, by name."""
    out: list[Path] = []
    try:
        entries = sorted(base.iterdir(), key=lambda p: p.name)
    except OSError:
        return out
    for entry in entries:
        if not entry.is_dir():
            continue
        if (entry / "index.json").is_file():
            out.append(entry)
        elif depth > 1:
            out += _containers(entry, depth - 1)
    return out


def _model_row(entry: Path, shown: str, where: str, default: Path) -> ModelRow:
    import vindex3
    from vindex3.errors import VindexError

    is_default = os.path.realpath(entry) == os.path.realpath(default)
    try:
        c = vindex3.open(entry)
        size = sum(o["bytes"] for o in c.objects())
        return ModelRow(path=shown, where=where, default=is_default, name=c.name, layers=c.graph.num_layers,
                        generation=c.generation, bytes=size)
    except VindexError as e:  # a directory that does not open is listed with the reason
        return ModelRow(path=shown, where=where, default=is_default, name=None, layers=None, generation=None,
                        bytes=None, problem=str(e).splitlines()[0])


@fam.runs(NotePlan)
def run_note(session, node: NotePlan) -> NoteResult:
    return NoteResult(topic=node.topic, lines=list(node.lines))


# ---- layouts ----------------------------------------------------------------------------


@fam.layout(ModelsResult)
def layout_models(r: ModelsResult, timing: bool) -> list[str]:
    here = [m for m in r.models if m.where == "here"]
    cached = [m for m in r.models if m.where == "cache"]
    out = []
    if here:
        out.append(f"{len(here)} container(s) in {r.directory}:")
        out += _models_table(here)
    else:
        out.append(f"no containers in {r.directory} (a container is a directory holding an index.json)")
    if r.cache is not None:
        out.append("")
        if cached:
            out.append(f"{len(cached)} container(s) in the cache {r.cache}:")
            out += _models_table(cached)
        else:
            out.append(f"no containers in the cache {r.cache}")
        if not r.default_encoded:
            out.append("the default model is not encoded yet: OPEN DEFAULT encodes it into the cache")
    return out


def _models_table(models: list[ModelRow]) -> list[str]:
    return table(["path", "name", num("layers"), num("generation"), num("bytes"), "problem"],
                 [[m.path, (m.name or "-") + (" (DEFAULT)" if m.default else ""),
                   "-" if m.layers is None else str(m.layers), "-" if m.generation is None else str(m.generation),
                   fmt_bytes(m.bytes), m.problem or ""] for m in models])


@fam.layout(NoteResult)
def layout_note(r: NoteResult, timing: bool) -> list[str]:
    return list(r.lines)
