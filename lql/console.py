"""The output side that the ``lql`` command and the REPL share: it runs text through the one
statement loop (`lql.loop`), runs shell commands (``\\timing``, ``\\o``...), and prints every
result and every error the same way — in the session's format (text, json, csv, tsv,
markdown, jsonl), fitted to the terminal, through a pager when it is long (interactive only),
or into a file (``\\o``, ``\\once``), with the wall time of each statement when timing is on.

Results go to standard output (or the redirect target), diagnostics to standard error; both
are looked up when written, so a test's captured streams see them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from prompt_toolkit.formatted_text import FormattedText
from prompt_toolkit.shortcuts import print_formatted_text

from . import ast, loop, render, text
from . import results as R
from .errors import FileRefusal, InternalError, LqlError, LqlSyntaxError, MetaError
from .repl_lexer import STYLE

# What running a piece of text came to.
OK, FAILED, EXIT, INTERRUPTED, INTERNAL = "ok", "failed", "exit", "interrupted", "internal"

DEFAULT_PAGER = "less -SRXF"


def isatty(f: Any) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False


def terminal_size(f: Any) -> tuple[int, int]:
    """(columns, lines) of the terminal behind ``f``; $COLUMNS/$LINES, else 80 x 24, when it
    has none."""
    try:
        size = os.get_terminal_size(f.fileno())
        return max(20, size.columns), max(5, size.lines)
    except (OSError, AttributeError, ValueError):
        pass

    def env(name: str, default: int) -> int:
        try:
            return int(os.environ.get(name, ""))
        except ValueError:
            return default

    return max(20, env("COLUMNS", 80)), max(5, env("LINES", 24))


def write_text(f: TextIO, text: str) -> None:
    """Write ``text`` however the stream is encoded: a lone surrogate becomes ``\\udXXX`` and a
    character the stream's encoding lacks a backslash escape, never a UnicodeEncodeError."""
    text = render.escape_surrogates(text)
    try:
        f.write(text)
    except UnicodeEncodeError:
        enc = getattr(f, "encoding", None) or "utf-8"
        f.write(text.encode(enc, "backslashreplace").decode(enc, "replace"))


_KEY_VALUE = re.compile(r"(\S(?:.*?\S)?)( {2,})(\S.*)")


