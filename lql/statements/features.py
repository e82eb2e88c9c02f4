"""Looking inside the FFN as a database of features: WALK, DESCRIBE, SELECT ... FROM FEATURES,
SHOW FEATURES, EXPLAIN INFER ... FEATURES (the features most active in a real run), and BUILD
FEATURES (the feature metadata, derived data kept in the container)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from .. import ast, catalog
from ..ast import dialect
from ..binding import SliceBinding, internals, internals_data, internals_query, with_text
from ..errors import StatementError
from ..layouts import (
    intervention,
    layer_groups,
    metadata_fields,
    prompt_text,
    skipped_fields,
    time,
    token,
    token_list,
)
from ..planner import (
    BoundPrompt,
    Context,
    Node,
    bind_prompt,
    check_executed_layers,
    check_infer,
    check_span,
    depth_of,
    err,
    layers_word,
    positive,
    span_text,
)
from ..registry import family
from ..results import Data, InternalsPrompt, MetadataNote, Result, SkippedLayer, TokenLogit, dump
from ..syntax import BuildError, Children, Clause
from ..text import fields, fmt_bytes, fmt_int, fmt_seconds, fmt_text, layers_phrase, num, table
from .infer import Infer

fam = family("features", module=__name__, statements=(
    "walk_stmt", "explain_walk", "describe_stmt", "select_stmt", "show_features_stmt", "show_features_ref",
    "explain_features_stmt", "explain_infer_ref", "build_features_stmt"), grammar=r"""
walk_stmt: WALK prompt walk_option*

?walk_option: top_clause
            | layers_clause
            | layers_all_clause
            | mode_clause
            | compare_clause
            | detail_clause

explain_walk: EXPLAIN walk_stmt

describe_stmt: DESCRIBE STRING describe_option*

?describe_option: top_clause
                | layers_clause
                | band_clause
                | at_layer_clause
                | relations_only_clause
                | detail_clause

// SELECT columns FROM FEATURES, SQL's clause order; columns and conditions are typed by the
// planner (FEATURE_COLUMNS below), an unknown column is refused by name.
select_stmt: SELECT select_list FROM FEATURES [feature_scope] [nearest_clause] [where_clause] [order_clause] [limit_clause]

?feature_scope: AT LAYER INT             -> at_layer
             | layers_clause

show_features_stmt: SHOW FEATURES AT LAYER INT [limit_clause]
show_features_ref: SHOW FEATURES INT [where_clause] [limit_clause]   // the reference's SHOW FEATURES n

// EXPLAIN INFER ... FEATURES: the features most active at the last position of a real run.
explain_features_stmt: EXPLAIN infer_stmt FEATURES features_option*

?features_option: top_clause
                | layers_clause

// the reference's EXPLAIN INFER options, onto ... FEATURES
explain_infer_ref: EXPLAIN infer_stmt explain_ref_option+

?explain_ref_option: layers_clause
                   | verbose_clause
                   | band_clause
                   | relations_only_clause
                   | with_attention_clause
                   | top_clause

with_attention_clause: WITH ATTENTION

