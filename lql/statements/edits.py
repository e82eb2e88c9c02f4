"""Knowledge edits (the reference dialect): INSERT, DELETE, UPDATE, MERGE, patches (BEGIN, SAVE,
APPLY, REMOVE, SHOW PATCHES), REBALANCE, COMPACT MINOR | MAJOR. Each parses into its own class
and is refused at planning: this build has no patch overlay."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from .. import ast
from ..planner import Context, Node, err
from ..registry import family
from ..syntax import BuildError, Children, Clause
from .dialect import NotePlan

fam = family("edits", module=__name__, statements=(
    "insert_edges", "delete_edges", "update_edges", "merge_stmt", "begin_patch", "save_patch", "apply_patch",
    "remove_patch", "rebalance", "compact_level", "show_patches"), grammar=r"""
insert_edges: INSERT INTO EDGES _LPAR column (_COMMA column)* _RPAR VALUES _LPAR literal (_COMMA literal)* _RPAR insert_option*
delete_edges: DELETE FROM EDGES [where_clause]
update_edges: UPDATE EDGES SET assignment (_COMMA assignment)* [where_clause]
merge_stmt: MERGE STRING [INTO STRING] [on_conflict_clause]
begin_patch: BEGIN PATCH STRING
save_patch: SAVE PATCH
apply_patch: APPLY PATCH STRING
remove_patch: REMOVE PATCH STRING
rebalance: REBALANCE loose_option*
compact_level: COMPACT (MINOR | MAJOR) loose_option*
show_patches: SHOW PATCHES

?insert_option: at_layer_clause
              | confidence_clause
              | alpha_clause
              | mode_clause
confidence_clause: CONFIDENCE _number
alpha_clause: ALPHA _number
_number: INT | FLOAT
assignment: column _EQ literal
loose_option: NAME [literal]
            | at_layer_clause
