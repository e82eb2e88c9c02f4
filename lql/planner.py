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

from . import ast, files, limits
from .binding import Catalog, SliceBinding
from .errors import NoContainer, StatementError
from .text import fmt_layers


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
class RemoteStatement(Node):
    """A statement of a remote-bound session: it runs on the server (``remote``)."""

    remote: Any

    def describe(self) -> str:
        return f"{self.statement.keyword} on {self.remote.url}"


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
    intervention: Any = None  # vindex3.exec.intervention.FeatureAblation (ABLATE FEATURES) or None

    def describe(self) -> str:
        parts = []
        if self.top is not None:
            parts.append(f"the top {self.top} next tokens")
        if self.generate is not None:
            stop = ("" if self.exactly or not self.stop_ids else
                    f", stopping at end-of-sequence ({', '.join(map(str, self.stop_ids))})")
            parts.append(f"{self.generate} greedy tokens{' exactly' if self.exactly else ''}{stop}")
        head = f"INFER: prefill {len(self.prompt.ids)} tokens"
        tail = f", with {self.intervention.describe()}" if self.intervention is not None else ""
        return head + (", then " + " and ".join(parts) if parts else "") + tail


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
    intervention: Any = None
    experts: tuple[int, ...] | None = None  # TRACE ... EXPERTS: the routed layers whose routing is shown


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
    intervention: Any = None
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
class Represent(Node):
    """REPRESENT: write the bound container (``source``) into ``into`` in ``encoding``."""

    source: str
    into: str
    encoding: str


@dataclass(frozen=True, eq=False)
class Compact(Node):
    source: str
    into: str


@dataclass(frozen=True, eq=False)
class Diff(Node):
    a: str
    b: str
    layer: int | None = None  # LAYER n: only the differences that name layer n
    limit: int | None = None  # LIMIT n: at most n differences
    physical: bool = False  # PHYSICAL: only the physical differences


@dataclass(frozen=True, eq=False)
class ScoreRepresentation(Node):
    candidate: str
    reference: str
    prompts: str
    greedy: int


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
        case ast.Infer():
            check_infer(s)
        case ast.Explain() if s.infer is not None:
            check_infer(s.infer)
        case ast.DraftLadder():
            seen: set[int] = set()
            for d in s.depths:
                if d in seen:
                    raise err(s, f"DRAFT LADDER lists depth {d} twice")
                seen.add(d)


def check_span(s: ast.Statement, span: tuple[int, int] | None, clause: str = "LAYERS") -> None:
    if span is not None and span[1] < span[0]:
        raise err(s, f"{clause} {span[0]}-{span[1]} runs backwards", hint=f"write {clause} {span[1]}-{span[0]}")


def check_infer(s: ast.Infer) -> None:
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


@plans(ast.Explain, needs_container=True)
def _explain(s: ast.Explain, ctx: Context) -> Node:
    if s.infer is not None:
        target = _infer(s.infer, ctx)
        sl = target.slice if isinstance(target, Run) else target.target
        return Explain(s, slice=sl, target=target)
    return Explain(s, slice=ctx.catalog.bind_slice(depth_of(ctx, s.depth)))


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
    sl = cat.bind_slice(depth_of(ctx, s.depth))  # a bad depth is refused before tokenising anything
    ablation = cat.ablation(s.ablate, sl)
    prompt = bind_prompt(ctx, s.prompt, chat=chat)
    top = s.top if s.top is not None else (None if s.generate is not None else ctx.settings.get("top", 5))
    stop = () if s.exactly or s.generate is None else cat.eos_ids()
    node = Run(s, slice=sl, prompt=prompt, top=top, generate=s.generate, exactly=s.exactly, stop_ids=stop,
               intervention=ablation)
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
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    experts = None
    if s.experts is not None:
        layer = s.experts.layer
        routed = routed_or_refuse(s, ctx, layer, "TRACE ... EXPERTS")
        ran = sl.executed_layers
        shown = [i for i in ((layer,) if layer is not None else routed) if i in ran]
        if not shown:
            which = f"layer {layer}" if layer is not None else f"a routed layer (routed: {fmt_layers(routed)})"
            raise err(s, f"{sl.label} runs {'layer' if len(ran) == 1 else 'layers'} {fmt_layers(ran)}, not {which}",
                       hint="a deeper DRAFT DEPTH, or DRAFT OFF, runs it")
        experts = tuple(shown)
    prompt = bind_prompt(ctx, s.prompt)
    p = len(prompt.ids)
    limits.check_positions(p, cat.context_length, ctx.settings, _run_words("TRACE", p))
    limits.Need().add("one step at the end", cat.estimate(1, sl.depth, start=p - 1)).check(ctx.settings, "TRACE")
    return Trace(s, slice=sl, prompt=prompt, experts=experts, intervention=cat.ablation(s.ablate, sl))


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
    overwrite = may_overwrite(s, ctx)
    inside = files.container_paths(ctx.catalog)
    files.input_file(s.prompts, "DRAFT LADDER prompt bank")
    if s.into is not None:
        files.output_file(s.into, "DRAFT LADDER report", overwrite=overwrite, inside=inside)
    if s.plot is not None:
        files.output_file(s.plot, "DRAFT LADDER chart", overwrite=overwrite, inside=inside)
        if s.into is not None and _same_file(s.into, s.plot):
            raise err(s, f"DRAFT LADDER writes its report and its chart to the same file {s.plot!r}",
                       hint="give PLOT INTO another file")
    return Ladder(s, depths=tuple(s.depths), prompts=s.prompts, into=s.into, plot=s.plot, overwrite=overwrite)


