"""Knowledge edits (vindex3.edits): INSERT, DELETE and UPDATE on the open patch's edits, patches
(BEGIN, SAVE, APPLY, REMOVE, SHOW PATCHES), SCORE EDITS; MERGE, REBALANCE and COMPACT MINOR |
MAJOR are refused by name.

Edits live in patches, an overlay over the bound container that never modifies it: the session
runs on the container seen through every active patch (`vindex3.edits.EditedModel`), so INFER,
GENERATE and the other statements that run the model see the edits. One active patch is open
for writing: INSERT opens one named 'session' when none is. A patch file records the digest of
the container it was made on; APPLY PATCH refuses it on any other, by name."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, ValidationError

from .. import ast, files
from ..errors import StatementError
from ..planner import Context, Node, depth_of, err, may_overwrite
from ..registry import family
from ..results import Result
from ..syntax import BuildError, Children, Clause
from ..text import fields, table

fam = family("edits", module=__name__, statements=(
    "insert_edges", "delete_edges", "update_edges", "merge_stmt", "begin_patch", "save_patch", "apply_patch",
    "remove_patch", "rebalance", "compact_level", "show_patches", "score_edits"),
    path_keywords=("APPLY", "ON"), grammar=r"""
insert_edges: INSERT INTO EDGES _LPAR column (_COMMA column)* _RPAR VALUES _LPAR literal (_COMMA literal)* _RPAR insert_option*
delete_edges: DELETE FROM EDGES [where_clause]
update_edges: UPDATE EDGES SET assignment (_COMMA assignment)* [where_clause]
merge_stmt: MERGE STRING [INTO STRING] [on_conflict_clause]
begin_patch: BEGIN PATCH STRING
save_patch: SAVE PATCH [INTO STRING] [overwrite_clause]
apply_patch: APPLY PATCH STRING
remove_patch: REMOVE PATCH STRING
rebalance: REBALANCE loose_option*
compact_level: COMPACT (MINOR | MAJOR) loose_option*
show_patches: SHOW PATCHES
score_edits: SCORE EDITS ON STRING insert_option*

?insert_option: at_layer_clause
              | layers_clause
              | confidence_clause
              | alpha_clause
              | mode_clause
              | template_clause
              | corpus_clause
              | preserve_clause
confidence_clause: CONFIDENCE _number
alpha_clause: ALPHA _number
template_clause: TEMPLATE STRING
corpus_clause: CORPUS STRING
preserve_clause: PRESERVE STRING
_number: INT | FLOAT
assignment: column _EQ literal
loose_option: NAME [literal]
            | at_layer_clause