// BUILD FEATURES: make the feature metadata (a derived representation) now.
build_features_stmt: BUILD FEATURES [layers_clause]
""")

fam.doc('WALK',
        "[EXPLAIN] WALK 'text' | TOKENS (ids) [TOP n] [LAYERS a-b | ALL] [MODE pure] [VERBOSE]",
        "per FFN layer, the features whose gates answer the last token's embedding, and what they write",
        "WALK 'The capital of France is' TOP 3;", order=170, aliases=('EXPLAIN WALK',))
fam.doc('DESCRIBE',
        "DESCRIBE 'entity' [LAYERS a-b | AT LAYER n | ALL LAYERS | SYNTAX | KNOWLEDGE | OUTPUT] [TOP n] [VERBOSE | BRIEF | RAW]",
        "edges entity -> token through the features the entity's embedding opens (SET threshold)",
        "DESCRIBE 'France';", order=180)
fam.doc('SELECT',
        "SELECT layer, feature, token, score | * FROM FEATURES [AT LAYER n | LAYERS a-b] [NEAREST TO 'text' [AT LAYER n]] [WHERE column op value [AND ...]] [ORDER BY column [ASC | DESC]] [LIMIT n]",
        "query the FFN features as a table (op: =, !=, <, <=, >, >=, IN (v, ...), and LIKE for token); "
        "SELECT entity, target, layer, score, source | * FROM EDGES [WHERE ...] [ORDER BY ...] [LIMIT n] lists the "
        "active patches' inserted edges (source 'patch:<name>', score: the target's probability through the "
        "overlay), not the edges DESCRIBE computes",
        "SELECT layer, feature, token, score FROM FEATURES NEAREST TO 'Paris' LIMIT 5;", order=190,
        aliases=('SELECT FROM FEATURES', 'SELECT FROM EDGES', 'SELECT FROM ENTITIES'))
fam.doc('SHOW FEATURES',
        'SHOW FEATURES [AT LAYER] n [WHERE ...] [LIMIT n]',
        "a layer's features in order, each with the top tokens its down column writes",
        'SHOW FEATURES AT LAYER 0 LIMIT 5;', order=200, aliases=('FEATURES',))
fam.doc('BUILD FEATURES',
        'BUILD FEATURES [LAYERS a-b]',
        'build (or check) the feature metadata now: the tokens each FFN feature writes, kept as derived data',
        'BUILD FEATURES;', order=210, aliases=('BUILD',))


@fam.rule
def walk_stmt(c: Children) -> Walk:
    return Walk(prompt=c.get("WALK"), **c.options("WALK"))


@fam.rule
def explain_walk(c: Children) -> Walk:
    return c.get("EXPLAIN").model_copy(update={"explain": True, **c.pos})


@fam.rule
def describe_stmt(c: Children) -> Describe:
    return Describe(entity=c.string("DESCRIBE"), **c.options("DESCRIBE"))


@fam.rule
def at_layer(c: Children) -> Clause:
    n = c.int("AT", "LAYER")
    return c.clause("at_layer", (n, n))


def select_fields(c: Children, opts: dict) -> dict:
    """The fields SELECT ... FROM FEATURES and FROM EDGES | ENTITIES share."""
    fields: dict = {"columns": c.get("SELECT"), "where": opts.get("where") or [], "limit": opts.get("limit")}
    if "order" in opts:
        fields["order_by"], fields["descending"] = opts["order"]
    return fields


@fam.rule
def select_stmt(c: Children) -> SelectFeatures:
    # SELECT list FROM FEATURES [scope] [nearest] [where] [order] [limit]
    opts = c.options("SELECT")
    fields = select_fields(c, opts)
    nearest = opts.get("nearest")
    scope = ("at_layer", opts["at_layer"]) if "at_layer" in opts else ("layers", opts["layers"]) if "layers" in opts else None
    if isinstance(nearest, tuple):
        nearest, layer = nearest
        if scope is not None:
            raise BuildError("NEAREST TO ... AT LAYER n and a layer scope before it are both given", c.keyword("FEATURES"),
                             hint="keep one: SELECT ... FROM FEATURES NEAREST TO 'text' AT LAYER n")
        scope = ("at_layer", (layer, layer))
    fields["nearest"] = nearest
    if scope is not None:
        fields["layers"], fields["at_layer"] = scope[1], scope[0] == "at_layer"
    return SelectFeatures(**fields)


@fam.rule
def show_features_stmt(c: Children) -> ShowFeatures:
    return ShowFeatures(layer=c.int("LAYER"), limit=c.options("SHOW FEATURES").get("limit"))


@fam.rule
def show_features_ref(c: Children) -> ShowFeatures | SelectFeatures:
    # SHOW FEATURES INT [where_clause] [limit_clause]: the reference's SHOW FEATURES n
    opts = c.options("SHOW FEATURES")
    layer, where, limit = c.int("FEATURES"), opts.get("where"), opts.get("limit")
    if where is None:
        return ShowFeatures(layer=layer, limit=limit)
    return SelectFeatures(layers=(layer, layer), at_layer=True, where=where, limit=limit)


@fam.rule
def explain_features_stmt(c: Children) -> ExplainFeatures:
    fields = c.options("EXPLAIN INFER ... FEATURES", first=c.keyword("FEATURES"))
    return ExplainFeatures(infer=c.get("EXPLAIN"), **fields)


@fam.rule
def with_attention_clause(c: Children) -> Clause:
    return c.clause("attention", True)


@fam.rule
def explain_infer_ref(c: Children) -> ExplainFeatures:
    inf = c.get("EXPLAIN")
    fields = c.options("EXPLAIN INFER")
    if inf.top is not None:
        if "top" in fields:
            raise BuildError("TOP is given twice in one EXPLAIN INFER", c.first, hint="keep one TOP clause")
        fields["top"] = inf.top
        inf = inf.model_copy(update={"top": None})
    if "detail" in fields:
        fields["verbose"] = fields.pop("detail") == "verbose"
    return ExplainFeatures(infer=inf, reference=True, **fields)


@fam.rule
def build_features_stmt(c: Children) -> BuildFeatures:
    return BuildFeatures(layers=c.options("BUILD FEATURES").get("layers"))


# ---- the statements ---------------------------------------------------------------------


class Walk(ast.Statement):
    """WALK 'text' [TOP n] [LAYERS a-b]: per FFN layer, the features whose gate rows answer
    the text's last token most strongly."""

    keyword: ClassVar[str] = "WALK"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["walk"] = "walk"
    prompt: ast.Prompt
    top: int | None = None
    layers: ast.LayerSpan | None = None
    mode: str | None = dialect(None)  # MODE hybrid | pure | dense (the reference dialect), lower-cased
    compare: bool = dialect(False)  # COMPARE (the reference dialect)
    detail: ast.Detail | None = dialect(None)  # VERBOSE | BRIEF | RAW
    explain: bool = dialect(False)  # written EXPLAIN WALK

    def check(self) -> None:
        positive(self, self.top, "TOP", "TOP 5")
        check_span(self, self.layers)


class Describe(ast.Statement):
    """DESCRIBE 'entity' [LAYERS a-b] [TOP n]: edges entity -> token through the features the
    entity's embedding opens."""

    keyword: ClassVar[str] = "DESCRIBE"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["describe"] = "describe"
    entity: str
    top: int | None = None
    layers: ast.LayerSpan | None = None
    band: ast.Band | None = dialect(None)  # ALL LAYERS | SYNTAX | KNOWLEDGE | OUTPUT (the reference dialect)
    at_layer: int | None = dialect(None)  # AT LAYER n
    relations_only: bool = dialect(False)  # RELATIONS ONLY: refused (no relation labels in this build)
    detail: ast.Detail | None = dialect(None)  # VERBOSE | BRIEF | RAW

    def check(self) -> None:
        positive(self, self.top, "TOP", "TOP 5")
        check_span(self, self.layers)


