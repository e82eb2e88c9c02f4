"""Statement → plan node. The planner binds a statement against a read-only catalog view of the
open container (`lql.binding.Catalog`) and the session's settings, and returns a typed plan
node: what will run, on which slice (vindex3's own slice plan object), over which token ids.
EXPLAIN renders the node INFER would run; the command modules (`lql.commands`) execute nodes.

It refuses what can be judged before anything runs: a clause that contradicts another, a count
of zero, a range that runs backwards, a missing container, and, through the catalog, a depth
the model does not have (vindex3's `SliceError`, the one authority for depths), a layer it does
not have, a token outside the vocabulary. It never reads tensor data and never runs a model.

Adding a statement: a grammar rule (grammar/lql.lark), an AST node (lql/ast.py), a plan node
and a ``@plans(ast.X)`` function here, a command module under lql/commands/ registered for the
node, a result class (lql/results.py) with its layout in lql/render.py."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import ast, catalog
from .binding import Catalog, SliceBinding
from .errors import NoContainer, StatementError
from .text import fmt_layers


@dataclass(frozen=True)
class Context:
    """What the planner may know: the catalog of the bound container (None when unbound), the
    session's default draft depth and its settings."""

    catalog: Catalog | None
    draft_depth: int | None = None
    settings: catalog.Settings = field(default_factory=catalog.Settings)
    remote: Any = None  # lql.server.client.Remote when the session is bound to a server (USE REMOTE)

    @property
    def bound(self) -> bool:
        return self.catalog is not None


# ---- plan nodes -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Node:
    """A planned statement. ``statement`` is the AST node it came from."""

    statement: ast.Statement

    def describe(self) -> str:
        return self.statement.keyword

    def bound_prompt(self) -> BoundPrompt | None:
        """The prompt the node runs (a server bounds its length), if it runs one."""
        target = getattr(self, "target", None)
        if isinstance(target, Node):  # EXPLAIN INFER: the INFER it shows
            return target.bound_prompt()
        prompt = getattr(self, "prompt", None)
        return prompt if isinstance(prompt, BoundPrompt) else None


@dataclass(frozen=True)
class BoundPrompt:
    """A prompt as the model will see it: its text (None for TOKENS), the token ids, and
    whether the chat template wrapped the text."""

    text: str | None
    ids: tuple[int, ...]
    chat: bool = False


@dataclass(frozen=True, eq=False)
class RemoteStatement(Node):
    """A statement of a remote-bound session: it runs on the server (``remote``)."""

    remote: Any

    def describe(self) -> str:
        return f"{self.statement.keyword} on {self.remote.url}"


# ---- looking inside (issue 15): plan nodes -----------------------------------------------


@dataclass(frozen=True, eq=False)
class Walk(Node):
    """WALK: the query is the last token's scaled embedding (``prompt`` tokenised without BOS)."""

    prompt: BoundPrompt
    top: int
    layers: tuple[int, ...] | None  # None: every layer
    notes: tuple[str, ...] = ()  # what MODE, VERBOSE, EXPLAIN WALK meant here


@dataclass(frozen=True, eq=False)
class Describe(Node):
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
class SelectFeatures(Node):
    columns: tuple[str, ...]  # in order, * expanded
    layers: tuple[int, ...] | None
    nearest: BoundPrompt | None  # NEAREST TO: its tokens (no BOS)
    where: tuple[Where, ...]
    order_by: str | None
    descending: bool
    limit: int | None


@dataclass(frozen=True, eq=False)
class ShowFeatures(Node):
    layer: int
    limit: int | None