""")

fam.doc('SHOW PATCHES',
        'SHOW PATCHES',
        "the patch overlay's patches: none, this build has no patch overlay",
        'SHOW PATCHES;', order=340)
fam.doc('INSERT',
        'INSERT INTO EDGES (columns) VALUES (values) [AT LAYER n] [CONFIDENCE x] [ALPHA x] [MODE KNN | COMPOSE]',
        'refused: INSERT edits knowledge through a patch overlay, which this build does not have yet',
        'SHOW PATCHES;', order=380)
fam.doc('DELETE',
        'DELETE FROM EDGES WHERE ...',
        'refused: DELETE edits knowledge through a patch overlay, which this build does not have yet',
        'SHOW PATCHES;', order=390)
fam.doc('UPDATE',
        'UPDATE EDGES SET column = value, ... WHERE ...',
        'refused: UPDATE edits knowledge through a patch overlay, which this build does not have yet',
        'SHOW PATCHES;', order=400)
fam.doc('MERGE',
        "MERGE 'source' [INTO 'target'] [ON CONFLICT name]",
        'refused: MERGE merges another set of edits through a patch overlay, which this build does not have yet',
        'SHOW PATCHES;', order=410)
fam.doc('BEGIN PATCH',
        "BEGIN PATCH 'file' | SAVE PATCH | APPLY PATCH 'file' | REMOVE PATCH 'file'",
        'refused: patches are a patch overlay, which this build does not have yet',
        'SHOW PATCHES;', order=420, aliases=('SAVE PATCH', 'APPLY PATCH', 'REMOVE PATCH', 'PATCH'))
fam.doc('REBALANCE',
        'REBALANCE [options]',
        'refused: REBALANCE rebalances the edits held in a patch overlay, which this build does not have yet',
        'SHOW PATCHES;', order=430)
fam.doc('COMPACT MINOR',
        'COMPACT MINOR | MAJOR [options]',
        "refused: COMPACT MINOR | MAJOR fold a patch overlay's edits into the base model, which this build does not have yet (COMPACT INTO 'dir' is this build's COMPACT)",
        'SHOW COMPACT STATUS;', order=440, aliases=('COMPACT MAJOR',))


@fam.rule
def insert_edges(c: Children) -> InsertEdges:
    # INSERT INTO EDGES ( columns ) VALUES ( literals ) insert_option*
    columns, values = c.all("INSERT", "INTO", "EDGES"), c.all("VALUES")
    fields = c.options("INSERT")
    if "at_layer" in fields:
        fields["layer"] = fields.pop("at_layer")
    if len(columns) != len(values):
        raise BuildError(f"INSERT names {len(columns)} columns and gives {len(values)} values", c.keyword("VALUES"),
                         hint="give one value per column")
    return InsertEdges(columns=columns, values=values, **fields)


@fam.rule
def delete_edges(c: Children) -> DeleteEdges:
    return DeleteEdges(where=c.options("DELETE").get("where") or [])


@fam.rule
def update_edges(c: Children) -> UpdateEdges:
    return UpdateEdges(assignments=c.all("SET"), where=c.options("UPDATE").get("where") or [])


@fam.rule
def merge_stmt(c: Children) -> Merge:
    return Merge(src=c.string("MERGE"), into=c.string("INTO"), on_conflict=c.options("MERGE").get("on_conflict"))


@fam.rule
def begin_patch(c: Children) -> BeginPatch:
    return BeginPatch(path=c.string("PATCH"))


@fam.rule
def save_patch(c: Children) -> SavePatch:
    return SavePatch()


@fam.rule
def apply_patch(c: Children) -> ApplyPatch:
    return ApplyPatch(path=c.string("PATCH"))


@fam.rule
def remove_patch(c: Children) -> RemovePatch:
    return RemovePatch(path=c.string("PATCH"))


@fam.rule
def rebalance(c: Children) -> Rebalance:
    return Rebalance(options=c.values())


@fam.rule
def compact_level(c: Children) -> CompactLevel:
    return CompactLevel(level=c.which("MINOR", "MAJOR"), options=c.values())


@fam.rule
def show_patches(c: Children) -> ShowPatches:
    return ShowPatches()


@fam.rule
def confidence_clause(c: Children) -> Clause:
    return c.clause("confidence", float(c.get("CONFIDENCE").value))


@fam.rule
def alpha_clause(c: Children) -> Clause:
    return c.clause("alpha", float(c.get("ALPHA").value))


@fam.rule
def assignment(c: Children) -> tuple:
    col, value = c.values(2)
    return (col, value)


@fam.rule
def loose_option(c: Children) -> LooseOption:
    if c.clauses:  # AT LAYER n
        return LooseOption(name="layer", value=c.clauses[0].value)
    name, *value = c.values()
    return LooseOption(name=name.value.lower(), value=value[0] if value else None)



# ---- statements -------------------------------------------------------------------------

_EDITS_KNOWLEDGE = "it edits knowledge (and this build has no patch overlay)"


class ShowPatches(ast.Statement):
    keyword: ClassVar[str] = "SHOW PATCHES"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    kind: Literal["show_patches"] = "show_patches"


class KnowledgeEdit(ast.Statement):
    """A knowledge edit of the reference dialect. Each parses into its own class and is refused
    at planning: this build has no patch overlay."""

    verb: ClassVar[str] = ""  # what it does, for the refusal
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = _EDITS_KNOWLEDGE


class InsertEdges(KnowledgeEdit):
    keyword: ClassVar[str] = "INSERT"
    verb: ClassVar[str] = "edits knowledge through a patch overlay"
    kind: Literal["insert_edges"] = "insert_edges"
    columns: list[ast.Column]
    values: list[str | int | float]
    layer: int | None = None
    confidence: float | None = None
    alpha: float | None = None
    mode: str | None = None


class DeleteEdges(KnowledgeEdit):
    keyword: ClassVar[str] = "DELETE"
    verb: ClassVar[str] = "edits knowledge through a patch overlay"
    kind: Literal["delete_edges"] = "delete_edges"
    where: list[ast.Condition] = Field(default_factory=list)


class UpdateEdges(KnowledgeEdit):
    keyword: ClassVar[str] = "UPDATE"
    verb: ClassVar[str] = "edits knowledge through a patch overlay"
    kind: Literal["update_edges"] = "update_edges"
    assignments: list[tuple[ast.Column, str | int | float]]
    where: list[ast.Condition] = Field(default_factory=list)


class Merge(KnowledgeEdit):
    keyword: ClassVar[str] = "MERGE"
    verb: ClassVar[str] = "merges another set of edits through a patch overlay"
    paths: ClassVar[tuple[str, ...]] = ("src", "into")
    kind: Literal["merge"] = "merge"
    src: str
    into: str | None = None
    on_conflict: str | None = None


class BeginPatch(KnowledgeEdit):
    keyword: ClassVar[str] = "BEGIN PATCH"
    verb: ClassVar[str] = "opens a patch overlay"
    paths: ClassVar[tuple[str, ...]] = ("path",)
    kind: Literal["begin_patch"] = "begin_patch"
    path: str


class SavePatch(KnowledgeEdit):
    keyword: ClassVar[str] = "SAVE PATCH"
    verb: ClassVar[str] = "writes the open patch overlay to its file"
    kind: Literal["save_patch"] = "save_patch"


class ApplyPatch(KnowledgeEdit):
    keyword: ClassVar[str] = "APPLY PATCH"
    verb: ClassVar[str] = "applies a patch overlay"
    paths: ClassVar[tuple[str, ...]] = ("path",)
    kind: Literal["apply_patch"] = "apply_patch"
    path: str


class RemovePatch(KnowledgeEdit):
    keyword: ClassVar[str] = "REMOVE PATCH"
    verb: ClassVar[str] = "removes an applied patch overlay"
    paths: ClassVar[tuple[str, ...]] = ("path",)
    kind: Literal["remove_patch"] = "remove_patch"
    path: str


class LooseOption(ast.Node):
    """An option of REBALANCE or COMPACT MINOR | MAJOR as written (name and value)."""

    name: str
    value: str | int | float | None = None


class Rebalance(KnowledgeEdit):
    keyword: ClassVar[str] = "REBALANCE"
    verb: ClassVar[str] = "rebalances the edits held in a patch overlay"
    kind: Literal["rebalance"] = "rebalance"
    options: list[LooseOption] = Field(default_factory=list)


class CompactLevel(KnowledgeEdit):
    keyword: ClassVar[str] = "COMPACT"
    verb: ClassVar[str] = "folds a patch overlay's edits into the base model"
    kind: Literal["compact_level"] = "compact_level"
    level: Literal["minor", "major"]
    options: list[LooseOption] = Field(default_factory=list)


#: The knowledge edits (refused at planning in this build).
KNOWLEDGE_EDITS: tuple[type[KnowledgeEdit], ...] = (
    InsertEdges, DeleteEdges, UpdateEdges, Merge, BeginPatch, SavePatch, ApplyPatch, RemovePatch, Rebalance,
    CompactLevel,
)


# ---- plans ------------------------------------------------------------------------------


def knowledge_edit_refusal(s: KnowledgeEdit) -> str:
    """Why a knowledge edit is refused, naming it (also HELP's words)."""
    name = f"COMPACT {s.level.upper()}" if isinstance(s, CompactLevel) else s.keyword
    return f"{name} {s.verb}, which this build does not have yet"


def plan_knowledge_edit(s: KnowledgeEdit, ctx: Context) -> Node:
    raise err(s, knowledge_edit_refusal(s), hint="SHOW PATCHES says what this build has")


for _cls in KNOWLEDGE_EDITS:
    fam.plans(_cls)(plan_knowledge_edit)


@fam.plans(ShowPatches)
def plan_show_patches(s: ShowPatches, ctx: Context) -> Node:
    return NotePlan(s, topic="patches", lines=(
        "no patches: this build has no patch overlay, so no patch is open, applied or saved",
        "the knowledge edits (INSERT, DELETE, UPDATE, MERGE, BEGIN / SAVE / APPLY / REMOVE PATCH) are refused by name"))