class SelectFeatures(ast.Statement):
    """SELECT columns FROM FEATURES [AT LAYER n | LAYERS a-b] [NEAREST TO 'text'] [WHERE ...]
    [ORDER BY column [ASC | DESC]] [LIMIT n]."""

    keyword: ClassVar[str] = "SELECT"
    paths: ClassVar[tuple[str, ...]] = ()  # NEAREST TO and WHERE take text, not paths
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["select_features"] = "select_features"
    columns: list[ast.Column] | None = None  # None: SELECT *
    layers: ast.LayerSpan | None = None  # AT LAYER n is (n, n)
    at_layer: bool = False  # the scope was written AT LAYER n
    nearest: str | None = None
    nearest_layer: int | None = dialect(None)  # NEAREST TO 'e' AT LAYER n (the reference's order)
    where: list[ast.Condition] = []  # noqa: RUF012 (pydantic copies the default per instance)
    order_by: ast.Column | None = None
    descending: bool | None = None  # None: not written
    limit: int | None = None

    def check(self) -> None:
        """Columns known, each condition's operator and value of its column's type: all judged
        from the statement alone."""
        seen: set[str] = set()
        for col in self.columns or []:
            name = _known_column(self, col, "the column list")
            if name in seen:
                raise _column_error(self, col, f"column {name!r} is listed twice")
            seen.add(name)
        if self.at_layer is False:
            check_span(self, self.layers)
        for cond in self.where:
            name = _known_column(self, cond.column, "WHERE")
            ops = catalog.FEATURE_COLUMN_OPS[name]
            if cond.op not in ops:
                raise _column_error(self, cond.column, f"column {name!r} does not take {cond.op}",
                                    hint=f"{name} takes {', '.join(ops)}")
            want = catalog.FEATURE_COLUMNS[name]
            if cond.op == "IN":
                for v in cond.value:
                    _check_value(self, cond, name, want, v)
                continue
            _check_value(self, cond, name, want, cond.value)
        if self.order_by is not None:
            _known_column(self, self.order_by, "ORDER BY")


class ShowFeatures(ast.Statement):
    keyword: ClassVar[str] = "SHOW FEATURES"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_features"] = "show_features"
    layer: int
    limit: int | None = None


class ExplainFeatures(ast.Statement):
    """EXPLAIN INFER ... FEATURES [TOP n] [LAYERS a-b]: the features most active at the last
    position of the run the INFER describes."""

    keyword: ClassVar[str] = "EXPLAIN"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["explain_features"] = "explain_features"
    infer: Infer  # the INFER it explains (the infer family's statement)
    top: int | None = None
    layers: ast.LayerSpan | None = None
    band: ast.Band | None = dialect(None)  # KNOWLEDGE | SYNTAX | OUTPUT (the reference's EXPLAIN INFER options)
    verbose: bool = dialect(False)
    relations_only: bool = dialect(False)  # refused: no relation labels in this build
    attention: bool = dialect(False)  # WITH ATTENTION: refused
    reference: bool = dialect(False)  # written in the reference dialect (without FEATURES)

    def check(self) -> None:
        check_infer(self.infer)
        positive(self, self.top, "FEATURES TOP", "FEATURES TOP 5")
        check_span(self, self.layers)
        for word, given in (("GENERATE", self.infer.generate), ("SPECULATE", self.infer.speculate),
                            ("TOP", self.infer.top)):
            if given is not None:
                hint = ("the number of features goes after FEATURES: EXPLAIN INFER 'text' FEATURES TOP n"
                        if word == "TOP" else "EXPLAIN INFER ... FEATURES reads the prefill of the prompt")
                raise err(self, f"EXPLAIN INFER ... FEATURES looks at one run of the prompt; {word} does not apply",
                          hint=hint)


class BuildFeatures(ast.Statement):
    """BUILD FEATURES [LAYERS a-b]: build (or check) the feature metadata now."""

    keyword: ClassVar[str] = "BUILD FEATURES"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = "it builds derived data into the served container, long work"
    needs_container: ClassVar[bool] = True
    kind: Literal["build_features"] = "build_features"
    layers: ast.LayerSpan | None = None

    def check(self) -> None:
        check_span(self, self.layers)


def _column_error(s: ast.Statement, col: ast.Column, message: str, hint: str | None = None) -> StatementError:
    """A refusal that points at the column as written."""
    return StatementError(message, hint=hint, line=col.line, column=col.column, statement=s.source)


def _known_column(s: ast.Statement, col: ast.Column, where: str) -> str:
    if col.name not in catalog.FEATURE_COLUMNS:
        close = difflib.get_close_matches(col.name, list(catalog.FEATURE_COLUMNS), n=1)
        raise _column_error(s, col, f"FEATURES has no column {col.name!r} ({where})",
                            hint=(f"did you mean {close[0]}? " if close else "")
                            + "columns: " + ", ".join(catalog.FEATURE_COLUMNS))
    return col.name


def _check_value(s: ast.Statement, cond: ast.Condition, name: str, want: type, v) -> None:
    if want is str and not isinstance(v, str):
        raise _column_error(s, cond.column, f"{name} {cond.op} needs text, got the number {v!r}",
                            hint=f"quote it: {name} {cond.op} '{v}'")
    if want is not str and isinstance(v, str):
        raise _column_error(s, cond.column, f"{name} {cond.op} needs a number, got the text {v!r}")
    if want is int and isinstance(v, float):
        raise _column_error(s, cond.column, f"{name} {cond.op} needs a whole number, got {v!r}")


# ---- plans --------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class WalkPlan(Node):
    """WALK: the query is the last token's scaled embedding (``prompt`` tokenised without BOS)."""

    prompt: BoundPrompt
    top: int
    layers: tuple[int, ...] | None  # None: every layer
    notes: tuple[str, ...] = ()  # what MODE, VERBOSE, EXPLAIN WALK meant here


@dataclass(frozen=True, eq=False)
class DescribePlan(Node):
    """DESCRIBE: the query is the mean of the entity's scaled token embeddings."""

    entity: str
    prompt: BoundPrompt  # the entity's tokens (no BOS)
    top: int
    layers: tuple[int, ...] | None
    threshold: float
    notes: tuple[str, ...] = ()  # how a band was chosen, what VERBOSE | BRIEF | RAW meant


