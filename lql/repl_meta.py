"""Meta commands: the shell's own commands, which are not LQL (``\\q``, ``\\timing``, ``\\i``...).

They live in one registry — name, aliases, arguments, one line of help, handler — and ``\\?``
is generated from it, so the help cannot drift from what the commands do. Handlers receive the
`lql.console.Console` (the REPL's `Shell` is one; so is the ``lql`` command running a script)
and the argument text; they return `CONTINUE` or `EXIT`, and refuse a bad argument by raising
`MetaError`. Commands marked ``interactive_only`` are refused in scripts run by ``lql``."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import MetaError

if TYPE_CHECKING:  # pragma: no cover
    from .console import Console as Shell

CONTINUE, EXIT = True, False

Handler = Callable[["Shell", str], bool]


@dataclass(frozen=True)
class MetaCommand:
    name: str  # e.g. "\\timing"
    aliases: tuple[str, ...]
    args: str  # e.g. "[on|off]", shown in the help
    help: str
    handler: Handler
    interactive_only: bool = False

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class MetaRegistry:
    """Meta commands by name and alias, in registration order."""

    def __init__(self) -> None:
        self._commands: list[MetaCommand] = []
        self._by_name: dict[str, MetaCommand] = {}

    def command(
        self, name: str, *aliases: str, args: str = "", help: str, interactive_only: bool = False
    ) -> Callable[[Handler], Handler]:
        """Register the decorated function as a meta command."""

        def register(fn: Handler) -> Handler:
            cmd = MetaCommand(name, tuple(aliases), args, help, fn, interactive_only)
            for n in cmd.names:
                if n.lower() in self._by_name:
                    raise ValueError(f"meta command {n} is registered twice")
                self._by_name[n.lower()] = cmd
            self._commands.append(cmd)
            return fn

        return register

    def __iter__(self) -> Iterator[MetaCommand]:
        return iter(self._commands)

    def find(self, word: str) -> MetaCommand | None:
        return self._by_name.get(word.lower())

    def split(self, text: str) -> tuple[str, str]:
        """``'\\i  x.lql '`` → (``'\\i'``, ``'x.lql'``). A trailing ';' is forgiven."""
        s = text.strip()
        if s.endswith(";"):
            s = s[:-1].rstrip()
        word, _, arg = s.partition(" ")
        return word, arg.strip()

    def suggest(self, word: str) -> list[str]:
        return difflib.get_close_matches(word.lower(), list(self._by_name), n=2, cutoff=0.5)

    def completions(self) -> list[tuple[str, str]]:
        """(name, help) for every backslash name, aliases included, for the completer."""
        return [(n, c.help) for c in self._commands for n in c.names if n.startswith("\\")]

    def help_text(self) -> str:
        """The generated ``\\?`` table."""
        rows = [
            (", ".join(c.names) + (f" {c.args}" if c.args else ""), c.help) for c in self._commands
        ]
        width = max(len(r[0]) for r in rows)
        lines = ["Shell commands (LQL statements end with ';'; HELP; lists them):", ""]
        lines += [f"  {left.ljust(width)}  {right}" for left, right in rows]
        return "\n".join(lines)


#: The shell's commands. Handlers receive the console and the argument text.
META = MetaRegistry()


@META.command("\\?", "\\help", help="this list of shell commands")
def _help(shell: Shell, arg: str) -> bool:
    shell.print_text(META.help_text())
    return CONTINUE


@META.command("\\q", "\\quit", "exit", "quit", help="leave the shell (Ctrl-D does too)")
def _quit(shell: Shell, arg: str) -> bool:
    return EXIT


def _switch(arg: str, current: bool) -> bool | None:
    a = arg.lower()
    if a == "":
        return not current
    if a in ("on", "true", "yes"):
        return True
    if a in ("off", "false", "no"):
        return False
    return None


@META.command(
    "\\timing", args="[on|off]",
    help="show the wall time of every statement and the model's timings (toggles without an argument)",
)
def _timing(shell: Shell, arg: str) -> bool:
    value = _switch(arg, bool(shell.session.settings.timing))
    if value is None:
        raise MetaError(f"\\timing takes on or off, not {arg!r}")
    shell.session.settings.timing = value
    shell.print_info(f"timing is {'on' if value else 'off'}")
    return CONTINUE


def _set_format(shell: Shell, fmt: str) -> None:
    from .render import FORMATS

    if fmt not in FORMATS:
        raise MetaError(f"\\T takes one of {', '.join(FORMATS)}, not {fmt!r}", hint="e.g. \\T csv")
    shell.session.settings.format = fmt
    shell.print_info(f"output format is {fmt}")


@META.command("\\T", "\\format", args="FORMAT", help="output format: text, json, csv, tsv, markdown or jsonl")
def _format(shell: Shell, arg: str) -> bool:
    if not arg:
        shell.print_info(f"output format is {shell.session.settings.format}")
        return CONTINUE
    _set_format(shell, arg.lower())
    return CONTINUE


@META.command("\\json", help="print results as JSON, one object per statement")
def _json(shell: Shell, arg: str) -> bool:
    _set_format(shell, "json")
    return CONTINUE


@META.command("\\text", help="print results as text tables (the default)")
def _text(shell: Shell, arg: str) -> bool:
    _set_format(shell, "text")
    return CONTINUE


@META.command("\\x", args="[on|off|auto]",
              help="tables one field per line: on, off, or auto when too wide (toggles without an argument)")
def _expanded(shell: Shell, arg: str) -> bool:
    a = arg.lower()
    current = shell.session.settings.expanded
    if a == "":
        a = "off" if current == "on" else "on"
    elif a in ("true", "yes"):
        a = "on"
    elif a in ("false", "no"):
        a = "off"
    if a not in ("on", "off", "auto"):
        raise MetaError(f"\\x takes on, off or auto, not {arg!r}")
    shell.session.settings.expanded = a
    shell.print_info(f"expanded display is {a}")
    return CONTINUE


@META.command("\\pager", args="[on|off]",
              help="page output longer than the screen through $PAGER (toggles without an argument)")
def _pager(shell: Shell, arg: str) -> bool:
    value = _switch(arg, bool(shell.session.settings.pager))
    if value is None:
        raise MetaError(f"\\pager takes on or off, not {arg!r}")
    shell.session.settings.pager = value
    shell.print_info(f"pager is {'on' if value else 'off'}")
    return CONTINUE


@META.command("\\o", "\\out", args="[FILE]", help="send results to FILE until \\o alone sends them back")
def _out(shell: Shell, arg: str) -> bool:
    shell.redirect(arg or None)
    shell.print_info(f"results go to {shell.redirected_to}" if arg else "results go to the screen")
    return CONTINUE


@META.command("\\once", args="FILE", help="send the next statement's result to FILE")
def _once(shell: Shell, arg: str) -> bool:
    if not arg:
        raise MetaError("\\once needs a file, e.g. \\once layers.csv")
    shell.redirect_once(arg)
    return CONTINUE


@META.command(
    "\\i",
    "\\include",
    args="FILE",
    help="run a script of LQL statements (and shell commands) in this session",
)
def _include(shell: Shell, arg: str) -> bool:
    if not arg:
        raise MetaError("\\i needs a file, e.g. \\i examples/quickstart.lql")
    return EXIT if shell.run_file(arg) == "exit" else CONTINUE


@META.command("\\history", args="[n]", help="the last n entries of the history (default 20)",
              interactive_only=True)
def _history(shell: Shell, arg: str) -> bool:
    try:
        n = int(arg) if arg else 20
    except ValueError:
        raise MetaError(f"\\history takes a count, not {arg!r}") from None
    entries = shell.history_entries()
    if n <= 0 or not entries:
        shell.print_info("the history is empty" if not entries else "nothing to show")
        return CONTINUE
    first = max(0, len(entries) - n)
    width = len(str(len(entries)))
    out: list[str] = []
    for i, entry in enumerate(entries[first:], start=first + 1):
        lines = entry.split("\n")
        out.append(f"{str(i).rjust(width)}  {lines[0]}")
        out += [f"{' ' * width}  {ln}" for ln in lines[1:]]
    shell.print_text("\n".join(out))
    return CONTINUE


def describe(registry: MetaRegistry = META) -> list[dict[str, Any]]:
    """The registry as data (for docs and tests)."""
    return [
        {"name": c.name, "aliases": list(c.aliases), "args": c.args, "help": c.help}
        for c in registry
    ]
