"""Statement → plan. The planner resolves what a statement leaves to the session (the default
draft depth, the TOP setting), checks what can be judged without a model (a clause that
contradicts another, a count of zero, a range that runs backwards, a missing binding), and
names the one operation the session will perform. It never opens a file or touches a model.

Bounds that depend on the model (a depth deeper than it, a layer it does not have) are judged
by vindex3 when the session plans the slice, so there is one authority for each."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from . import ast
from .errors import NoContainer, StatementError


@dataclass(frozen=True)
class Context:
    """What the planner may know about the session."""

    bound: bool
    draft_depth: int | None  # the session default set by DRAFT DEPTH n
    top: int  # the TOP setting


@dataclass(frozen=True)
class QueryPlan:
    """One operation for the session: ``op`` names it, ``args`` carries resolved values,
    ``depth`` is the draft depth the operation runs at (None: the full model)."""

    op: str
    statement: ast.Statement
    needs_container: bool = False
    depth: int | None = None
    args: dict[str, Any] = field(default_factory=dict)


def _err(stmt: ast.Statement, message: str, hint: str | None = None) -> StatementError:
    return StatementError(message, hint=hint, line=stmt.line, column=stmt.column, statement=stmt.source)


def _positive(stmt: ast.Statement, value: int | None, what: str, example: str) -> None:
    if value is not None and value < 1:
        raise _err(stmt, f"{what} must be at least 1, got {value}", hint=f"e.g. {example}")


def plan(stmt: ast.Statement, ctx: Context) -> QueryPlan:
    """Lower one statement. Raises `StatementError` / `NoContainer`, positioned at it."""
    p = _lower(stmt, ctx)
    if p.needs_container and not ctx.bound:
        raise NoContainer(
            f"{stmt.keyword} needs an open container, and none is open",
            hint="OPEN 'path/to/model.vindex3' (or OPEN DEFAULT) first",
            line=stmt.line, column=stmt.column, statement=stmt.source,
        )
    return p


def _lower(s: ast.Statement, ctx: Context) -> QueryPlan:
    default_depth = ctx.draft_depth
    match s:
        case ast.Open():
            return QueryPlan("open", s, args={"path": s.path, "default": s.default})
        case ast.Stats():
            _positive(s, s.positions, "STATS AT ... POSITIONS", "STATS AT 4096 POSITIONS")
            return QueryPlan("stats", s, needs_container=True, args={"positions": s.positions})
        case ast.Explain():
            _positive(s, s.depth, "DRAFT DEPTH", "EXPLAIN DRAFT DEPTH 2")
            depth = s.depth if s.depth is not None else default_depth
            return QueryPlan("explain", s, needs_container=True, depth=depth, args={"prompt": s.prompt})
        case ast.ShowLayers():
            if s.start is not None and s.end is not None and s.end < s.start:
                raise _err(s, f"RANGE {s.start}-{s.end} runs backwards", hint=f"write RANGE {s.end}-{s.start}")
            return QueryPlan("show_layers", s, needs_container=True, args={"start": s.start, "end": s.end})
        case ast.ShowComponents():
            return QueryPlan("show_components", s, needs_container=True)
        case ast.ShowRepresentations():
            return QueryPlan("show_representations", s, needs_container=True, args={"filter": s.filter})
        case ast.ShowProvenance():
            return QueryPlan("show_provenance", s, needs_container=True)
        case ast.ShowOperands():
            return QueryPlan("show_operands", s, needs_container=True, args={"layer": s.layer})
        case ast.ShowSettings():
            return QueryPlan("show_settings", s)
        case ast.Infer():
            return _lower_infer(s, ctx)
        case ast.Trace():
            _positive(s, s.depth, "DRAFT DEPTH", "TRACE 'text' DRAFT DEPTH 2")
            depth = s.depth if s.depth is not None else default_depth
            return QueryPlan("trace", s, needs_container=True, depth=depth, args={"prompt": s.prompt})
        case ast.DraftDepth():
            return QueryPlan("draft", s, needs_container=True, depth=s.depth)
        case ast.DraftOff():
            return QueryPlan("draft_off", s)
        case ast.DraftLadder():
            seen: set[int] = set()
            for d in s.depths:
                if d in seen:
                    raise _err(s, f"DRAFT LADDER lists depth {d} twice")
                seen.add(d)
            return QueryPlan("ladder", s, needs_container=True,
                             args={"depths": list(s.depths), "prompts": s.prompts, "into": s.into})
        case ast.DumpLogits():
            depth = s.depth if s.depth is not None else default_depth
            return QueryPlan("dump", s, needs_container=True, depth=depth, args={"prompt": s.prompt, "into": s.into})
        case ast.ScoreDraft():
            return QueryPlan("score", s, args={"draft": s.draft, "target": s.target})
        case ast.Verify():
            return QueryPlan("verify", s, needs_container=True)
        case ast.Plan():
            return QueryPlan("admit", s, args={"path": s.path})
        case ast.Encode():
            return QueryPlan("encode", s, args={"checkpoint": s.checkpoint, "into": s.into})
        case ast.Help():
            return QueryPlan("help", s, args={"topic": s.topic})
        case ast.Set():
            return QueryPlan("set", s, args={"name": s.name, "value": s.value})
    raise _err(s, f"{type(s).__name__} has no plan")  # a grammar rule without a lowering is a bug


def _lower_infer(s: ast.Infer, ctx: Context) -> QueryPlan:
    _positive(s, s.top, "TOP", "TOP 5")
    _positive(s, s.generate, "GENERATE", "GENERATE 20")
    _positive(s, s.depth, "DRAFT DEPTH", "DRAFT DEPTH 2")
    if s.speculate is not None or s.lookahead is not None:
        if s.speculate is None:
            raise _err(s, "LOOKAHEAD only applies to speculative decoding",
                       hint="add SPECULATE DEPTH d, e.g. INFER 'text' GENERATE 20 SPECULATE DEPTH 2 LOOKAHEAD 4")
        _positive(s, s.speculate, "SPECULATE DEPTH", "SPECULATE DEPTH 2")
        _positive(s, s.lookahead, "LOOKAHEAD", "LOOKAHEAD 4")
        if s.generate is None:
            raise _err(s, "SPECULATE needs GENERATE n: speculation is a way of generating tokens",
                       hint="e.g. INFER 'text' GENERATE 20 SPECULATE DEPTH 2")
        if s.depth is not None:
            raise _err(s, "SPECULATE verifies with the full model, so DRAFT DEPTH cannot be combined with it",
                       hint="the draft that proposes tokens is SPECULATE DEPTH d")
        if s.top is not None:
            raise _err(s, "TOP cannot be combined with SPECULATE", hint="run INFER 'text' TOP n on its own")
        return QueryPlan("speculate", s, needs_container=True, depth=s.speculate,
                         args={"prompt": s.prompt, "generate": s.generate, "lookahead": s.lookahead or 4})
    depth = s.depth if s.depth is not None else ctx.draft_depth
    top = s.top if s.top is not None else (None if s.generate is not None else ctx.top)
    return QueryPlan("infer", s, needs_container=True, depth=depth,
                     args={"prompt": s.prompt, "top": top, "generate": s.generate})
