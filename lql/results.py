"""Typed results, one class per kind of answer. A result is data only: a command fills it,
`lql.render` lays it out (text, JSON, CSV, TSV, Markdown, JSON lines, HTML).

In a notebook a result shows itself as an HTML table (``_repr_html_``; a result with a figure,
such as DRAFT LADDER's, shows it too, as ``_repr_png_``, with no ``%matplotlib`` needed) and
``str(result)`` is its text; a refusal shows its message, not a traceback. ``to_dict()`` /
``to_json()`` give the JSON object ``lql --format json`` prints, ``to_records()`` its rows as dicts, and ``to_pandas()`` those rows as a DataFrame (pandas is
an optional extra: ``pip install -e '.[notebook]'`` from a clone)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from .text import dump, flat  # noqa: F401  (families import them from here too)


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

        return to_html(self, self._repr_png_())

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict[str, Any]:
        """What a notebook shows: the HTML view (with the figure embedded, since a front end shows
        one representation of an output), the figure as its own PNG, and the text."""
        from .render import to_html

        png = self._repr_png_()
        bundle: dict[str, Any] = {"text/plain": self.to_text(), "text/html": to_html(self, png)}
        if png is not None:
            bundle["image/png"] = png
        return bundle

    def _repr_png_(self) -> bytes | None:
        """A result that draws itself (it has ``plot()``, as DRAFT LADDER's does) shows its figure
        in a notebook beneath its table, with no ``%matplotlib`` needed; None (nothing shown, no
        error) for a result without a figure, or when matplotlib is not installed."""
        plot = getattr(self, "plot", None)
        if not callable(plot):
            return None
        from .errors import NotAvailable

        try:
            fig = plot()
        except NotAvailable:  # matplotlib is an optional extra
            return None
        import io

        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()

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


class ReadCost(BaseModel):
    ends_reads: int
    ends_bytes: int
    layer_reads: int
    layer_bytes: int
    total_reads: int
    total_bytes: int
    by_encoding: list[EncodingShare] = []  # the distinct operands read, per encoding


# ---- drafts made measurable (vindex3.draft) -------------------------------------------


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


