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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import ast, parser
from . import results as R
from .errors import InternalError, LqlError, LqlSyntaxError, StatementError

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
    """The text of one statement (up to and including its ';') and where it starts.
    ``statements`` counts what it holds: a pipe ``a |> b`` is one chunk of two statements."""

    text: str
    start: int  # 0-based offset in the whole text
    line: int
    column: int
    statements: int = 1


@dataclass(frozen=True)
class MetaLine:
    """A shell command line in a script: ``\\timing off``."""

    text: str
    line: int


def chunks(text: str, *, offset: int = 0) -> Iterator[Chunk]:
    """The statements of ``text`` as text, in order (empty statements skipped)."""
    first = None  # the first significant token of the pending statement
    pipes = 0
    for tok in parser.lex(text):
        if tok.type in ("WS", "COMMENT"):
            continue
        if first is None:
            first = tok
        if tok.type == "_PIPE":
            pipes += 1
        if tok.type == "_SEMI":
            if tok.start_pos > first.start_pos:  # not a lone ';'
                yield Chunk(text[first.start_pos : tok.start_pos + 1], first.start_pos + offset, first.line, first.column,
                            1 + pipes)
            first, pipes = None, 0
    if first is not None:
        end = len(text.rstrip())
        yield Chunk(text[first.start_pos : end], first.start_pos + offset, first.line, first.column, 1 + pipes)


def parse_chunk(full: str, ch: Chunk) -> list[ast.Statement]:
    """Parse one statement's text with its position in ``full`` kept (line, column, offsets);
    a syntax error shows the offending line of ``full``."""
    try:
        return parser.parse(ch.text, at=(ch.line, ch.column, ch.start))
    except LqlSyntaxError as e:
        if e.line is not None and e.line >= ch.line:
            e.source_line = _line_of(full, ch.start, e.line - ch.line)
        e.statement = ch.text
        raise


def _line_of(full: str, start: int, k: int) -> str:
    """The line of ``full`` that is ``k`` lines after the one holding offset ``start``."""
    begin = full.rfind("\n", 0, start) + 1
    for _ in range(k):
        nxt = full.find("\n", begin)
        if nxt < 0:
            return ""
        begin = nxt + 1
    end = full.find("\n", begin)
    return full[begin : end if end >= 0 else len(full)].rstrip("\r")


def script_items(text: str) -> Iterator[Chunk | MetaLine]:
    """Statements and shell-command lines of a script, in order. A line whose first non-blank
    character is a backslash is a shell command when no statement is pending.

    Each line is lexed once (no token but whitespace crosses a line end: strings and comments
    stop at it), so a script of many lines costs what its text costs."""
    pending_start: int | None = None  # offset where the pending statement text begins
    pending_line = 1  # and its line (it begins at a line's start)
    last = None  # the last significant token type of the pending text
    pos = 0
    for lineno, line in enumerate(text.split("\n"), start=1):
        if line.lstrip().startswith("\\") and last is None:
            pending_start = None
            yield MetaLine(line.strip(), lineno)
        else:
            if pending_start is None:
                pending_start, pending_line = pos, lineno
            for tok in parser.lex(line):
                if tok.type not in ("WS", "COMMENT"):
                    last = tok.type
            if last == "_SEMI":
                yield from _chunks_at(text[pending_start : pos + len(line)], pending_start, pending_line)
                pending_start, last = None, None
        pos += len(line) + 1
    if pending_start is not None and last is not None:
        yield from _chunks_at(text[pending_start:], pending_start, pending_line)


def _chunks_at(body: str, start: int, line: int) -> Iterator[Chunk]:
    """The statements of ``body``, which begins at offset ``start``, at the start of ``line``."""
    for ch in chunks(body):
        yield Chunk(ch.text, start + ch.start, line + ch.line - 1, ch.column, ch.statements)


