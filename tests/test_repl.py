"""The REPL driven through prompt_toolkit's pipe input and a dummy output: keys in, what the
shell printed out. Results go to stdout and diagnostics to stderr (captured by pytest)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import signal

import pytest
from prompt_toolkit.enums import EditingMode
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

import vindex3
from lql import repl
from lql.repl_meta import META

CTRL_C, CTRL_D, ENTER, TAB = "\x03", "\x04", "\r", "\t"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    """No user's home, startup file or history leaks into a test."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LQL_RC", "")
    monkeypatch.delenv("LQL_HISTORY", raising=False)
    monkeypatch.delenv("LQL_EDITING_MODE", raising=False)


@pytest.fixture
def history(tmp_path):
    return tmp_path / "history"


def drive(keys: str, history, path=None) -> int:
    """Run `lql.repl.main` on typed keys; the input ends (like Ctrl-D) after the last key."""
    with create_pipe_input() as inp:
        inp.send_text(keys)
        inp.close()
        return repl.main(
            str(path) if path else None, input=inp, output=DummyOutput(), history_path=history
        )


def quoted(path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


class Tty(io.StringIO):
    """A captured stream that claims to be a terminal (for the progress bar)."""

    def isatty(self) -> bool:
        return True


def make_shell(history, **kw) -> tuple[repl.Shell, io.StringIO, io.StringIO]:
    out, err = kw.pop("stdout", io.StringIO()), kw.pop("stderr", io.StringIO())
    sh = repl.Shell(output=DummyOutput(), history_path=history, stdout=out, stderr=err, **kw)
    return sh, out, err


# ---- typing statements ---------------------------------------------------------------


def test_statements_run_and_print_tables(tiny_llama_container, history, capsys):
    name = vindex3.open(tiny_llama_container).name
    rc = drive(f"OPEN {quoted(tiny_llama_container)};{ENTER}SHOW LAYERS;{ENTER}", history)
    out = capsys.readouterr().out
    assert rc == 0
    assert f"opened {name}" in out
    assert "layer  operator" in out and "-----  --------" in out  # a table, aligned
    assert out.count("softmax") >= 4


def test_several_statements_on_one_line_run_in_order(tiny_llama_container, history, capsys):
    drive(
        f"OPEN {quoted(tiny_llama_container)}; DRAFT DEPTH 1; SHOW SETTINGS; DRAFT OFF;{ENTER}",
        history,
    )
    out = capsys.readouterr().out
    i_open, i_draft = out.index("opened"), out.index("draft depth 1:")
    i_settings, i_off = out.index("setting  "), out.index("draft off:")
    assert i_open < i_draft < i_settings < i_off


def test_enter_continues_an_unfinished_statement_on_a_new_line(history, capsys):
    drive(f"SHOW{ENTER}SETTINGS{ENTER}  ;{ENTER}", history)
    out = capsys.readouterr().out
    assert "setting" in out and "format" in out
    assert history.read_text().count("+SHOW\n+SETTINGS\n+  ;") == 1  # one entry, three lines


def test_the_container_given_at_start_is_opened(tiny_llama_container, history, capsys):
    drive(f"STATS;{ENTER}", history, path=tiny_llama_container)
    assert "operators" in capsys.readouterr().out


def test_a_container_that_cannot_be_opened_still_opens_the_shell(tmp_path, history, capsys):
    rc = drive(f"SHOW SETTINGS;{ENTER}", history, path=tmp_path / "missing.vindex3")
    cap = capsys.readouterr()
    assert rc == 0
    assert "error:" in cap.err and "missing.vindex3" in cap.err
    assert "format" in cap.out


# ---- errors never end the shell --------------------------------------------------------


def test_a_syntax_error_shows_the_caret_and_the_shell_goes_on(history, capsys):
    rc = drive(f"OPEN model.vindex3;{ENTER}HELP;{ENTER}", history)
    cap = capsys.readouterr()
    assert rc == 0
    assert "syntax error at line 1, column 6" in cap.err
    assert "  OPEN model.vindex3;\n       ^" in cap.err
    assert "hint: paths are strings" in cap.err
    assert "LQL statements" in cap.out  # the next statement ran


def test_a_refusal_stops_the_rest_of_the_line_and_says_so(history, capsys):
    drive(f"STATS; SHOW LAYERS; HELP;{ENTER}", history)
    cap = capsys.readouterr()
    assert "error: STATS needs an open container" in cap.err
    assert "in: STATS" in cap.err
    assert "2 later statements not run" in cap.err
    assert "LQL statements" not in cap.out


def test_an_internal_error_is_reported_and_the_shell_survives(history, capsys, monkeypatch):
    from lql import registry

    def boom(session, node):  # a bug below the statement boundary
        raise RuntimeError("kaboom")

    monkeypatch.setattr(registry, "run", boom)
    rc = drive(f"HELP;{ENTER}\\timing off{ENTER}", history)
    cap = capsys.readouterr()
    assert rc == 0
    assert "internal error: RuntimeError: kaboom" in cap.err
    assert "--debug" in cap.err and "Traceback" not in cap.err
    assert "timing is off" in cap.err  # the next command ran


# ---- keys ------------------------------------------------------------------------------


def test_ctrl_c_while_typing_clears_the_buffer(history, capsys):
    rc = drive(f"SHOW LAY{CTRL_C}SHOW SETTINGS;{ENTER}", history)
    cap = capsys.readouterr()
    assert rc == 0
    assert "format" in cap.out and "error" not in cap.err  # 'SHOW LAYSHOW SETTINGS' never ran
    assert "SHOW LAY" not in history.read_text().replace("SHOW SETTINGS", "")


def test_ctrl_d_exits(history, capsys):
    rc = drive(f"{CTRL_D}HELP;{ENTER}", history)
    assert rc == 0
    assert "LQL statements" not in capsys.readouterr().out


@pytest.mark.parametrize("word", ["\\q", "\\quit", "exit", "quit", "QUIT;"])
def test_exit_commands_end_the_shell(word, history, capsys):
    rc = drive(f"{word}{ENTER}HELP;{ENTER}", history)
    assert rc == 0
    assert "LQL statements" not in capsys.readouterr().out


def test_vi_mode_is_a_setting(history, capsys):
    sh, out, err = make_shell(history)
    assert sh.prompt.editing_mode == EditingMode.EMACS
    sh.run_text("SET editing_mode = vi;")
    assert sh.prompt.editing_mode == EditingMode.VI
    assert "editing_mode = vi (was emacs)" in out.getvalue()
    sh.run_text("SET editing_mode = nano;")
    assert "editing_mode takes emacs or vi" in err.getvalue()
    sh.run_text("SHOW SETTINGS;")
    assert re.search(r"editing_mode +vi", out.getvalue())


def test_vi_mode_from_the_environment(history, monkeypatch):
    monkeypatch.setenv("LQL_EDITING_MODE", "vi")
    sh, _, _ = make_shell(history)
    assert sh.prompt.editing_mode == EditingMode.VI


def test_tab_completes_from_the_grammar_while_typing(history):
    """Real typing: keys arrive while the prompt runs, so completion has time to answer."""

    async def scenario() -> str:
        with create_pipe_input() as inp:
            sh = repl.Shell(input=inp, output=DummyOutput(), history_path=history)
            task = asyncio.ensure_future(sh.prompt.prompt_async())
            for keys in ["sh", TAB, " LAY", TAB, ";", ENTER]:
                inp.send_text(keys)
                await asyncio.sleep(0.3)
            return await asyncio.wait_for(task, 10)

    assert asyncio.run(scenario()) == "show LAYERS;"


def test_enter_on_a_highlighted_completion_takes_it_without_running(history):
    async def scenario() -> str:
        with create_pipe_input() as inp:
            sh = repl.Shell(input=inp, output=DummyOutput(), history_path=history)
            task = asyncio.ensure_future(sh.prompt.prompt_async())
            for keys in ["SHOW ", TAB, TAB, ENTER, ";", ENTER]:
                inp.send_text(keys)
                await asyncio.sleep(0.3)
            return await asyncio.wait_for(task, 10)

    # the first of SHOW's keywords in the completion menu (ATTENTION, of SHOW ATTENTION), taken
    # by ENTER without running the line
    assert asyncio.run(scenario()) == "SHOW ATTENTION;"


def test_suggestions_from_history(history):
    """A line typed before is offered as a suggestion; the right arrow takes it."""
    history.write_text("\n# earlier\n+SHOW SETTINGS;\n")

    async def scenario() -> str:
        with create_pipe_input() as inp:
            sh = repl.Shell(input=inp, output=DummyOutput(), history_path=history)
            task = asyncio.ensure_future(sh.prompt.prompt_async())
            for keys in ["SHOW S", "\x1b[C", ENTER]:
                inp.send_text(keys)
                await asyncio.sleep(0.3)
            return await asyncio.wait_for(task, 10)

    assert asyncio.run(scenario()) == "SHOW SETTINGS;"


# ---- history ---------------------------------------------------------------------------


def test_history_persists_and_feeds_the_next_shell(history, capsys):
    drive(f"HELP;{ENTER}SHOW SETTINGS;{ENTER}", history)
    capsys.readouterr()
    drive(f"\\history{ENTER}", history)
    out = capsys.readouterr().out
    assert "1  HELP;" in out and "2  SHOW SETTINGS;" in out and "3  \\history" in out


def test_history_path_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LQL_HISTORY", str(tmp_path / "elsewhere"))
    assert repl.default_history_path() == tmp_path / "elsewhere"
    monkeypatch.delenv("LQL_HISTORY")
    assert repl.default_history_path() == tmp_path / ".lql_history"  # HOME is tmp_path


def test_history_file_is_a_setting(tmp_path, history):
    sh, out, _ = make_shell(history)
    other = tmp_path / "other_history"
    sh.run_text(f"SET history = {quoted(other)};")
    assert sh.history_path == other and other.exists()
    assert sh.prompt.history is sh.history
    assert f"history = {other}" in out.getvalue()


def test_an_unusable_history_file_falls_back_to_memory(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    sh, _, err = make_shell(blocker / "history")
    assert "kept in memory only" in err.getvalue()
    assert sh.history_entries() == []


# ---- meta commands ---------------------------------------------------------------------


def test_help_is_generated_from_the_registry(history, capsys):
    drive(f"\\?{ENTER}", history)
    out = capsys.readouterr().out
    for cmd in META:
        assert cmd.name in out and cmd.help in out


def test_timing_json_and_text(tiny_llama_container, history):
    sh, out, err = make_shell(history)
    sh.run_text(f"OPEN {quoted(tiny_llama_container)};")
    sh.run_text("\\timing")
    assert sh.session.settings["timing"] is False and "timing is off" in err.getvalue()
    sh.run_text("\\timing on")
    assert sh.session.settings["timing"] is True
    sh.run_text("\\json")
    out.seek(0), out.truncate()
    sh.run_text("DRAFT DEPTH 1;")
    obj = json.loads(out.getvalue())
    assert obj["kind"] == "draft" and obj["ok"] is True and obj["result"]["depth"] == 1
    sh.run_text("\\text")
    assert sh.session.settings["format"] == "text"


def test_unknown_meta_command_suggests(history, capsys):
    drive(f"\\timming{ENTER}", history)
    err = capsys.readouterr().err
    assert "unknown shell command \\timming" in err and "did you mean \\timing" in err


def test_include_runs_a_script_in_the_session(tiny_llama_container, tmp_path, history):
    script = tmp_path / "s.lql"
    script.write_text(
        f"-- a script\n\\timing off\nOPEN {quoted(tiny_llama_container)};\n"
        "DRAFT DEPTH 2;\nSHOW\n  SETTINGS;\nSTATS AT x POSITIONS;\nDRAFT OFF;\n"
    )
    sh, out, err = make_shell(history)
    sh.run_text(f"\\i {script}")
    assert sh.session.settings["timing"] is False
    assert sh.session.draft_depth == 2  # the script stopped before DRAFT OFF
    assert "format" in out.getvalue()
    assert f"{script}:7:10: syntax error: expected a whole number" in err.getvalue()


def test_include_of_a_missing_file(history, tmp_path):
    sh, _, err = make_shell(history)
    sh.run_text(f"\\i {tmp_path}/nope.lql")
    assert "does not exist" in err.getvalue()


def test_help_mentions_the_shell_commands(history, capsys):
    drive(f"HELP;{ENTER}", history)
    assert "\\? lists shell commands" in capsys.readouterr().out


# ---- the toolbar -----------------------------------------------------------------------


def test_toolbar_shows_model_layers_mix_and_draft_depth(tiny_llama_container, history):
    sh, _, _ = make_shell(history)

    def text() -> str:
        return "".join(t for _, t in sh.toolbar())

    assert "no container bound" in text()
    sh.run_text(f"OPEN {quoted(tiny_llama_container)};")
    c = vindex3.open(tiny_llama_container)
    bar = text()
    assert c.name in bar
    assert f"{c.graph.num_layers} layers ({c.graph.operator_mix_text()})" in bar
    assert "draft depth off" in bar and "emacs" in bar
    sh.run_text("DRAFT DEPTH 2;")
    assert "draft depth 2" in text()


# ---- long statements: streaming, progress, interruption --------------------------------


def test_generate_streams_tokens_as_they_are_produced(tiny_llama_container, history):
    sh, out, _ = make_shell(history)
    sh.run_text(f"OPEN {quoted(tiny_llama_container)};")
    hook = sh.session.on_token
    seen: list[int] = []

    def spy(token_id, text):
        seen.append(len(out.getvalue()))  # what was on screen when this token was produced
        hook(token_id, text)

    sh.session.on_token = spy
    before = len(out.getvalue())
    sh.run_text("INFER 'hello' GENERATE 12;")
    shown = out.getvalue()[before:]
    assert shown.startswith("generating: ")
    assert len(seen) == 12
    assert len(set(seen[1:])) >= 3  # the screen grew while the tokens were being produced
    assert shown.index("generating: ") < shown.index("generated  12 tokens")


def _press_ctrl_c_after(sh, n: int):
    """A token hook that sends SIGINT (what the terminal sends on Ctrl-C) at the n-th token."""
    hook = sh.session.on_token
    count = 0

    def press(token_id, text):
        nonlocal count
        count += 1
        if count == n:
            signal.raise_signal(signal.SIGINT)
        hook(token_id, text)

    return press, lambda: count


def test_ctrl_c_keeps_the_tokens_generated_so_far(tiny_llama_container, history):
    sh, out, err = make_shell(history)
    sh.run_text(f"OPEN {quoted(tiny_llama_container)}; DRAFT DEPTH 2;")
    sh.run_text("\\json")
    out.seek(0), out.truncate()
    sh.run_text("INFER 'hello' GENERATE 6 EXACTLY;")
    first = json.loads(out.getvalue())["result"]["generated_ids"]

    hook = sh.session.on_token
    press, count = _press_ctrl_c_after(sh, 3)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sh.session.on_token = press
        out.seek(0), out.truncate()
        status = sh.run_statement(repl.parser.parse_one("INFER 'hello' GENERATE 200 EXACTLY;"))
    finally:
        signal.signal(signal.SIGINT, previous)
        sh.session.on_token = hook
    assert status == "interrupted" and count() < 200
    partial = json.loads(out.getvalue())["result"]
    assert partial["interrupted"] is True
    assert partial["generated_ids"] == first[: len(partial["generated_ids"])] and len(partial["generated_ids"]) >= 2
    assert "interrupted: INFER stopped" in err.getvalue()
    assert sh.session.bound and sh.session.draft_depth == 2

    out.seek(0), out.truncate()
    sh.run_text("INFER 'hello' GENERATE 6 EXACTLY;")
    assert json.loads(out.getvalue())["result"]["generated_ids"] == first


def test_ctrl_c_through_the_pipe_input_shows_the_partial_text(tiny_llama_container, history, capsys, monkeypatch):
    """Typed into the REPL: the interrupted GENERATE prints the tokens it had, marked."""
    from lql import session as session_mod

    real_init = session_mod.Session.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        hook = self.on_token
        count = 0

        def press(token_id, text):
            nonlocal count
            count += 1
            if count == 4:
                signal.raise_signal(signal.SIGINT)
            hook(token_id, text)

        self.on_token = press

    monkeypatch.setattr(session_mod.Session, "__init__", init)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        drive(f"OPEN {quoted(tiny_llama_container)};{ENTER}INFER 'hello' GENERATE 200 EXACTLY;{ENTER}"
              f"SHOW SETTINGS;{ENTER}", history)
    finally:
        signal.signal(signal.SIGINT, previous)
    cap = capsys.readouterr()
    assert "generated  4 tokens (interrupted: the tokens produced before Ctrl-C)" in cap.out
    assert "interrupted: INFER stopped" in cap.err
    assert "setting" in cap.out  # the shell went on


def test_ctrl_c_in_the_loop_returns_to_the_prompt(history, capsys, monkeypatch):
    from lql import registry

    def interrupted(session, node):
        raise KeyboardInterrupt

    monkeypatch.setattr(registry, "run", interrupted)
    rc = drive(f"HELP;{ENTER}\\timing off{ENTER}", history)
    err = capsys.readouterr().err
    assert rc == 0 and "interrupted: HELP stopped" in err and "timing is off" in err


def test_encode_draws_a_progress_bar(tiny_llama_dir, tmp_path, history):
    sh, out, err = make_shell(history, stderr=Tty())
    target = tmp_path / "again.vindex3"
    sh.run_text(f"ENCODE {quoted(tiny_llama_dir)} INTO {quoted(target)};")
    drawn = err.getvalue()
    assert re.search(r"encode \[#{30}\] 39/39, \d+ s elapsed: ", drawn)  # the last frame, complete, with its time
    assert drawn.endswith("\r")  # then erased
    assert f"into {target}" in out.getvalue()
    assert target.exists()


def test_no_progress_bar_when_stderr_is_not_a_terminal(tiny_llama_dir, tmp_path, history):
    sh, out, err = make_shell(history)
    sh.run_text(f"ENCODE {quoted(tiny_llama_dir)} INTO {quoted(tmp_path / 'x.vindex3')};")
    assert "[" not in err.getvalue() and "encoded" in out.getvalue()


def test_streamed_control_characters_are_made_visible():
    assert repl._printable("a\x0cb\n\tc\x1b[31m") == "a\\x0cb\n\tc\\x1b[31m"


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch, history):
    import os

    def styled(no_color: bool) -> bytes:
        if no_color:
            monkeypatch.setenv("NO_COLOR", "1")
        else:
            monkeypatch.delenv("NO_COLOR", raising=False)
        master, slave = os.openpty()
        with open(slave, "w", closefd=True) as tty:
            sh, _, _ = make_shell(history, stderr=tty)
            sh.print_error("boom")
        data = os.read(master, 4096)
        os.close(master)
        return data

    assert b"\x1b[0;31m" in styled(no_color=False)  # red
    assert b"31m" not in styled(no_color=True)
    sh, _, err = make_shell(history)
    sh.print_error("boom")
    assert err.getvalue() == "boom\n"  # not a terminal: plain text


def test_the_docs_list_every_shell_command_and_setting():
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "repl.md").read_text(encoding="utf-8")
    for cmd in META:
        names = ", ".join(f"`{n}{' ' + cmd.args if cmd.args else ''}`" for n in cmd.names)
        row = f"| {names.replace('|', chr(92) + '|')} | {cmd.help} |"
        assert row in doc, f"docs/repl.md lacks the row for {cmd.name}: {row}"
    for name in repl.SHELL_SETTINGS:
        assert f"| `{name}` |" in doc