@dataclass(frozen=True)
class Where:
    """A typed WHERE condition: a known column, an operator it takes, a value of its type."""

    column: str
    op: str
    value: str | int | float


@dataclass(frozen=True, eq=False)
class SelectFeaturesPlan(Node):
    columns: tuple[str, ...]  # in order, * expanded
    layers: tuple[int, ...] | None
    nearest: BoundPrompt | None  # NEAREST TO: its tokens (no BOS)
    where: tuple[Where, ...]
    order_by: str | None
    descending: bool
    limit: int | None


@dataclass(frozen=True, eq=False)
class ShowFeaturesPlan(Node):
    layer: int
    limit: int | None


@dataclass(frozen=True, eq=False)
class ExplainFeaturesPlan(Node):
    """EXPLAIN INFER ... FEATURES: prefill the prompt on the slice (with the intervention),
    then the most active features at the last position."""

    slice: SliceBinding
    prompt: BoundPrompt
    intervention: Any
    top: int
    layers: tuple[int, ...] | None

    def describe(self) -> str:
        tail = f", with {self.intervention.describe()}" if self.intervention is not None else ""
        return f"EXPLAIN INFER ... FEATURES: prefill {len(self.prompt.ids)} tokens, then the top {self.top} features{tail}"


@dataclass(frozen=True, eq=False)
class BuildFeaturesPlan(Node):
    layers: tuple[int, ...] | None


_NO_RELATIONS = ("{what} keeps edges that carry a relation label (the reference system's probe-labelled knowledge "
                 "graph), and this build's feature metadata carries no relation labels")
_NO_RELATIONS_HINT = "leave it out: the edges are the tokens each feature writes"


def bind_pieces(ctx: Context, prompt: ast.TextPrompt | ast.TokenPrompt, what: str) -> BoundPrompt:
    """Token ids of a query text as the feature statements read it: the text alone, without
    BOS (a query is the text's own tokens), or TOKENS checked against the vocabulary."""
    cat = ctx.catalog
    if isinstance(prompt, ast.TextPrompt):
        if not cat.has_tokenizer:
            raise StatementError(f"{what}: the container carries no tokenizer, so {prompt.text!r} cannot be tokenised",
                                 hint="give token ids instead: TOKENS (1, 2, 3)")
        ids = tuple(cat.tokenize(prompt.text, special=False))
        if not ids:
            raise StatementError(f"{what}: {prompt.text!r} tokenises to no tokens")
        return BoundPrompt(prompt.text, ids)
    return bind_prompt(ctx, prompt)


def _feature_layers(s: ast.Statement, ctx: Context, layers: tuple[int, ...] | None, what: str) -> None:
    """Refuse a choice of layers in which no layer has features; a choice in which some do is
    answered for those, the others listed as skipped with the reason."""
    infos = ctx.catalog.feature_layers
    chosen = [infos[i] for i in (layers if layers is not None else range(len(infos)))]
    if any(x.has_features for x in chosen):
        return
    reasons: dict[str, list[int]] = {}
    for x in chosen:
        reasons.setdefault(x.reason or "no features", []).append(x.layer)
    why = "; ".join(f"{layers_word(ls)}: {r}" for r, ls in reasons.items())
    scope = "no layer of this model" if layers is None else f"no layer of {layers_word(list(layers))}"
    have = [x.layer for x in infos if x.has_features]
    hint = f"layers with FFN features: {span_text(have)}" if have else None
    raise StatementError(f"{what}: {scope} has FFN features ({why})", hint=hint)


def _score_value(c: ast.Condition):
    return [float(v) for v in c.value] if isinstance(c.value, list) else float(c.value)


def _walk_dialect(s: Walk) -> tuple[str, ...]:
    if s.mode is not None and s.mode not in ("pure", "hybrid", "dense"):
        raise err(s, f"WALK MODE {s.mode} is not a walk mode", hint="modes: pure (this build's), hybrid, dense")
    if s.mode in ("hybrid", "dense"):
        what = ("runs the model's attention and reads the FFN from the index" if s.mode == "hybrid"
                else "runs the full dense forward pass")
        raise err(s, f"WALK MODE {s.mode} {what}; this build's WALK reads gate rows against the last token's "
                   "embedding alone (MODE pure)",
                   hint="MODE pure (or no MODE); EXPLAIN INFER 'text' FEATURES shows the features of a real run")
    if s.compare:
        raise err(s, "WALK ... COMPARE sets the walk modes side by side, and this build has one mode (pure)",
                   hint="leave COMPARE out; EXPLAIN INFER 'text' FEATURES shows the features of a real run")
    notes: list[str] = []
    if s.mode == "pure":
        notes.append("MODE pure: the only walk this build has (gate rows against the embedding, no attention)")
    if s.explain:
        notes.append("EXPLAIN WALK: the walk itself; every field is in the JSON output")
    if s.detail is not None:
        notes.append(f"{s.detail.upper()}: this build has one text layout for WALK; SET format = json gives every field")
    return tuple(notes)


_BANDS = ("syntax", "knowledge", "output")


