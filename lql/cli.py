"""The ``lql`` command. Batch use: ``lql script.lql``, ``lql -e "OPEN 'm'; STATS;"``, or
statements on standard input; with no arguments at a terminal it opens the REPL.

Results go to stdout (text, or one JSON object per statement per line); diagnostics go to
stderr, as ``SOURCE:LINE:COLUMN: error: message``. Exit status: 0 when every statement ran,
1 when a statement failed or the text is not LQL, 2 for a usage error, 3 for an internal
error (a bug; ``--debug`` shows its traceback), 130 when interrupted."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from typing import TextIO

from . import render
from .errors import LqlError, LqlSyntaxError
from .parser import parse
from .results import StatementRef

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lql",
        description="LQL: query, explain and run language models stored as VINDEX3 containers.",
        epilog="With no script and no -e, statements are read from standard input; "
               "at a terminal, the interactive shell opens instead.",
    )
    from vindex3 import __version__

    p.add_argument("--version", action="version", version=f"lql {__version__}")
    p.add_argument("script", nargs="?", help="a .lql script to run ('-' for standard input)")
    p.add_argument("-e", "--execute", action="append", metavar="TEXT", default=[],
                   help="run these statements (may be given more than once)")
    p.add_argument("-c", "--container", metavar="PATH", help="open this container before running anything")
    p.add_argument("--json", action="store_true", help="print results as JSON, one object per statement per line")
    p.add_argument("--keep-going", action="store_true",
                   help="run every statement even after one fails (the exit status still reports the failure)")
    p.add_argument("--no-timing", action="store_true", help="leave machine-dependent timings out of text output")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    p.add_argument("--repl", nargs="?", const="", metavar="PATH", default=None,
                   help="open the interactive shell (optionally on a container)")
    return p


def _start_repl(path: str | None, debug: bool, err: TextIO) -> int:
    try:
        repl = importlib.import_module("lql.repl")
    except ModuleNotFoundError as e:
        if e.name not in ("lql.repl",):
            raise
        print("lql: the interactive shell is not part of this build yet; run a script with "
              "`lql script.lql` or `lql -e \"...\"` (see lql --help)", file=err)
        return EXIT_USAGE
    rc = repl.main(path=path or None, debug=debug)
    return int(rc or 0)


def main(argv: list[str] | None = None, *, stdin: TextIO | None = None, stdout: TextIO | None = None,
         stderr: TextIO | None = None) -> int:
    """Run the command; returns the exit status (the console script exits with it)."""
    stdin, out, err = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    args = _arg_parser().parse_args(argv)

    if args.repl is not None:
        return _start_repl(args.repl or args.container, args.debug, err)
    if args.script is None and not args.execute:
        if stdin.isatty():
            return _start_repl(args.container, args.debug, err)
        args.script = "-"

    sources: list[tuple[str, str]] = []  # (label, text)
    for i, text in enumerate(args.execute):
        sources.append(("<-e>" if len(args.execute) == 1 else f"<-e #{i + 1}>", text))
    if args.script is not None:
        if args.script == "-":
            sources.append(("<stdin>", stdin.read()))
        else:
            try:
                with open(args.script, encoding="utf-8") as f:
                    sources.append((args.script, f.read()))
            except FileNotFoundError:
                print(f"lql: script {args.script} does not exist", file=err)
                return EXIT_FAILED
            except (OSError, UnicodeDecodeError) as e:
                print(f"lql: script {args.script} cannot be read: {e}", file=err)
                return EXIT_FAILED

    runner = _Runner(out, err, json_output=args.json, keep_going=args.keep_going, debug=args.debug,
                     timing=not args.no_timing)
    try:
        return runner.run(sources, container=args.container)
    except KeyboardInterrupt:
        print("lql: interrupted", file=err)
        return EXIT_INTERRUPTED


class _Runner:
    def __init__(self, out: TextIO, err: TextIO, *, json_output: bool, keep_going: bool, debug: bool, timing: bool):
        from .session import Session

        self.out, self.err = out, err
        self.keep_going, self.debug = keep_going, debug
        self.session = Session()
        self.session.settings["format"] = "json" if json_output else "text"
        self.session.settings["timing"] = timing
        self.failed = 0
        self.ran = 0
        self.printed = False

    def run(self, sources: list[tuple[str, str]], container: str | None) -> int:
        if container is not None:
            text = "OPEN " + _quote(container)
            rc = self._run_text("<--container>", text)
            if rc != EXIT_OK:
                return rc
        for label, text in sources:
            rc = self._run_text(label, text)
            if rc in (EXIT_INTERNAL,) or (rc != EXIT_OK and not self.keep_going):
                return rc
        if self.failed:
            if self.keep_going:
                print(f"lql: {self.failed} of {self.ran} statement(s) failed", file=self.err)
            return EXIT_FAILED
        return EXIT_OK

    def _run_text(self, label: str, text: str) -> int:
        try:
            statements = parse(text)
        except LqlSyntaxError as e:
            self.failed += 1
            self._report(label, e, None)
            if self._json():
                self._emit_json(render.error_json(e, None))
            return EXIT_FAILED
        rc = EXIT_OK
        for stmt in statements:
            self.ran += 1
            ref = StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)
            try:
                result = self.session.execute_statement(stmt)
            except LqlError as e:
                self.failed += 1
                self._report(label, e, stmt)
                if self._json():
                    self._emit_json(render.error_json(e, ref))
                rc = EXIT_FAILED
                if not self.keep_going:
                    return rc
                continue
            except KeyboardInterrupt:
                raise
            except Exception as e:  # a bug: say so, without a traceback unless asked
                self.failed += 1
                if self.debug:
                    traceback.print_exc(file=self.err)
                print(f"{label}:{stmt.line}:{stmt.column}: internal error: {type(e).__name__}: {e}\n"
                      f"  in: {stmt.source}\n  this is a bug in lql or vindex3; run with --debug for the traceback",
                      file=self.err)
                if self._json():
                    self._emit_json(render.error_json(e, ref))
                return EXIT_INTERNAL
            self._emit(result)
        return rc

    def _json(self) -> bool:
        return self.session.settings["format"] == "json"

    def _emit(self, result) -> None:
        if self._json():
            self._emit_json(render.to_json(result))
            return
        if self.printed:
            self.out.write("\n")
        self.out.write(render.to_text(result, timing=bool(self.session.settings["timing"])) + "\n")
        self.out.flush()
        self.printed = True

    def _emit_json(self, obj: dict) -> None:
        self.out.write(render.dumps_json(obj) + "\n")
        self.out.flush()

    def _report(self, label: str, e: LqlError, stmt) -> None:
        if self.debug:
            traceback.print_exception(e, file=self.err)
        if isinstance(e, LqlSyntaxError):
            msg = f"{label}:{e.line}:{e.column}: syntax error: {e.message}\n{e.context()}"
            if e.hint:
                msg += f"\n  hint: {e.hint}"
            print(msg, file=self.err)
            return
        line = e.line if e.line is not None else (stmt.line if stmt else "?")
        col = e.column if e.column is not None else (stmt.column if stmt else "?")
        msg = f"{label}:{line}:{col}: error: {e.message}"
        if e.statement:
            msg += f"\n  in: {e.statement}"
        if e.hint:
            msg += f"\n  hint: {e.hint}"
        print(msg, file=self.err)


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
