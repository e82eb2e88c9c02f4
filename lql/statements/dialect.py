"""The reference dialect's facts: SHOW MODELS, SHOW COMPACT STATUS, and its knowledge-graph
views (SHOW ENTITIES, SHOW RELATIONS, SELECT ... FROM EDGES | ENTITIES), refused by name where
this build has no honest meaning for them."""

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
        'the containers in the current directory',
        'SHOW MODELS;', order=330, aliases=('MODELS',))
fam.doc('SHOW COMPACT STATUS',
        'SHOW COMPACT STATUS',
        'edits waiting to be compacted: none, this build has no patch overlay',
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
    paths: ClassVar[tuple[str, ...]] = ()  # lists the server's working directory: refused by the read-only profile
    read_only: ClassVar[bool | str] = "it lists the server's working directory"
    kind: Literal["show_models"] = "show_models"


class ShowCompactStatus(ast.Statement):
    keyword: ClassVar[str] = "SHOW COMPACT STATUS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    kind: Literal["show_compact_status"] = "show_compact_status"


class ShowEntities(ast.Statement):
    keyword: ClassVar[str] = "SHOW ENTITIES"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True  # refused at planning whatever the profile
    kind: Literal["show_entities"] = "show_entities"
    layer: int | None = None
    limit: int | None = None


class ShowRelations(ast.Statement):
    keyword: ClassVar[str] = "SHOW RELATIONS"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True  # refused at planning whatever the profile
    kind: Literal["show_relations"] = "show_relations"
    layer: int | None = None
    examples: bool = False
    detail: ast.Detail | None = None


class SelectGraph(ast.Statement):
    """SELECT ... FROM EDGES | ENTITIES: the reference's knowledge-graph tables."""

    keyword: ClassVar[str] = "SELECT"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True  # refused at planning whatever the profile
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
    path: str
    name: str | None
    layers: int | None
    generation: int | None
    bytes: int | None
    problem: str | None = None  # why a directory with an index.json does not open


class ModelsResult(Result):
    """SHOW MODELS: the containers in the current directory."""

    kind: Literal["show_models"] = "show_models"
    directory: str
    models: list[ModelRow]


class NoteResult(Result):
    """A statement whose answer is a fact in words (SHOW PATCHES, SHOW COMPACT STATUS)."""

    kind: Literal["note"] = "note"
    topic: str
    lines: list[str]


# ---- plans ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShowModelsPlan(Node):
    directory: str


@dataclass(frozen=True, eq=False)
class NotePlan(Node):
    """A fact in words, decided at planning (also the edits family's SHOW PATCHES)."""

    topic: str
    lines: tuple[str, ...]


@fam.plans(ShowModels)
def plan_show_models(s: ShowModels, ctx: Context) -> Node:
    return ShowModelsPlan(s, directory=os.getcwd())


@fam.plans(ShowCompactStatus)
def plan_show_compact_status(s: ShowCompactStatus, ctx: Context) -> Node:
    lines = [("nothing to compact: this build has no patch overlay, so no edits wait to be folded in "
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
    table = s.table.upper()
    what = "labelled edges: entity, relation, target" if table == "EDGES" else "its entities"
    raise err(s, f"SELECT ... FROM {table} reads the reference system's knowledge graph ({what}), and this build "
               "keeps FFN features, not a graph", hint="SELECT ... FROM FEATURES is the table here (layer, feature, "
               "token, score); DESCRIBE 'entity' gives edges entity -> token")


# ---- runners ----------------------------------------------------------------------------


@fam.runs(ShowModelsPlan)
def run_show_models(session, node: ShowModelsPlan) -> ModelsResult:
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
            rows.append(ModelRow(path=entry.name, name=c.name, layers=c.graph.num_layers, generation=c.generation,
                                 bytes=size))
        except VindexError as e:  # a directory that does not open is listed with the reason
            rows.append(ModelRow(path=entry.name, name=None, layers=None, generation=None, bytes=None,
                                 problem=str(e).splitlines()[0]))
    return ModelsResult(directory=os.fspath(base), models=rows)


@fam.runs(NotePlan)
def run_note(session, node: NotePlan) -> NoteResult:
    return NoteResult(topic=node.topic, lines=list(node.lines))


# ---- layouts ----------------------------------------------------------------------------


@fam.layout(ModelsResult)
def layout_models(r: ModelsResult, timing: bool) -> list[str]:
    if not r.models:
        return [f"no containers in {r.directory} (a container is a directory holding an index.json)"]
    out = [f"{len(r.models)} container(s) in {r.directory}:"]
    out += table(["path", "name", num("layers"), num("generation"), num("bytes"), "problem"],
                 [[m.path, m.name or "-", "-" if m.layers is None else str(m.layers),
                   "-" if m.generation is None else str(m.generation), fmt_bytes(m.bytes), m.problem or ""]
                  for m in r.models])
    return out


@fam.layout(NoteResult)
def layout_note(r: NoteResult, timing: bool) -> list[str]:
    return list(r.lines)