@contextmanager
def boundary(session: Session, stmt: ast.Statement) -> Iterator[None]:
    """The error boundary of a statement: a refusal leaves as an `LqlError` positioned at the
    statement (a vindex3 refusal as `EngineRefusal`, a MemoryError as the `LimitError` naming
    memory_limit), and any other exception — a bug — as an `InternalError` naming the statement,
    with the exception as its ``original`` and ``__cause__``. Only an interrupt (a BaseException
    such as KeyboardInterrupt) passes through as itself."""
    from .binding import engine_refusal, is_engine_error

    try:
        yield
    except LqlError as e:
        raise e.locate(stmt.line, stmt.column, stmt.source) from None
    except MemoryError as e:  # the machine, not a bug: named, and the session stays usable
        from .limits import out_of_memory

        raise out_of_memory(session.settings, stmt.kind.replace("_", " ").upper()).locate(stmt.line, stmt.column, stmt.source) from e
    except Exception as e:
        if is_engine_error(e):
            raise engine_refusal(e).locate(stmt.line, stmt.column, stmt.source) from e
        raise InternalError.wrap(e, line=stmt.line, column=stmt.column, statement=stmt.source) from e


def plan_statement(session: Session, stmt: ast.Statement):
    """The plan node of one parsed statement, bound against the session (nothing runs)."""
    from .planner import plan

    with boundary(session, stmt):
        return plan(stmt, session.context())


def execute_statement(session: Session, stmt: ast.Statement, *,
                      before_run: Callable[[Any], None] | None = None) -> R.Result:
    """Plan and execute one parsed statement, inside `boundary`: its result, or the `LqlError`
    that stopped it. ``before_run(node)`` sees the plan node before it runs (a server checks its
    limits there, so a statement is planned once)."""
    from . import registry
    from .planner import plan

    with boundary(session, stmt):
        bound = getattr(session, "base_container", None)
        if bound is not None and hasattr(bound, "check_unchanged"):
            bound.check_unchanged()  # a segment changed on disk since OPEN: refused by name, before anything
        node = plan(stmt, session.context())
        if before_run is not None:
            before_run(node)
        result = registry.run(session, node)
        result.statement = R.StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)
    return result


def execute(session: Session, stmt: ast.Statement, *, before_run: Callable[[Any], None] | None = None) -> Outcome:
    """The one execution boundary every front end uses (the REPL, scripts, ``lql -e``, the API,
    the server): one statement's `Outcome`, timed. Never raises but for an interrupt."""
    t0 = time.perf_counter()
    try:
        result = execute_statement(session, stmt, before_run=before_run)
    except LqlError as e:
        return Outcome(stmt, error=e, seconds=time.perf_counter() - t0)
    return Outcome(stmt, result=result, seconds=time.perf_counter() - t0)


def parse_or_internal(full: str, ch: Chunk) -> list[ast.Statement]:
    """`parse_chunk`, with anything but a syntax error (a bug in the parser) as an
    `InternalError` naming the text."""
    try:
        return parse_chunk(full, ch)
    except LqlSyntaxError:
        raise
    except Exception as e:  # the boundary: a bug in the parser, named
        raise InternalError.wrap(e, line=ch.line, column=ch.column, statement=ch.text) from e


def run_chunk(session: Session, full: str, ch: Chunk) -> Iterator[Outcome]:
    """Parse and run one statement chunk, yielding its outcome (a syntax error is an outcome
    with no statement; so is a bug in the parser, as an `InternalError`)."""
    try:
        stmts = parse_or_internal(full, ch)
    except LqlError as e:
        yield Outcome(None, error=e, source=ch.text, line=ch.line, column=ch.column)
        return
    for stmt in stmts:
        yield execute(session, stmt)


def run(session: Session, text: str, *, keep_going: bool = False) -> Iterator[Outcome]:
    """Run every statement of ``text`` in order, yielding each outcome as it completes. Stops
    after the first failure (a syntax error included) unless ``keep_going``, and after an
    interrupted statement or an internal error always."""
    if not isinstance(text, str):
        raise StatementError(f"LQL text must be a str, got {type(text).__name__}")
    for ch in _guarded(chunks(text), text):
        if isinstance(ch, Outcome):  # a bug while cutting the text into statements
            yield ch
            return
        for out in run_chunk(session, text, ch):
            yield out
            if out.interrupted or isinstance(out.error, InternalError) or (out.error is not None and not keep_going):
                return


def _guarded(items: Iterator[Chunk], text: str) -> Iterator[Chunk | Outcome]:
    """``items``, ending with an `InternalError` outcome if producing them fails (a bug)."""
    try:
        yield from items
    except Exception as e:  # noqa: BLE001 - the boundary: a bug becomes an outcome naming the text
        yield Outcome(None, error=InternalError.wrap(e, line=1, column=1, statement=text[:200]), source=text[:200])