def _band_span(s: ast.Statement, ctx: Context, band: str) -> tuple[tuple[int, int], str]:
    """The layers of a band and how they were chosen: the container's own ``layer_bands`` when its
    index records them, else the model's depth in thirds."""
    cat = ctx.catalog
    n = cat.num_layers
    if band == "all":
        return (0, n - 1), f"ALL LAYERS: layers 0-{n - 1}"
    index = getattr(cat.container, "index", None) or {}
    recorded = index.get("layer_bands") if isinstance(index, dict) else None
    if isinstance(recorded, dict) and band in recorded:
        a, b = recorded[band]
        return (int(a), int(b)), f"{band.upper()}: layers {a}-{b}, the band the container records"
    k = _BANDS.index(band)
    lo, hi = (k * n) // 3, ((k + 1) * n) // 3 - 1
    if hi < lo:
        raise err(s, f"{band.upper()} is the {('first', 'middle', 'last')[k]} third of the model's depth, and a "
                   f"{n}-layer model's {band} third holds no layer (the container records no layer bands)",
                   hint="name the layers: AT LAYER n or LAYERS a-b")
    return (lo, hi), (f"{band.upper()}: layers {lo}-{hi}, the {('first', 'middle', 'last')[k]} third of the model's "
                      f"{n} layers (the container records no layer bands)")


def _describe_layers(s: Describe, ctx: Context) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    if s.relations_only:
        raise err(s, _NO_RELATIONS.format(what="DESCRIBE ... RELATIONS ONLY"), hint=_NO_RELATIONS_HINT)
    given = [w for w, v in (("LAYERS", s.layers), ("AT LAYER", s.at_layer), ("a band", s.band)) if v is not None]
    if len(given) > 1:
        raise err(s, f"DESCRIBE takes one choice of layers, and {' and '.join(given)} are both given")
    if s.at_layer is not None:
        return ctx.catalog.layer_span((s.at_layer, s.at_layer), "AT LAYER"), ()
    if s.band is not None:
        span, note = _band_span(s, ctx, s.band)
        return ctx.catalog.layer_span(span, "LAYERS"), (note,)
    return ctx.catalog.layer_span(s.layers, "LAYERS"), ()


@fam.plans(Walk)
def plan_walk(s: Walk, ctx: Context) -> Node:
    notes = _walk_dialect(s)
    layers = ctx.catalog.layer_span(s.layers, "LAYERS")
    _feature_layers(s, ctx, layers, "WALK")
    return WalkPlan(s, prompt=bind_pieces(ctx, s.prompt, "WALK"), top=s.top if s.top is not None else 5, layers=layers,
                    notes=notes)


@fam.plans(Describe)
def plan_describe(s: Describe, ctx: Context) -> Node:
    if not s.entity.strip():
        raise err(s, "DESCRIBE needs an entity: the text is empty", hint="e.g. DESCRIBE 'France'")
    layers, notes = _describe_layers(s, ctx)
    _feature_layers(s, ctx, layers, "DESCRIBE")
    prompt = bind_pieces(ctx, ast.TextPrompt(text=s.entity), "DESCRIBE")
    top = s.top if s.top is not None else {"brief": 5, "verbose": 30}.get(s.detail or "", 10)
    if s.detail is not None:
        notes += ({"brief": "BRIEF: the top 5 edges (TOP n overrides)",
                   "verbose": "VERBOSE: the top 30 edges (TOP n overrides); every field is in the JSON output",
                   "raw": "RAW: this build has one text layout; SET format = json gives the raw result"}[s.detail],)
    return DescribePlan(s, entity=s.entity, prompt=prompt, top=top, layers=layers,
                        threshold=float(ctx.settings.threshold), notes=notes)


@fam.plans(SelectFeatures)
def plan_select(s: SelectFeatures, ctx: Context) -> Node:
    cat = ctx.catalog
    if s.at_layer:
        layer = s.layers[0]
        cat.check_layer(layer)
        layers: tuple[int, ...] | None = (layer,)
    else:
        layers = cat.layer_span(s.layers, "LAYERS")
    _feature_layers(s, ctx, layers, "SELECT ... FROM FEATURES")
    if s.where and any(c.column.name == "token" for c in s.where) and not cat.has_tokenizer:
        raise err(s, "WHERE token ... compares token text, and the container carries no tokenizer")
    nearest = bind_pieces(ctx, ast.TextPrompt(text=s.nearest), "NEAREST TO") if s.nearest is not None else None
    columns = tuple(c.name for c in s.columns) if s.columns is not None else tuple(catalog.FEATURE_COLUMNS)
    where = tuple(Where(c.column.name, c.op, _score_value(c) if c.column.name == "score" else c.value) for c in s.where)
    descending = s.descending if s.descending is not None else True
    return SelectFeaturesPlan(s, columns=columns, layers=layers, nearest=nearest, where=where,
                              order_by=s.order_by.name if s.order_by is not None else None, descending=descending,
                              limit=s.limit)


@fam.plans(ShowFeatures)
def plan_show_features(s: ShowFeatures, ctx: Context) -> Node:
    cat = ctx.catalog
    cat.check_layer(s.layer)
    info = cat.feature_layers[s.layer]
    if not info.has_features:
        have = [x.layer for x in cat.feature_layers if x.has_features]
        raise err(s, f"SHOW FEATURES AT LAYER {s.layer}: {info.reason}",
                   hint=f"layers with FFN features: {span_text(have)}" if have else None)
    return ShowFeaturesPlan(s, layer=s.layer, limit=s.limit)


