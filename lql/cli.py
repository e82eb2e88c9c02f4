"""The ``lql`` command. Batch use: ``lql script.lql``, ``lql -c "OPEN 'm'; STATS;"`` (``-c``
runs a command, as psql's and duckdb's do; ``-e`` is the same), or statements on standard
input; with no arguments at a terminal it opens the REPL. A container is opened first with
``--container PATH`` or by giving its directory as the argument (``lql model.vindex3``: the
shell at a terminal, else standard input's statements against it).

Results go to stdout in the chosen format (``--format text|json|csv|tsv|markdown|jsonl``;
``--json`` is ``--format json``, one object per statement per line); diagnostics go to stderr,
as ``SOURCE:LINE:COLUMN: error: message``. A script runs statement by statement and stops at
the first that fails (statements before it have run, as with sqlite3 and psql), unless
``--keep-going``. Lines that start with a backslash are shell commands (``\\timing off``).
Exit status: 0 when every statement ran, 1 when a statement failed or the text is not LQL, 2
for a usage error, 3 for an internal error (a bug; ``--debug`` shows its traceback), 130 when
interrupted.

``lql serve ...`` starts the HTTP server instead (see docs/server.md and ``lql serve --help``)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from typing import TextIO

from . import console as C
from . import render
from .errors import LqlError
from .render import FORMATS

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lql",
        description="LQL: query, explain and run language models stored as VINDEX3 containers.",
        epilog="With no script and no -e, statements are read from standard input; "
               "at a terminal, the interactive shell opens instead. "
               "`lql serve --help`: serve models over HTTP.",
    )
    from vindex3 import __version__

    p.add_argument("--version", action="version", version=f"lql {__version__}")
    p.add_argument("script", nargs="?",
                   help="a .lql script to run ('-' for standard input), or a container directory to open")
    p.add_argument("-c", "--command", "-e", "--execute", dest="execute", action="append", metavar="TEXT", default=[],
                   help="run these statements, as psql -c does (may be given more than once)")
    p.add_argument("--container", metavar="PATH", help="open this container before running anything")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="output format of results (default text; json is one object per statement per line)")
    p.add_argument("--json", action="store_true", help="the same as --format json")
    p.add_argument("-t", "--tuples-only", action="store_true",
                   help="print only the last statement's rows: no earlier results (OPEN's), no CSV/TSV header, "
                        "no time line; nothing when it failed (for pipes: lql -t --format csv -e ...)")
    p.add_argument("--keep-going", action="store_true",
                   help="run every statement even after one fails (the exit status still reports the failure)")
    p.add_argument("--no-timing", action="store_true", help="leave machine-dependent timings out of text output")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    p.add_argument("--repl", nargs="?", const="", metavar="PATH", default=None,
                   help="open the interactive shell (optionally on a container)")
    return p


def _looks_like_a_path(text: str) -> bool:
    """A -c argument from before -c meant a command: one word naming a file or directory that
    exists, or a container's name (``m.vindex3``, ``m.gguf``). No statement is such a word."""
    t = text.strip()
    if not t or any(ch.isspace() for ch in t) or ";" in t or "'" in t:
        return False
    return t.endswith((".vindex3", ".vindex3/", ".gguf")) or os.path.exists(t)


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
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:  # `lql serve ...`: the HTTP server (a script named serve: `lql ./serve`)
        from .server.cli import main as serve

        return serve(argv[1:], stderr=err)
    args = _arg_parser().parse_args(argv)
    old = next((t for t in args.execute if _looks_like_a_path(t)), None)
    if old is not None:
        print(f"lql: -c runs a command now, as psql -c does (it used to open a container); {old!r} looks like "
              f"a container path: open it with --container {old} (or give it as the argument: lql {old})", file=err)
        return EXIT_USAGE
    if args.script is not None and args.script != "-" and os.path.isdir(args.script):
        if args.container is not None:
            print(f"lql: both --container {args.container} and the container {args.script} are given; give one",
                  file=err)
            return EXIT_USAGE
        args.container, args.script = args.script, None

    if args.repl is not None:
        return _start_repl(args.repl or args.container, args.debug, err)
    if args.script is None and not args.execute:
        if stdin.isatty():
            return _start_repl(args.container, args.debug, err)
        args.script = "-"

    try:
        return _main(args, stdin, out, err)
    except KeyboardInterrupt:
        print("lql: interrupted", file=err)
        return EXIT_INTERRUPTED
    except Exception as e:  # noqa: BLE001 - the command's last boundary: a bug, never a traceback
        if args.debug:
            traceback.print_exception(e, file=err)
        C.write_text(err, render.internal_error_text(e, where="lql", debug=args.debug) + "\n")
        return EXIT_INTERNAL


def _main(args: argparse.Namespace, stdin: TextIO, out: TextIO, err: TextIO) -> int:
    sources: list[tuple[str, str]] = []  # (label, text)
    for i, text in enumerate(args.execute):
        sources.append(("<-e>" if len(args.execute) == 1 else f"<-e #{i + 1}>", text))
    if args.script is not None:
        try:
            sources.append(_read_script(args.script, stdin))
        except ScriptUnreadable as e:
            C.write_text(err, f"lql: {e}\n")
            return EXIT_FAILED

    from .session import Session

    session = Session()
    session.settings.format = args.format or ("json" if args.json else "text")
    session.settings.timing = not args.no_timing
    con = C.Console(session, stdout=out, stderr=err, keep_going=args.keep_going, debug=args.debug,
                    tuples_only=args.tuples_only)
    try:
        return _run(con, sources, args.container, err)
    finally:
        con.close()


class ScriptUnreadable(Exception):
    """The script named on the command line (or standard input) cannot be read as text."""


def _read_script(name: str, stdin: TextIO) -> tuple[str, str]:
    """(label, text) of the script: standard input for '-', else a regular file through
    vindex3.paths (a directory, FIFO or device is refused by name, never read or waited on)."""
    if name == "-":
        buf = getattr(stdin, "buffer", None)
        try:
            if buf is not None:  # bytes, decoded here, so that a bad byte is named, not a traceback
                return "<stdin>", buf.read().decode("utf-8")
            return "<stdin>", stdin.read()
        except UnicodeDecodeError as e:
            raise ScriptUnreadable(f"standard input is not UTF-8 text (byte {e.start}: {e.reason})") from None
    from .files import read_script

    try:
        return name, read_script(name)
    except LqlError as e:
        raise ScriptUnreadable(e.message) from None


def _run(con: C.Console, sources: list[tuple[str, str]], container: str | None, err: TextIO) -> int:
    if container is not None:
        st = con.run_script("OPEN " + _quote(container), where="<--container>")
        if st != C.OK:
            return _exit_status(st)
    for label, text in sources:
        st = con.run_script(text, where=label)
        if st in (C.INTERNAL, C.INTERRUPTED, C.EXIT):
            if st == C.INTERRUPTED:
                print("lql: interrupted", file=err)
            return _exit_status(st)
        if st == C.FAILED and not con.keep_going:
            return EXIT_FAILED
    if con.failed:
        if con.keep_going:
            print(f"lql: {con.failed} of {con.ran} statement(s) failed", file=err)
        return EXIT_FAILED
    return EXIT_OK


def _exit_status(st: str) -> int:
    return {C.OK: EXIT_OK, C.EXIT: EXIT_OK, C.FAILED: EXIT_FAILED, C.INTERNAL: EXIT_INTERNAL,
            C.INTERRUPTED: EXIT_INTERRUPTED}[st]


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
