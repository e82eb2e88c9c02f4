"""The interactive LQL shell. One `PromptSession` owns the terminal: history kept in a file,
suggestions from it, emacs keys (vi as a setting), multi-line statements, highlighting from
the grammar's lexer, completion from the grammar, a bottom toolbar with the bound model.

The shell is a `lql.console.Console` (the same statement loop, printer, formats and shell
commands as the batch ``lql`` command); what it adds is the terminal: GENERATE's tokens are
printed as they are produced, ENCODE draws a progress bar, long output goes through a pager,
tables fit the screen, Ctrl-C stops a running statement and returns to the prompt (with the
tokens or ladder depths finished so far), and no error ends the shell — only ``\\q``,
``exit``, ``quit`` or Ctrl-D do.

Data goes to stdout and diagnostics to stderr, each looked up when written (so a test's
captured streams see them); prompt_toolkit's own input and output can be injected."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from prompt_toolkit import PromptSession
from prompt_toolkit.auto_suggest import AutoSuggestFromHistory
from prompt_toolkit.enums import EditingMode
from prompt_toolkit.filters import Condition, completion_is_selected
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.shortcuts import CompleteStyle

from . import ast, catalog, parser
from . import results as R
from .console import EXIT, Console
from .errors import SettingError
from .repl_complete import LqlCompleter, SettingInfo
from .repl_lexer import STYLE, LqlLexer, is_meta
from .repl_meta import META
from .statements.settings import SetResult, SettingRow, SettingsResult

PROMPT = "lql> "
CONTINUATION = "... "

#: Settings the shell itself owns (SET name = value; SHOW SETTINGS lists them with the rest).
SHELL_SETTINGS: dict[str, str] = {
    "editing_mode": "key bindings at the prompt: emacs or vi",
    "history": "the file the prompt's history is kept in",
}


def default_history_path() -> Path:
    """``$LQL_HISTORY`` if set, else ``~/.lql_history``."""
    env = os.environ.get("LQL_HISTORY")
    return Path(env).expanduser() if env else Path.home() / ".lql_history"


def default_rc_path() -> Path | None:
    """The startup file: ``$LQL_RC`` if set (empty: none), else ``~/.lqlrc``."""
    env = os.environ.get("LQL_RC")
    if env is not None:
        return Path(env).expanduser() if env else None
    return Path.home() / ".lqlrc"


def _quote(s: str) -> str:
    return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _setting_choices(doc: catalog.SettingDoc) -> tuple[str, ...]:
    """The closed set of values a session setting takes, when it has one (for completion)."""
    if isinstance(doc.default, bool):
        return ("on", "off")
    return tuple(getattr(doc.parse, "choices", ()))


def should_submit(text: str) -> bool:
    """Enter submits when the buffer is empty, a meta command, or holds a statement ending in
    ';' (outside strings and comments); otherwise Enter continues on a new line."""
    return not text.strip() or is_meta(text) or parser.is_complete(text)


class _TokenEcho:
    """GENERATE's tokens on stdout as they come. Text is decoded incrementally from all the
    ids so far, so a character spread over several byte-level tokens appears whole."""

    def __init__(self, shell: Shell):
        self.shell = shell
        self.ids: list[int] = []
        self.shown = ""
        self.started = False

    def __call__(self, token_id: int, text: str | None) -> None:
        out = self.shell.stdout
        if not self.started:
            self.started = True
            self.shell.print_styled([("class:info", "generating: ")], file=out, end="")
        self.ids.append(int(token_id))
        decoded = self._decode()
        if decoded is None:
            piece = text if text is not None else f"[{token_id}]"
        elif decoded.endswith("\ufffd"):
            return  # the middle of a multi-byte character: wait for the rest
        elif decoded.startswith(self.shown):
            piece, self.shown = decoded[len(self.shown) :], decoded
        else:  # the tokenizer revised earlier text; show what is new from here on
            piece, self.shown = (text or ""), decoded
        out.write(_printable(piece))
        out.flush()

    def _decode(self) -> str | None:
        c = getattr(self.shell.session, "container", None)
        if c is None or not getattr(c, "has_tokenizer", False):
            return None
        try:
            return c.tokenizer.decode(self.ids)
        except Exception:  # noqa: BLE001 - echo is a courtesy: never let it stop a generation
            return None

    def finish(self) -> None:
        if self.started:
            decoded = self._decode()
            if decoded is not None and decoded.startswith(self.shown):
                self.shell.stdout.write(
                    _printable(decoded[len(self.shown) :])
                )  # what was held back
            self.shell.stdout.write("\n")
            self.shell.stdout.flush()


def _printable(text: str) -> str:
    """Control characters a model may produce (form feeds, escapes) made visible, so that a
    generation cannot drive the terminal; newlines and tabs pass."""
    return "".join(
        ch if ch in "\n\t" or (ch.isprintable() or ch == " ") else repr(ch)[1:-1] for ch in text
    )


def _blank(text: str) -> bool:
    """Nothing but whitespace and comments."""
    return all(t.type in ("WS", "COMMENT") for t in parser.lex(text))


class Shell(Console):
    """The REPL: a `lql.Session`, the console that prints for it, and the `PromptSession` that
    feeds it.

    ``input``/``output`` are prompt_toolkit's (tests pass a pipe input and `DummyOutput`);
    ``stdout``/``stderr`` default to the process's streams, looked up when written."""

    def __init__(
        self,
        *,
        input: Any = None,
        output: Any = None,
        history_path: str | os.PathLike | None = None,
        debug: bool = False,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
        vi_mode: bool | None = None,
    ):
        from .session import Session

        self._echo: _TokenEcho | None = None
        super().__init__(Session(on_token=self._on_token), stdout=stdout,
                         stderr=stderr, interactive=True, debug=debug, color=True)
        self.history_path: Path | None = (
            Path(history_path).expanduser() if history_path else default_history_path()
        )
        self.history = self._open_history(self.history_path)
        self._toolbar_cache: tuple[int, str] | None = None
        self._pt_io = (input, output)
        vi = (
            bool(vi_mode)
            if vi_mode is not None
            else os.environ.get("LQL_EDITING_MODE", "").lower() == "vi"
        )
        self.prompt = self._make_prompt(vi)

    def _make_prompt(self, vi_mode: bool) -> PromptSession:
        input, output = self._pt_io
        return PromptSession(
            message=[("class:prompt", PROMPT)],
            multiline=Condition(lambda: not should_submit(self.prompt.default_buffer.text)),
            prompt_continuation=lambda width, line, soft: [
                ("class:prompt.continuation", CONTINUATION.ljust(width))
            ],
            lexer=LqlLexer(),
            completer=LqlCompleter(settings=self.setting_infos, meta_commands=META.completions,
                                   model_layers=self._model_layers),
            complete_while_typing=True,
            complete_style=CompleteStyle.COLUMN,
            auto_suggest=AutoSuggestFromHistory(),
            enable_open_in_editor=True,  # Ctrl-X Ctrl-E (emacs) or v (vi): edit in $EDITOR
            history=self.history,
            key_bindings=self._key_bindings(),
            bottom_toolbar=self.toolbar,
            style=STYLE,
            include_default_pygments_style=False,
            vi_mode=vi_mode,
            input=input,
            output=output,
        )

    # ---- hooks the session calls ------------------------------------------------------

    def _on_token(self, token_id: int, text: str | None) -> None:
        if self._echo is not None:
            self._echo(token_id, text)

    @contextmanager
    def live(self, stmt: ast.Statement) -> Iterator[None]:
        """Token echo (text output only) and the progress line while ``stmt`` runs; both are
        cleared however the statement ends."""
        self._echo = _TokenEcho(self) if self.session.settings.format == "text" else None
        try:
            with super().live(stmt):
                yield
        finally:
            echo, self._echo = self._echo, None
            if echo is not None:
                echo.finish()

    # ---- history ----------------------------------------------------------------------

    def _open_history(self, path: Path | None) -> History:
        if path is None:
            return InMemoryHistory()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists() and not path.is_file():  # a FIFO would block the first read forever
                raise OSError(0, "it is not a regular file")
            path.touch(exist_ok=True)
            return FileHistory(str(path))
        except (OSError, ValueError) as e:
            self.print_error(
                f"history file {path} cannot be used ({getattr(e, 'strerror', None) or e}); "
                "this session's history is kept in memory only"
            )
            return InMemoryHistory()

    def history_entries(self) -> list[str]:
        """History entries, oldest first."""
        return list(reversed(list(self.history.load_history_strings())))

    def _model_layers(self) -> int | None:
        cat = self.session.catalog
        return cat.num_layers if cat is not None else None

    # ---- settings the shell owns ------------------------------------------------------

    def setting_infos(self) -> list[SettingInfo]:
        infos = [SettingInfo(s.name, s.description, _setting_choices(s)) for s in catalog.SETTINGS]
        infos.append(SettingInfo("editing_mode", SHELL_SETTINGS["editing_mode"], ("emacs", "vi")))
        infos.append(SettingInfo("history", SHELL_SETTINGS["history"]))
        return infos

    def _shell_setting_values(self) -> dict[str, Any]:
        mode = "vi" if self.prompt.editing_mode == EditingMode.VI else "emacs"
        return {
            "editing_mode": mode,
            "history": str(self.history_path) if self.history_path else "-",
        }

    def _set_shell_setting(self, stmt: ast.Statement) -> R.Result:
        previous = self._shell_setting_values()[stmt.name]
        value = stmt.value
        if stmt.name == "editing_mode":
            if not isinstance(value, str) or value.lower() not in ("emacs", "vi"):
                raise SettingError(f"setting editing_mode takes emacs or vi; got {value!r}")
            self.prompt.editing_mode = (
                EditingMode.VI if value.lower() == "vi" else EditingMode.EMACS
            )
            value = value.lower()
        else:  # history
            if not isinstance(value, str) or not value:
                raise SettingError(
                    f"setting history takes a file path in quotes; got {value!r}",
                    hint="SET history = '~/.lql_history'",
                )
            from vindex3.errors import PathRefused
            from vindex3.paths import check_text

            try:
                path = check_text(os.path.expanduser(value), "history file")
            except PathRefused as e:
                raise SettingError(f"setting history: {e.message}", hint=e.hint) from None
            self.history = self._open_history(path)
            self.history_path = path if isinstance(self.history, FileHistory) else None
            # the prompt's buffer loads its history once: a new history needs a new prompt
            self.prompt = self._make_prompt(self.prompt.editing_mode == EditingMode.VI)
            value = str(path)
        return SetResult(name=stmt.name, value=value, previous=previous)

    # ---- the toolbar ------------------------------------------------------------------

    def toolbar(self) -> list[tuple[str, str]]:
        """The bound model, its layer count and operator mix, the draft depth, the output mode."""
        try:
            return self._toolbar()
        except Exception:  # noqa: BLE001 - the toolbar must never break the prompt
            return [("class:bottom-toolbar", " lql ")]

    def _toolbar(self) -> list[tuple[str, str]]:
        s = self.session
        c = s.container
        remote = getattr(s, "remote", None)
        if remote is not None:  # USE REMOTE: statements run on that server
            depth = "off" if remote.draft_depth is None else f"{remote.draft_depth}"
            frags = [
                ("class:bottom-toolbar", " remote "),
                ("class:bottom-toolbar.model", f"{remote.url}"),
                ("class:bottom-toolbar", " model "),
                ("class:bottom-toolbar.model", str(remote.model)),
                ("class:bottom-toolbar", f" | draft depth {depth} "),
            ]
        elif c is None:
            frags = [
                ("class:bottom-toolbar.off", " no container bound: OPEN 'path' or OPEN DEFAULT ")
            ]
        else:
            key = id(c)
            if self._toolbar_cache is None or self._toolbar_cache[0] != key:
                g = c.graph
                mix = g.operator_mix_text() if hasattr(g, "operator_mix_text") else ""
                self._toolbar_cache = (key, f"{g.num_layers} layers ({mix})")
            depth = "off" if s.draft_depth is None else f"{s.draft_depth}"
            frags = [
                ("class:bottom-toolbar", " model "),
                ("class:bottom-toolbar.model", str(c.name)),
                ("class:bottom-toolbar", f" | {self._toolbar_cache[1]} | draft depth {depth} "),
            ]
        fmt = s.settings.format
        timing = "on" if s.settings.timing else "off"
        mode = "vi" if self.prompt.editing_mode == EditingMode.VI else "emacs"
        frags.append(("class:bottom-toolbar", f"| {fmt} | timing {timing} | {mode} | \\? help "))
        return frags

    # ---- keys -------------------------------------------------------------------------

    def _key_bindings(self) -> KeyBindings:
        kb = KeyBindings()

        @kb.add("enter", filter=completion_is_selected)
        def _take_completion(event) -> None:
            """Enter on a highlighted completion takes it and keeps editing."""
            event.current_buffer.complete_state = None

        @kb.add("escape", "enter")
        def _newline(event) -> None:
            """Alt-Enter (Esc Enter) always starts a new line."""
            event.current_buffer.insert_text("\n")

        return kb

    # ---- what the console asks the shell -------------------------------------------------

    def shell_statement(self, stmt: ast.Statement) -> R.Result | None:
        if stmt.kind == "set" and stmt.name in SHELL_SETTINGS:
            return self._set_shell_setting(stmt)
        return None

    def decorate(self, result: R.Result) -> R.Result:
        if isinstance(result, SettingsResult):
            return self._with_shell_settings(result)
        if result.kind == "help" and getattr(result, "topic", "") is None:
            return result.model_copy(update={
                "text": result.text.rstrip("\n") + "\n\nIn the shell: \\? lists shell commands; \\q quits."})
        return result

    def _with_shell_settings(self, result: SettingsResult) -> SettingsResult:
        values = self._shell_setting_values()
        rows = list(result.settings) + [
            SettingRow(name=name, value=values[name], description=desc)
            for name, desc in SHELL_SETTINGS.items()
        ]
        return result.model_copy(update={"settings": rows})

    # ---- the loop ---------------------------------------------------------------------

    def banner(self) -> None:
        from . import __version__

        self.print_info(
            f"LQL {__version__}: statements end with ';'. HELP; lists them, \\? the shell "
            "commands, \\q or Ctrl-D quits."
        )

    def run_rc(self, path: Path | None) -> None:
        """Run the startup file (``~/.lqlrc``) if it exists: settings such as
        ``SET editing_mode = vi;`` or ``\\timing off``."""
        if path is not None and path.is_file():
            self.run_meta(f"\\i {path}")

    def loop(self) -> int:
        """Read, run, repeat until an exit command or Ctrl-D. Returns the exit status (0)."""
        while True:
            try:
                text = self.prompt.prompt()
            except KeyboardInterrupt:
                continue  # Ctrl-C while typing: drop the buffer, fresh prompt
            except EOFError:
                break
            if not text.strip():
                continue
            try:
                if self.run_text(text) == EXIT:
                    break
            except KeyboardInterrupt:  # between statements, or while printing
                self.print_error("interrupted")
            except Exception as e:  # noqa: BLE001 - nothing but an exit command ends the shell
                self.internal_error(e, what=text)
        self.close()
        return 0


def _own_ctrl_c() -> None:
    """Ctrl-C stops a running statement whatever the shell inherited: a parent that ignores
    SIGINT, or whose thread blocked it when it started this process (both survive exec), would
    otherwise leave Ctrl-C dead in the shell. Only the main thread may set a handler."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def main(
    path: str | None = None,
    *,
    debug: bool = False,
    input: Any = None,
    output: Any = None,
    history_path: str | os.PathLike | None = None,
) -> int:
    """Open the interactive shell, optionally on the container at ``path``; returns the exit
    status. ``input``/``output`` are prompt_toolkit's (tests inject a pipe and `DummyOutput`);
    ``history_path`` overrides ``$LQL_HISTORY`` and ``~/.lql_history``."""
    _own_ctrl_c()
    shell = Shell(input=input, output=output, history_path=history_path, debug=debug)
    shell.banner()
    shell.run_rc(default_rc_path())
    if path:
        shell.run_text(f"OPEN {_quote(path)};")  # a refusal prints; the shell opens anyway
    return shell.loop()