@fam.plans(ExplainFeatures)
def plan_explain_features(s: ExplainFeatures, ctx: Context) -> Node:
    if s.relations_only:
        raise err(s, _NO_RELATIONS.format(what="EXPLAIN INFER ... RELATIONS ONLY"), hint=_NO_RELATIONS_HINT)
    if s.attention:
        raise err(s, "EXPLAIN INFER ... WITH ATTENTION shows attention weights per head, and this build's EXPLAIN "
                   "INFER reads FFN features only", hint="leave WITH ATTENTION out: the features most active in the run")
    if s.band is not None:
        if s.layers is not None:
            raise err(s, f"EXPLAIN INFER takes LAYERS a-b or {s.band.upper()}, not both")
        span = _band_span(s, ctx, s.band)[0]
        s = s.model_copy(update={"layers": span})
    inf = s.infer
    cat = ctx.catalog
    chat = inf.chat if inf.chat is not None else (bool(ctx.settings.chat) and isinstance(inf.prompt, ast.TextPrompt))
    sl = cat.bind_slice(depth_of(ctx, inf.depth))
    layers = cat.layer_span(s.layers, "LAYERS")
    check_executed_layers(s, sl, layers, "EXPLAIN INFER ... FEATURES LAYERS")
    ran = tuple(sl.executed_layers)
    _feature_layers(s, ctx, layers if layers is not None else (None if len(ran) == cat.num_layers else ran),
                    "EXPLAIN INFER ... FEATURES")
    ablation = cat.ablation(inf.ablate, sl)
    return ExplainFeaturesPlan(s, slice=sl, prompt=bind_prompt(ctx, inf.prompt, chat=chat), intervention=ablation,
                               top=s.top if s.top is not None else 5, layers=layers)


@fam.plans(BuildFeatures)
def plan_build_features(s: BuildFeatures, ctx: Context) -> Node:
    layers = ctx.catalog.layer_span(s.layers, "LAYERS")
    _feature_layers(s, ctx, layers, "BUILD FEATURES")
    return BuildFeaturesPlan(s, layers=layers)


# ---- results ------------------------------------------------------------------------------
#
# These mirror vindex3.internals' result models field for field (see `lql.results.Data`).


class FeatureHit(Data):
    layer: int
    feature: int
    score: float
    tokens: list[TokenLogit]


class WalkLayer(Data):
    layer: int
    mixer: str
    ffn: str
    features: list[FeatureHit]


class WalkResult(Result):
    kind: Literal["walk"] = "walk"
    prompt: InternalsPrompt
    query_id: int
    query_token: str | None
    query: str
    top: int
    layers: list[WalkLayer]
    skipped: list[SkippedLayer]
    metadata: MetadataNote
    seconds: float
    notes: list[str] = []  # what a reference-dialect option meant here (MODE pure, VERBOSE ...)  # noqa: RUF012


class DescribeEdge(Data):
    source: str
    target: str | None
    target_id: int
    best_score: float
    best_layer: int
    best_feature: int
    first_layer: int
    last_layer: int
    count: int
    features: list[tuple[int, int]]
    also: list[str | None]
    also_ids: list[int]


class DescribeResult(Result):
    kind: Literal["describe"] = "describe"
    entity: str
    prompt: InternalsPrompt
    query: str
    threshold: float
    top: int
    layers: list[int]
    skipped: list[SkippedLayer]
    passing: int
    excluded: int
    excluded_tokens: list[str | None]
    total_edges: int
    edges: list[DescribeEdge]
    metadata: MetadataNote
    notes: list[str] = []  # how a layer band was chosen (thirds of depth, or the container's own bands)  # noqa: RUF012
    seconds: float


class FeatureCondition(Data):
    column: str
    op: str
    value: str | int | float | list[str | int | float]  # a list for IN


class FeatureQuery(Data):
    columns: list[str]
    layers: list[int] | None = None
    nearest_to: str | list[int] | None = None
    where: list[FeatureCondition] = []  # noqa: RUF012 (pydantic copies the default per instance)
    order_by: str | None = None
    descending: bool = True
    limit: int | None = None


class FeatureRow(Data):
    layer: int
    feature: int
    token: str | None
    token_id: int
    score: float


class SelectFeaturesResult(Result):
    kind: Literal["select_features"] = "select_features"
    query: FeatureQuery
    columns: list[str]
    score: str
    layers: list[int]
    skipped: list[SkippedLayer]
    total: int
    rows: list[FeatureRow]
    metadata: MetadataNote
    seconds: float


class FeatureTokensRow(Data):
    feature: int
    tokens: list[TokenLogit]


class ShowFeaturesResult(Result):
    kind: Literal["show_features"] = "show_features"
    layer: int
    mixer: str
    ffn: str
    features: int
    rows: list[FeatureTokensRow]
    metadata: MetadataNote


class ActiveFeature(Data):
    layer: int
    feature: int
    activation: float
    gate: float
    ablated: bool
    tokens: list[TokenLogit]


class ActivityLayer(Data):
    layer: int
    mixer: str
    ffn: str
    features: list[ActiveFeature]


class FeatureActivityResult(Result):
    """EXPLAIN INFER ... FEATURES."""

    kind: Literal["explain_features"] = "explain_features"
    prompt: InternalsPrompt
    position: int
    slice: str
    executed_layers: list[int]
    intervention: dict[str, Any] | None
    next_id: int
    next_token: str | None
    top: int
    layers: list[ActivityLayer]
    skipped: list[SkippedLayer]
    metadata: MetadataNote
    seconds: float


class BuiltLayer(Data):
    layer: int
    mixer: str
    ffn: str
    features: int
    built: bool  # built by this statement (False: read from the container, already fresh)
    seconds: float | None  # the build time the index records for the layer


class BuildFeaturesResult(Result):
    """BUILD FEATURES: the feature metadata of the chosen FFN layers, and where it lives."""

    kind: Literal["build_features"] = "build_features"
    metadata: MetadataNote
    layers: list[BuiltLayer]
    skipped: list[SkippedLayer]
    directory: str  # inside the container
    files: int  # in the derived representation, every layer built so far
    bytes: int
    summary: str | None
    ffn_layers: int  # layers of the model that have FFN features


# ---- running ------------------------------------------------------------------------------


@fam.runs(WalkPlan)
def run_walk(session, node: WalkPlan) -> WalkResult:
    r = internals(session).walk(internals_query(node.prompt), top=node.top, layers=node.layers)
    return WalkResult.model_validate({**internals_data(r), "notes": list(node.notes)})


