"""The typed AST: one pydantic class per statement. Nodes know where they came from (line,
column, source text) and nothing else; downstream code takes nodes, never text."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


def dialect(default):
    """A field added for the reference dialect (issue 19) to a statement that had none: marked so
    that tests comparing whole nodes can leave it out while it holds its default."""
    return Field(default, json_schema_extra={"dialect": True})


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---- prompts --------------------------------------------------------------------------


class TextPrompt(Node):
    """A prompt given as text; tokenised with the container's own tokenizer."""

    kind: Literal["text"] = "text"
    text: str

    def describe(self) -> str:
        return repr(self.text)


class TokenPrompt(Node):
    """A prompt given as token ids: ``TOKENS (1, 2, 3)``. Needs no tokenizer."""

    kind: Literal["tokens"] = "tokens"
    ids: list[int]

    def describe(self) -> str:
        return "TOKENS (" + ", ".join(str(i) for i in self.ids) + ")"


Prompt = Annotated[TextPrompt | TokenPrompt, Field(discriminator="kind")]

#: ABLATE FEATURES (layer:feature, ...) as written: (layer, feature) pairs in the order given.
Ablation = tuple[tuple[int, int], ...]

#: A layer range as written (LAYERS a-b, inclusive; LAYERS a is (a, a)).
LayerSpan = tuple[int, int]

#: The reference dialect's output detail and layer bands.
Detail = Literal["verbose", "brief", "raw"]
Band = Literal["all", "syntax", "knowledge", "output"]


# ---- statements -----------------------------------------------------------------------


#: Every concrete statement class by its name, filled as classes are defined (a family's module
#: defining one is what registers it; `lql.registry.statement_classes` lists them).
CLASSES: dict[str, type[Statement]] = {}


class Statement(Node):
    """Common to every statement: where it is in the script (1-based line and column of its
    first token, 0-based character offsets) and its own source text.

    What a statement class declares about itself (the server's policy, the planner's checks):

    * ``paths``: the fields that hold a file path the statement reads or writes (a server
      confines each to its data directory); ``None`` means undeclared, and a server refuses the
      statement by name rather than guess that it names no path.
    * ``read_only``: True when it only reads (the read-only profile allows it), else the reason
      it does not, in words; ``None`` is undeclared and refused like ``paths``.
    * ``needs_container``: refused (`NoContainer`) when nothing is bound, after ``check`` passes.
    * ``local_when_remote``: still runs here in a session bound to a server (USE REMOTE);
      ``remote_mirror``: runs on the server and here too (SET)."""

    keyword: ClassVar[str] = ""  # the statement's name as a user writes it, e.g. "SHOW LAYERS"
    paths: ClassVar[tuple[str, ...] | None] = None
    read_only: ClassVar[bool | str | None] = None
    needs_container: ClassVar[bool] = False
    local_when_remote: ClassVar[bool] = False
    remote_mirror: ClassVar[bool] = False
    never_on_server: ClassVar[tuple[str, str] | None] = None  # (why, hint): refused by every server

    line: int = 1
    column: int = 1
    end_line: int = 1
    end_column: int = 1
    start_pos: int = 0
    end_pos: int = 0
    source: str = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields.get("kind")
        if kind is not None and isinstance(kind.default, str):
            if cls.__name__ in CLASSES and CLASSES[cls.__name__].__module__ != cls.__module__:
                raise TypeError(f"two statement classes are named {cls.__name__} "
                                f"({CLASSES[cls.__name__].__module__} and {cls.__module__})")
            CLASSES[cls.__name__] = cls

    def check(self) -> None:
        """The checks that need no container (a count of zero, a range that runs backwards),
        raised as `StatementError`s; run before the statement is bound."""

    def refused_read_only(self) -> str | None:
        """Why the read-only profile refuses this statement (None: it only reads)."""
        if self.read_only is True:
            return None
        return self.read_only or "it is not a statement that only reads"

    def error(self, message: str, hint: str | None = None):
        """A refusal positioned at this statement."""
        from .errors import StatementError

        return StatementError(message, hint=hint, line=self.line, column=self.column, statement=self.source)


class Explain(Statement):
    keyword: ClassVar[str] = "EXPLAIN"
    kind: Literal["explain"] = "explain"
    prompt: Prompt | None = None
    depth: int | None = None
    infer: Infer | None = None  # EXPLAIN INFER ...: the statement whose plan is shown


class Infer(Statement):
    keyword: ClassVar[str] = "INFER"
    kind: Literal["infer"] = "infer"
    prompt: Prompt
    top: int | None = None
    generate: int | None = None
    depth: int | None = None
    speculate: int | None = None  # the draft depth that proposes tokens
    lookahead: int | None = None
    exactly: bool = False  # GENERATE n EXACTLY: no stop at end-of-sequence
    chat: bool | None = None  # CHAT: wrap the text in the model's chat template (None: the setting)
    ablate: Ablation | None = None  # ABLATE FEATURES (...): zero those FFN features for the run
    compare: bool = dialect(False)  # COMPARE (the reference dialect): refused at planning


