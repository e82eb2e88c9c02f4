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

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import ast, catalog, files, limits
from .binding import Catalog, SliceBinding
from .errors import NoContainer, SettingError, StatementError


@dataclass(frozen=True)
class Context:
    """What the planner may know: the catalog of the bound container (None when unbound), the
    session's default draft depth and its settings."""

    catalog: Catalog | None
    draft_depth: int | None = None
    settings: Mapping[str, Any] = field(default_factory=dict)
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


@dataclass(frozen=True)
class BoundPrompt:
    """A prompt as the model will see it: its text (None for TOKENS), the token ids, and
    whether the chat template wrapped the text."""

    text: str | None
    ids: tuple[int, ...]
    chat: bool = False


@dataclass(frozen=True, eq=False)
class Open(Node):
    path: str | None
    default: bool
    shards: int  # 0: one process; n: n layer-range actors


@dataclass(frozen=True, eq=False)
class UseRemote(Node):
    """USE REMOTE: bind the session to a server (the URL already checked)."""

    url: str
    model: str | None


@dataclass(frozen=True, eq=False)
class RemoteStatement(Node):
    """A statement of a remote-bound session: it runs on the server (``remote``)."""

    remote: Any

    def describe(self) -> str:
        return f"{self.statement.keyword} on {self.remote.url}"


@dataclass(frozen=True, eq=False)
class RemoteSet(Node):
    """SET in a remote-bound session: sent to the server (whose planner reads top, chat,
    compare), then applied here too (format, timing, pager are the local console's)."""

    remote: Any
    local: SetSetting


@dataclass(frozen=True, eq=False)
class Stats(Node):
    positions: int | None


@dataclass(frozen=True, eq=False)
class ShowLayers(Node):
    layers: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ShowComponents(Node):
    pass


@dataclass(frozen=True, eq=False)
class ShowRepresentations(Node):
    filter: str | None


@dataclass(frozen=True, eq=False)
class ShowProvenance(Node):
    pass


@dataclass(frozen=True, eq=False)
class ShowOperands(Node):
    layer: int | None


@dataclass(frozen=True, eq=False)
class ShowSettings(Node):
    pass


@dataclass(frozen=True, eq=False)
class Run(Node):
    """INFER: prefill the prompt on the slice, then the TOP n candidates and/or n greedy
    tokens. Generation stops at an end-of-sequence id in ``stop_ids`` unless ``exactly``."""

    slice: SliceBinding
    prompt: BoundPrompt
    top: int | None
    generate: int | None
    exactly: bool = False
    stop_ids: tuple[int, ...] = ()

    def describe(self) -> str:
        parts = []
        if self.top is not None:
            parts.append(f"the top {self.top} next tokens")
        if self.generate is not None:
            stop = ("" if self.exactly or not self.stop_ids else
                    f", stopping at end-of-sequence ({', '.join(map(str, self.stop_ids))})")
            parts.append(f"{self.generate} greedy tokens{' exactly' if self.exactly else ''}{stop}")
        head = f"INFER: prefill {len(self.prompt.ids)} tokens"
        return head + (", then " + " and ".join(parts) if parts else "")


@dataclass(frozen=True, eq=False)
class Speculate(Node):
    """INFER ... SPECULATE: the draft slice proposes ``lookahead`` tokens, the full model
    (``target``) verifies them; ``generate`` tokens in all."""

    prompt: BoundPrompt
    target: SliceBinding
    draft: SliceBinding
    generate: int
    lookahead: int
    compare: bool

    def describe(self) -> str:
        return (f"INFER: prefill {len(self.prompt.ids)} tokens, then {self.generate} tokens by self-speculation "
                f"({self.draft.label} proposes {self.lookahead} at a time, the {self.target.label} verifies)")


@dataclass(frozen=True, eq=False)
class Explain(Node):
    """EXPLAIN: the slice plan, and the node INFER would run (None for a bare EXPLAIN)."""

    slice: SliceBinding
    target: Run | Speculate | None = None


@dataclass(frozen=True, eq=False)
class Trace(Node):
    slice: SliceBinding
    prompt: BoundPrompt


@dataclass(frozen=True, eq=False)
class SetDraft(Node):
    """DRAFT DEPTH n (slice bound) or DRAFT OFF (slice of the full model, or None unbound)."""

    slice: SliceBinding | None
    depth: int | None


