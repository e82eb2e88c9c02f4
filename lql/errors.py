"""Every failure a user of LQL can meet. Front ends print ``str(err)`` and never a traceback
(unless asked with ``--debug``). A message says what was refused and names the thing; where
known, the statement's line and column travel with it."""

from __future__ import annotations


class LqlError(Exception):
    """Base of every LQL failure: a refusal, a syntax error, or an engine refusal passed on.

    ``message`` is the user's message; ``line``/``column`` locate the statement (1-based) when
    the error belongs to one; ``statement`` is the statement's source text; ``hint`` says what
    would have been accepted."""

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        line: int | None = None,
        column: int | None = None,
        statement: str | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.line = line
        self.column = column
        self.statement = statement

    @property
    def kind(self) -> str:
        """A stable name for the kind of failure (the class name), used by the JSON output."""
        return type(self).__name__

    def locate(self, line: int, column: int, statement: str | None) -> LqlError:
        """Attach a statement's position unless one is already known; returns self."""
        if self.line is None:
            self.line, self.column = line, column
        if self.statement is None:
            self.statement = statement
        return self

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"

    def _render_traceback_(self) -> list[str]:
        """What IPython (a notebook) shows for this error instead of a traceback: the message
        as the shell prints it (a syntax error with its caret, a refusal with its hint); a bug
        (`InternalError`) keeps its traceback."""
        if isinstance(self, InternalError):
            import traceback

            err = self.original if self.original is not None else self
            return [ln.rstrip("\n") for ln in traceback.format_exception(err)] + [error_text(self)]
        return error_text(self, show_statement=True).split("\n")


class LqlSyntaxError(LqlError):
    """The text is not LQL. Carries the offending line, a caret under the offending token,
    what was expected (in words) and, where a common mistake is recognised, a hint."""

    def __init__(
        self,
        message: str,
        *,
        line: int,
        column: int,
        source_line: str,
        expected: list[str] | None = None,
        hint: str | None = None,
    ):
        super().__init__(message, hint=hint, line=line, column=column)
        self.source_line = source_line
        self.expected = list(expected or [])

    def context(self) -> str:
        """The offending line with a caret under the column (a long line is cut around it)."""
        shown, col = caret_window(self.source_line, self.column)
        pad = "".join("\t" if ch == "\t" else " " for ch in shown[: col - 1])
        return f"  {shown}\n  {pad}^"

    def __str__(self) -> str:
        return error_text(self)  # the one formatter, below