class DraftDepth(Statement):
    keyword: ClassVar[str] = "DRAFT DEPTH"
    kind: Literal["draft_depth"] = "draft_depth"
    depth: int


class DraftOff(Statement):
    keyword: ClassVar[str] = "DRAFT OFF"
    kind: Literal["draft_off"] = "draft_off"


class DraftLadder(Statement):
    keyword: ClassVar[str] = "DRAFT LADDER"
    kind: Literal["draft_ladder"] = "draft_ladder"
    depths: list[int]
    prompts: str
    into: str | None = None
    plot: str | None = None  # PLOT INTO 'chart.png' | 'chart.svg'
    overwrite: bool = False  # OVERWRITE: an existing report or chart is replaced


class ExpertsClause(Node):
    """TRACE ... EXPERTS [AT LAYER n]: show each position's routing (of every routed layer the
    slice runs, or of layer n)."""

    layer: int | None = None


class Trace(Statement):
    keyword: ClassVar[str] = "TRACE"
    kind: Literal["trace"] = "trace"
    prompt: Prompt
    depth: int | None = None
    ablate: Ablation | None = None
    experts: ExpertsClause | None = None


class DumpLogits(Statement):
    keyword: ClassVar[str] = "DUMP LOGITS"
    kind: Literal["dump_logits"] = "dump_logits"
    prompt: Prompt
    depth: int | None = None
    ablate: Ablation | None = None
    into: str
    overwrite: bool = False  # OVERWRITE: an existing dump (and its sidecar) is replaced


class ScoreDraft(Statement):
    keyword: ClassVar[str] = "SCORE DRAFT"
    kind: Literal["score_draft"] = "score_draft"
    draft: str
    target: str


class Verify(Statement):
    keyword: ClassVar[str] = "VERIFY"
    kind: Literal["verify"] = "verify"


class Plan(Statement):
    keyword: ClassVar[str] = "PLAN"
    kind: Literal["plan"] = "plan"
    path: str


class Encode(Statement):
    keyword: ClassVar[str] = "ENCODE"
    kind: Literal["encode"] = "encode"
    checkpoint: str
    into: str
    overwrite: bool = False  # OVERWRITE: an existing container is replaced once the encode is complete


class Represent(Statement):
    """REPRESENT INTO 'out' ENCODING 'int8': the bound container in another weight encoding."""

    keyword: ClassVar[str] = "REPRESENT"
    kind: Literal["represent"] = "represent"
    into: str
    encoding: str


class Compact(Statement):
    """COMPACT INTO 'out': the bound container's referenced files only."""

    keyword: ClassVar[str] = "COMPACT"
    kind: Literal["compact"] = "compact"
    into: str


class Diff(Statement):
    """DIFF 'a' 'b' (or DIFF 'b': the bound container against b) [LAYER n] [LIMIT n] [PHYSICAL]
    [INTO PATCH 'p' (refused)]; b may be CURRENT, the bound container."""

    keyword: ClassVar[str] = "DIFF"
    kind: Literal["diff"] = "diff"
    a: str
    b: str | None = None
    b_current: bool = dialect(False)  # DIFF 'a' CURRENT
    layer: int | None = dialect(None)
    limit: int | None = dialect(None)
    physical: bool = dialect(False)
    into_patch: str | None = dialect(None)


class ScoreRepresentation(Statement):
    """SCORE REPRESENTATION 'cand' AGAINST 'ref' ON 'prompts.jsonl' [GREEDY n]."""

    keyword: ClassVar[str] = "SCORE REPRESENTATION"
    kind: Literal["score_representation"] = "score_representation"
    candidate: str
    reference: str
    prompts: str
    greedy: int | None = None


# ---- columns and conditions (SELECT ... FROM FEATURES, and the reference dialect's tables) --


class Column(Node):
    """A column named in SELECT, WHERE or ORDER BY, where it was written."""

    name: str  # lower-cased
    line: int = 1
    column: int = 1


class Condition(Node):
    """``column op value`` in WHERE: op is =, !=, <, <=, >, >= or LIKE (``<>`` is read as !=)."""

    column: Column
    op: str  # also IN, whose value is a list
    value: str | int | float | list[str | int | float]


# ---- the reference dialect (issue 19) -----------------------------------------------------


class ShowModels(Statement):
    keyword: ClassVar[str] = "SHOW MODELS"
    kind: Literal["show_models"] = "show_models"


class ShowPatches(Statement):
    keyword: ClassVar[str] = "SHOW PATCHES"
    kind: Literal["show_patches"] = "show_patches"


class ShowCompactStatus(Statement):
    keyword: ClassVar[str] = "SHOW COMPACT STATUS"
    kind: Literal["show_compact_status"] = "show_compact_status"


class ShowEntities(Statement):
    keyword: ClassVar[str] = "SHOW ENTITIES"
    kind: Literal["show_entities"] = "show_entities"
    layer: int | None = None
    limit: int | None = None


class ShowRelations(Statement):
    keyword: ClassVar[str] = "SHOW RELATIONS"
    kind: Literal["show_relations"] = "show_relations"
    layer: int | None = None
    examples: bool = False
    detail: Detail | None = None