@fam.runs(DescribePlan)
def run_describe(session, node: DescribePlan) -> DescribeResult:
    r = internals(session).describe(node.entity, layers=node.layers, top=node.top, threshold=node.threshold)
    return DescribeResult.model_validate({**internals_data(r), "notes": list(node.notes)})


@fam.runs(SelectFeaturesPlan)
def run_select(session, node: SelectFeaturesPlan) -> SelectFeaturesResult:
    from vindex3.internals import Condition, FeatureQuery

    q = FeatureQuery(columns=list(node.columns), layers=list(node.layers) if node.layers is not None else None,
                     nearest_to=internals_query(node.nearest) if node.nearest is not None else None,
                     where=[Condition(column=w.column, op=w.op, value=w.value) for w in node.where],
                     order_by=node.order_by, descending=node.descending, limit=node.limit)
    r = internals(session).select(q)
    return SelectFeaturesResult.model_validate(internals_data(r))


@fam.runs(ShowFeaturesPlan)
def run_show_features(session, node: ShowFeaturesPlan) -> ShowFeaturesResult:
    r = internals(session).show_features(node.layer, limit=node.limit)
    return ShowFeaturesResult.model_validate(internals_data(r))


@fam.runs(ExplainFeaturesPlan)
def run_explain_features(session, node: ExplainFeaturesPlan) -> FeatureActivityResult:
    r = internals(session).feature_activity(list(node.prompt.ids), top=node.top, layers=node.layers,
                                            slice=node.slice.depth, intervention=node.intervention,
                                            activations=session.settings.activations)
    return FeatureActivityResult.model_validate(with_text(internals_data(r), node.prompt))


@fam.runs(BuildFeaturesPlan)
def run_build_features(session, node: BuildFeaturesPlan) -> BuildFeaturesResult:
    from vindex3.internals.metadata import DIRECTORY, KIND

    ix = internals(session)
    note = ix.build_metadata(node.layers)
    infos = session.catalog.feature_layers
    chosen = node.layers if node.layers is not None else range(len(infos))
    entry = ((ix.container.index.get("derived") or {}).get(KIND) or {}) if note.cached else {}
    recorded = entry.get("layers") or {}
    built = set(note.built_layers)
    rows, skipped = [], []
    for i in chosen:
        x = infos[i]
        if not x.has_features:
            skipped.append(SkippedLayer(layer=i, operator=x.mixer, reason=x.reason or "no features"))
            continue
        secs = (recorded.get(str(i)) or {}).get("seconds")
        rows.append(BuiltLayer(layer=i, mixer=x.mixer, ffn=x.ffn or "-", features=int(x.features), built=i in built,
                               seconds=float(secs) if isinstance(secs, (int, float)) else None))
    row = next((d for d in ix.container.derived if d.key == KIND), None) if note.cached else None
    return BuildFeaturesResult(
        metadata=MetadataNote.model_validate(note.model_dump()), layers=rows, skipped=skipped, directory=DIRECTORY,
        files=row.files if row is not None else 0, bytes=row.bytes if row is not None else 0,
        summary=row.summary if row is not None else None, ffn_layers=sum(x.has_features for x in infos))


# ---- layouts and rows ---------------------------------------------------------------------


