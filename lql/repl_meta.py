"""Meta commands: the shell's own commands, which are not LQL (``\\q``, ``\\timing``, ``\\i``...).

They live in one registry — name, aliases, arguments, one line of help, handler — and ``\\?``
is generated from it, so the help cannot drift from what the commands do. Handlers return
`CONTINUE` or `EXIT`."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .repl import Shell

CONTINUE, EXIT = True, False

Handler = Callable[["Shell", str], bool]


@dataclass(frozen=True)
class MetaCommand:
    name: str  # e.g. "\\timing"
    aliases: tuple[str, ...]
    args: str  # e.g. "[on|off]", shown in the help
    help: str
    handler: Handler

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)


class MetaRegistry:
    """Meta commands by name and alias, in registration order."""

    def __init__(self) -> None:
        self._commands: list[MetaCommand] = []
        self._by_name: dict[str, MetaCommand] = {}

    def command(
        self, name: str, *aliases: str, args: str = "", help: str
    ) -> Callable[[Handler], Handler]:
        """Register the decorated function as a meta command."""

        def register(fn: Handler) -> Handler:
            cmd = MetaCommand(name, tuple(aliases), args, help, fn)
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


#: The shell's commands. Handlers receive the `Shell` and the argument text.
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
    "\\timing", args="[on|off]", help="show timings with results (toggles without an argument)"
)
def _timing(shell: Shell, arg: str) -> bool:
    value = _switch(arg, bool(shell.session.settings.get("timing")))
    if value is None:
        shell.print_error(f"\\timing takes on or off, not {arg!r}")
        return CONTINUE
    shell.session.settings["timing"] = value
    shell.print_info(f"timing is {'on' if value else 'off'}")
    return CONTINUE


@META.command("\\json", help="print results as JSON, one object per statement")
def _json(shell: Shell, arg: str) -> bool:
    shell.session.settings["format"] = "json"
    shell.print_info("output format is json")
    return CONTINUE


@META.command("\\text", help="print results as text tables (the default)")
def _text(shell: Shell, arg: str) -> bool:
    shell.session.settings["format"] = "text"
    shell.print_info("output format is text")
    return CONTINUE


@META.command(
    "\\i",
    "\\include",
    args="FILE",
    help="run a script of LQL statements (and shell commands) in this session",
)
def _include(shell: Shell, arg: str) -> bool:
    if not arg:
        shell.print_error("\\i needs a file, e.g. \\i examples/quickstart.lql")
        return CONTINUE
    return shell.run_file(arg)


@META.command("\\history", args="[n]", help="the last n entries of the history (default 20)")
def _history(shell: Shell, arg: str) -> bool:
    try:
        n = int(arg) if arg else 20
    except ValueError:
        shell.print_error(f"\\history takes a count, not {arg!r}")
        return CONTINUE
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
