"""The typed AST: one pydantic class per statement. Nodes know where they came from (line,
column, source text) and nothing else; downstream code takes nodes, never text."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


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


# ---- statements -----------------------------------------------------------------------


class Statement(Node):
    """Common to every statement: where it is in the script (1-based line and column of its
    first token, 0-based character offsets) and its own source text."""

    keyword: ClassVar[str] = ""  # the statement's name as a user writes it, e.g. "SHOW LAYERS"

    line: int = 1
    column: int = 1
    end_line: int = 1
    end_column: int = 1
    start_pos: int = 0
    end_pos: int = 0
    source: str = ""


class Open(Statement):
    keyword: ClassVar[str] = "OPEN"
    kind: Literal["open"] = "open"
    path: str | None = None  # None with default=True
    default: bool = False
    shards: int | None = None  # SHARDS n: run the layers as n Ray actors (vindex3.shards)


class UseRemote(Statement):
    """USE REMOTE 'http://host:port' [MODEL 'id']: later statements run on that server."""

    keyword: ClassVar[str] = "USE REMOTE"
    kind: Literal["use_remote"] = "use_remote"
    url: str
    model: str | None = None


class Stats(Statement):
    keyword: ClassVar[str] = "STATS"
    kind: Literal["stats"] = "stats"
    positions: int | None = None


class Explain(Statement):
    keyword: ClassVar[str] = "EXPLAIN"
    kind: Literal["explain"] = "explain"
    prompt: Prompt | None = None
    depth: int | None = None
    infer: Infer | None = None  # EXPLAIN INFER ...: the statement whose plan is shown


class ShowLayers(Statement):
    keyword: ClassVar[str] = "SHOW LAYERS"
    kind: Literal["show_layers"] = "show_layers"
    start: int | None = None  # inclusive
    end: int | None = None  # inclusive


class ShowComponents(Statement):
    keyword: ClassVar[str] = "SHOW COMPONENTS"
    kind: Literal["show_components"] = "show_components"


class ShowRepresentations(Statement):
    keyword: ClassVar[str] = "SHOW REPRESENTATIONS"
    kind: Literal["show_representations"] = "show_representations"
    filter: str | None = None


class ShowProvenance(Statement):
    keyword: ClassVar[str] = "SHOW PROVENANCE"
    kind: Literal["show_provenance"] = "show_provenance"


class ShowOperands(Statement):
    keyword: ClassVar[str] = "SHOW OPERANDS"
    kind: Literal["show_operands"] = "show_operands"
    layer: int | None = None


class ShowSettings(Statement):
    keyword: ClassVar[str] = "SHOW SETTINGS"
    kind: Literal["show_settings"] = "show_settings"


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


class Trace(Statement):
    keyword: ClassVar[str] = "TRACE"
    kind: Literal["trace"] = "trace"
    prompt: Prompt
    depth: int | None = None


class DumpLogits(Statement):
    keyword: ClassVar[str] = "DUMP LOGITS"
    kind: Literal["dump_logits"] = "dump_logits"
    prompt: Prompt
    depth: int | None = None
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


class Help(Statement):
    keyword: ClassVar[str] = "HELP"
    kind: Literal["help"] = "help"
    topic: str | None = None  # upper-cased words, e.g. "SHOW LAYERS"


class Set(Statement):
    keyword: ClassVar[str] = "SET"
    kind: Literal["set"] = "set"
    name: str
    value: str | int | float


Explain.model_rebuild()

AnyStatement = Annotated[
    Open | UseRemote | Stats | Explain | ShowLayers | ShowComponents | ShowRepresentations | ShowProvenance | ShowOperands | ShowSettings | Infer | DraftDepth | DraftOff | DraftLadder | Trace | DumpLogits | ScoreDraft | Verify | Plan | Encode | Help | Set,
    Field(discriminator="kind"),
]

STATEMENT_CLASSES: tuple[type[Statement], ...] = (
    Open, UseRemote, Stats, Explain, ShowLayers, ShowComponents, ShowRepresentations, ShowProvenance,
    ShowOperands, ShowSettings, Infer, DraftDepth, DraftOff, DraftLadder, Trace, DumpLogits,
    ScoreDraft, Verify, Plan, Encode, Help, Set,
)