@fam.layout(WalkResult)
def layout_walk(r: WalkResult, timing: bool) -> list[str]:
    out = [(f"walk {prompt_text(r.prompt)}: the query is the embedding of its last token "
           f"{token(r.query_token, r.query_id)} (id {r.query_id}); the top {r.top} features per layer by |gate score|")]
    rows, first = [], []
    for lay in r.layers:
        for j, h in enumerate(lay.features):
            rows.append([str(lay.layer), str(h.feature), f"{h.score:.2f}", token_list(h.tokens)])
            first.append(j == 0)
    out += table([num("layer"), num("feature"), num("gate score"), "writes"], layer_groups(rows, first))
    tail = fields([*skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


@fam.layout(DescribeResult)
def layout_describe(r: DescribeResult, timing: bool) -> list[str]:
    own = ", ".join(token(t, i) for t, i in zip(r.prompt.tokens, r.prompt.ids))
    out = [(f"describe {fmt_text(r.entity)} (tokens {own}): {r.passing:,} feature(s) with gate score > {r.threshold:g} "
           f"in {layers_phrase(r.layers)}")]
    if r.excluded:
        out.append(f"{r.excluded:,} of them write the entity's own tokens ({', '.join(fmt_text(t) for t in r.excluded_tokens)}) "
                   "and are left out")
    if not r.edges:
        out.append("no edges: no feature passes the threshold (SET threshold = n to lower it)")
    else:
        shown = f"the top {len(r.edges)}" if len(r.edges) < r.total_edges else "all"
        out.append(f"{r.total_edges:,} edge(s), {shown} by best gate score:")
        out += table(
            ["edge", num("best gate"), "at", "layers", num("features"), "also writes"],
            [[f"{e.source} -> {token(e.target, e.target_id)}", f"{e.best_score:.2f}", f"L{e.best_layer}:{e.best_feature}",
              f"{e.first_layer}-{e.last_layer}" if e.first_layer != e.last_layer else str(e.first_layer), str(e.count),
              ", ".join(token(t, i) for t, i in zip(e.also, e.also_ids)) or "-"] for e in r.edges],
        )
    tail = fields([*skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


def _feature_cell(col: str, x: FeatureRow) -> str:
    if col == "token":
        return token(x.token, x.token_id)
    if col == "score":
        return f"{x.score:.4f}"
    return str(getattr(x, col))


@fam.layout(SelectFeaturesResult)
def layout_select(r: SelectFeaturesResult, timing: bool) -> list[str]:
    cols = r.columns
    if r.rows:
        out = table([c if c == "token" else num(c) for c in cols], [[_feature_cell(c, x) for c in cols] for x in r.rows])
    else:
        out = ["no feature matches"]
    limit = r.query.limit
    count = (f"{len(r.rows):,} of {r.total:,} matching features (LIMIT {limit})" if limit is not None and r.total > len(r.rows)
             else f"{r.total:,} matching feature{'' if r.total == 1 else 's'}")
    tail = fields([("rows", f"{count} in {layers_phrase(r.layers)}"), ("score", r.score) if "score" in cols else ("", None),
                   *skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


@fam.layout(ShowFeaturesResult)
def layout_show_features(r: ShowFeaturesResult, timing: bool) -> list[str]:
    k = len(r.rows[0].tokens) if r.rows else 0
    out = [(f"layer {r.layer}: {r.features:,} features ({r.ffn} after {r.mixer}); the top {k} tokens each down column "
           "writes, with their logits")]
    out += table([num("feature"), "writes"], [[str(x.feature), token_list(x.tokens, logits=True)] for x in r.rows])
    if len(r.rows) < r.features:
        out.append(f"{len(r.rows):,} of {r.features:,} features shown")
    return out + fields(metadata_fields(r.metadata, timing))


@fam.layout(FeatureActivityResult)
def layout_activity(r: FeatureActivityResult, timing: bool) -> list[str]:
    pos_tok = r.prompt.tokens[r.position] if r.position < len(r.prompt.tokens) else None
    out = [(f"features most active at position {r.position} ({token(pos_tok, r.prompt.ids[r.position])}, the last) "
           f"of {prompt_text(r.prompt)}: {r.slice}, {layers_phrase(r.executed_layers)}")]
    out += fields([("ablated", intervention(r.intervention)),
                   ("next token", f"{token(r.next_token, r.next_id)} (id {r.next_id})"),
                   ("activation", ("the coefficient the feature's down column is written with (ranked by size); "
                                  "gate: its gate pre-activation"))])
    headers = [num("layer"), num("feature"), num("activation"), num("gate"), "writes"]
    ablation = r.intervention is not None
    if ablation:
        headers.insert(4, "ablated")
    rows, first = [], []
    for lay in r.layers:
        for j, f in enumerate(lay.features):
            row = [str(lay.layer), str(f.feature), f"{f.activation:.4f}", f"{f.gate:.2f}", token_list(f.tokens)]
            if ablation:
                row.insert(4, "yes (zeroed)" if f.ablated else "")
            rows.append(row)
            first.append(j == 0)
    out += table(headers, layer_groups(rows, first))
    tail = fields([*skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


@fam.layout(BuildFeaturesResult)
def layout_build_features(r: BuildFeaturesResult, timing: bool) -> list[str]:
    m = r.metadata
    built = [x.layer for x in r.layers if x.built]
    read = [x.layer for x in r.layers if not x.built]
    out = [(f"feature metadata: the top {m.k} tokens each feature's down column writes, "
           f"{layers_phrase([x.layer for x in r.layers])} ({len(r.layers)} of {r.ffn_layers} FFN layers)")]
    out += fields([
        ("built now", (layers_phrase(built) + (f" in {fmt_seconds(m.build_seconds)}" if timing else "")) if built else "none"),
        ("already fresh", layers_phrase(read) if read else None),
        ("rebuilt", m.rebuilt),
        ("stored", f"{r.directory} in the container: {r.files} file(s), {fmt_bytes(r.bytes)}" if m.cached
         else f"kept in memory only: {m.note}"),
        *skipped_fields(r.skipped),
    ])
    headers = [num("layer"), "mixer", "ffn", num("features"), "status"] + (["build time"] if timing else [])
    rows = []
    for x in r.layers:
        row = [str(x.layer), x.mixer, x.ffn, fmt_int(x.features), "built now" if x.built else "fresh"]
        if timing:
            row.append(fmt_seconds(x.seconds))
        rows.append(row)
    return out + [""] + table(headers, rows)


@fam.records(WalkResult)
def records_walk(r: WalkResult) -> list[dict[str, Any]]:
    return [{"layer": lay.layer, "mixer": lay.mixer, "ffn": lay.ffn, "feature": h.feature, "score": h.score,
             "tokens": [t.text for t in h.tokens], "token_ids": [t.id for t in h.tokens],
             "token_logits": [t.logit for t in h.tokens]} for lay in r.layers for h in lay.features]


@fam.records(DescribeResult)
def records_describe(r: DescribeResult) -> list[dict[str, Any]]:
    return [dump(e) for e in r.edges]


@fam.records(SelectFeaturesResult)
def records_select(r: SelectFeaturesResult) -> list[dict[str, Any]]:
    cols = list(r.columns) + (["token_id"] if "token" in r.columns else [])
    return [{c: getattr(x, c) for c in cols} for x in r.rows]


@fam.records(ShowFeaturesResult)
def records_show_features(r: ShowFeaturesResult) -> list[dict[str, Any]]:
    return [{"layer": r.layer, "feature": x.feature, "tokens": [t.text for t in x.tokens],
             "token_ids": [t.id for t in x.tokens], "token_logits": [t.logit for t in x.tokens]} for x in r.rows]


@fam.records(FeatureActivityResult)
def records_activity(r: FeatureActivityResult) -> list[dict[str, Any]]:
    return [{"layer": lay.layer, "mixer": lay.mixer, "ffn": lay.ffn, "feature": f.feature, "activation": f.activation,
             "gate": f.gate, "ablated": f.ablated, "tokens": [t.text for t in f.tokens],
             "token_ids": [t.id for t in f.tokens]} for lay in r.layers for f in lay.features]


@fam.records(BuildFeaturesResult)
def records_build_features(r: BuildFeaturesResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.layers]