""")

fam.doc('SHOW PATCHES',
        'SHOW PATCHES',
        "the active patches (the overlay over the open container) and their edits: mode, layers, vectors, fit",
        'SHOW PATCHES;', order=340)
fam.doc('INSERT',
        "INSERT INTO EDGES (entity, relation, target) | (prompt, target [, entity]) VALUES (...) "
        "[TEMPLATE 'The {entity} is in'] [AT LAYER n | LAYERS a-b] [MODE KNN | COMPOSE | MEMIT] [CONFIDENCE p] "
        "[ALPHA cos] [CORPUS 'bank.jsonl'] [PRESERVE 'kept.jsonl']",
        "write a fact into the open patch: MEMIT (rank-one weight terms keyed at the entity's last token, its value "
        "fitted by gradient; at the prompt's last token when no entity is named; PRESERVE keeps the keys of a named "
        "file's held-out {prompt, subject} lines in place), COMPOSE (one FFN feature) or KNN "
        "(a retrieval overlay: no weight changes; the default, as in the reference)",
        "INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Rome') MODE MEMIT;", order=380)
fam.doc('DELETE',
        'DELETE FROM EDGES [WHERE ...]',
        "remove the open patch's edits that match (columns: id, entity, relation, prompt, target, mode, layer)",
        "DELETE FROM EDGES WHERE target = ' Rome';", order=390)
fam.doc('UPDATE',
        "UPDATE EDGES SET target = 'x' [WHERE ...]",
        "refit the open patch's edits that match with a new target (same prompt, mode and layers)",
        "UPDATE EDGES SET target = ' Paris' WHERE id = 1;", order=400)
fam.doc('MERGE',
        "MERGE 'source' [INTO 'target'] [ON CONFLICT name]",
        "refused: MERGE merges another vindex's knowledge graph; this build's edits travel as patches (APPLY PATCH)",
        'SHOW PATCHES;', order=410)
fam.doc('BEGIN PATCH',
        "BEGIN PATCH 'name' | SAVE PATCH [INTO 'p.vlp'] | APPLY PATCH 'p.vlp' | REMOVE PATCH 'name'",
        "patches: open one for writing, save it (bound to this container's digest), apply a saved one (refused "
        "on any other container), remove one",
        "BEGIN PATCH 'facts.vlp';", order=420, aliases=('SAVE PATCH', 'APPLY PATCH', 'REMOVE PATCH', 'PATCH'))
fam.doc('SCORE EDITS',
        "SCORE EDITS ON 'edits.jsonl' [MODE m [AT LAYER n | LAYERS a-b]] [CORPUS 'bank.jsonl'] [PRESERVE 'kept.jsonl']",
        "CounterFact metrics of the current overlay (or, with MODE, of the file's edits fitted together on top of "
        "it, then dropped): efficacy, paraphrase, neighborhood, target probability and rank, prompt-bank KL; "
        "under the session's DRAFT DEPTH d it scores the draft at d, its KL against the base model's draft at d",
        "SCORE EDITS ON 'edits.jsonl';", order=425)
fam.doc('REBALANCE',
        'REBALANCE [options]',
        "refused: REBALANCE rescales the reference's inserted features together, which this build does not do "
        "(each COMPOSE edit is rescaled when it is fitted)",
        'SHOW PATCHES;', order=430)
fam.doc('COMPACT MINOR',
        'COMPACT MINOR | MAJOR [options]',
        "refused: COMPACT MINOR | MAJOR fold edits into the container in place, and a container is never modified "
        "(COMPILE CURRENT INTO VINDEX 'dir' writes the edited model as a new container; COMPACT INTO 'dir' is "
        "this build's COMPACT)",
        'SHOW COMPACT STATUS;', order=440, aliases=('COMPACT MAJOR',))


@fam.rule
def insert_edges(c: Children) -> InsertEdges:
    # INSERT INTO EDGES ( columns ) VALUES ( literals ) insert_option*
    columns, values = c.all("INSERT", "INTO", "EDGES"), c.all("VALUES")
    fields_ = c.options("INSERT")
    if "at_layer" in fields_:
        fields_["layer"] = fields_.pop("at_layer")
    if len(columns) != len(values):
        raise BuildError(f"INSERT names {len(columns)} columns and gives {len(values)} values", c.keyword("VALUES"),
                         hint="give one value per column")
    return InsertEdges(columns=columns, values=values, **fields_)


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
    return SavePatch(into=c.string("INTO"), overwrite=bool(c.options("SAVE").get("overwrite")))


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
def score_edits(c: Children) -> ScoreEdits:
    opts = c.options("SCORE")
    if "at_layer" in opts:
        opts["layer"] = opts.pop("at_layer")
    return ScoreEdits(path=c.string("ON"), **opts)


@fam.rule
def confidence_clause(c: Children) -> Clause:
    return c.clause("confidence", float(c.get("CONFIDENCE").value))


@fam.rule
def alpha_clause(c: Children) -> Clause:
    return c.clause("alpha", float(c.get("ALPHA").value))


@fam.rule
def template_clause(c: Children) -> Clause:
    return c.clause("template", c.string("TEMPLATE"))


@fam.rule
def corpus_clause(c: Children) -> Clause:
    return c.clause("corpus", c.string("CORPUS"))


@fam.rule
def preserve_clause(c: Children) -> Clause:
    return c.clause("preserve", c.string("PRESERVE"))


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

_EDITS = "it changes the session's edit overlay (the container itself is never modified)"


class EditStatement(ast.Statement):
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = _EDITS
    needs_container: ClassVar[bool] = True


class ShowPatches(ast.Statement):
    keyword: ClassVar[str] = "SHOW PATCHES"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    kind: Literal["show_patches"] = "show_patches"


class InsertEdges(EditStatement):
    keyword: ClassVar[str] = "INSERT"
    paths: ClassVar[tuple[str, ...]] = ("corpus", "preserve")
    kind: Literal["insert_edges"] = "insert_edges"
    columns: list[ast.Column]
    values: list[str | int | float]
    layer: int | None = None
    layers: tuple[int, int] | None = None
    confidence: float | None = None
    alpha: float | None = None
    mode: str | None = None
    template: str | None = None
    corpus: str | None = None  # a JSONL prompt bank for the fit's corpus statistics (default: the frozen bank)
    preserve: str | None = None  # MEMIT: a JSONL of {prompt, subject} whose subject keys the closed form keeps


class DeleteEdges(EditStatement):
    keyword: ClassVar[str] = "DELETE"
    kind: Literal["delete_edges"] = "delete_edges"
    where: list[ast.Condition] = Field(default_factory=list)


class UpdateEdges(EditStatement):
    keyword: ClassVar[str] = "UPDATE"
    kind: Literal["update_edges"] = "update_edges"
    assignments: list[tuple[ast.Column, str | int | float]]
    where: list[ast.Condition] = Field(default_factory=list)


class BeginPatch(EditStatement):
    keyword: ClassVar[str] = "BEGIN PATCH"
    kind: Literal["begin_patch"] = "begin_patch"
    path: str  # the patch's name (a .vlp name is also where SAVE PATCH writes it)


class SavePatch(EditStatement):
    keyword: ClassVar[str] = "SAVE PATCH"
    paths: ClassVar[tuple[str, ...]] = ("into",)
    read_only: ClassVar[bool | str] = "it writes a patch file"
    kind: Literal["save_patch"] = "save_patch"
    into: str | None = None
    overwrite: bool = False


class ApplyPatch(EditStatement):
    keyword: ClassVar[str] = "APPLY PATCH"
    paths: ClassVar[tuple[str, ...]] = ("path",)
    kind: Literal["apply_patch"] = "apply_patch"
    path: str


class RemovePatch(EditStatement):
    keyword: ClassVar[str] = "REMOVE PATCH"
    kind: Literal["remove_patch"] = "remove_patch"
    path: str  # a patch's name (or the file it was applied from or saved to)


class ScoreEdits(ast.Statement):
    keyword: ClassVar[str] = "SCORE EDITS"
    paths: ClassVar[tuple[str, ...]] = ("path", "corpus", "preserve")
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["score_edits"] = "score_edits"
    path: str
    layer: int | None = None
    layers: tuple[int, int] | None = None
    confidence: float | None = None
    alpha: float | None = None
    mode: str | None = None
    template: str | None = None
    corpus: str | None = None  # a JSONL prompt bank for the fit's corpus statistics (default: the frozen bank)
    preserve: str | None = None  # MEMIT: a JSONL of {prompt, subject} whose subject keys the closed form keeps


class LooseOption(ast.Node):
    """An option of REBALANCE or COMPACT MINOR | MAJOR as written (name and value)."""

    name: str
    value: str | int | float | None = None


class KnowledgeEdit(ast.Statement):
    """A statement of the reference dialect this build refuses by name (``why``)."""

    verb: ClassVar[str] = ""
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = "it edits knowledge"


class Merge(KnowledgeEdit):
    keyword: ClassVar[str] = "MERGE"
    verb: ClassVar[str] = ("merges another vindex's knowledge graph into this one; this build's edits travel as "
                           "patches bound to the container they were made on")
    paths: ClassVar[tuple[str, ...]] = ("src", "into")
    kind: Literal["merge"] = "merge"
    src: str
    into: str | None = None
    on_conflict: str | None = None


class Rebalance(KnowledgeEdit):
    keyword: ClassVar[str] = "REBALANCE"
    verb: ClassVar[str] = ("rescales the reference's inserted features together until each lands in a probability "
                           "range; this build rescales each COMPOSE edit when it is fitted, and does not rescale "
                           "them together")
    kind: Literal["rebalance"] = "rebalance"
    options: list[LooseOption] = Field(default_factory=list)


class CompactLevel(KnowledgeEdit):
    keyword: ClassVar[str] = "COMPACT"
    verb: ClassVar[str] = ("folds edits into the container in place, and a container is never modified: COMPILE "
                           "CURRENT INTO VINDEX 'dir' writes the edited model as a new container")
    kind: Literal["compact_level"] = "compact_level"
    level: Literal["minor", "major"]
    options: list[LooseOption] = Field(default_factory=list)


#: What this build refuses by name.
KNOWLEDGE_EDITS: tuple[type[KnowledgeEdit], ...] = (Merge, Rebalance, CompactLevel)


def knowledge_edit_refusal(s: KnowledgeEdit) -> str:
    name = f"COMPACT {s.level.upper()}" if isinstance(s, CompactLevel) else s.keyword
    return f"{name} {s.verb}"


def plan_knowledge_edit(s: KnowledgeEdit, ctx: Context) -> Node:
    raise err(s, knowledge_edit_refusal(s), hint="SHOW PATCHES lists the edits this session holds")


for _cls in KNOWLEDGE_EDITS:
    fam.plans(_cls)(plan_knowledge_edit)


# ---- the session's patches ------------------------------------------------------------------

#: relation -> prompt template ({entity} is replaced), for INSERT (entity, relation, target)
TEMPLATES: dict[str, str] = {
    "located-in": "The {entity} is located in",
    "capital": "The capital of {entity} is",
    "capital-of": "{entity} is the capital of",
    "language": "The official language of {entity} is",
    "currency": "The currency of {entity} is the",
    "author": "{entity} was written by",
    "born-in": "{entity} was born in",
    "continent": "{entity} is a country in",
    "occupation": "{entity} works as a",
}

MAX_TEMPLATE_BYTES = 1 << 20


def templates(s, ctx: Context) -> dict[str, str]:
    """The relation templates INSERT reads: the built-in ones, then SET templates' file over them
    (read at each INSERT; every entry must be text with an {entity} to fill, else refused by name)."""
    path = ctx.settings.templates
    if path is None:
        return dict(TEMPLATES)
    from vindex3 import jsonio
    from vindex3.paths import read_regular

    data = read_regular(files.input_file(path, "templates file"), "templates file", max_bytes=MAX_TEMPLATE_BYTES)
    obj = jsonio.loads(jsonio.decode_text(data, path), source=path)
    if not isinstance(obj, dict):
        raise err(s, f"SET templates: {path} holds a JSON {type(obj).__name__}, not an object of relation -> template")
    for k, v in obj.items():
        if not isinstance(v, str) or "{entity}" not in v:
            raise err(s, f"SET templates: {path}: relation {k!r}'s template {v!r} is not text with an {{entity}} to fill")
    return {**TEMPLATES, **obj}


MODES = ("knn", "compose", "memit")
LAST_TOKEN_NOTE = ("MODE MEMIT keyed at the prompt's last token: the INSERT names no entity, so there is no subject to "
                   "key at (name one: (prompt, target, entity) or (entity, relation, target))")
EDGE_COLUMNS = ("id", "entity", "relation", "prompt", "target", "original", "mode", "layer", "patch")


class EditState:
    """The patches of a session's bound container: every active patch, in order, and the one open
    for writing. Belongs to one container; a new binding starts afresh."""

    def __init__(self, base):
        self.base = base
        self.active: list = []  # vindex3.edits.Patch
        self.open_name: str | None = None
        self.sources: dict[str, str] = {}  # patch name -> file it was applied from or saved to

    def open_patch(self):
        return next((p for p in self.active if p.name == self.open_name), None)

    def find(self, name: str):
        return next((p for p in self.active if p.name == name or self.sources.get(p.name) == name), None)

    def begin(self, name: str):
        from vindex3.edits import Patch

        p = self.find(name)
        if p is None:
            p = Patch(name=name, base_digest=self.base.digest, base_name=self.base.name,
                      provenance={"base": self.base.name, "base_digest": self.base.digest})
            self.active.append(p)
        self.open_name = p.name
        return p

    def model(self):
        from vindex3.edits import EditedModel

        if not any(p.edits for p in self.active):
            return self.base
        return EditedModel(self.base, self.active)


def edit_state(session) -> EditState:
    st = getattr(session, "_edit_state", None)
    if st is None or st.base is not session.base_container:
        st = EditState(session.base_container)
        session._edit_state = st
    return st


def _refresh(session, st: EditState) -> None:
    """Run the session on the container seen through the active patches (a fresh set of executors)."""
    session.container = st.model()
    session._executors = {}


def _writable(session) -> EditState:
    from vindex3.shards import ShardedModel

    if isinstance(session.container, ShardedModel):
        raise StatementError("edits run in this process, and the model runs as shards", hint="SET shards = 0")
    return edit_state(session)


# ---- INSERT / DELETE / UPDATE ------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class InsertPlan(Node):
    prompt: str
    target: str
    entity: str | None
    relation: str | None
    mode: str
    layers: tuple[int, ...] | None
    confidence: float | None
    alpha: float | None
    corpus: str | None = None
    preserve: str | None = None


def _mode_and_layers(s, ctx: Context) -> tuple[str, tuple[int, ...] | None, dict]:
    mode = (s.mode or "knn").lower()
    if mode not in MODES:
        raise err(s, f"MODE {mode.upper()} is not an edit mode", hint="MODE KNN, MODE COMPOSE or MODE MEMIT")
    if s.layer is not None and s.layers is not None:
        raise err(s, f"{s.keyword} takes AT LAYER n or LAYERS a-b, not both")
    layers = (s.layer,) if s.layer is not None else tuple(range(s.layers[0], s.layers[1] + 1)) if s.layers else None
    if s.layers is not None and s.layers[1] < s.layers[0]:
        raise err(s, f"LAYERS {s.layers[0]}-{s.layers[1]} runs backwards", hint="LAYERS a-b with a <= b")
    n = ctx.catalog.num_layers if ctx.bound else None
    for i in layers or ():
        if n is not None and not 0 <= i < n:
            raise err(s, f"{s.keyword} names layer {i}, but the model has {n} layers (0..{n - 1})")
    if layers and len(layers) > 1 and mode != "memit":
        raise err(s, f"MODE {mode.upper()} writes at one layer; LAYERS {layers[0]}-{layers[-1]} names several",
                  hint="AT LAYER n, or MODE MEMIT for a range")
    knobs: dict = {}
    if s.confidence is not None:
        if mode == "knn":
            raise err(s, "CONFIDENCE is the probability a weight edit aims for; MODE KNN (a retrieval overlay) "
                         "answers with probability 1 wherever its key fires", hint="ALPHA sets KNN's cosine threshold")
        if not 0 < s.confidence < 1:
            raise err(s, f"CONFIDENCE {s.confidence:g} is not a probability between 0 and 1")
        knobs["confidence"] = s.confidence
    if s.alpha is not None:
        if mode != "knn":
            raise err(s, f"ALPHA is MODE KNN's cosine threshold; MODE {mode.upper()} has none",
                      hint="CONFIDENCE sets the probability a weight edit aims for")
        if not -1 < s.alpha < 1:
            raise err(s, f"ALPHA {s.alpha:g} is not a cosine between -1 and 1")
        knobs["alpha"] = s.alpha
    return mode, layers, knobs


def _settings(mode: str, confidence: float | None, alpha: float | None, corpus: str | None = None,
              preserve: str | None = None):
    from vindex3.edits import FitSettings

    st = FitSettings(corpus=corpus, preserve=preserve)
    if alpha is not None:
        st.threshold = alpha
    if confidence is not None:
        if mode == "compose":
            st.floor = confidence
            st.ceiling = max(st.ceiling, confidence)
        else:
            st.goal = confidence
    return st


@fam.plans(InsertEdges)
def plan_insert(s: InsertEdges, ctx: Context) -> Node:
    cols = [c.name for c in s.columns]
    for c in cols:
        if c not in ("entity", "relation", "target", "prompt", "confidence"):
            raise err(s, f"INSERT INTO EDGES has no column {c!r}",
                      hint="(entity, relation, target) or (prompt, target [, entity])")
    row = dict(zip(cols, s.values))
    for c, v in row.items():
        if c != "confidence" and not isinstance(v, str):
            raise err(s, f"INSERT: {c} must be text, got {v!r}")
    if "confidence" in row:
        raise err(s, "INSERT: a confidence column is the reference's edge weight, which an edit here does not "
                     "carry", hint="CONFIDENCE p after VALUES sets the probability a weight edit aims for")
    mode, layers, knobs = _mode_and_layers(s, ctx)
    if "target" not in row:
        raise err(s, "INSERT INTO EDGES needs a target column")
    if "prompt" in row:
        if "relation" in row or s.template is not None:
            raise err(s, "INSERT takes (prompt, target [, entity]) or (entity, relation, target), not both")
        # an entity beside a prompt names the subject MODE MEMIT keys at (it must occur in the prompt)
        prompt, entity, relation = row["prompt"], row.get("entity"), None
    else:
        if "entity" not in row or "relation" not in row:
            raise err(s, "INSERT INTO EDGES needs (entity, relation, target) or (prompt, target)")
        entity, relation = row["entity"], row["relation"]
        known = templates(s, ctx)
        template = s.template or known.get(relation)
        if template is None:
            raise err(s, f"INSERT: relation {relation!r} has no prompt template (known: {', '.join(sorted(known))})",
                      hint="add TEMPLATE 'The {entity} is located in', or SET templates = 'templates.json'")
        if "{entity}" not in template:
            raise err(s, f"TEMPLATE {template!r} has no {{entity}} to fill")
        prompt = template.replace("{entity}", entity)
    target = row["target"]
    if not target.strip():
        raise err(s, "INSERT: the target is empty")
    if not target.startswith(" ") and not prompt.endswith(" "):
        target = " " + target  # the word follows the prompt after a space, as written in a sentence
    if s.corpus is not None:
        files.input_file(s.corpus, "corpus")
    _check_preserve(s, mode)
    return InsertPlan(s, prompt=prompt, target=target, entity=entity, relation=relation, mode=mode,
                      layers=layers, confidence=knobs.get("confidence"), alpha=knobs.get("alpha"), corpus=s.corpus,
                      preserve=s.preserve)


def _check_preserve(s, mode: str | None) -> None:
    if s.preserve is None:
        return
    if mode != "memit":
        raise err(s, f"PRESERVE names keys MEMIT's closed form keeps; MODE {(mode or 'none').upper()} has no closed form",
                  hint="MODE MEMIT ... PRESERVE 'kept.jsonl'")
    files.input_file(s.preserve, "preservation corpus")


class EditRow(BaseModel):
    patch: str
    id: int
    mode: str  # as labelled: "KNN (retrieval overlay)", "COMPOSE", "MEMIT"
    entity: str | None
    relation: str | None
    prompt: str | None  # None: a values edit (DIFF INTO PATCH) answers no prompt
    target: str | None
    original: str | None
    layers: list[int]
    writes: int
    vectors: int
    fit: dict


def _rows(patches) -> list[EditRow]:
    return [EditRow(patch=p.name, id=e.id, mode=e.label, entity=e.entity, relation=e.relation, prompt=e.prompt,
                    target=e.target, original=e.original, layers=list(e.layers), writes=len(e.writes),
                    vectors=e.vectors(), fit=e.fit)
            for p in patches for e in p.edits]


class EditsResult(Result):
    kind: Literal["edits"] = "edits"
    action: str
    patch: str | None
    edits: list[EditRow]
    notes: list[str] = Field(default_factory=list)


@fam.runs(InsertPlan)
def run_insert(session, node: InsertPlan) -> EditsResult:
    from vindex3.edits.fit import make_edits, request

    st = _writable(session)
    notes = []
    if st.open_patch() is None:
        st.begin("session")
        notes.append("no patch was open: opened patch 'session' (BEGIN PATCH 'name' names one)")
    patch = st.open_patch()
    model = st.model()
    req = request(model, node.prompt, node.target, node.entity, node.relation)
    settings = _settings(node.mode, node.confidence, node.alpha, node.corpus, node.preserve)
    if node.mode == "memit" and node.entity is None:
        settings.key = "last-token"
        notes.append(LAST_TOKEN_NOTE)
    new = make_edits(model, patch, [req], node.mode, list(node.layers) if node.layers else None, settings)
    _refresh(session, st)
    if node.mode == "knn":
        notes.append("MODE KNN is a retrieval overlay: it changes no weight; where a prompt's residual is close "
                     "to the stored key, the next token is replaced with the target at probability 1")
    rows = [r for r in _rows([patch]) if r.id in {e.id for e in new}]
    return EditsResult(action="inserted", patch=patch.name, edits=rows, notes=notes)


def _check_where(s, conds) -> None:
    for c in conds:
        if c.column.name not in EDGE_COLUMNS:
            raise err(s, f"{s.keyword}: EDGES has no column {c.column.name!r} here (columns: {', '.join(EDGE_COLUMNS)})")


def _value(e, patch, col: str):
    if col == "mode":  # matched as written in a result too: 'KNN (retrieval overlay)'
        return e.label.lower()
    if col == "layer":
        return list(e.layers)
    if col == "patch":
        return patch.name
    return getattr(e, col)


def _holds(cond, v) -> bool:
    if isinstance(v, list):  # layer: any of the edit's layers
        return any(_holds(cond, x) for x in v)
    op, want = cond.op, cond.value
    if isinstance(v, str) and v in ("knn (retrieval overlay)", "compose", "memit", "values"):  # the mode column
        want = [w.lower() for w in want] if isinstance(want, list) else str(want).lower()
        if want == "knn" or (isinstance(want, list) and "knn" in want):
            want = [*want, "knn (retrieval overlay)"] if isinstance(want, list) else "knn (retrieval overlay)"
    if op == "IN":
        return any(v == w for w in want)
    if op == "LIKE":
        return isinstance(v, str) and fnmatch.fnmatchcase(v, str(want).replace("%", "*").replace("_", "?"))
    if v is None:
        return op == "!=" and want is not None
    try:
        return {"=": v == want, "!=": v != want, "<": v < want, "<=": v <= want, ">": v > want, ">=": v >= want}[op]
    except TypeError:
        return False


def _matching(st: EditState, conds) -> list:
    p = st.open_patch()
    if p is None:
        return []
    return [e for e in p.edits if all(_holds(c, _value(e, p, c.column.name)) for c in conds)]


@dataclass(frozen=True, eq=False)
class DeletePlan(Node):
    where: tuple


@fam.plans(DeleteEdges)
def plan_delete(s: DeleteEdges, ctx: Context) -> Node:
    _check_where(s, s.where)
    return DeletePlan(s, where=tuple(s.where))


@fam.runs(DeletePlan)
def run_delete(session, node: DeletePlan) -> EditsResult:
    st = _writable(session)
    p = st.open_patch()
    gone = _matching(st, node.where)
    rows = [r for r in _rows([p]) if r.id in {e.id for e in gone}] if p is not None else []
    if p is not None:
        p.edits = [e for e in p.edits if e not in gone]
        _refresh(session, st)
    notes = [] if p is not None else ["no patch is open, so there is nothing to delete (BEGIN PATCH 'name')"]
    if any(e.mode == "memit" for e in gone):
        notes.append("the other MEMIT edits keep their own rank-one terms, fitted with the deleted ones present")
    return EditsResult(action="deleted", patch=p.name if p else None, edits=rows, notes=notes)


@dataclass(frozen=True, eq=False)
class UpdatePlan(Node):
    target: str
    where: tuple


@fam.plans(UpdateEdges)
def plan_update(s: UpdateEdges, ctx: Context) -> Node:
    _check_where(s, s.where)
    target = None
    for col, value in s.assignments:
        if col.name != "target":
            raise err(s, f"UPDATE EDGES SET {col.name}: only the target of an edit can be changed (it is refitted)",
                      hint="UPDATE EDGES SET target = 'x' WHERE ...")
        if not isinstance(value, str) or not value.strip():
            raise err(s, f"UPDATE EDGES SET target: {value!r} is not a word")
        target = value
    return UpdatePlan(s, target=target, where=tuple(s.where))


@fam.runs(UpdatePlan)
def run_update(session, node: UpdatePlan) -> EditsResult:
    from vindex3.edits.fit import make_edits, request

    st = _writable(session)
    p = st.open_patch()
    hit = _matching(st, node.where)
    copied = [e for e in hit if e.mode == "values"]
    if copied:
        raise StatementError(f"UPDATE EDGES: edit {copied[0].id} holds tensor values copied by DIFF INTO PATCH and "
                             "answers no prompt, so it has no target to refit", hint="add WHERE mode != 'values'")
    done = []
    for e in hit:
        target = node.target if node.target.startswith(" ") or e.prompt.endswith(" ") else " " + node.target
        p.edits = [x for x in p.edits if x is not e]
        model = st.model()
        req = request(model, e.prompt, target, e.entity, e.relation)
        settings = _settings(e.mode, None, None)
        for k, v in (e.fit.get("settings") or {}).items():
            setattr(settings, k, v)
        for k, v in (e.fit.get("value_fit") or {}).items():
            setattr(settings, k, v)
        if e.mode == "memit":
            settings.key = e.fit.get("key", "last-token")  # a MEMIT edit with no key record predates subject keys
        new = make_edits(model, p, [req], e.mode, list(e.layers), settings)
        new[0].id = e.id
        done.append(e.id)
    if p is not None:
        p.edits.sort(key=lambda x: x.id)
        _refresh(session, st)
    rows = [r for r in _rows([p]) if r.id in done] if p is not None else []
    return EditsResult(action="updated", patch=p.name if p else None, edits=rows,
                       notes=[] if p is not None else ["no patch is open, so there is nothing to update"])


# ---- patches -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class PatchPlan(Node):
    action: str
    path: str | None
    overwrite: bool = False


@fam.plans(BeginPatch)
def plan_begin(s: BeginPatch, ctx: Context) -> Node:
    if not s.path.strip():
        raise err(s, "BEGIN PATCH needs a name", hint="BEGIN PATCH 'facts.vlp'")
    return PatchPlan(s, action="begin", path=s.path)


@fam.plans(SavePatch)
def plan_save(s: SavePatch, ctx: Context) -> Node:
    overwrite = may_overwrite(s, ctx)
    if s.into is not None:
        files.output_file(s.into, "patch file", overwrite=overwrite, inside=files.container_paths(ctx.catalog))
    return PatchPlan(s, action="save", path=s.into, overwrite=overwrite)


@fam.plans(ApplyPatch)
def plan_apply(s: ApplyPatch, ctx: Context) -> Node:
    files.input_file(s.path, "patch file")
    return PatchPlan(s, action="apply", path=s.path)


@fam.plans(RemovePatch)
def plan_remove(s: RemovePatch, ctx: Context) -> Node:
    return PatchPlan(s, action="remove", path=s.path)


@fam.plans(ShowPatches)
def plan_show_patches(s: ShowPatches, ctx: Context) -> Node:
    return PatchPlan(s, action="show", path=None)


class PatchesResult(Result):
    kind: Literal["patches"] = "patches"
    action: str
    container: str | None
    patches: list[dict]  # name, edits, open, source
    edits: list[EditRow]
    path: str | None = None
    notes: list[str] = Field(default_factory=list)


MAX_PATCH_BYTES = 256 << 20


def load_patch(path: str):
    from vindex3 import jsonio
    from vindex3.edits import Patch
    from vindex3.errors import ConfigError
    from vindex3.paths import existing_file, read_regular

    data = read_regular(existing_file(path, "patch file"), "patch file", max_bytes=MAX_PATCH_BYTES)
    obj = jsonio.loads(jsonio.decode_text(data, path), source=path)
    if not isinstance(obj, dict) or obj.get("format") != "vindex3-patch":
        raise ConfigError(f"{path} is not a patch file (no \"format\": \"vindex3-patch\")")
    try:
        return Patch.model_validate(obj)
    except ValidationError as e:
        first = e.errors()[0]
        raise ConfigError(f"{path}: {'.'.join(str(x) for x in first['loc']) or 'patch'}: {first['msg']}") from None


@fam.runs(PatchPlan)
def run_patch(session, node: PatchPlan) -> PatchesResult:
    from vindex3 import jsonio
    from vindex3.edits import check_base

    if session.base_container is None:
        return PatchesResult(action=node.action, container=None, patches=[], edits=[],
                             notes=["no container is open, so no patch is active"])
    st = edit_state(session) if node.action == "show" else _writable(session)
    notes: list[str] = []
    path = None
    if node.action == "begin":
        existed = st.find(node.path) is not None
        st.begin(node.path)
        notes.append(f"patch {node.path!r} is open for writing" + (" again" if existed else ""))
    elif node.action == "save":
        p = st.open_patch()
        if p is None:
            raise StatementError("SAVE PATCH saves the open patch, and none is open",
                                 hint="BEGIN PATCH 'name' and INSERT first")
        dest = node.path or (p.name if p.name.endswith(".vlp") else None)
        if dest is None:
            raise StatementError(f"SAVE PATCH: patch {p.name!r} is not named after a file",
                                 hint="SAVE PATCH INTO 'file.vlp'")
        out = files.output_file(dest, "patch file", overwrite=node.overwrite or node.path is None,
                                inside=files.container_paths(session.base_container))
        jsonio.write_atomic(out, p.model_dump(mode="json"))
        st.sources[p.name] = dest
        path = str(out)
        notes.append(f"bound to {p.base_name} (digest {p.base_digest[:16]}…): APPLY PATCH refuses it on any other container")
    elif node.action == "apply":
        p = load_patch(node.path)
        check_base(p, st.base, f" in {node.path}")
        if st.find(p.name) is not None:
            raise StatementError(f"APPLY PATCH: a patch named {p.name!r} is already active",
                                 hint=f"REMOVE PATCH '{p.name}' first")
        st.active.append(p)
        st.sources[p.name] = node.path
        path = node.path
        notes.append(f"applied {len(p.edits)} edit(s) from {node.path}")
    elif node.action == "remove":
        p = st.find(node.path)
        if p is None:
            names = ", ".join(repr(x.name) for x in st.active) or "none"
            raise StatementError(f"REMOVE PATCH: no active patch is named {node.path!r} (active: {names})")
        st.active = [x for x in st.active if x is not p]
        if st.open_name == p.name:
            st.open_name = None
        notes.append(f"removed patch {p.name!r} ({len(p.edits)} edit(s))")
    if node.action != "show":
        _refresh(session, st)
    if not st.active:
        notes.append("no patches: the session runs the container as it is on disk")
    elif any(e.mode == "knn" for p in st.active for e in p.edits):
        notes.append("KNN edits are a retrieval overlay: they change no weight")
    pats = [{"name": p.name, "edits": len(p.edits), "open": p.name == st.open_name, "source": st.sources.get(p.name),
             "base_digest": p.base_digest[:16]} for p in st.active]
    return PatchesResult(action=node.action, container=st.base.name, patches=pats, edits=_rows(st.active), path=path,
                         notes=notes)


# ---- SCORE EDITS ---------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class ScorePlan(Node):
    path: str
    mode: str | None
    layers: tuple[int, ...] | None
    confidence: float | None
    alpha: float | None
    corpus: str | None = None
    preserve: str | None = None
    depth: int | None = None  # the session's DRAFT DEPTH: both the edited and the base model run Draft(depth)


@fam.plans(ScoreEdits)
def plan_score(s: ScoreEdits, ctx: Context) -> Node:
    files.input_file(s.path, "edits file")
    if s.template is not None:
        raise err(s, "SCORE EDITS: the edits file gives each prompt; TEMPLATE has nothing to fill")
    if s.mode is None and (s.layer is not None or s.layers is not None or s.confidence is not None or s.alpha is not None):
        raise err(s, "SCORE EDITS: AT LAYER, LAYERS, CONFIDENCE and ALPHA say how to fit the file's edits, and "
                     "without MODE nothing is fitted", hint="add MODE MEMIT (or COMPOSE, KNN)")
    mode, layers, knobs = _mode_and_layers(s, ctx) if s.mode is not None else (None, None, {})
    if s.corpus is not None:
        files.input_file(s.corpus, "corpus")
    _check_preserve(s, mode)
    # the session's DRAFT DEPTH d scores the draft (the edited model's and, for the KL, the base
    # model's, both at d): a draft reads edits at layers below d only. WITH ADAPTER is refused.
    depth = depth_of(ctx, None)
    if depth is not None and ctx.bound:
        ctx.catalog.bind_slice(depth)  # the same refusal as DRAFT DEPTH n for a depth the model lacks
    return ScorePlan(s, path=s.path, mode=mode, layers=layers, confidence=knobs.get("confidence"),
                     alpha=knobs.get("alpha"), corpus=s.corpus, preserve=s.preserve, depth=depth)


class ScoreRow(BaseModel):
    prompt: str
    target: str
    original: str
    efficacy: bool
    paraphrase: float | None
    neighborhood: float | None
    p_target: float
    rank: int
    retrieval_hits: int
    neighbors_edited: int = 0  # neighbors whose prompt the overlay edits: scored against that edit's target
    neighbors_undecidable: int = 0  # of those, left out: that target shares the case target's first token


class ScoreEditsResult(Result):
    kind: Literal["score_edits"] = "score_edits"
    path: str
    overlay: str
    fitted: str | None  # MODE ...: what was fitted for the score (then dropped)
    rows: list[ScoreRow]
    efficacy: float
    paraphrase: float | None
    neighborhood: float | None
    p_target: float
    kl: float | None
    kl_positions: int
    bank: str | None
    neighbors_edited: int = 0
    neighbors_undecidable: int = 0
    depth: int | None = None  # scored at the session's draft depth (edited and base drafts), else the full model


@fam.runs(ScorePlan)
def run_score(session, node: ScorePlan) -> ScoreEditsResult:
    from vindex3.edits import EditedModel, Patch
    from vindex3.edits.fit import make_edits, request
    from vindex3.edits.score import load_cases, score

    st = edit_state(session)
    cases = load_cases(node.path)
    model = st.model()
    fitted = None
    if node.mode is not None:
        scratch = Patch(name="(score)", base_digest=st.base.digest, base_name=st.base.name)
        settings = _settings(node.mode, node.confidence, node.alpha, node.corpus, node.preserve)
        subjects = all(c.subject for c in cases)
        if node.mode == "memit" and not subjects:
            settings.key = "last-token"
        make_edits(model, scratch, [request(model, c.prompt, c.target, c.subject) for c in cases], node.mode,
                   list(node.layers) if node.layers else None, settings)
        model = EditedModel(st.base, [*st.active, scratch])
        fitted = f"{len(cases)} edit(s) fitted together, MODE {scratch.edits[0].label}, layers {scratch.edits[0].layers}"
        if node.mode == "memit":
            fitted += (", keyed at each subject's last token" if subjects else
                       ", keyed at each prompt's last token (not every line names its subject)")
    ex = bex = None
    if node.depth is not None:
        from vindex3.exec.slice import Draft

        ex, bex = model.executor(slice=Draft(node.depth)), st.base.executor(slice=Draft(node.depth))
    r = score(st.base, model, cases, bank=node.corpus, executor=ex, base_executor=bex)
    return ScoreEditsResult(depth=node.depth, path=node.path, overlay=r.overlay, fitted=fitted,
                            rows=[ScoreRow(**c.model_dump()) for c in r.cases], efficacy=r.efficacy,
                            paraphrase=r.paraphrase, neighborhood=r.neighborhood, p_target=r.p_target, kl=r.kl,
                            kl_positions=r.kl_positions, bank=r.bank, neighbors_edited=r.neighbors_edited,
                            neighbors_undecidable=r.neighbors_undecidable)


# ---- SELECT ... FROM EDGES -----------------------------------------------------------------------

#: SELECT ... FROM EDGES: the columns, in SELECT *'s order
SELECT_COLUMNS = ("source", "id", "entity", "relation", "prompt", "target", "original", "mode", "layer", "score")


@dataclass(frozen=True, eq=False)
class SelectEdgesPlan(Node):
    columns: tuple[str, ...]
    where: tuple
    order_by: str | None
    descending: bool
    limit: int | None


def plan_select_edges(s, ctx: Context) -> Node:
    """SELECT ... FROM EDGES (the dialect family's statement): the active patches' edges."""
    if s.nearest is not None:
        raise err(s, "SELECT ... FROM EDGES NEAREST TO: a patch's edges are listed, not searched by similarity",
                  hint="SELECT ... FROM FEATURES NEAREST TO 'text'; or WHERE entity = 'x'")
    cols = tuple(c.name for c in s.columns) if s.columns else SELECT_COLUMNS
    for c in list(cols) + [x.column.name for x in s.where] + ([s.order_by.name] if s.order_by else []):
        if c not in SELECT_COLUMNS:
            raise err(s, f"SELECT ... FROM EDGES has no column {c!r}", hint=f"columns: {', '.join(SELECT_COLUMNS)}")
    if s.limit is not None and s.limit < 1:
        raise err(s, f"LIMIT {s.limit} lists nothing", hint="LIMIT 10")
    return SelectEdgesPlan(s, columns=cols, where=tuple(s.where), order_by=s.order_by.name if s.order_by else None,
                           descending=bool(s.descending), limit=s.limit)


class SelectEdgesResult(Result):
    kind: Literal["select_edges"] = "select_edges"
    columns: list[str]
    rows: list[dict[str, Any]]
    notes: list[str] = Field(default_factory=list)


def _p_target(model, prompt: str, target_id: int) -> float:
    import numpy as np

    ex = model.executor()
    logits = np.asarray(ex.forward(model.tokenizer.encode(prompt))[-1], dtype=np.float32)
    z = np.exp(logits - logits.max())
    return float(z[target_id] / z.sum())


@fam.runs(SelectEdgesPlan)
def run_select_edges(session, node: SelectEdgesPlan) -> SelectEdgesResult:
    notes = [("the patches' inserted edges only: the edges DESCRIBE computes from the features are not listed "
              "(DESCRIBE 'entity' gives them)")]
    if session.base_container is None:
        return SelectEdgesResult(columns=list(node.columns), rows=[], notes=["no container is open, so no patch is active"])
    st = edit_state(session)
    model = st.model()
    rows: list[dict[str, Any]] = []
    for p in st.active:
        for e in p.edits:
            score = None if e.prompt is None or e.target_id is None else round(_p_target(model, e.prompt, e.target_id), 6)
            for layer in e.layers:
                row = {"source": f"patch:{p.name}", "id": e.id, "entity": e.entity, "relation": e.relation,
                       "prompt": e.prompt, "target": e.target, "original": e.original, "mode": e.label.lower(),
                       "layer": layer, "score": score}
                if all(_holds(c, row[c.column.name]) for c in node.where):
                    rows.append(row)
    if node.order_by is not None:
        present = [r for r in rows if r[node.order_by] is not None]
        absent = [r for r in rows if r[node.order_by] is None]  # rows without the value come last either way
        rows = sorted(present, key=lambda r: r[node.order_by], reverse=node.descending) + absent
    if node.limit is not None:
        rows = rows[: node.limit]
    if any(r["mode"].startswith("knn") for r in rows):
        notes.append("KNN edges are a retrieval overlay: no weight holds them; their score is the overlay's answer")
    return SelectEdgesResult(columns=list(node.columns), rows=[{c: r[c] for c in node.columns} for r in rows],
                             notes=notes)


@fam.layout(SelectEdgesResult)
def layout_select_edges(r: SelectEdgesResult, timing: bool) -> list[str]:
    def cell(v) -> str:
        return "-" if v is None else f"{v:.4f}" if isinstance(v, float) else str(v)

    return table(list(r.columns), [[cell(row[c]) for c in r.columns] for row in r.rows]) if r.rows else \
        ["no edges: no active patch holds an edit that matches"]


@fam.records(SelectEdgesResult)
def records_select_edges(r: SelectEdgesResult) -> list[dict[str, Any]]:
    return [dict(x) for x in r.rows]


# ---- layouts -------------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _edit_table(rows: list[EditRow]) -> list[str]:
    return table(["patch", "id", "mode", "prompt", "target", "original", "layers", "writes", "vectors"],
                 [[r.patch, str(r.id), r.mode, r.prompt or "-", r.target or "-", r.original or "-",
                   ",".join(str(x) for x in r.layers), str(r.writes), str(r.vectors)] for r in rows])


@fam.layout(EditsResult)
def layout_edits(r: EditsResult, timing: bool) -> list[str]:
    out = [f"{r.action} {len(r.edits)} edit(s)" + (f" in patch {r.patch!r}" if r.patch else "")]
    if r.edits:
        out += _edit_table(r.edits)
    return out


@fam.records(EditsResult)
def records_edits(r: EditsResult) -> list[dict[str, Any]]:
    return [{"action": r.action, **e.model_dump(exclude={"fit"})} for e in r.edits]


@fam.layout(PatchesResult)
def layout_patches(r: PatchesResult, timing: bool) -> list[str]:
    out = []
    if r.path and r.action == "save":
        out.append(f"saved patch into {r.path}")
    if r.patches:
        out += table(["patch", "edits", "open", "file", "made on (digest)"],
                     [[p["name"], str(p["edits"]), "yes" if p["open"] else "", p["source"] or "-", p["base_digest"]]
                      for p in r.patches])
    if r.edits:
        out += [""] + _edit_table(r.edits)
    return out


@fam.records(PatchesResult)
def records_patches(r: PatchesResult) -> list[dict[str, Any]]:
    return [e.model_dump(exclude={"fit"}) for e in r.edits]


@fam.layout(ScoreEditsResult)
def layout_score(r: ScoreEditsResult, timing: bool) -> list[str]:
    out = [f"scored {len(r.rows)} edit(s) from {r.path} on {r.overlay}"]
    if r.depth is not None:
        out.append(f"at draft depth {r.depth} (the session's DRAFT DEPTH): the edited model's draft, KL against the "
                   f"base model's draft at the same depth")
    if r.fitted:
        out.append(f"fitted for the score, then dropped: {r.fitted}")
    out += table(["prompt", "target", "efficacy", "paraphrase", "neighborhood", "p(target)", "rank"],
                 [[x.prompt, x.target, "yes" if x.efficacy else "no", _pct(x.paraphrase), _pct(x.neighborhood),
                   f"{x.p_target:.3f}", str(x.rank)] for x in r.rows])
    out += fields([("efficacy", _pct(r.efficacy)), ("paraphrase", _pct(r.paraphrase)),
                   ("neighborhood", _pct(r.neighborhood)), ("mean p(target)", f"{r.p_target:.3f}"),
                   ("prompt-bank KL", None if r.kl is None else f"{r.kl:.4f} nats over {r.kl_positions} positions of {r.bank}")])
    if r.neighbors_edited:
        out.append(f"note: {r.neighbors_edited} neighbor prompt(s) are edited by the overlay itself: scored against "
                   f"that edit's target, not the file's answer ({r.neighbors_undecidable} left out: that target begins "
                   "with the case's own target's token)")
    if "retrieval overlay" in r.overlay:
        out.append("note: KNN edits are a retrieval overlay (no weight changes); "
                   f"{sum(x.retrieval_hits for x in r.rows)} position(s) were overridden while scoring")
    return out


@fam.records(ScoreEditsResult)
def records_score(r: ScoreEditsResult) -> list[dict[str, Any]]:
    return [{"overlay": r.overlay, **x.model_dump()} for x in r.rows]