def test_the_startup_file_runs_first(tmp_path, history, monkeypatch, capsys):
    rc_file = tmp_path / "lqlrc"
    rc_file.write_text("-- my settings\nSET editing_mode = vi;\n\\timing off\n")
    monkeypatch.setenv("LQL_RC", str(rc_file))
    assert repl.default_rc_path() == rc_file
    drive(f"SHOW SETTINGS;{ENTER}", history)
    out = capsys.readouterr().out
    assert re.search(r"editing_mode +vi", out) and re.search(r"\ntiming +off", out)


def test_the_default_startup_file_is_in_home(tmp_path, monkeypatch):
    monkeypatch.delenv("LQL_RC")
    assert repl.default_rc_path() == tmp_path / ".lqlrc"


def test_over_wide_key_value_lines_fold_to_the_terminal(tiny_llama_container, history, monkeypatch):
    from lql.console import fold_wide

    ids = ", ".join(str(1000 + i) for i in range(30))
    text = f"slice       full model\nprompt ids  [{ids}]\nrank  token\n" + "x" * 70
    folded = fold_wide(text, 50)
    lines = folded.split("\n")
    assert lines[0] == "slice       full model"
    assert all(len(ln) <= 50 for ln in lines[:-1]) and lines[-1] == "x" * 70  # not a key/value line: left alone
    body = [ln for ln in lines if ln.startswith(("prompt ids  ", " " * 12))]
    assert body[0].startswith("prompt ids  [1000, ") and all(ln.startswith(" " * 12 + "1") for ln in body[1:])
    assert all(ln.rstrip().endswith(",") for ln in body[:-1])  # broken after commas
    assert " ".join(ln[12:] for ln in body) == f"[{ids}]"  # nothing dropped
    assert fold_wide(text, 500) == text

    # in the shell: on a terminal 60 columns wide, INFER's prompt ids fold; to a file they do not
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("LINES", "200")
    sh, out, _err = make_shell(history, stdout=Tty())
    sh.interactive = True
    long = "Water boils at a temperature of 100 degrees Celsius. " * 3
    sh.run_text(f"OPEN {quoted(tiny_llama_container)}; INFER {long!r} TOP 1;")
    shown = out.getvalue().split("\n")
    assert all(len(ln) <= 60 for ln in shown), [ln for ln in shown if len(ln) > 60]
    assert any(ln.startswith("prompt ids  [") for ln in shown)


