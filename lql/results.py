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

    # ---- what a result class says about its own shape (its family overrides both)

    def layout(self, timing: bool) -> list[str]:
        """The result as aligned text lines (``timing``: include machine-dependent times). A
        result without its own layout still shows its data."""
        import json

        return json.dumps(self.model_dump(mode="json", exclude={"statement"}), indent=2).split("\n")

    def records(self) -> list[dict[str, Any]]:
        """The result's rows as flat dicts (CSV, TSV, Markdown, JSON lines, pandas); by default one
        row of every field."""
        return [flat(self.model_dump(mode="json", exclude={"statement", "kind"}))]


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def dump(m: Any) -> dict[str, Any]:
    """A model (or a mapping) as a JSON-ready dict."""
    return m.model_dump(mode="json") if hasattr(m, "model_dump") else dict(m)


# ---- shared pieces --------------------------------------------------------------------


class EncodingShare(BaseModel):
    """Tensors of one encoding within a container, an object or a slice's reads."""

    encoding: str
    tensors: int
    parameters: int
    bytes: int
    bits_per_weight: float


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


class ReadsInfo(BaseModel):
    """Operand bytes a position reads, from sizes only (no tensor data): ``always_bytes`` by
    every position, ``expert_bank_bytes`` held in routed-expert banks of which a position reads
    k of E experts per layer, ``embedding_bytes`` the embedding (one row per position, unless the
    head reads it whole), and ``per_position_bytes`` what one position reads in all."""

    always_bytes: int
    expert_bank_bytes: int
    expert_layers: list[int]  # layers whose FFN reads an expert bank
    embedding_bytes: int
    per_position_bytes: int
    total_bytes: int


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


class ExplainStep(BaseModel):
    stage: Literal["embedding", "layer", "final_norm", "head"]
    layer: int | None = None
    operator: str | None = None
    params: dict[str, Any] = {}
    geometry: str | None = None
    bytes_per_position: int | None = None
    fixed_bytes: int | None = None
    ops: list[OpInfo]
    # the layer's read profile (vindex3 LayerOps.reads.to_data()): always_bytes, bank_bytes,
    # per_position_bytes, total_bytes and each op's detail (a routed FFN's experts, top_k, router,
    # bytes_per_expert...), keyed by the op's role
    reads: dict[str, Any] | None = None


class ReadCost(BaseModel):
    ends_reads: int
    ends_bytes: int
    layer_reads: int
    layer_bytes: int
    total_reads: int
    total_bytes: int
    by_encoding: list[EncodingShare] = []  # the distinct operands read, per encoding


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
    per_position: ReadsInfo | None = None  # what one position of this slice reads


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
    intervention: dict[str, Any] | None = None  # ABLATE FEATURES, as the run recorded it
    # operand bytes each call touched (vindex3's trace.step_bytes): the prefill, then each decode
    # step; a routed layer counts only the experts its positions used. None when not recorded.
    prefill_bytes: int | None = None
    decode_bytes: list[int] | None = None
    expert_layers: list[int] = []  # routed layers the slice ran (their reads depend on the routing)
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


class ExpertPick(BaseModel):
    """One routed layer at one position: the experts the router chose (in its order) and their
    weights."""

    layer: int
    experts: list[int]
    weights: list[float]


class TraceRow(BaseModel):
    position: int
    token_id: int
    token: str | None
    layers: list[int]
    operators: list[str]
    next_id: int
    next_token: str | None
    bytes_read: int | None = None  # operand bytes this position's step touched (None: not recorded)
    experts: list[ExpertPick] | None = None  # with EXPERTS: the routing, per routed layer shown


class ExpertLayerInfo(BaseModel):
    layer: int
    experts: int  # E
    top_k: int
    router: str


class TraceResult(Result):
    kind: Literal["trace"] = "trace"
    slice: str
    depth: int | None
    model_layers: int
    prompt: PromptInfo
    rows: list[TraceRow]
    intervention: dict[str, Any] | None = None  # ABLATE FEATURES, as the run recorded it
    expert_layers: list[ExpertLayerInfo] | None = None  # with EXPERTS: the routed layers shown


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
    draft_intervention: dict[str, Any] | None = None  # what each dump's run changed (ABLATE FEATURES), from its sidecar
    target_intervention: dict[str, Any] | None = None


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


# ---- representations and maintenance (vindex3.represent, .compact, .diff, .evidence) ----


class KeptTensor(BaseModel):
    tensor: str
    encoding: str
    reason: str


class RepresentResult(Result):
    kind: Literal["represent"] = "represent"
    source: str
    path: str
    encoding: str
    tensors: int
    bytes: int
    source_bytes: int
    encodings: list[EncodingShare]
    kept: list[KeptTensor]  # tensors not in the requested encoding, and why
    not_carried: list[str]  # derived representations left with the source
    exact: bool
    worst: list[dict[str, Any]]  # the tensors with the largest relative RMS error
    seconds: float | None = None


class LeftBehind(BaseModel):
    path: str
    kind: str
    bytes: int


class CompactResult(Result):
    kind: Literal["compact"] = "compact"
    source: str
    path: str
    generation: int
    copied: int
    copied_bytes: int
    left_behind: list[LeftBehind]


class DiffRow(BaseModel):
    kind: Literal["logical", "physical", "metadata"]
    area: str
    what: str
    a: Any = None
    b: Any = None


class DiffResult(Result):
    kind: Literal["diff"] = "diff"
    a: str
    b: str
    verdict: str
    logically_identical: bool
    physically_identical: bool
    relation: str | None
    differences: list[DiffRow]


class RepresentationScoreResult(Result):
    kind: Literal["score_representation"] = "score_representation"
    candidate: str
    reference: str
    bank: str
    prompts: int
    positions: int
    greedy: int
    kl_mean: float
    kl_p50: float
    kl_p95: float
    kl_max: float
    top1: float
    greedy_agreement: float
    greedy_exact: float
    candidate_encodings: dict[str, str]
    stored: bool
    per_prompt: list[dict[str, Any]]
    seconds: float | None = None


# ---- looking inside (issue 15) ------------------------------------------------------------
#
# These mirror vindex3.internals' result models field for field (built from them with
# ``model_validate(x.model_dump())``, every nested model forbidding extra fields, so a field
# added there and not here fails loudly in the tests), so that JSON carries every column and a
# remote session rebuilds them, without importing vindex3 when lql is imported.


class Data(BaseModel):
    """A mirror of one of vindex3.internals' models: a field it does not know is refused."""

    model_config = ConfigDict(extra="forbid")


class TokenLogit(Data):
    id: int
    text: str | None
    logit: float


class SkippedLayer(Data):
    """A layer a statement did not look at, and why (a mixer-only layer has no FFN features)."""

    layer: int
    operator: str
    reason: str


class InternalsPrompt(Data):
    text: str | None
    ids: list[int]
    tokens: list[str | None]


class MetadataNote(Data):
    """What a statement's use of feature metadata involved: read, built now, or rebuilt (why)."""

    kind: Literal["feature_tokens"] = "feature_tokens"
    k: int
    source_digest: str
    layers: list[int]
    built_layers: list[int]
    build_seconds: float
    rebuilt: str | None = None
    cached: bool = True
    note: str | None = None


# ---- the reference dialect (issue 19) -------------------------------------------------------


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


class CompileResult(Result):
    kind: Literal["compile"] = "compile"
    source: str
    path: str
    files: int
    bytes: int
    generation: int
    verified: int
    left_behind: int
    patches: int = 0
    on_conflict: str | None = None