def caret_window(line: str, column: int, width: int = 120) -> tuple[str, int]:
    """A source line as shown under an error, and the caret's column in it: a line longer than
    ``width`` characters is cut to the part around ``column``, with '…' where text was left out."""
    if len(line) <= width:
        return line, column
    start = max(0, min(column - 1 - width // 2, len(line) - width))
    shown = line[start : start + width]
    col = column - start
    if start > 0:
        shown, col = "…" + shown, col + 1
    if start + width < len(line):
        shown += "…"
    return shown, col


class StatementError(LqlError):
    """A statement that parses but cannot mean anything: TOP 0, LOOKAHEAD without SPECULATE,
    a range whose end precedes its start, a clause given twice."""


class NoContainer(LqlError):
    """The statement needs a bound container and none is open."""


class SettingError(LqlError):
    """SET names an unknown setting or gives it a value it does not take."""


class NotAvailable(LqlError):
    """The statement's engine is not part of this build (e.g. vindex3.draft is missing)."""


class EngineRefusal(LqlError):
    """A refusal raised by vindex3, passed on with its own message. ``engine_kind`` is the
    vindex3 error class (``SliceError``, ``TokenizerMissing``...)."""

    def __init__(self, message: str, *, engine_kind: str, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.engine_kind = engine_kind

    @property
    def kind(self) -> str:
        return self.engine_kind


class FileRefusal(LqlError):
    """A file the statement reads or writes cannot be used (missing, unreadable, exists)."""


class LimitError(LqlError):
    """A statement asks for more than a named limit allows (``max_generate``, ``max_lookahead``,
    ``max_prompts``, ``max_positions``, ``memory_limit``); the message names the limit, what was
    asked and, where it matters, the bytes needed; the hint says which setting raises it."""


INTERNAL_HINT = "this is a bug in lql or vindex3; run with --debug for the traceback"


class InternalError(LqlError):
    """A bug: an exception that is not a refusal, met while parsing, planning, running or
    printing a statement. The one error boundary (`lql.loop`, the ``lql`` command, the REPL,
    the server) turns it into this, naming the statement; the command exits 3 and shows the
    traceback of ``original`` only with ``--debug``. Never raised for bad input: every bad input
    has a refusal of its own, and an ``InternalError`` is a defect to fix."""

    def __init__(self, message: str, *, original: BaseException | None = None, hint: str | None = INTERNAL_HINT,
                 line: int | None = None, column: int | None = None, statement: str | None = None):
        super().__init__(message, hint=hint, line=line, column=column, statement=statement)
        self.original = original

    @classmethod
    def wrap(cls, err: BaseException, *, line: int | None = None, column: int | None = None,
             statement: str | None = None) -> InternalError:
        """``err`` as an internal error (its ``__cause__`` is ``err``)."""
        if isinstance(err, InternalError):
            return err.locate(line, column, statement) if line is not None else err
        e = cls("internal error: " + describe_exception(err), original=err, line=line, column=column,
                statement=statement)
        e.__cause__ = err
        return e


def describe_exception(err: BaseException, limit: int = 500) -> str:
    """``Type: message`` of an exception, cut to ``limit`` characters, never raising (an
    exception whose ``__str__`` fails is named by its type)."""
    try:
        text = str(err)
    except Exception:  # noqa: BLE001 - describing a bug must not raise another
        text = "(its message cannot be shown)"
    if len(text) > limit:
        text = text[: limit - 20] + "…" + text[-12:]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ---- errors as text: the one formatter ------------------------------------------------


def error_fragments(err: BaseException, *, where: str = "", show_statement: bool = False) -> list[tuple[str, str]]:
    """An error as styled fragments (style class, text): a syntax error with its line and a
    caret, a refusal with its message, the statement (with ``where`` or ``show_statement``)
    and its hint. ``where`` (a file name, ``<-e>``) prefixes ``where:line:column:``."""
    if isinstance(err, LqlSyntaxError):
        head = (f"{where}:{err.line}:{err.column}: syntax error: " if where
                else f"syntax error at line {err.line}, column {err.column}: ")
        shown, col = caret_window(err.source_line, err.column)
        pad = "".join("\t" if ch == "\t" else " " for ch in shown[: col - 1])
        frags = [("class:error", f"{head}{err.message}\n"), ("", f"  {shown}\n"),
                 ("class:error.caret", f"  {pad}^")]
        if err.hint:
            frags.append(("class:warning", f"\n  hint: {err.hint}"))
        return frags
    if isinstance(err, LqlError):
        loc = (f"{where}:{err.line}:{err.column}: " if where and err.line is not None
               else (f"{where}: " if where else ""))
        frags = [("class:error", f"{loc}error: {err.message}")]
        if err.statement and (show_statement or where):
            frags.append(("", f"\n  in: {clip_statement(err.statement)}"))
        if err.hint:
            frags.append(("class:warning", f"\n  hint: {err.hint}"))
        return frags
    return [("class:error", f"internal error: {describe_exception(err)}")]


def clip_statement(text: str, limit: int = 300) -> str:
    """A statement's text as an error shows it: at most ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 40] + " … " + text[-30:]


def error_text(err: BaseException, *, where: str = "", show_statement: bool = False) -> str:
    """`error_fragments` as plain text."""
    return "".join(t for _, t in error_fragments(err, where=where, show_statement=show_statement))


def internal_error_text(err: BaseException, *, where: str = "", line: int | None = None, column: int | None = None,
                        statement: str | None = None, debug: bool = False) -> str:
    """A bug's one-line report (the traceback is shown separately, with --debug)."""
    loc = f"{where}:{line}:{column}: " if where and line is not None else (f"{where}: " if where else "")
    out = f"{loc}internal error: {describe_exception(err)}"
    if statement:
        out += f"\n  in: {clip_statement(statement)}"
    if not debug:
        out += "\n  this is a bug in lql or vindex3; run with --debug for the traceback"
    return out


class MetaError(Exception):
    """A shell command refused its argument; the message says what it takes."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message, self.hint = message, hint