def _same_file(a: str, b: str) -> bool:
    import os

    return os.path.realpath(a) == os.path.realpath(b)


@plans(ast.DumpLogits, needs_container=True)
def _dump(s: ast.DumpLogits, ctx: Context) -> Node:
    cat = ctx.catalog
    overwrite = may_overwrite(s, ctx)
    files.output_file(s.into, "DUMP LOGITS file", overwrite=overwrite, inside=files.container_paths(cat))
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    prompt = bind_prompt(ctx, s.prompt)
    p = len(prompt.ids)
    limits.check_positions(p, cat.context_length, ctx.settings, _run_words("DUMP LOGITS", p))
    (limits.Need().add("one step at the end", cat.estimate(1, sl.depth, start=p - 1))
     .add(f"the logits [{p:,}, {cat.vocab:,}] and their bytes", extra=2 * p * cat.vocab * 4)
     .check(ctx.settings, "DUMP LOGITS"))
    return Dump(s, slice=sl, prompt=prompt, into=s.into, overwrite=overwrite,
                intervention=cat.ablation(s.ablate, sl))


def may_overwrite(s: ast.Statement, ctx: Context) -> bool:
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
    overwrite = may_overwrite(s, ctx)
    inside = files.container_paths(ctx.catalog) if ctx.bound else []
    replaces = files.encode_target(s.into, overwrite=overwrite, inside=inside)
    return Encode(s, checkpoint=s.checkpoint, into=s.into, replaces=replaces)


# ---- representations and maintenance (issue 20) -----------------------------------------


@plans(ast.Represent, needs_container=True)
def _represent(s: ast.Represent, ctx: Context) -> Node:
    from vindex3.represent import TARGETS

    if s.encoding not in TARGETS:
        raise err(s, f"REPRESENT cannot write encoding {s.encoding!r}", hint=f"REPRESENT writes: {', '.join(TARGETS)}")
    return Represent(s, source=ctx.catalog.path, into=s.into, encoding=s.encoding)


@plans(ast.Compact, needs_container=True)
def _compact(s: ast.Compact, ctx: Context) -> Node:
    return Compact(s, source=ctx.catalog.path, into=s.into)


@plans(ast.Diff)
def _diff(s: ast.Diff, ctx: Context) -> Node:
    if s.into_patch is not None:
        raise err(s, "DIFF ... INTO PATCH writes the difference as a patch overlay, which this build does not have yet",
                   hint="leave INTO PATCH out: DIFF shows the differences")
    positive(s, s.limit, "LIMIT", "LIMIT 10")
    opts = {"layer": s.layer, "limit": s.limit, "physical": s.physical}
    if s.b_current:
        if not ctx.bound:
            raise NoContainer("DIFF 'a' CURRENT compares a with the open container, and none is open",
                              hint="OPEN one first, or DIFF 'a' 'b'", line=s.line, column=s.column, statement=s.source)
        return Diff(s, a=s.a, b=ctx.catalog.path, **opts)
    if s.b is not None:
        return Diff(s, a=s.a, b=s.b, **opts)
    if not ctx.bound:
        raise NoContainer("DIFF 'b' compares the open container with b, and none is open",
                          hint="DIFF 'a' 'b' compares two containers; or OPEN one first",
                          line=s.line, column=s.column, statement=s.source)
    return Diff(s, a=ctx.catalog.path, b=s.a, **opts)


@plans(ast.ScoreRepresentation)
def _score_representation(s: ast.ScoreRepresentation, ctx: Context) -> Node:
    from vindex3.evidence import GREEDY

    positive(s, s.greedy, "GREEDY", "GREEDY 32")
    return ScoreRepresentation(s, candidate=s.candidate, reference=s.reference, prompts=s.prompts,
                               greedy=s.greedy if s.greedy is not None else GREEDY)


# ---- layers as words, and the layers a slice runs (the features and lens families) ------------


def span_text(layers) -> str:
    """Layer numbers as runs: '0-3, 5'."""
    out, xs, i = [], list(layers), 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def layers_word(layers) -> str:
    """'layer 2' or 'layers 0-3, 5'."""
    return ("layer " if len(layers) == 1 else "layers ") + span_text(layers)


def check_executed_layers(s: ast.Statement, sl: SliceBinding, layers: tuple[int, ...] | None, what: str) -> None:
    """Refuse ``layers`` (chosen by ``what``) that the slice does not run, naming the first."""
    if layers is None:
        return
    ran = set(sl.executed_layers)
    missing = [i for i in layers if i not in ran]
    if missing:
        raise StatementError(f"{what}: layer {missing[0]} is not run by the {sl.label} "
                             f"({layers_word(sl.executed_layers)})", hint="choose layers the slice runs, or leave DRAFT DEPTH out")


