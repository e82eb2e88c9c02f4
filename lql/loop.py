"""The statement loop every front end shares: `Session.run`, the ``lql`` command and the REPL.

Text is cut into statements at each ``;`` that ends one (not inside a string or a comment);
each statement is parsed, planned and executed in turn, the way sqlite3 and psql run a script:
statements before a syntax error run, and the syntax error still points at its own line and
column. The first failure stops the run unless ``keep_going``; an interrupted statement that
kept partial work (``result.interrupted``) also stops it.

A script may also hold shell commands (``\\timing off``): a line that starts with a backslash
where no statement is pending. `script_items` yields them in order with the statements; what a
shell command does is the front end's business."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import ast, parser
from . import results as R
from .errors import LqlError, LqlSyntaxError

if TYPE_CHECKING:  # pragma: no cover
    from .session import Session


@dataclass
class Outcome:
    """One statement's outcome: a result, or the error that stopped it. ``statement`` is None
    for text that did not parse (``source`` holds it); ``seconds`` is the wall time."""

    statement: ast.Statement | None
    result: R.Result | None = None
    error: LqlError | None = None
    seconds: float = 0.0
    source: str = ""
    line: int = 1
    column: int = 1

    @property
    def ref(self) -> R.StatementRef:
        """Which statement this is (kind None for text that did not parse)."""
        if self.statement is not None:
            s = self.statement
            return R.StatementRef(kind=s.kind, line=s.line, column=s.column, text=s.source)
        return R.StatementRef(kind=None, line=self.line, column=self.column, text=self.source)

    @property
    def interrupted(self) -> bool:
        return bool(getattr(self.result, "interrupted", False))


@dataclass(frozen=True)
class Chunk:
    """The text of one statement (up to and including its ';') and where it starts."""

    text: str
    start: int  # 0-based offset in the whole text
    line: int
    column: int


@dataclass(frozen=True)
class MetaLine:
    """A shell command line in a script: ``\\timing off``."""

    text: str
    line: int


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def chunks(text: str, *, offset: int = 0) -> Iterator[Chunk]:
    """The statements of ``text`` as text, in order (empty statements skipped)."""
    start = None
    for tok in parser.lex(text):
        if tok.type in ("WS", "COMMENT"):
            continue
        if start is None:
            start = tok.start_pos
        if tok.type == "_SEMI":
            if tok.start_pos > start:  # not a lone ';'
                yield _chunk(text, start, tok.start_pos + 1, offset)
            start = None
    if start is not None:
        end = len(text.rstrip())
        yield _chunk(text, start, end, offset)


def _chunk(text: str, start: int, end: int, offset: int) -> Chunk:
    line, col = _line_col(text, start)
    return Chunk(text[start:end], start + offset, line, col)


def parse_chunk(full: str, ch: Chunk) -> list[ast.Statement]:
    """Parse one statement's text with its position in ``full`` kept (line, column, offsets);
    a syntax error shows the offending line of ``full``."""
    pad = "\n" * (ch.line - 1) + " " * (ch.column - 1)
    try:
        stmts = parser.parse(pad + ch.text)
    except LqlSyntaxError as e:
        lines = full.split("\n")
        if e.line is not None and 0 < e.line <= len(lines):
            e.source_line = lines[e.line - 1].rstrip("\r")
        e.statement = ch.text
        raise
    shift = ch.start - len(pad)
    return [s.model_copy(update={"start_pos": s.start_pos + shift, "end_pos": s.end_pos + shift}) for s in stmts]


def script_items(text: str) -> Iterator[Chunk | MetaLine]:
    """Statements and shell-command lines of a script, in order. A line whose first non-blank
    character is a backslash is a shell command when no statement is pending."""
    pending: list[str] = []
    pending_start = 0
    pos = 0
    for lineno, line in enumerate(text.split("\n"), start=1):
        body = "\n".join(pending)
        if line.lstrip().startswith("\\") and _blank(body):
            pending = []
            yield MetaLine(line.strip(), lineno)
        else:
            if _blank(body):
                pending, pending_start = [], pos
            pending.append(line)
            body = "\n".join(pending)
            if parser.is_complete(body):
                yield from _chunks_at(text, pending_start, body)
                pending = []
        pos += len(line) + 1
    body = "\n".join(pending)
    if not _blank(body):
        yield from _chunks_at(text, pending_start, body)


def _chunks_at(full: str, start: int, body: str) -> Iterator[Chunk]:
    for ch in chunks(body):
        line, col = _line_col(full, start + ch.start)
        yield Chunk(ch.text, start + ch.start, line, col)


def _blank(text: str) -> bool:
    return all(t.type in ("WS", "COMMENT") for t in parser.lex(text))


def execute_statement(session: Session, stmt: ast.Statement) -> R.Result:
    """Plan and execute one parsed statement; every refusal leaves as an `LqlError` positioned
    at the statement (a vindex3 refusal as `EngineRefusal`). Anything else is a bug and
    propagates as it is."""
    from . import commands
    from .binding import engine_refusal, is_engine_error
    from .planner import plan

    try:
        node = plan(stmt, session.context())
        result = commands.execute(session, node)
    except LqlError as e:
        raise e.locate(stmt.line, stmt.column, stmt.source) from None
    except Exception as e:
        if is_engine_error(e):
            raise engine_refusal(e).locate(stmt.line, stmt.column, stmt.source) from e
        raise
    result.statement = R.StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)
    return result


def run_chunk(session: Session, full: str, ch: Chunk) -> Iterator[Outcome]:
    """Parse and run one statement chunk, yielding its outcome (a syntax error is an outcome
    with no statement)."""
    try:
        stmts = parse_chunk(full, ch)
    except LqlSyntaxError as e:
        yield Outcome(None, error=e, source=ch.text, line=ch.line, column=ch.column)
        return
    for stmt in stmts:
        t0 = time.perf_counter()
        try:
            result = execute_statement(session, stmt)
        except LqlError as e:
            yield Outcome(stmt, error=e, seconds=time.perf_counter() - t0)
            continue
        yield Outcome(stmt, result=result, seconds=time.perf_counter() - t0)


def run(session: Session, text: str, *, keep_going: bool = False) -> Iterator[Outcome]:
    """Run every statement of ``text`` in order, yielding each outcome as it completes. Stops
    after the first failure (a syntax error included) unless ``keep_going``, and after an
    interrupted statement always."""
    for ch in chunks(text):
        for out in run_chunk(session, text, ch):
            yield out
            if out.interrupted or (out.error is not None and not keep_going):
                return