@dataclass(frozen=True, eq=False)
class Ladder(Node):
    depths: tuple[int, ...]
    prompts: str
    into: str | None
    plot: str | None
    overwrite: bool = False


@dataclass(frozen=True, eq=False)
class Dump(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    into: str
    overwrite: bool = False


@dataclass(frozen=True, eq=False)
class Score(Node):
    draft: str
    target: str


@dataclass(frozen=True, eq=False)
class Verify(Node):
    pass


@dataclass(frozen=True, eq=False)
class Admit(Node):
    path: str


@dataclass(frozen=True, eq=False)
class Encode(Node):
    checkpoint: str
    into: str
    replaces: bool = False  # OVERWRITE: an existing container at ``into`` is replaced when the encode succeeds


@dataclass(frozen=True, eq=False)
class Help(Node):
    topic: str | None
    text: str


@dataclass(frozen=True, eq=False)
class SetSetting(Node):
    name: str
    value: Any  # parsed by the setting's own parser


# ---- planning -------------------------------------------------------------------------

_PLANNERS: dict[type[ast.Statement], tuple[Callable[[Any, Context], Node], bool]] = {}


def plans(stmt_type: type[ast.Statement], *, needs_container: bool = False):
    """Register the function that plans ``stmt_type``. With ``needs_container`` the statement
    is refused (`NoContainer`) when no container is bound, after its own checks pass."""

    def register(fn):
        _PLANNERS[stmt_type] = (fn, needs_container)
        return fn

    return register


def _err(stmt: ast.Statement, message: str, hint: str | None = None) -> StatementError:
    return StatementError(message, hint=hint, line=stmt.line, column=stmt.column, statement=stmt.source)


def _positive(stmt: ast.Statement, value: int | None, what: str, example: str) -> None:
    if value is not None and value < 1:
        raise _err(stmt, f"{what} must be at least 1, got {value}", hint=f"e.g. {example}")


def plan(stmt: ast.Statement, ctx: Context) -> Node:
    """Bind one statement. Raises `StatementError`, `NoContainer`, `SettingError`, or a
    vindex3 refusal (a depth the model does not have, a missing tokenizer)."""
    entry = _PLANNERS.get(type(stmt))
    if entry is None:  # a grammar rule without a planner is a bug
        raise _err(stmt, f"{type(stmt).__name__} has no plan")
    fn, needs_container = entry
    if ctx.remote is not None and not isinstance(stmt, _LOCAL_WHEN_REMOTE):
        if isinstance(stmt, ast.Set):
            return RemoteSet(stmt, remote=ctx.remote, local=fn(stmt, ctx))
        return RemoteStatement(stmt, remote=ctx.remote)
    if needs_container:
        _check(stmt, ctx)  # what needs no model is refused even with nothing bound
        if not ctx.bound:
            raise NoContainer(
                f"{stmt.keyword} needs an open container, and none is open",
                hint="OPEN 'path/to/model.vindex3' (or OPEN DEFAULT) first",
                line=stmt.line, column=stmt.column, statement=stmt.source,
            )
    return fn(stmt, ctx)


# What a remote-bound session still runs here: binding (OPEN leaves the server, USE REMOTE
# moves to another), the statement catalogue and the local settings table.
_LOCAL_WHEN_REMOTE = (ast.Open, ast.UseRemote, ast.Help, ast.ShowSettings)


def _check(s: ast.Statement, ctx: Context) -> None:
    """The checks that need no container."""
    match s:
        case ast.Stats():
            _positive(s, s.positions, "STATS AT ... POSITIONS", "STATS AT 4096 POSITIONS")
        case ast.ShowLayers():
            if s.start is not None and s.end is not None and s.end < s.start:
                raise _err(s, f"RANGE {s.start}-{s.end} runs backwards", hint=f"write RANGE {s.end}-{s.start}")
        case ast.Infer():
            _check_infer(s)
        case ast.Explain() if s.infer is not None:
            _check_infer(s.infer)
        case ast.DraftLadder():
            seen: set[int] = set()
            for d in s.depths:
                if d in seen:
                    raise _err(s, f"DRAFT LADDER lists depth {d} twice")
                seen.add(d)


def _check_infer(s: ast.Infer) -> None:
    _positive(s, s.top, "TOP", "TOP 5")
    _positive(s, s.generate, "GENERATE", "GENERATE 20")
    if s.exactly and s.generate is None:  # the grammar ties EXACTLY to GENERATE; kept for clarity
        raise _err(s, "EXACTLY belongs to GENERATE n", hint="e.g. GENERATE 20 EXACTLY")
    if s.speculate is not None or s.lookahead is not None:
        if s.speculate is None:
            raise _err(s, "LOOKAHEAD only applies to speculative decoding",
                       hint="add SPECULATE DEPTH d, e.g. INFER 'text' GENERATE 20 SPECULATE DEPTH 2 LOOKAHEAD 4")
        _positive(s, s.lookahead, "LOOKAHEAD", "LOOKAHEAD 4")
        if s.generate is None:
            raise _err(s, "SPECULATE needs GENERATE n: speculation is a way of generating tokens",
                       hint="e.g. INFER 'text' GENERATE 20 SPECULATE DEPTH 2")
        if s.depth is not None:
            raise _err(s, "SPECULATE verifies with the full model, so DRAFT DEPTH cannot be combined with it",
                       hint="the draft that proposes tokens is SPECULATE DEPTH d")
        if s.top is not None:
            raise _err(s, "TOP cannot be combined with SPECULATE", hint="run INFER 'text' TOP n on its own")


def _depth(ctx: Context, depth: int | None) -> int | None:
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


@plans(ast.Open)
def _open(s: ast.Open, ctx: Context) -> Node:
    _positive(s, s.shards, "SHARDS", "OPEN 'model.vindex3' SHARDS 2")
    if not s.default:
        files.container_dir(s.path)
    return Open(s, path=s.path, default=s.default, shards=s.shards if s.shards is not None else ctx.settings["shards"])


@plans(ast.UseRemote)
def _use_remote(s: ast.UseRemote, ctx: Context) -> Node:
    from .server.client import check_url

    if s.model is not None and not s.model:
        raise _err(s, "USE REMOTE ... MODEL '' names no model", hint="leave MODEL out to use the server's only model")
    return UseRemote(s, url=check_url(s.url), model=s.model)


@plans(ast.Stats, needs_container=True)
def _stats(s: ast.Stats, ctx: Context) -> Node:
    return Stats(s, positions=s.positions)


@plans(ast.Explain, needs_container=True)
def _explain(s: ast.Explain, ctx: Context) -> Node:
    if s.infer is not None:
        target = _infer(s.infer, ctx)
        sl = target.slice if isinstance(target, Run) else target.target
        return Explain(s, slice=sl, target=target)
    return Explain(s, slice=ctx.catalog.bind_slice(_depth(ctx, s.depth)))


@plans(ast.ShowLayers, needs_container=True)
def _show_layers(s: ast.ShowLayers, ctx: Context) -> Node:
    n = ctx.catalog.num_layers
    if s.start is None:
        return ShowLayers(s, layers=tuple(range(n)))
    ctx.catalog.check_layer(s.start)
    ctx.catalog.check_layer(s.end)
    return ShowLayers(s, layers=tuple(range(s.start, s.end + 1)))


@plans(ast.ShowComponents, needs_container=True)
def _show_components(s: ast.ShowComponents, ctx: Context) -> Node:
    return ShowComponents(s)


@plans(ast.ShowRepresentations, needs_container=True)
def _show_representations(s: ast.ShowRepresentations, ctx: Context) -> Node:
    return ShowRepresentations(s, filter=s.filter)


@plans(ast.ShowProvenance, needs_container=True)
def _show_provenance(s: ast.ShowProvenance, ctx: Context) -> Node:
    return ShowProvenance(s)


@plans(ast.ShowOperands, needs_container=True)
def _show_operands(s: ast.ShowOperands, ctx: Context) -> Node:
    if s.layer is not None:
        ctx.catalog.check_layer(s.layer)
    return ShowOperands(s, layer=s.layer)


@plans(ast.ShowSettings)
def _show_settings(s: ast.ShowSettings, ctx: Context) -> Node:
    return ShowSettings(s)


@plans(ast.Infer, needs_container=True)
def _infer(s: ast.Infer, ctx: Context) -> Run | Speculate:
    cat = ctx.catalog
    limits.check_count(s.generate, "max_generate", ctx.settings, "GENERATE", "tokens")
    # CHAT on the statement is explicit; the setting applies to text prompts only
    chat = s.chat if s.chat is not None else (bool(ctx.settings.get("chat")) and isinstance(s.prompt, ast.TextPrompt))
    if s.speculate is not None:
        lookahead = s.lookahead if s.lookahead is not None else ctx.settings["lookahead"]
        limits.check_count(lookahead, "max_lookahead", ctx.settings, "LOOKAHEAD", "draft tokens per round")
        draft = cat.bind_slice(s.speculate)  # refuses depth 0 or deeper than the model
        target = cat.bind_slice(None)
        prompt = bind_prompt(ctx, s.prompt, chat=chat)
        node = Speculate(s, prompt=prompt, target=target, draft=draft, generate=s.generate,
                         lookahead=lookahead, compare=bool(ctx.settings.get("compare", True)))
        _check_speculate(node, ctx)
        return node
    sl = cat.bind_slice(_depth(ctx, s.depth))  # a bad depth is refused before tokenising anything
    prompt = bind_prompt(ctx, s.prompt, chat=chat)
    top = s.top if s.top is not None else (None if s.generate is not None else ctx.settings.get("top", 5))
    stop = () if s.exactly or s.generate is None else cat.eos_ids()
    node = Run(s, slice=sl, prompt=prompt, top=top, generate=s.generate, exactly=s.exactly, stop_ids=stop)
    _check_run(node, ctx)
    return node


def _run_words(keyword: str, p: int, g: int = 0) -> str:
    return f"{keyword} ({p:,} prompt token{'s' if p != 1 else ''}" + (f" + {g:,} generated)" if g else ")")


def _check_run(node: Run, ctx: Context) -> None:
    """INFER's limits: prompt + generated positions, and the arrays of its largest pass."""
    cat, p, g, depth = ctx.catalog, len(node.prompt.ids), node.generate or 0, node.slice.depth
    limits.check_positions(p + g, cat.context_length, ctx.settings, _run_words("INFER", p, g))
    steps = cat.estimate(1, depth, start=p + g - 2) if g > 1 else None
    limits.Need().add("the largest pass", limits.largest(cat.estimate(p, depth), steps)).check(ctx.settings, "INFER")


def _check_speculate(node: Speculate, ctx: Context) -> None:
    """SPECULATE's limits: prompt + generated positions (a round never proposes past them: both
    streams hold at most prompt + n - 1 positions), and the arrays of the three streams it runs
    (the full model, the draft and, with compare on, plain greedy decoding)."""
    cat, p, g = ctx.catalog, len(node.prompt.ids), node.generate
    limits.check_positions(p + g, cat.context_length, ctx.settings, _run_words("INFER ... SPECULATE", p, g))
    k = min(node.lookahead, g - 1)
    end = p + g - 2  # positions held before the last one-token pass
    need = limits.Need()
    need.add("full model", limits.largest(cat.estimate(p, None), cat.estimate(k + 1, None, start=p + g - k - 2)))
    need.add(f"draft depth {node.draft.depth}", limits.largest(cat.estimate(p, node.draft.depth),
                                                              cat.estimate(1, node.draft.depth, start=max(end, 0))))
    if node.compare:
        need.add("plain greedy", limits.largest(cat.estimate(p, None), cat.estimate(1, None, start=max(end, 0))))
    need.check(ctx.settings, "INFER ... SPECULATE")


@plans(ast.Trace, needs_container=True)
def _trace(s: ast.Trace, ctx: Context) -> Node:
    cat = ctx.catalog
    sl = cat.bind_slice(_depth(ctx, s.depth))
    prompt = bind_prompt(ctx, s.prompt)
    p = len(prompt.ids)
    limits.check_positions(p, cat.context_length, ctx.settings, _run_words("TRACE", p))
    limits.Need().add("one step at the end", cat.estimate(1, sl.depth, start=p - 1)).check(ctx.settings, "TRACE")
    return Trace(s, slice=sl, prompt=prompt)


@plans(ast.DraftDepth, needs_container=True)
def _draft_depth(s: ast.DraftDepth, ctx: Context) -> Node:
    return SetDraft(s, slice=ctx.catalog.bind_slice(s.depth), depth=s.depth)


@plans(ast.DraftOff)
def _draft_off(s: ast.DraftOff, ctx: Context) -> Node:
    return SetDraft(s, slice=ctx.catalog.bind_slice(None) if ctx.bound else None, depth=None)


@plans(ast.DraftLadder, needs_container=True)
def _ladder(s: ast.DraftLadder, ctx: Context) -> Node:
    for d in s.depths:
        ctx.catalog.bind_slice(d)  # the same refusal as DRAFT DEPTH n for a depth the model lacks
    overwrite = _overwrite(s, ctx)
    inside = files.container_paths(ctx.catalog)
    files.input_file(s.prompts, "DRAFT LADDER prompt bank")
    if s.into is not None:
        files.output_file(s.into, "DRAFT LADDER report", overwrite=overwrite, inside=inside)
    if s.plot is not None:
        files.output_file(s.plot, "DRAFT LADDER chart", overwrite=overwrite, inside=inside)
        if s.into is not None and _same_file(s.into, s.plot):
            raise _err(s, f"DRAFT LADDER writes its report and its chart to the same file {s.plot!r}",
                       hint="give PLOT INTO another file")
    return Ladder(s, depths=tuple(s.depths), prompts=s.prompts, into=s.into, plot=s.plot, overwrite=overwrite)


def _same_file(a: str, b: str) -> bool:
    import os

    return os.path.realpath(a) == os.path.realpath(b)


@plans(ast.DumpLogits, needs_container=True)
def _dump(s: ast.DumpLogits, ctx: Context) -> Node:
    cat = ctx.catalog
    overwrite = _overwrite(s, ctx)
    files.output_file(s.into, "DUMP LOGITS file", overwrite=overwrite, inside=files.container_paths(cat))
    sl = cat.bind_slice(_depth(ctx, s.depth))
    prompt = bind_prompt(ctx, s.prompt)
    p = len(prompt.ids)
    limits.check_positions(p, cat.context_length, ctx.settings, _run_words("DUMP LOGITS", p))
    (limits.Need().add("one step at the end", cat.estimate(1, sl.depth, start=p - 1))
     .add(f"the logits [{p:,}, {cat.vocab:,}] and their bytes", extra=2 * p * cat.vocab * 4)
     .check(ctx.settings, "DUMP LOGITS"))
    return Dump(s, slice=sl, prompt=prompt, into=s.into, overwrite=overwrite)


def _overwrite(s: ast.Statement, ctx: Context) -> bool:
    """Whether a writing statement may replace an existing file: its OVERWRITE clause, or the
    session's ``overwrite`` setting."""
    return bool(getattr(s, "overwrite", False)) or bool(ctx.settings.get("overwrite", False))


@plans(ast.ScoreDraft)
def _score(s: ast.ScoreDraft, ctx: Context) -> Node:
    files.input_file(s.draft, "SCORE DRAFT draft dump")
    files.input_file(s.target, "SCORE DRAFT target dump")
    return Score(s, draft=s.draft, target=s.target)


@plans(ast.Verify, needs_container=True)
def _verify(s: ast.Verify, ctx: Context) -> Node:
    return Verify(s)


@plans(ast.Plan)
def _admit(s: ast.Plan, ctx: Context) -> Node:
    files.source(s.path, "checkpoint")
    return Admit(s, path=s.path)


@plans(ast.Encode)
def _encode(s: ast.Encode, ctx: Context) -> Node:
    files.source(s.checkpoint, "checkpoint")
    overwrite = _overwrite(s, ctx)
    inside = files.container_paths(ctx.catalog) if ctx.bound else []
    replaces = files.encode_target(s.into, overwrite=overwrite, inside=inside)
    return Encode(s, checkpoint=s.checkpoint, into=s.into, replaces=replaces)


@plans(ast.Help)
def _help(s: ast.Help, ctx: Context) -> Node:
    text = catalog.help_text(s.topic)
    if text is None:
        close = catalog.closest_topics(s.topic)
        raise StatementError(
            f"HELP has no entry for {s.topic!r}",
            hint=(f"did you mean {' or '.join(close)}? " if close else "") + "HELP alone lists every statement",
        )
    return Help(s, topic=s.topic, text=text)


@plans(ast.Set)
def _set(s: ast.Set, ctx: Context) -> Node:
    doc = catalog.setting(s.name)
    if doc is None:
        raise SettingError(f"there is no setting named {s.name!r}",
                           hint="settings: " + ", ".join(x.name for x in catalog.SETTINGS))
    try:
        value = doc.parse(s.value)
    except ValueError as e:
        raise SettingError(f"setting {s.name} {e}; got {s.value!r}") from None
    return SetSetting(s, name=s.name, value=value)

