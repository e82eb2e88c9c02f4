"""Typed results, one class per kind of answer. A result is data only: a command fills it,
`lql.render` lays it out (text, JSON, CSV, TSV, Markdown, JSON lines, HTML).

In a notebook a result shows itself as an HTML table (``_repr_html_``) and ``str(result)`` is
its text; ``to_dict()`` / ``to_json()`` give the JSON object ``lql --format json`` prints,
``to_records()`` its rows as dicts, and ``to_pandas()`` those rows as a DataFrame (pandas is
an optional extra: ``pip install 'lql-vindex3[notebook]'``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr


class StatementRef(BaseModel):
    """Which statement a result answers: its kind, position and source text (kind is None
    for text that did not parse)."""

    kind: str | None
    line: int
    column: int
    text: str


class Result(BaseModel):
    # Non-finite floats survive model_dump(mode="json") so that dumps_json can write them in the
    # tagged spelling (a Mamba2 time_step_limit of [0, inf] must not come out as [0, null]).
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")

    kind: str
    statement: StatementRef | None = None

    def to_text(self, *, timing: bool = True, width: int | None = None, expanded: str = "off") -> str:
        """Aligned text; ``width`` fits tables to that many columns, ``expanded`` (on, off,
        auto) lays them out one field per line."""
        from .render import to_text

        return to_text(self, timing=timing, width=width, expanded=expanded)

    def __str__(self) -> str:
        return self.to_text()

    def to_dict(self) -> dict:
        """The JSON object ``lql --format json`` prints for this result."""
        from .render import to_json

        return to_json(self)

    def to_json(self, *, indent: int | None = None) -> str:
        """`to_dict` as JSON text (non-finite floats in the tagged spelling)."""
        from .render import dumps_json, to_json

        return dumps_json(to_json(self), indent=indent)

    def to_records(self) -> list[dict[str, Any]]:
        """The result's rows (the table CSV and pandas see), one dict per row."""
        from .render import records

        return records(self)

    def to_pandas(self):
        """`to_records` as a pandas DataFrame; refuses by name when pandas is not installed."""
        from .render import to_pandas

        return to_pandas(self)

    def _repr_html_(self) -> str:
        from .render import to_html

        return to_html(self)


# ---- shared pieces --------------------------------------------------------------------


class MixEntry(BaseModel):
    label: str
    count: int


class Operand(BaseModel):
    role: str
    object: str
    tensor: str
    dtype: str
    shape: list[int]
    bytes: int


class OpInfo(BaseModel):
    kind: str
    role: str
    params: dict[str, Any]
    operands: list[Operand]


class PromptInfo(BaseModel):
    """A prompt as the model sees it: text (None for TOKENS) and the ids it tokenised to."""

    text: str | None
    ids: list[int]
    chat: bool = False  # the text was wrapped in the model's chat template


class Timing(BaseModel):
    """Machine-dependent: rendered only when the ``timing`` setting is on."""

    prepare_seconds: float | None = None
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    ms_per_token: float | None = None
    tokens_per_second: float | None = None


# ---- binding and facts ----------------------------------------------------------------


class OpenResult(Result):
    kind: Literal["open"] = "open"
    name: str
    path: str
    default_model: bool
    component: str
    role: str
    layers: int
    operator_mix: list[MixEntry]
    tokenizer: bool
    generation: int
    draft_reset: int | None = None  # the session's draft depth that OPEN cleared
    shards: int = 0  # layer-range actors the model runs in (0: this process)
    rebuilt: str | None = None  # OPEN DEFAULT: why the cached default model was rebuilt (None: it was not)


class RemoteResult(Result):
    """USE REMOTE: the server and model a session is now bound to."""

    kind: Literal["use_remote"] = "use_remote"
    url: str
    model: str
    name: str
    layers: int
    operator_mix: list[MixEntry]
    digest: str
    session: str  # the X-Session-Id the server keeps this session's state under


class ObjectRow(BaseModel):
    object: str
    representation: str
    tensors: int
    parameters: int
    bytes: int


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


class ShardRow(BaseModel):
    name: str
    layers: list[int]  # [first, last] held
    actor: str | None
    pid: int | None
    weight_bytes: int
    state_bytes_per_position: int
    fixed_state_bytes: int
    state_bytes: int


class PlacementInfo(BaseModel):
    """Where a sharded model's parts run and what crosses between them per position."""

    slice: str
    positions: int
    driver_holds: list[str]
    driver_weight_bytes: int
    shards: list[ShardRow]
    untouched: list[str]  # shards the slice never calls
    hops_per_position: int
    bytes_per_hop_per_position: int
    bytes_between_shards_per_position: int
    bytes_moved_per_position: int


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


class ExplainStep(BaseModel):
    stage: Literal["embedding", "layer", "final_norm", "head"]
    layer: int | None = None
    operator: str | None = None
    params: dict[str, Any] = {}
    geometry: str | None = None
    bytes_per_position: int | None = None
    fixed_bytes: int | None = None
    ops: list[OpInfo]


class ReadCost(BaseModel):
    ends_reads: int
    ends_bytes: int
    layer_reads: int
    layer_bytes: int
    total_reads: int
    total_bytes: int


