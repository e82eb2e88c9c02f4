"""What a server lets a statement do, decided before it runs: the profile (``full`` or
``read-only``), the confinement of every file path to ``--data-dir``, and the limits that a
statement's own numbers must respect. Every refusal names the statement and the reason.

Which fields of a statement are file paths, and whether it only reads, each statement class
declares itself (`lql.ast.Statement.paths` and ``read_only``). A statement that does not declare
its paths is refused in every profile, by name, rather than guessed to name no path."""

from __future__ import annotations

import os
from pathlib import Path

from .. import ast, planner
from ..errors import LqlError
from .config import Limits, ServerConfig


class ProfileRefusal(LqlError):
    """The server's profile does not allow this statement."""


class PathRefusal(LqlError):
    """A statement's file path is not inside the server's data directory."""


class LimitRefusal(LqlError):
    """A statement, a request or a completion asks for more than the server's limits allow."""


def fields_of(cls: type[ast.Statement]) -> tuple[str, ...] | None:
    """The fields of ``cls`` that hold a server-side path (None: it does not say)."""
    return cls.paths


def path_fields() -> dict[type[ast.Statement], tuple[str, ...]]:
    """Every statement class that says which of its fields are paths, and those fields."""
    from .. import registry

    out = {}
    for cls in registry.statement_classes():
        f = fields_of(cls)
        if f is not None:
            out[cls] = f
    return out


def read_only(stmt: ast.Statement) -> bool:
    """Whether the read-only profile allows ``stmt``: a reading statement, or one whose
    writing clause is absent (TRACE ... FOR without SAVE INTO): the statement says."""
    return type(stmt).read_only is not None and stmt.refused_read_only() is None


def check_statement(stmt: ast.Statement, config: ServerConfig) -> ast.Statement:
    """The statement as it may run on this server (paths resolved inside the data directory),
    or a refusal naming it."""
    kw = stmt.keyword
    if stmt.never_on_server is not None:
        why, hint = stmt.never_on_server
        raise ProfileRefusal(f"{kw} cannot run on a server: {why}", hint=hint)
    paths = fields_of(type(stmt))
    if paths is None:
        raise ProfileRefusal(f"this server does not serve {kw}: it does not know whether {kw} names a server-side path",
                             hint=f"{type(stmt).__name__} declares no paths (lql.ast.Statement.paths)")
    if config.profile == "read-only" and not read_only(stmt):
        why = stmt.refused_read_only() if type(stmt).read_only is not None else "it does not say that it only reads"
        raise ProfileRefusal(f"the read-only profile refuses {kw}: {why}",
                             hint="reading statements are allowed: STATS, EXPLAIN, SHOW ..., INFER, TRACE (without "
                                  "SAVE INTO), WALK, DESCRIBE, SELECT, DRAFT DEPTH, SET, HELP")
    _check_numbers(stmt, config)
    stmt.check_on_server(config)
    updates = {}
    for name in paths:
        raw = getattr(stmt, name)
        if raw is None:
            continue
        updates[name] = str(confine(raw, config.data_dir, kw))
    return stmt.model_copy(update=updates) if updates else stmt


def _check_numbers(stmt: ast.Statement, config: ServerConfig) -> None:
    generate = stmt.generates()
    if generate is None:
        return
    lim = config.limits
    limit, what = lim.max_tokens, "--max-tokens"
    if config.profile == "read-only" and lim.read_only_generate < limit:
        limit, what = lim.read_only_generate, "the read-only profile's --read-only-generate"
    if generate > limit:
        raise LimitRefusal(f"GENERATE {generate} is more than this server allows ({what} is {limit})",
                           hint=f"GENERATE at most {limit}")


def check_plan(node: planner.Node, limits: Limits) -> None:
    """Limits that need the bound statement: the prompt's token count."""
    prompt = node.bound_prompt()
    if isinstance(prompt, planner.BoundPrompt) and len(prompt.ids) > limits.max_prompt_tokens:
        raise LimitRefusal(f"the prompt is {len(prompt.ids)} tokens, more than this server allows "
                           f"(--max-prompt-tokens is {limits.max_prompt_tokens})")


def confine(raw: str, data_dir: Path | None, what: str) -> Path:
    """``raw`` resolved inside ``data_dir``; refuses a server without a data directory, '' and
    '.', a path starting with '~', and through `vindex3.paths.confined` (the helper every reader
    of a container's own paths uses) NUL, a lone surrogate, a component over 255 bytes, an
    absolute path, ``..``, and a path whose symlinks lead out of the directory."""
    from vindex3.errors import PathRefused
    from vindex3.paths import confined

    if data_dir is None:
        raise PathRefusal(f"{what} names the server-side path {raw!r}, and this server has no data directory",
                          hint="start the server with --data-dir DIR to allow paths inside DIR")
    if raw in ("", "."):
        raise PathRefusal(f"{what}: {raw!r} is not a file name")
    if raw.startswith("~"):
        raise PathRefusal(f"{what}: {raw!r} is an absolute path; paths on this server are relative to its data directory")
    root = Path(os.path.realpath(data_dir))
    try:
        p = confined(root, raw, f"{what} path")
    except PathRefused as e:
        words = {"absolute": "is an absolute path; paths on this server are relative to its data directory",
                 "dotdot": "climbs out with '..'; paths on this server stay inside its data directory",
                 "outside": "leads out of the data directory through a symbolic link"}
        raise PathRefusal(f"{what}: {raw!r} {words[e.reason]}" if e.reason in words else e.message, hint=e.hint) from None
    return Path(os.path.realpath(p))