# ---- the reference dialect (issue 19) -----------------------------------------------------


@dataclass(frozen=True, eq=False)
class ShowModels(Node):
    directory: str


@dataclass(frozen=True, eq=False)
class Note(Node):
    topic: str
    lines: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class Compile(Node):
    source: str
    into: str
    on_conflict: str | None
_NO_PATCHES = "this build has no patch overlay"


@plans(ast.ShowModels)
def _show_models(s: ast.ShowModels, ctx: Context) -> Node:
    import os

    return ShowModels(s, directory=os.getcwd())


@plans(ast.ShowPatches)
def _show_patches(s: ast.ShowPatches, ctx: Context) -> Node:
    return Note(s, topic="patches", lines=(
        "no patches: this build has no patch overlay, so no patch is open, applied or saved",
        "the knowledge edits (INSERT, DELETE, UPDATE, MERGE, BEGIN / SAVE / APPLY / REMOVE PATCH) are refused by name"))


@plans(ast.ShowCompactStatus)
def _show_compact_status(s: ast.ShowCompactStatus, ctx: Context) -> Node:
    lines = [("nothing to compact: this build has no patch overlay, so no edits wait to be folded in "
             "(COMPACT MINOR | MAJOR are refused by name)")]
    if ctx.bound:
        lines.append(f"COMPACT INTO 'dir' copies {ctx.catalog.name}'s referenced files and lists what it leaves behind")
    return Note(s, topic="compact status", lines=tuple(lines))


@plans(ast.ShowEntities)
def _show_entities(s: ast.ShowEntities, ctx: Context) -> Node:
    raise err(s, "SHOW ENTITIES lists the entities of the reference system's knowledge graph (the subjects its "
               "probes labelled), and this build keeps FFN features, not a graph of entities",
               hint="SHOW FEATURES n lists a layer's features and the tokens they write; DESCRIBE 'entity' its edges")


@plans(ast.ShowRelations)
def _show_relations(s: ast.ShowRelations, ctx: Context) -> Node:
    raise err(s, "SHOW RELATIONS lists the relation labels of the reference system's knowledge graph, and this "
               "build's feature metadata carries no relation labels",
               hint="DESCRIBE 'entity' shows the edges entity -> token through the features it opens")


@plans(ast.SelectGraph)
def _select_graph(s: ast.SelectGraph, ctx: Context) -> Node:
    table = s.table.upper()
    what = "labelled edges: entity, relation, target" if table == "EDGES" else "its entities"
    raise err(s, f"SELECT ... FROM {table} reads the reference system's knowledge graph ({what}), and this build "
               "keeps FFN features, not a graph", hint="SELECT ... FROM FEATURES is the table here (layer, feature, "
               "token, score); DESCRIBE 'entity' gives edges entity -> token")


@plans(ast.Extract)
def _extract(s: ast.Extract, ctx: Context) -> Node:
    if s.components is not None:
        raise err(s, f"EXTRACT ... COMPONENTS {', '.join(s.components)} narrows what is carried; this build's "
                   "ENCODE carries the whole model", hint="leave COMPONENTS out")
    if s.layers is not None:
        raise err(s, f"EXTRACT ... LAYERS {s.layers[0]}-{s.layers[1]} narrows what is carried; this build's ENCODE "
                   "carries every layer", hint="leave LAYERS out (DRAFT DEPTH n runs fewer layers of the whole)")
    if s.format is not None and s.format != "vindex3":
        raise err(s, f"EXTRACT ... FORMAT {s.format} is not a format this build writes", hint="FORMAT vindex3")
    return Encode(s, checkpoint=s.checkpoint, into=s.into)


@plans(ast.Compile)
def _compile(s: ast.Compile, ctx: Context) -> Node:
    if s.target == "model":
        raise err(s, "COMPILE ... INTO MODEL writes a checkpoint in the source model's own format, which this build "
                   "does not write", hint="COMPILE ... INTO VINDEX 'dir' writes a container")
    if s.path is None:
        if not ctx.bound:
            raise NoContainer("COMPILE CURRENT compiles the open container, and none is open",
                              hint="OPEN one first, or COMPILE 'path' INTO VINDEX 'dir'",
                              line=s.line, column=s.column, statement=s.source)
        source = ctx.catalog.path
    else:
        source = s.path
    return Compile(s, source=source, into=s.into, on_conflict=s.on_conflict)


def _knowledge_edit(s: ast.KnowledgeEdit, ctx: Context) -> Node:
    raise err(s, knowledge_edit_refusal(s), hint="SHOW PATCHES says what this build has")


def knowledge_edit_refusal(s: ast.KnowledgeEdit) -> str:
    """Why a knowledge edit is refused, naming it (also HELP's words)."""
    name = f"COMPACT {s.level.upper()}" if isinstance(s, ast.CompactLevel) else s.keyword
    return f"{name} {s.verb}, which this build does not have yet"


for _cls in ast.KNOWLEDGE_EDITS:
    plans(_cls)(_knowledge_edit)
