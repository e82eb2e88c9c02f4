"""Statement → plan node. The planner binds a statement against a read-only catalog view of the
open container (`lql.binding.Catalog`) and the session's settings, and returns a typed plan
node: what will run, on which slice (vindex3's own slice plan object), over which token ids.
EXPLAIN renders the node INFER would run; each family's runner executes its nodes.

It refuses what can be judged before anything runs: a clause that contradicts another, a count
of zero, a range that runs backwards, a missing container, and, through the catalog, a depth
the model does not have (vindex3's `SliceError`, the one authority for depths), a layer it does
not have, a token outside the vocabulary. It never reads tensor data and never runs a model.

Each statement family (``lql/statements/<family>.py``, docs/lql.md#adding-a-statement) binds
its own statements with ``@fam.plans``; what lives here is what every family shares: the
context, the plan-node base, prompt binding, the limits' words and the checks of spans."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

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
    draft_adapter: bool = False  # DRAFT DEPTH d WITH ADAPTER: the session's draft reads through its exit adapter
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


# ---- planning -------------------------------------------------------------------------

def err(stmt: ast.Statement, message: str, hint: str | None = None) -> StatementError:
    return StatementError(message, hint=hint, line=stmt.line, column=stmt.column, statement=stmt.source)


def positive(stmt: ast.Statement, value: int | None, what: str, example: str) -> None:
    if value is not None and value < 1:
        raise err(stmt, f"{what} must be at least 1, got {value}", hint=f"e.g. {example}")


@dataclass(frozen=True, eq=False)
class Identity(Node):
    """The plan of a statement that binds nothing: the statement itself (its runner is found by
    the statement's class)."""

    runs_statement: ClassVar[bool] = True  # registry.run looks its runner up by the statement's class


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
    if ctx.remote is not None and not stmt.local_when_remote:
        if stmt.remote_mirror:
            return RemoteMirror(stmt, remote=ctx.remote, local=_bind(fn, stmt, ctx))
        return RemoteStatement(stmt, remote=ctx.remote)
    stmt.check()
    if stmt.needs_container and not ctx.bound:
        raise NoContainer(
            f"{stmt.keyword} needs an open container, and none is open",
            hint="OPEN 'path/to/model.vindex3' (or OPEN DEFAULT) first",
            line=stmt.line, column=stmt.column, statement=stmt.source,
        )
    return _bind(fn, stmt, ctx)


def _bind(fn, stmt: ast.Statement, ctx: Context) -> Node:
    return fn(stmt, ctx) if fn is not None else Identity(stmt)


def check_span(s: ast.Statement, span: tuple[int, int] | None, clause: str = "LAYERS") -> None:
    if span is not None and span[1] < span[0]:
        raise err(s, f"{clause} {span[0]}-{span[1]} runs backwards", hint=f"write {clause} {span[1]}-{span[0]}")


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
    """The statement's depth, else the session's. A statement that runs the bare draft is refused
    while the session's draft reads through an exit adapter (DRAFT DEPTH d WITH ADAPTER): the
    statements that read the adapted draft bind it with `lql.statements.drafts.draft_slice`."""
    if depth is None and ctx.draft_adapter:
        d = ctx.draft_depth
        raise StatementError(f"the session's DRAFT DEPTH {d} WITH ADAPTER reads the draft through its exit adapter, "
                             "and this statement runs the bare draft (only INFER, TRACE, EXPLAIN and DUMP LOGITS read "
                             "through it)", hint=f"name the depth on the statement (DRAFT DEPTH {d}), or set DRAFT DEPTH "
                                                 f"{d} without WITH ADAPTER")
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