class ExplainResult(Result):
    kind: Literal["explain"] = "explain"
    slice: str
    depth: int | None
    model_layers: int
    executed_layers: list[int]
    skipped_layers: list[int]
    prompt: PromptInfo | None = None
    state_bytes_after_prompt: int | None = None
    operation: str | None = None  # what the explained INFER runs on this plan
    steps: list[ExplainStep]
    reads: ReadCost
    placement: PlacementInfo | None = None  # when the model runs as shards


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


class RepresentationsResult(Result):
    kind: Literal["show_representations"] = "show_representations"
    filter: str | None
    representations: list[RepresentationRow]


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


class SettingRow(BaseModel):
    name: str
    value: Any
    description: str


class SettingsResult(Result):
    kind: Literal["show_settings"] = "show_settings"
    settings: list[SettingRow]


# ---- running the model ----------------------------------------------------------------


class Candidate(BaseModel):
    rank: int
    token: str | None  # None when the container carries no tokenizer
    id: int
    probability: float


class InferResult(Result):
    kind: Literal["infer"] = "infer"
    slice: str
    depth: int | None
    executed_layers: list[int]
    prompt: PromptInfo
    top: list[Candidate] | None = None
    generated_ids: list[int] | None = None
    generated_text: str | None = None
    stopped_at: int | None = None  # the end-of-sequence id generation stopped at, if it did
    interrupted: bool = False  # Ctrl-C stopped the generation: the tokens so far
    prepared_reads: int | None = None  # operand reads the slice's executor made when prepared
    prepared_bytes: int | None = None  # distinct bytes it prepared
    timing: Timing | None = None
    _logits: Any = PrivateAttr(default=None)

    @property
    def logits(self):
        """The float32 logits [vocab] after the last prompt token (numpy), as the run computed
        them; not part of the JSON."""
        return self._logits


class SpeculateResult(Result):
    kind: Literal["speculate"] = "speculate"
    prompt: PromptInfo
    depth: int
    lookahead: int
    generated_ids: list[int]
    generated_text: str | None
    interrupted: bool = False  # Ctrl-C: the tokens so far, and no statistics
    rounds: int | None = None
    proposed: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None
    tokens_per_full_step: float | None = None
    full_model_calls: int | None = None
    rollback: str | None = None
    matches_plain: bool | None = None
    timing: Timing | None = None
    speedup: float | None = None
    plain_tokens_per_second: float | None = None


class TraceRow(BaseModel):
    position: int
    token_id: int
    token: str | None
    layers: list[int]
    operators: list[str]
    next_id: int
    next_token: str | None


class TraceResult(Result):
    kind: Literal["trace"] = "trace"
    slice: str
    depth: int | None
    model_layers: int
    prompt: PromptInfo
    rows: list[TraceRow]


class DraftResult(Result):
    kind: Literal["draft"] = "draft"
    depth: int | None  # None: the full model
    model_layers: int
    executed_layers: list[int]
    reads: ReadCost


# ---- the container, checkpoints, the session ------------------------------------------


class VerifyResult(Result):
    kind: Literal["verify"] = "verify"
    path: str
    ok: bool
    checked: int
    problems: list[str]
    show_path: bool = Field(default=False, exclude=True)  # name the container in the text (vindex3 verify)


class FindingRow(BaseModel):
    category: str
    key: str
    value: Any
    message: str
    blocks: bool


class PlanResult(Result):
    kind: Literal["plan"] = "plan"
    source: str
    source_kind: str | None = None
    model_type: str | None
    family: str | None = None
    admissible: bool
    layers: int | None = None
    operator_mix: list[MixEntry] | None = None
    tensors: int | None = None
    parameters: int | None = None
    findings: list[FindingRow]


class EncodeResult(Result):
    kind: Literal["encode"] = "encode"
    source: str
    path: str
    name: str
    layers: int
    operator_mix: list[MixEntry]
    bytes: int
    seconds: float | None = None  # how long the encode took (machine-dependent)


class HelpResult(Result):
    kind: Literal["help"] = "help"
    topic: str | None
    text: str


class SetResult(Result):
    kind: Literal["set"] = "set"
    name: str
    value: Any
    previous: Any


# ---- drafts made measurable (vindex3.draft) -------------------------------------------


class DumpResult(Result):
    kind: Literal["dump_logits"] = "dump_logits"
    path: str
    sidecar: str
    depth: int | None
    positions: int
    vocab: int
    executed_layers: list[int]
    meta: dict[str, Any]


class ScoreResult(Result):
    kind: Literal["score_draft"] = "score_draft"
    draft: str
    target: str
    depth: int | None
    model_layers: int
    summary: dict[str, Any]
    positions: list[dict[str, Any]]  # with target_token / draft_token text when a tokenizer matched
    tokens: bool = False  # whether token text is shown beside ids


class LadderResult(Result):
    kind: Literal["draft_ladder"] = "draft_ladder"
    prompts_file: str
    into: str | None
    model_layers: int
    depths: list[int]
    rows: list[dict[str, Any]]
    target: dict[str, Any]
    report: dict[str, Any]
    plot_path: str | None = None  # the chart written with PLOT INTO
    interrupted: bool = False  # Ctrl-C: the depths finished before it

    def plot(self, path: str | None = None):
        """Draw the ladder (KL and top-1 against depth); with ``path`` also save it (.png or
        .svg). Returns the matplotlib Figure. matplotlib is an optional extra."""
        from .render import ladder_figure, save_figure

        fig = ladder_figure(self)
        if path is not None:
            save_figure(fig, path)
        return fig