@dataclass(frozen=True, eq=False)
class ExplainFeatures(Node):
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
class TraceFor(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    target: int  # the token id traced
    layers: tuple[int, ...] | None
    positions: str  # "last" | "all"
    decompose: bool
    save: str | None
    overwrite: bool
    intervention: Any


@dataclass(frozen=True, eq=False)
class Observe(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    generate: int
    lens: tuple[int, ...]
    into: str
    overwrite: bool
    intervention: Any


@dataclass(frozen=True, eq=False)
class BuildFeatures(Node):
    layers: tuple[int, ...] | None


# ---- planning -------------------------------------------------------------------------

_PLANNERS: dict[type[ast.Statement], tuple[Callable[[Any, Context], Node], bool]] = {}


def plans(stmt_type: type[ast.Statement], *, needs_container: bool = False):
    """Register the function that plans ``stmt_type``. With ``needs_container`` the statement
    is refused (`NoContainer`) when no container is bound, after its own checks pass."""

    def register(fn):
        _PLANNERS[stmt_type] = (fn, needs_container)
        return fn

    return register


def err(stmt: ast.Statement, message: str, hint: str | None = None) -> StatementError:
    return StatementError(message, hint=hint, line=stmt.line, column=stmt.column, statement=stmt.source)


def positive(stmt: ast.Statement, value: int | None, what: str, example: str) -> None:
    if value is not None and value < 1:
        raise err(stmt, f"{what} must be at least 1, got {value}", hint=f"e.g. {example}")


@dataclass(frozen=True, eq=False)
class Identity(Node):
    """The plan of a statement that binds nothing: the statement itself (its runner is found by
    the statement's class)."""


@dataclass(frozen=True, eq=False)
class RemoteMirror(Node):
    """A statement of a remote-bound session that runs on the server and here too (SET: the
    server's planner reads top, chat, compare; format, timing and pager are the local console's):
    ``local`` is its plan here."""

    remote: Any
    local: Node


def plan(stmt: ast.Statement, ctx: Context) -> Node:
    """Bind one statement. Raises `StatementError`, `NoContainer`, `SettingError`, or a
    vindex3 refusal (a depth the model does not have, a missing tokenizer)."""
    from . import registry

    fn = registry.planner_for(type(stmt))
    legacy = _PLANNERS.get(type(stmt))
    if fn is None and legacy is not None:
        fn = legacy[0]
    needs_container = stmt.needs_container or bool(legacy and legacy[1])
    if ctx.remote is not None and not stmt.local_when_remote:
        if stmt.remote_mirror:
            return RemoteMirror(stmt, remote=ctx.remote, local=_bind(fn, stmt, ctx))
        return RemoteStatement(stmt, remote=ctx.remote)
    stmt.check()
    if needs_container:
        _check(stmt, ctx)  # what needs no model is refused even with nothing bound
        if not ctx.bound:
            raise NoContainer(
                f"{stmt.keyword} needs an open container, and none is open",
                hint="OPEN 'path/to/model.vindex3' (or OPEN DEFAULT) first",
                line=stmt.line, column=stmt.column, statement=stmt.source,
            )
    return _bind(fn, stmt, ctx)


def _bind(fn, stmt: ast.Statement, ctx: Context) -> Node:
    return fn(stmt, ctx) if fn is not None else Identity(stmt)


def _check(s: ast.Statement, ctx: Context) -> None:
    """The checks that need no container."""
    match s:
        case ast.Walk() | ast.Describe():
            positive(s, s.top, "TOP", "TOP 5")
            check_span(s, s.layers)
        case ast.SelectFeatures():
            _check_select(s)
        case ast.ShowFeatures():
            pass
        case ast.ExplainFeatures():
            check_infer(s.infer)
            positive(s, s.top, "FEATURES TOP", "FEATURES TOP 5")
            check_span(s, s.layers)
            for word, given in (("GENERATE", s.infer.generate), ("SPECULATE", s.infer.speculate),
                                ("TOP", s.infer.top)):
                if given is not None:
                    hint = ("the number of features goes after FEATURES: EXPLAIN INFER 'text' FEATURES TOP n"
                            if word == "TOP" else "EXPLAIN INFER ... FEATURES reads the prefill of the prompt")
                    raise err(s, f"EXPLAIN INFER ... FEATURES looks at one run of the prompt; {word} does not apply",
                               hint=hint)
        case ast.TraceFor():
            check_span(s, s.layers)
        case ast.Observe():
            if s.generate is not None and s.generate < 0:  # the grammar takes whole numbers; kept for clarity
                raise err(s, f"GENERATE must be at least 0, got {s.generate}")
        case ast.BuildFeatures():
            check_span(s, s.layers)


def check_span(s: ast.Statement, span: tuple[int, int] | None, clause: str = "LAYERS") -> None:
    if span is not None and span[1] < span[0]:
        raise err(s, f"{clause} {span[0]}-{span[1]} runs backwards", hint=f"write {clause} {span[1]}-{span[0]}")


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


def _check_select(s: ast.SelectFeatures) -> None:
    """Columns known, each condition's operator and value of its column's type: all judged
    from the statement alone."""
    seen: set[str] = set()
    for col in s.columns or []:
        name = _known_column(s, col, "the column list")
        if name in seen:
            raise _column_error(s, col, f"column {name!r} is listed twice")
        seen.add(name)
    if s.at_layer is False:
        check_span(s, s.layers)
    for cond in s.where:
        name = _known_column(s, cond.column, "WHERE")
        ops = catalog.FEATURE_COLUMN_OPS[name]
        if cond.op not in ops:
            raise _column_error(s, cond.column, f"column {name!r} does not take {cond.op}",
                                hint=f"{name} takes {', '.join(ops)}")
        want = catalog.FEATURE_COLUMNS[name]
        if cond.op == "IN":
            for v in cond.value:
                _check_value(s, cond, name, want, v)
            continue
        _check_value(s, cond, name, want, cond.value)
    if s.order_by is not None:
        _known_column(s, s.order_by, "ORDER BY")


def _check_value(s: ast.Statement, cond: ast.Condition, name: str, want: type, v) -> None:
    if True:
        if want is str and not isinstance(v, str):
            raise _column_error(s, cond.column, f"{name} {cond.op} needs text, got the number {v!r}",
                                hint=f"quote it: {name} {cond.op} '{v}'")
        if want is not str and isinstance(v, str):
            raise _column_error(s, cond.column, f"{name} {cond.op} needs a number, got the text {v!r}")
        if want is int and isinstance(v, float):
            raise _column_error(s, cond.column, f"{name} {cond.op} needs a whole number, got {v!r}")


def check_infer(s) -> None:
    """INFER's checks that need no container (also run for EXPLAIN INFER and EXPLAIN INFER ... FEATURES)."""
    if s.compare:
        raise err(s, "INFER ... COMPARE sets the reference system's walk prediction beside the dense one; this build "
                   "predicts with the dense model only, so there is nothing to compare it with",
                   hint="INFER 'text' TOP n for the prediction, WALK 'text' for the features the last token opens")
    positive(s, s.top, "TOP", "TOP 5")
    positive(s, s.generate, "GENERATE", "GENERATE 20")
    if s.exactly and s.generate is None:  # the grammar ties EXACTLY to GENERATE; kept for clarity
        raise err(s, "EXACTLY belongs to GENERATE n", hint="e.g. GENERATE 20 EXACTLY")
    if s.speculate is not None or s.lookahead is not None:
        if s.speculate is None:
            raise err(s, "LOOKAHEAD only applies to speculative decoding",
                       hint="add SPECULATE DEPTH d, e.g. INFER 'text' GENERATE 20 SPECULATE DEPTH 2 LOOKAHEAD 4")
        positive(s, s.lookahead, "LOOKAHEAD", "LOOKAHEAD 4")
        if s.generate is None:
            raise err(s, "SPECULATE needs GENERATE n: speculation is a way of generating tokens",
                       hint="e.g. INFER 'text' GENERATE 20 SPECULATE DEPTH 2")
        if s.depth is not None:
            raise err(s, "SPECULATE verifies with the full model, so DRAFT DEPTH cannot be combined with it",
                       hint="the draft that proposes tokens is SPECULATE DEPTH d")
        if s.top is not None:
            raise err(s, "TOP cannot be combined with SPECULATE", hint="run INFER 'text' TOP n on its own")
        if s.ablate is not None:
            raise err(s, "ABLATE FEATURES cannot be combined with SPECULATE: speculation checks itself against the "
                       "unchanged model", hint="run INFER 'text' GENERATE n ABLATE FEATURES (...) without SPECULATE")


def depth_of(ctx: Context, depth: int | None) -> int | None:
    return depth if depth is not None else ctx.draft_depth


def bind_prompt(ctx: Context, prompt: ast.TextPrompt | ast.TokenPrompt, *, chat: bool = False) -> BoundPrompt:
    """Token ids for a prompt: a text through the container's tokenizer (wrapped in its chat
    template with ``chat``), or TOKENS checked against the vocabulary."""
    cat = ctx.catalog
    assert cat is not None
    if isinstance(prompt, ast.TextPrompt):
        if chat:
            from . import chat as chat_mod

            template = cat.chat_template()
            if template is None:
                raise StatementError(f"CHAT needs the model's chat template, and container {cat.name} carries none",
                                     hint="leave CHAT out (or SET chat = off) to run the text as it is")
            rendered = chat_mod.render(template, [{"role": "user", "content": prompt.text}],
                                       add_generation_prompt=True, **cat.special_tokens())
            ids = cat.tokenize(rendered, special=False)
        else:
            ids = cat.tokenize(prompt.text)
        if not ids:
            raise StatementError(f"the prompt {prompt.text!r} tokenises to no tokens")
        bound = BoundPrompt(prompt.text, tuple(ids), chat)
    else:
        if chat:
            raise StatementError("CHAT applies a chat template to text, and TOKENS (...) are ids already",
                                 hint="give the prompt as text, or leave CHAT out")
        if not prompt.ids:
            raise StatementError("TOKENS () holds no token ids")
        bound = BoundPrompt(None, tuple(prompt.ids))
    vocab = cat.vocab
    bad = [i for i in bound.ids if i >= vocab]
    if bad:
        raise StatementError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return bound


def run_words(keyword: str, p: int, g: int = 0) -> str:
    """'INFER (5 prompt tokens + 3 generated)': a run's positions, in words, for a limit's refusal."""
    return f"{keyword} ({p:,} prompt token{'s' if p != 1 else ''}" + (f" + {g:,} generated)" if g else ")")


def routed_or_refuse(s: ast.Statement, ctx: Context, layer: int | None, what: str) -> list[int]:
    """The model's routed-expert layers; refuses a model without any, and a ``layer`` that is
    not one of them, by name."""
    cat = ctx.catalog
    if layer is not None:
        cat.check_layer(layer)
    routed = cat.expert_layers()
    if not routed:
        raise err(s, f"{what} needs routed-expert layers, and model {cat.name} has none (every FFN is dense or absent)",
                   hint="SHOW LAYERS shows each layer's ffn")
    if layer is not None and layer not in routed:
        raise err(s, f"layer {layer} has no routed experts; the routed layers are {fmt_layers(routed)}",
                   hint=f"e.g. {what} AT LAYER {routed[0]}")
    return routed


def may_overwrite(s: ast.Statement, ctx: Context) -> bool:
    """Whether a writing statement may replace an existing file: its OVERWRITE clause, or the
    session's ``overwrite`` setting."""
    return bool(getattr(s, "overwrite", False)) or bool(ctx.settings.overwrite)


# ---- looking inside (issue 15): planning ----------------------------------------------------


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
    why = "; ".join(f"{_layers_word(ls)}: {r}" for r, ls in reasons.items())
    scope = "no layer of this model" if layers is None else f"no layer of {_layers_word(list(layers))}"
    have = [x.layer for x in infos if x.has_features]
    hint = f"layers with FFN features: {_span_text(have)}" if have else None
    raise StatementError(f"{what}: {scope} has FFN features ({why})", hint=hint)


def _span_text(layers) -> str:
    out, xs, i = [], list(layers), 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def _layers_word(layers) -> str:
    return ("layer " if len(layers) == 1 else "layers ") + _span_text(layers)


def _executed_layers(s: ast.Statement, sl: SliceBinding, layers: tuple[int, ...] | None, what: str) -> None:
    if layers is None:
        return
    ran = set(sl.executed_layers)
    missing = [i for i in layers if i not in ran]
    if missing:
        raise StatementError(f"{what}: layer {missing[0]} is not run by the {sl.label} "
                             f"({_layers_word(sl.executed_layers)})", hint="choose layers the slice runs, or leave DRAFT DEPTH out")


@plans(ast.Walk, needs_container=True)
def _walk(s: ast.Walk, ctx: Context) -> Node:
    notes = _walk_dialect(s)
    layers = ctx.catalog.layer_span(s.layers, "LAYERS")
    _feature_layers(s, ctx, layers, "WALK")
    return Walk(s, prompt=bind_pieces(ctx, s.prompt, "WALK"), top=s.top if s.top is not None else 5, layers=layers,
                notes=notes)


@plans(ast.Describe, needs_container=True)
def _describe(s: ast.Describe, ctx: Context) -> Node:
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
    return Describe(s, entity=s.entity, prompt=prompt, top=top, layers=layers,
                    threshold=float(ctx.settings.threshold), notes=notes)


@plans(ast.SelectFeatures, needs_container=True)
def _select(s: ast.SelectFeatures, ctx: Context) -> Node:
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
    return SelectFeatures(s, columns=columns, layers=layers, nearest=nearest, where=where,
                          order_by=s.order_by.name if s.order_by is not None else None, descending=descending,
                          limit=s.limit)


@plans(ast.ShowFeatures, needs_container=True)
def _show_features(s: ast.ShowFeatures, ctx: Context) -> Node:
    cat = ctx.catalog
    cat.check_layer(s.layer)
    info = cat.feature_layers[s.layer]
    if not info.has_features:
        have = [x.layer for x in cat.feature_layers if x.has_features]
        raise err(s, f"SHOW FEATURES AT LAYER {s.layer}: {info.reason}",
                   hint=f"layers with FFN features: {_span_text(have)}" if have else None)
    return ShowFeatures(s, layer=s.layer, limit=s.limit)


@plans(ast.ExplainFeatures, needs_container=True)
def _explain_features(s: ast.ExplainFeatures, ctx: Context) -> Node:
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
    _executed_layers(s, sl, layers, "EXPLAIN INFER ... FEATURES LAYERS")
    ran = tuple(sl.executed_layers)
    _feature_layers(s, ctx, layers if layers is not None else (None if len(ran) == cat.num_layers else ran),
                    "EXPLAIN INFER ... FEATURES")
    ablation = cat.ablation(inf.ablate, sl)
    return ExplainFeatures(s, slice=sl, prompt=bind_prompt(ctx, inf.prompt, chat=chat), intervention=ablation,
                           top=s.top if s.top is not None else 5, layers=layers)


@plans(ast.TraceFor, needs_container=True)
def _trace_for(s: ast.TraceFor, ctx: Context) -> Node:
    if s.save_file and s.positions != "all":
        raise err(s, "TRACE ... SAVE 'file' saves every position's trace, so it needs POSITIONS ALL (as in the "
                   "reference dialect)", hint="add POSITIONS ALL, or write SAVE INTO 'file' for the positions shown")
    if s.token is None:
        raise err(s, "TRACE 'text' without FOR traces the predicted token in the reference dialect; this build "
                   "traces a token you name", hint="add FOR 'token' (INFER 'text' TOP 1 names the prediction)")
    cat = ctx.catalog
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    layers = cat.layer_span(s.layers, "LAYERS")
    _executed_layers(s, sl, layers, "TRACE ... LAYERS")
    ablation = cat.ablation(s.ablate, sl)
    target = cat.single_token(s.token, "TRACE ... FOR")
    return TraceFor(s, slice=sl, prompt=bind_prompt(ctx, s.prompt), target=target, layers=layers,
                    positions=s.positions or "last", decompose=s.decompose, save=s.save,
                    overwrite=bool(s.overwrite or ctx.settings.overwrite), intervention=ablation)


@plans(ast.Observe, needs_container=True)
def _observe(s: ast.Observe, ctx: Context) -> Node:
    cat = ctx.catalog
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    ablation = cat.ablation(s.ablate, sl)
    lens = tuple(cat.single_token(t, "OBSERVE ... LENS") for t in s.lens)
    return Observe(s, slice=sl, prompt=bind_prompt(ctx, s.prompt), generate=s.generate or 0, lens=lens, into=s.into,
                   overwrite=bool(s.overwrite or ctx.settings.overwrite), intervention=ablation)


@plans(ast.BuildFeatures, needs_container=True)
def _build_features(s: ast.BuildFeatures, ctx: Context) -> Node:
    layers = ctx.catalog.layer_span(s.layers, "LAYERS")
    _feature_layers(s, ctx, layers, "BUILD FEATURES")
    return BuildFeatures(s, layers=layers)


# ---- the reference dialect (issue 19) -----------------------------------------------------


_NO_RELATIONS = ("{what} keeps edges that carry a relation label (the reference system's probe-labelled knowledge "
                 "graph), and this build's feature metadata carries no relation labels")
_NO_RELATIONS_HINT = "leave it out: the edges are the tokens each feature writes"
_NO_PATCHES = "this build has no patch overlay"


def _score_value(c: ast.Condition):
    return [float(v) for v in c.value] if isinstance(c.value, list) else float(c.value)


def _walk_dialect(s: ast.Walk) -> tuple[str, ...]:
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


def _describe_layers(s: ast.Describe, ctx: Context) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
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