def fold_wide(text: str, width: int) -> str:
    """Text output for a terminal ``width`` columns wide: a key/value line wider than that
    (``prompt ids  [504, 3575, ...]``) folds its value onto lines of its own, indented to the
    value's column and broken after a comma or a space where one falls in the last third of the
    line, so the keys stay a column. Other lines are left as they are (table cells are already
    elided to the width by the renderer); nothing is ever dropped."""
    out: list[str] = []
    for line in text.split("\n"):
        m = _KEY_VALUE.fullmatch(line) if len(line) > width else None
        col = len(m.group(1)) + len(m.group(2)) if m else 0
        if m is None or col > width // 2:
            out.append(line)
            continue
        room = width - col
        value = m.group(3)
        first = True
        while value:
            if len(value) <= room:
                cut = len(value)
            else:
                cut = room
                for sep in (", ", " "):
                    k = value.rfind(sep, room * 2 // 3, room)
                    if k > 0:
                        cut = k + len(sep)
                        break
            piece, value = value[:cut].rstrip(" "), value[cut:]
            out.append((line[:col] if first else " " * col) + piece)
            first = False
    return "\n".join(out)


def _expand(path: str) -> str:
    """A shell command's path with a leading ~ expanded (as a shell would); refused text (a NUL,
    a lone surrogate) is left for the path check to name."""
    try:
        return os.path.expanduser(path)
    except (ValueError, UnicodeError):
        return path


def fmt_duration(seconds: float) -> str:
    """A wall time for a progress line: '8 s', '1 min 05 s', '2 h 03 min'."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class ProgressLine:
    """Progress of a long statement on standard error, with the time elapsed and an estimate of
    the time left (from the rate so far). On a terminal: one line redrawn in place at most 20
    times a second and erased by `finish` however the statement ends. Elsewhere (a script's
    log): a line at most every ``every`` seconds, so a build of a minute says how it goes and a
    quick one says nothing. The clock restarts when a call reports 0 done (a new phase: the
    prompt's encoding, then the feature metadata)."""

    def __init__(self, stream: TextIO, title: str, *, tty: bool | None = None, every: float = 10.0,
                 clock=time.monotonic):
        self.stream, self.title = stream, title
        self.tty = isatty(stream) if tty is None else tty
        self.every, self.clock = every, clock
        self.t0 = clock()
        self.last = float("-inf")  # the first frame is always drawn
        self.drawn = False

    def text(self, done: int, total: int, label: str) -> str:
        """'12/30, 8 s elapsed, about 12 s left: layer 11' (no estimate before the first step; the
        label last, where a narrow terminal cuts it)."""
        elapsed = self.clock() - self.t0
        out = f"{done}/{total}, {fmt_duration(elapsed)} elapsed"
        if 0 < done < total:
            out += f", about {fmt_duration(elapsed / done * (total - done))} left"
        return out + (f": {label}" if label else "")

    def __call__(self, done: int, total: int, label: str) -> None:
        now = self.clock()
        if done == 0:
            self.t0 = now
        if self.tty:
            if 0 < done < total and now - self.last < 0.05:
                return
            self.last = now
            cols = terminal_size(self.stream)[0]
            width = 30
            frac = 0.0 if total <= 0 else min(1.0, done / total)
            filled = round(frac * width)
            line = f"{self.title} [{'#' * filled}{'-' * (width - filled)}] {self.text(done, total, label)}"
            self.stream.write("\r" + line[: cols - 1].ljust(cols - 1))
            self.stream.flush()
            self.drawn = True
        elif done < total and now - self.last >= self.every and now - self.t0 >= self.every:
            self.last = now
            write_text(self.stream, f"{self.title}: {self.text(done, total, label)}\n")
            self.stream.flush()

    def finish(self) -> None:
        """Erase the line drawn on a terminal (nothing to do elsewhere)."""
        if self.drawn:
            cols = terminal_size(self.stream)[0]
            self.stream.write("\r" + " " * (cols - 1) + "\r")
            self.stream.flush()
            self.drawn = False


class Console:
    """Runs text against a `lql.Session` and prints what comes back.

    ``interactive``: the REPL (a pager and terminal-width fitting when standard output is a
    terminal, indented JSON, a blank line after each result); otherwise batch (a blank line
    between results, one JSON object per line). ``keep_going``: a script runs on after a
    failure. ``color``: styled diagnostics on a terminal (NO_COLOR respected). ``tuples_only``
    (batch): print only the last statement's result, when it succeeded, as rows alone (CSV and
    TSV without their header line, text without a time line), so that one statement's rows can
    be piped; earlier results (OPEN's) are not printed."""

    def __init__(self, session, *, stdout: TextIO | None = None, stderr: TextIO | None = None,
                 interactive: bool = False, keep_going: bool = False, debug: bool = False, color: bool = False,
                 tuples_only: bool = False):
        self.session = session
        self.tuples_only = tuples_only and not interactive
        self._held: R.Result | None = None  # tuples-only: the last statement's result, printed at close
        self._stdout, self._stderr = stdout, stderr
        self.interactive, self.keep_going, self.debug, self.color = interactive, keep_going, debug, color
        self.ran = self.failed = 0
        self._printed = False
        self._redirect: TextIO | None = None
        self._redirect_path: str | None = None
        self._once: str | None = None
        self._include_depth = 0
        self._progress: ProgressLine | None = None  # the running statement's, on standard error
        if getattr(session, "on_notice", None) is None:
            session.on_notice = self.print_notice
        if getattr(session, "on_progress", None) is None:
            session.on_progress = self.on_progress

    # ---- streams --------------------------------------------------------------------------

    @property
    def stdout(self) -> TextIO:
        return self._stdout or sys.stdout

    @property
    def stderr(self) -> TextIO:
        return self._stderr or sys.stderr

    def print_styled(self, fragments: list[tuple[str, str]], *, file: TextIO | None = None, end: str = "\n") -> None:
        """Styled text on a stream: coloured on a terminal when colour is on, plain elsewhere."""
        f = file or self.stdout
        fragments = [(style, render.escape_surrogates(t)) for style, t in fragments]
        if self.color and isatty(f):
            print_formatted_text(FormattedText(fragments), style=STYLE, file=f, end=end, flush=True)
        else:
            write_text(f, "".join(t for _, t in fragments) + end)
            f.flush()

    def print_text(self, text: str) -> None:
        self.print_styled([("", text)])

    def print_info(self, text: str) -> None:
        self.print_styled([("class:info", text)], file=self.stderr)

    def print_notice(self, text: str) -> None:
        """What a statement says while it runs (OPEN DEFAULT rebuilding a damaged cache, a feature
        metadata build starting); a progress line on the screen is erased first, and is drawn
        again below it at the next step."""
        if self._progress is not None:
            self._progress.finish()
        self.print_styled([("class:warning", f"notice: {text}")], file=self.stderr)

    def print_error(self, text: str, hint: str | None = None) -> None:
        frags = [("class:error", text)]
        if hint:
            frags.append(("class:warning", f"\n  hint: {hint}"))
        self.print_styled(frags, file=self.stderr)

    def print_lql_error(self, e: LqlError, *, where: str = "", show_statement: bool = False) -> None:
        """A syntax error with its line and caret; a refusal with its message and hint."""
        self.print_styled(render.error_fragments(e, where=where, show_statement=show_statement), file=self.stderr)

    # ---- settings the console reads -------------------------------------------------------

    @property
    def format(self) -> str:
        return self.session.settings.format

    @property
    def timing(self) -> bool:
        return bool(self.session.settings.timing)

    def _results_stream(self) -> tuple[TextIO, bool]:
        """Where a result goes, and whether that is the screen."""
        if self._redirect is not None:
            return self._redirect, False
        return self.stdout, True

    # ---- printing results -----------------------------------------------------------------

    def emit_result(self, result: R.Result, seconds: float | None = None) -> None:
        """Print a result in the session's format, with its wall time when timing is on."""
        once = self._once
        fmt = self.format
        if once is not None:
            self._once = None
            body = render.escape_surrogates(self._formatted(result, fmt, None)) + "\n"
            self._target("\\once", once)  # checked again: the statement may have created it
            try:
                with open(once, "x" if not self._overwrite else "w", encoding="utf-8") as f:
                    f.write(body)
            except FileExistsError:
                raise FileRefusal(f"\\once: {once!r} appeared while the statement ran; refusing to overwrite it",
                                  hint="choose another name, or SET overwrite = on") from None
            except OSError as e:
                raise FileRefusal(f"\\once: cannot write {once}: {e.strerror or e}") from None
            self.print_info(f"result written to {once}")
            return
        if self.tuples_only:
            self._held = result
            return
        out, screen = self._results_stream()
        width = None
        if screen and self.interactive and isatty(out):
            width = terminal_size(out)[0]
        shown = self._formatted(result, fmt, width)
        if fmt == "text" and width is not None:
            shown = fold_wide(shown, width)
        if fmt in ("text",) and self.timing and seconds is not None:
            shown += f"\ntime: {text.fmt_seconds(seconds)}"
        self._write_block(shown, out, screen, fmt)

    def _formatted(self, result: R.Result, fmt: str, width: int | None) -> str:
        indent = 2 if self.interactive and fmt == "json" else None
        return render.format_result(result, fmt, timing=self.timing, width=width,
                                    expanded=str(self.session.settings.expanded), indent=indent)

    def _write_block(self, text: str, out: TextIO, screen: bool, fmt: str) -> None:
        blocky = fmt in ("text", "csv", "tsv", "markdown")
        if self.interactive:
            body = text + ("\n" if blocky else "")  # a blank line after each result keeps them apart
        else:
            body = ("\n" if blocky and self._printed else "") + text
        self._printed = True
        body = render.escape_surrogates(body)
        if screen and self._should_page(body, out) and self._page(body, out):
            return
        write_text(out, body + "\n")
        out.flush()

    def _should_page(self, text: str, out: TextIO) -> bool:
        if not (self.interactive and self.session.settings.pager and isatty(out)):
            return False
        # taller than the screen only: a short result with one wide line (a long prompt's ids)
        # is printed and wraps, instead of waiting in the pager for a key
        _cols, rows = terminal_size(out)
        return text.count("\n") + 1 > rows - 2

    def _page(self, text: str, out: TextIO) -> bool:
        """Send ``text`` through $PAGER (default ``less -SRXF``); False if it could not run."""
        cmd = os.environ.get("PAGER") or DEFAULT_PAGER
        try:
            fd = out.fileno()
        except (AttributeError, ValueError, OSError):
            fd = None
        try:
            p = subprocess.Popen(cmd, shell=True, stdin=subprocess.PIPE, stdout=fd)
        except OSError as e:
            self.print_error(f"the pager {cmd!r} cannot run ({e}); printing instead",
                             hint="SET pager = off, or set $PAGER")
            return False
        try:
            assert p.stdin is not None
            p.stdin.write((text + "\n").encode("utf-8", "replace"))
            p.stdin.close()
        except BrokenPipeError:  # the reader quit early (q in less)
            pass
        while True:
            try:
                p.wait()
                break
            except KeyboardInterrupt:  # Ctrl-C belongs to the pager while it runs
                continue
        if p.returncode == 127:
            self.print_error(f"the pager {cmd!r} was not found; printing instead",
                             hint="SET pager = off, or set $PAGER")
            return False
        return True

    def emit_error(self, err: BaseException, ref: R.StatementRef | None, *, where: str = "",
                   show_statement: bool = False) -> None:
        """A failure: the diagnostic on standard error; in json/jsonl format also its JSON
        object in the results, where a program reading them will look."""
        self._held = None
        if self.debug and isinstance(err, LqlError):
            traceback.print_exception(err, file=self.stderr)
        self.print_lql_error(err, where=where, show_statement=show_statement)
        if self.format in ("json", "jsonl"):
            self._emit_json(render.error_json(err, ref))

    def _emit_json(self, obj: dict) -> None:
        indent = 2 if self.interactive and self.format == "json" else None
        out, _ = self._results_stream()
        write_text(out, render.dumps_json(obj, indent=indent) + "\n")
        out.flush()

    def internal_error(self, e: BaseException, *, where: str = "", stmt: ast.Statement | None = None,
                       what: str | None = None) -> None:
        """A bug: one line naming the statement (the traceback only with --debug); the front end
        survives it. ``e`` may be the `InternalError` the statement loop raised, or the
        exception itself."""
        original = e.original if isinstance(e, InternalError) and e.original is not None else e
        if self.debug:
            traceback.print_exception(original, file=self.stderr)
        line = stmt.line if stmt else (e.line if isinstance(e, InternalError) else None)
        column = stmt.column if stmt else (e.column if isinstance(e, InternalError) else None)
        statement = stmt.source if stmt else (what or (e.statement if isinstance(e, InternalError) else None))
        self.print_error(render.internal_error_text(original, where=where, line=line, column=column,
                                                    statement=statement, debug=self.debug))
        if self.format in ("json", "jsonl"):
            ref = (R.StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)
                   if stmt else None)
            self._emit_json(render.error_json(e, ref))

    # ---- redirect -------------------------------------------------------------------------

    @property
    def _overwrite(self) -> bool:
        return bool(self.session.settings.overwrite)

    def _target(self, command: str, path: str) -> Path:
        """A file a shell command writes, checked through vindex3.paths: a file name under an
        existing directory, outside the open container, and an existing file only with
        ``SET overwrite = on`` (never a FIFO, device or directory)."""
        from .files import container_paths, shell_output

        try:
            return shell_output(path, f"{command} target", overwrite=self._overwrite,
                                inside=container_paths(getattr(self.session, "container", None)))
        except FileRefusal as e:
            raise MetaError(e.message, hint=e.hint) from None

    def redirect(self, path: str | None) -> None:
        """``\\o FILE``: results go to FILE until ``\\o`` alone. An existing FILE is replaced
        only with ``SET overwrite = on``."""
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = self._redirect_path = None
        if path:
            p = self._target("\\o", _expand(path))
            try:
                self._redirect = open(p, "w" if self._overwrite else "x", encoding="utf-8")  # noqa: SIM115 - open until \\o alone
            except OSError as e:
                raise MetaError(f"\\o: cannot write {p}: {e.strerror or e}") from None
            self._redirect_path = str(p)

    def redirect_once(self, path: str) -> None:
        """``\\once FILE``: the next statement's result goes to FILE (checked now, and again
        when it is written)."""
        self._once = str(self._target("\\once", _expand(path)))

    @property
    def redirected_to(self) -> str | None:
        return self._redirect_path

    def close(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            fmt = self.format
            body = render.format_result(held, fmt, timing=False, header=False)
            out, _screen = self._results_stream()
            if body:
                write_text(out, render.escape_surrogates(body) + "\n")
                out.flush()
        self.redirect(None)

    # ---- hooks a front end fills ------------------------------------------------------------

    def on_progress(self, done: int, total: int, label: str) -> None:
        """The session's progress hook: the running statement's progress line."""
        if self._progress is not None:
            self._progress(done, total, label)

    @contextmanager
    def live(self, stmt: ast.Statement) -> Iterator[None]:
        """What the front end shows while ``stmt`` runs: a progress line on standard error for a
        statement that reports progress (ENCODE, OPEN DEFAULT's first encode, DRAFT LADDER, a
        feature metadata build), erased however the statement ends (the REPL adds token echo)."""
        self._progress = ProgressLine(self.stderr, stmt.keyword.lower() or "working")
        try:
            yield
        finally:
            progress, self._progress = self._progress, None
            progress.finish()

    def shell_statement(self, stmt: ast.Statement) -> R.Result | None:
        """A statement the front end answers itself (the REPL's own settings), or None."""
        return None

    def decorate(self, result: R.Result) -> R.Result:
        """The front end's additions to a result (the REPL adds its settings to SHOW SETTINGS)."""
        return result

    # ---- running ----------------------------------------------------------------------------

    def run_meta(self, text: str, *, where: str = "", line: int | None = None) -> str:
        """A shell command line. Unknown commands and bad arguments are refused by name."""
        from .repl_meta import EXIT as META_EXIT
        from .repl_meta import META

        word, arg = META.split(text)
        cmd = META.find(word)
        loc = f"{where}:{line}: " if where and line is not None else (f"{where}: " if where else "")
        if cmd is None:
            close = META.suggest(word)
            self.print_error(f"{loc}unknown shell command {word}",
                             hint=(f"did you mean {' or '.join(close)}? " if close else "") + "\\? lists them")
            return FAILED
        if cmd.interactive_only and not self.interactive:
            self.print_error(f"{loc}{cmd.name} works only in the interactive shell",
                             hint=f"leave {cmd.name} out of the script")
            return FAILED
        try:
            return EXIT if cmd.handler(self, arg) is META_EXIT else OK
        except _ScriptFailed:  # an included script stopped; it said why
            return FAILED
        except MetaError as e:
            self.print_error(f"{loc}{e.message}", hint=e.hint)
            return FAILED
        except KeyboardInterrupt:
            self.print_error(f"interrupted: {cmd.name} stopped")
            return INTERRUPTED
        except Exception as e:  # noqa: BLE001 - a bug in a shell command; the front end survives it
            self.internal_error(e, what=cmd.name)
            return INTERNAL

    def run_statement(self, stmt: ast.Statement, *, where: str = "", show_statement: bool = False) -> str:
        """Execute one parsed statement and print its outcome."""
        self._held = None  # tuples-only: this statement's result replaces the last one, or its failure does
        t0 = time.perf_counter()
        try:
            result = self.shell_statement(stmt)
            if result is None:
                with self.live(stmt):
                    out = loop.execute(self.session, stmt)
                if out.error is not None:
                    raise out.error
                result = out.result
        except KeyboardInterrupt:
            self._once = None
            self.print_error(f"interrupted: {stmt.keyword} stopped; the session is as it was before it")
            return INTERRUPTED
        except InternalError as e:
            self._once = None
            self.internal_error(e, where=where, stmt=stmt)
            return INTERNAL
        except LqlError as e:
            self._once = None
            if e.line is None:
                e.locate(stmt.line, stmt.column, stmt.source)
            ref = R.StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)
            self.emit_error(e, ref, where=where, show_statement=show_statement)
            return FAILED
        except Exception as e:  # noqa: BLE001 - a bug; printed, the front end decides what next
            self._once = None
            self.internal_error(e, where=where, stmt=stmt)
            return INTERNAL
        return self._print_outcome(stmt, result, time.perf_counter() - t0, where)

    def _print_outcome(self, stmt: ast.Statement, result: R.Result, seconds: float, where: str = "") -> str:
        try:
            self.emit_result(self.decorate(result), seconds)
        except KeyboardInterrupt:
            self.print_error(f"interrupted: {stmt.keyword} ran; printing its result stopped")
            return INTERRUPTED
        except LqlError as e:  # \once could not write
            self.print_lql_error(e)
            return FAILED
        except Exception as e:  # noqa: BLE001 - a bug in rendering: the boundary names the statement
            self.internal_error(e, where=where, stmt=stmt)
            return INTERNAL
        if getattr(result, "interrupted", False):
            self.print_error(f"interrupted: {stmt.keyword} stopped; what it finished is shown")
            return INTERRUPTED
        return OK

    def _run_chunk(self, full: str, ch: loop.Chunk, where: str, show_statement: bool) -> list[str]:
        try:
            stmts = loop.parse_or_internal(full, ch)
        except InternalError as e:
            self._once = None
            self.internal_error(e, where=where, what=ch.text)
            return [INTERNAL]
        except LqlSyntaxError as e:
            self._once = None
            ref = R.StatementRef(kind=None, line=ch.line, column=ch.column, text=ch.text)
            self.emit_error(e, ref, where=where)
            return [FAILED]
        return [self.run_statement(s, where=where, show_statement=show_statement) for s in stmts]

    def run_items(self, text: str, items, *, where: str = "", show_statement: bool = False,
                  keep_going: bool | None = None) -> str:
        """Run statements and shell-command lines in order; stop at the first failure (unless
        ``keep_going``), at an interrupt, an internal error or an exit command. Counts what
        ran and what failed."""
        keep_going = self.keep_going if keep_going is None else keep_going
        items = list(items)
        status = OK
        for i, item in enumerate(items):
            if not (isinstance(item, loop.MetaLine) and item.text.split()[0] in ("\\i", "\\include")):
                self.ran += 1  # an \i line is counted by the statements it runs
            if isinstance(item, loop.MetaLine):
                st = self.run_meta(item.text, where=where, line=item.line)
                sts = [st]
            else:
                sts = self._run_chunk(text, item, where, show_statement)
            for st in sts:
                if st in (EXIT, INTERRUPTED, INTERNAL):
                    if st != EXIT and st == INTERNAL:
                        self.failed += 1
                    return st
                if st == FAILED:
                    self.failed += 1
                    status = FAILED
                    if not keep_going:
                        left = len(items) - i - 1
                        if left and self.interactive and not where:
                            self.print_info(f"({left} later statement{'s' if left > 1 else ''} not run)")
                        return FAILED
        return status

    def run_text(self, text: str, *, where: str = "") -> str:
        """What was typed at the prompt: a shell command, or statements run in order until
        the first failure."""
        from .repl_lexer import is_meta

        if is_meta(text):
            self.ran += 1
            st = self.run_meta(text, where=where)
            if st == FAILED:
                self.failed += 1
            return st
        items = list(loop.chunks(text))
        return self.run_items(text, items, where=where, show_statement=len(items) > 1, keep_going=False)

    def run_script(self, text: str, *, where: str) -> str:
        """A script (a file, ``-e`` text, standard input, ``\\i``, the rc file): statements and
        shell-command lines in order, stopping at the first failure unless keep-going."""
        return self.run_items(text, loop.script_items(text), where=where)

    def run_file(self, path: str) -> str:
        """``\\i``: run a script file in this session; a failure names file and line."""
        from .files import read_script

        if self._include_depth >= 8:
            raise MetaError(f"\\i {path}: scripts include each other more than 8 deep; stopped")
        try:
            text = read_script(_expand(path), "\\i: script")
        except FileRefusal as e:
            raise MetaError(e.message, hint=e.hint) from None
        self._include_depth += 1
        try:
            st = self.run_script(text, where=str(path))
        finally:
            self._include_depth -= 1
        if st == FAILED:
            raise _ScriptFailed
        return st


class _ScriptFailed(MetaError):
    """An included script stopped at a failure it already reported."""

    def __init__(self):
        super().__init__("")