class SelectGraph(Statement):
    """SELECT ... FROM EDGES | ENTITIES: the reference's knowledge-graph tables."""

    keyword: ClassVar[str] = "SELECT"
    kind: Literal["select_graph"] = "select_graph"
    table: Literal["edges", "entities"]
    columns: list[Column] | None = None
    nearest: str | None = None
    nearest_layer: int | None = None
    where: list[Condition] = []
    order_by: Column | None = None
    descending: bool | None = None
    limit: int | None = None


class Extract(Statement):
    """EXTRACT MODEL 'm' INTO 'o' [COMPONENTS ...] [LAYERS a-b] [WITH INFERENCE | ALL | WEIGHTS]
    [FORMAT VINDEX3]: ENCODE by the reference's name."""

    keyword: ClassVar[str] = "EXTRACT"
    kind: Literal["extract"] = "extract"
    checkpoint: str
    into: str
    components: list[str] | None = None
    layers: LayerSpan | None = None
    level: Literal["inference", "all", "weights"] | None = None
    format: str | None = None


class Compile(Statement):
    """COMPILE CURRENT | 'p' INTO VINDEX 'o' | INTO MODEL 'o' [ON CONFLICT name]."""

    keyword: ClassVar[str] = "COMPILE"
    kind: Literal["compile"] = "compile"
    path: str | None  # None: CURRENT, the bound container
    into: str
    target: Literal["vindex", "model"]
    on_conflict: str | None = None


class KnowledgeEdit(Statement):
    """A knowledge edit of the reference dialect. Each parses into its own class and is refused
    at planning: this build has no patch overlay."""

    verb: ClassVar[str] = ""  # what it does, for the refusal


class InsertEdges(KnowledgeEdit):
    keyword: ClassVar[str] = "INSERT"
    verb: ClassVar[str] = "edits knowledge through a patch overlay"
    kind: Literal["insert_edges"] = "insert_edges"
    columns: list[Column]
    values: list[str | int | float]
    layer: int | None = None
    confidence: float | None = None
    alpha: float | None = None
    mode: str | None = None


class DeleteEdges(KnowledgeEdit):
    keyword: ClassVar[str] = "DELETE"
    verb: ClassVar[str] = "edits knowledge through a patch overlay"
    kind: Literal["delete_edges"] = "delete_edges"
    where: list[Condition] = []


class UpdateEdges(KnowledgeEdit):
    keyword: ClassVar[str] = "UPDATE"
    verb: ClassVar[str] = "edits knowledge through a patch overlay"
    kind: Literal["update_edges"] = "update_edges"
    assignments: list[tuple[Column, str | int | float]]
    where: list[Condition] = []


class Merge(KnowledgeEdit):
    keyword: ClassVar[str] = "MERGE"
    verb: ClassVar[str] = "merges another set of edits through a patch overlay"
    kind: Literal["merge"] = "merge"
    src: str
    into: str | None = None
    on_conflict: str | None = None


class BeginPatch(KnowledgeEdit):
    keyword: ClassVar[str] = "BEGIN PATCH"
    verb: ClassVar[str] = "opens a patch overlay"
    kind: Literal["begin_patch"] = "begin_patch"
    path: str


class SavePatch(KnowledgeEdit):
    keyword: ClassVar[str] = "SAVE PATCH"
    verb: ClassVar[str] = "writes the open patch overlay to its file"
    kind: Literal["save_patch"] = "save_patch"


class ApplyPatch(KnowledgeEdit):
    keyword: ClassVar[str] = "APPLY PATCH"
    verb: ClassVar[str] = "applies a patch overlay"
    kind: Literal["apply_patch"] = "apply_patch"
    path: str


class RemovePatch(KnowledgeEdit):
    keyword: ClassVar[str] = "REMOVE PATCH"
    verb: ClassVar[str] = "removes an applied patch overlay"
    kind: Literal["remove_patch"] = "remove_patch"
    path: str


class LooseOption(Node):
    """An option of REBALANCE or COMPACT MINOR | MAJOR as written (name and value)."""

    name: str
    value: str | int | float | None = None


class Rebalance(KnowledgeEdit):
    keyword: ClassVar[str] = "REBALANCE"
    verb: ClassVar[str] = "rebalances the edits held in a patch overlay"
    kind: Literal["rebalance"] = "rebalance"
    options: list[LooseOption] = []


class CompactLevel(KnowledgeEdit):
    keyword: ClassVar[str] = "COMPACT"
    verb: ClassVar[str] = "folds a patch overlay's edits into the base model"
    kind: Literal["compact_level"] = "compact_level"
    level: Literal["minor", "major"]
    options: list[LooseOption] = []


Explain.model_rebuild()

#: The knowledge edits (refused at planning in this build).
KNOWLEDGE_EDITS: tuple[type[KnowledgeEdit], ...] = (
    InsertEdges, DeleteEdges, UpdateEdges, Merge, BeginPatch, SavePatch, ApplyPatch, RemovePatch, Rebalance,
    CompactLevel,
)
