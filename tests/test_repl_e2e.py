"""End to end: the real ``lql`` command in a pseudo-terminal (pexpect), on the fixture
container, reading what reaches the screen."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

CPR_REQUEST = re.compile(r"\x1b\[6n")
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
TIMEOUT = 60  # generous: a loaded machine must not make this flaky


def _lql() -> str:
    exe = shutil.which("lql", path=str(Path(sys.executable).parent)) or shutil.which("lql")
    if exe is None:
        pytest.skip("the lql console script is not installed (pip install -e .)")
    return exe


class Screen:
    """A child process and what it wrote. Answers prompt_toolkit's cursor-position requests
    as a terminal would, so that the bottom toolbar is drawn."""

    def __init__(self, child):
        self.child = child

    def expect(self, pattern: str, timeout: int = TIMEOUT) -> str:
        """Wait for ``pattern`` (a regex); return the text before it, escapes removed."""
        seen = []
        while True:
            i = self.child.expect([CPR_REQUEST, pattern], timeout=timeout)
            seen.append(self.child.before)
            if i == 0:
                self.child.send("\x1b[1;1R")
                continue
            return ANSI.sub("", "".join(seen))

    def prompt(self) -> str:
        return self.expect(r"lql>")


def _sigint_dead_in_child():
    """What a parent can hand a child: SIGINT ignored and blocked (both survive exec)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})


@pytest.fixture(params=["plain", "sigint-ignored-and-blocked"])
def screen(request, tiny_llama_container, tmp_path):
    env = dict(os.environ)
    env.update(
        TERM="xterm",
        HOME=str(tmp_path),
        LQL_RC="",
        LQL_HISTORY=str(tmp_path / "history"),
        COLUMNS="120",
        LINES="40",
    )
    env.pop("NO_COLOR", None)  # this test reads colours too
    env.pop("LQL_EDITING_MODE", None)
    child = pexpect.spawn(
        _lql(),
        ["--repl", str(tiny_llama_container)],
        env=env,
        cwd=str(tmp_path),
        encoding="utf-8",
        codec_errors="replace",
        timeout=TIMEOUT,
        dimensions=(40, 120),
        preexec_fn=_sigint_dead_in_child if request.param != "plain" else None,
    )
    yield Screen(child)
    if child.isalive():
        child.terminate(force=True)


def test_the_lql_binary_runs_an_interactive_session(screen, tiny_llama_container):
    import vindex3

    name = vindex3.open(tiny_llama_container).name
    child = screen.child

    # opened on the container given on the command line; the toolbar names it
    before = screen.prompt()
    assert f"opened {name}" in before
    screen.expect(
        rf"model .*{re.escape(name)}.*\| 4 layers \(4 softmax \(full\)\) \| draft depth off"
    )

    # a statement, typed: a table comes back
    child.send("SHOW LAYERS;\r")
    screen.expect(r"layer  operator")
    screen.prompt()

    # Tab completes from the grammar (typed slowly, as a person would)
    child.send("DRAFT DEP")
    screen.expect(r"DEPTH")  # the completion menu shows it
    child.send("\t")
    child.send(" 2;\r")
    screen.expect(r"draft depth 2: later INFER")
    screen.expect(r"draft depth 2 ")  # the toolbar follows the session

    # errors are red, with the caret, and the shell goes on
    child.send("OPEN nowhere;\r")
    err = child.expect([r"\x1b\[0;31msyntax error"], timeout=TIMEOUT)
    assert err == 0
    screen.expect(r"\^")
    screen.prompt()

    # a long GENERATE streams, Ctrl-C stops it, and the session is still bound
    child.send("SET max_generate = 100000; SET max_positions = 100100;\r")  # past the limits, on purpose
    screen.prompt()
    child.send("INFER 'hello' GENERATE 100000 EXACTLY;\r")
    screen.expect(r"generating: ")
    screen.expect(r"\S")  # at least one token reached the screen
    child.sendintr()
    screen.expect(r"interrupted: INFER stopped")
    screen.prompt()
    child.send("INFER 'hello' TOP 2;\r")
    text = screen.expect(r"probability")
    assert "draft depth 2 (layers 0-1)" in text
    screen.prompt()

    # Ctrl-C while typing drops the line
    child.send("STATS")
    screen.expect(r"STATS")
    child.sendcontrol("c")
    screen.prompt()

    # multi-line: Enter continues until ';'
    child.send("SHOW\r")
    screen.expect(r"\.\.\.")
    child.send("SETTINGS;\r")
    screen.expect(r"editing_mode")
    screen.prompt()

    child.send("\\q\r")
    child.expect(pexpect.EOF, timeout=TIMEOUT)
    child.close()
    assert child.exitstatus == 0


def test_a_short_infer_with_a_wide_line_is_not_paged_in_a_real_terminal(tiny_llama_container, tmp_path):
    """A 120x40 terminal: an INFER whose prompt ids line is wider than the screen prints straight
    (the pager is for output taller than the screen)."""
    paged = tmp_path / "paged.txt"
    env = dict(os.environ)
    env.update(TERM="xterm", HOME=str(tmp_path), LQL_RC="", LQL_HISTORY=str(tmp_path / "history"),
               NO_COLOR="1", PAGER=f"cat > {paged}",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))  # this tree's lql, whichever is installed
    for name in ("LESS", "COLUMNS", "LINES", "LQL_EDITING_MODE"):
        env.pop(name, None)
    child = pexpect.spawn(_lql(), ["--repl", str(tiny_llama_container)], env=env, cwd=str(tmp_path),
                          encoding="utf-8", codec_errors="replace", timeout=TIMEOUT, dimensions=(40, 120))
    screen = Screen(child)
    try:
        screen.prompt()
        child.send("INFER '" + "water boils at one hundred degrees " * 6 + "' TOP 2;\r")
        screen.expect(r"prompt ids")
        screen.prompt()
        assert not paged.exists()
        child.send("\\q\r")
        child.expect(pexpect.EOF, timeout=TIMEOUT)
    finally:
        if child.isalive():
            child.terminate(force=True)


def test_long_output_goes_through_a_real_pager(tiny_llama_container, tmp_path):
    """less -SRXF (the default pager) shows the first screen and waits; G shows the end, q
    returns to the prompt. With \\pager off the same output is printed straight."""
    if shutil.which("less") is None:
        pytest.skip("SKIPPED LOUDLY: less is not installed (apt-get install less)")
    env = dict(os.environ)
    env.update(TERM="xterm", HOME=str(tmp_path), LQL_RC="", LQL_HISTORY=str(tmp_path / "history"),
               NO_COLOR="1")
    for name in ("PAGER", "LESS", "COLUMNS", "LINES", "LQL_EDITING_MODE"):
        env.pop(name, None)
    child = pexpect.spawn(_lql(), ["--repl", str(tiny_llama_container)], env=env, cwd=str(tmp_path),
                          encoding="utf-8", codec_errors="replace", timeout=TIMEOUT, dimensions=(15, 100))
    screen = Screen(child)
    try:
        screen.prompt()
        child.send("SHOW OPERANDS;\r")
        screen.expect(r"layer\s+op\s+operand")
        with pytest.raises(pexpect.TIMEOUT):  # the pager holds the rest back ...
            child.expect(r"39 operands", timeout=3)
        child.send("G")  # ... until asked for the end
        screen.expect(r"39 operands")
        child.send("q")
        screen.prompt()
        child.send("\\pager off\r")
        screen.expect(r"pager is off")
        child.send("SHOW OPERANDS;\r")
        screen.expect(r"39 operands")  # no pager: all of it, no key pressed
        screen.prompt()
        child.send("\\q\r")
        child.expect(pexpect.EOF, timeout=TIMEOUT)
    finally:
        if child.isalive():
            child.terminate(force=True)


# ---- a real terminal emulator: tmux --------------------------------------------------------


class Tmux:
    """One private tmux server (its own socket, no user configuration) running one command in a
    pane of a fixed size; the pane's screen is read with capture-pane, as a person sees it."""

    def __init__(self, tmp_path: Path, argv: list[str], env: dict[str, str], size: tuple[int, int]):
        self.sock = f"lql-test-{os.getpid()}-{tmp_path.name}"
        cols, rows = size
        cmd = " ".join(_sh_quote(a) for a in argv)
        self._tmux("new-session", "-d", "-s", "t", "-x", str(cols), "-y", str(rows), cmd, env=env)

    def _tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        import subprocess

        done = subprocess.run(["tmux", "-L", self.sock, "-f", os.devnull, *args], env=env, capture_output=True,
                              text=True, timeout=30, check=True)
        return done.stdout

    def screen(self) -> list[str]:
        return self._tmux("capture-pane", "-p", "-t", "t").rstrip("\n").split("\n")

    def send(self, text: str, enter: bool = True) -> None:
        if text.endswith(";"):  # tmux reads an argument's trailing ';' as its command separator
            text = text[:-1] + "\\;"
        self._tmux("send-keys", "-t", "t", "-l", text)
        if enter:
            self._tmux("send-keys", "-t", "t", "Enter")

    def wait(self, ok, what: str, timeout: float = 180) -> list[str]:
        """Poll the screen until ``ok(lines)``; fail naming ``what`` with the screen shown."""
        import time

        end = time.monotonic() + timeout
        while True:
            lines = self.screen()
            if ok(lines):
                return lines
            if time.monotonic() > end:
                raise AssertionError(f"tmux: {what} did not appear in {timeout} s; the screen:\n" + "\n".join(lines))
            time.sleep(0.3)

    def kill(self) -> None:
        import subprocess

        subprocess.run(["tmux", "-L", self.sock, "kill-server"], check=False, capture_output=True, timeout=30)


def _sh_quote(s: str) -> str:
    import shlex

    return shlex.quote(s)


def _last_line(lines: list[str]) -> str:
    """The last non-blank line above the bottom toolbar (which names the model and draft depth)."""
    shown = [ln.rstrip() for ln in lines if ln.strip() and "draft depth" not in ln]
    return shown[-1] if shown else ""


def test_tmux_a_short_infer_prints_folded_and_a_400_line_explain_opens_the_pager(smollm2_container, tmp_path):
    """In a 120x40 tmux pane with the default pager (less -SRXF): a short INFER whose prompt ids
    are wider than the screen prints at once, its ids folded under their label (no pager, no
    (END) waiting for a key); a 400-line EXPLAIN of the default model opens less, which waits on
    its first screen until q."""
    if shutil.which("tmux") is None:
        pytest.skip("SKIPPED LOUDLY: tmux is not installed (apt-get install tmux); the pexpect tests cover the pty")
    if shutil.which("less") is None:
        pytest.skip("SKIPPED LOUDLY: less is not installed (apt-get install less)")
    env = dict(os.environ)
    env.update(TERM="xterm", HOME=str(tmp_path), LQL_RC="", LQL_HISTORY=str(tmp_path / "history"), NO_COLOR="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))  # this tree's lql, whichever is installed
    for name in ("PAGER", "LESS", "COLUMNS", "LINES", "LQL_EDITING_MODE", "TMUX"):
        env.pop(name, None)
    t = Tmux(tmp_path, [_lql(), "--repl", str(smollm2_container)], env, (120, 40))
    try:
        t.wait(lambda s: _last_line(s).startswith("lql>"), "the first prompt")
        t.send("\\timing off")
        t.wait(lambda s: any("timing is off" in ln for ln in s), "\\timing off's answer")
        t.send("INFER '" + "water boils at one hundred degrees " * 6 + "' TOP 2;")
        screen = t.wait(lambda s: any("probability" in ln for ln in s) and _last_line(s).startswith("lql>"),
                        "the INFER result and the next prompt")
        assert not any("(END)" in ln for ln in screen)
        i = next(n for n, ln in enumerate(screen) if ln.startswith("prompt ids"))
        assert screen[i + 1].startswith(" " * len("prompt ids  ")) and screen[i + 1].strip()[0].isdigit()  # folded
        result = screen[next(n for n, ln in enumerate(screen) if ln.startswith("slice")):]
        result = result[:next(n for n, ln in enumerate(result) if ln.startswith("lql>"))]
        assert all(len(ln.rstrip()) < 120 for ln in result)  # no line of the result reached the edge to wrap
        t.send("EXPLAIN;")
        screen = t.wait(lambda s: _last_line(s) == ":", "less's prompt")  # the pager holds the rest back
        assert not any(ln.startswith("lql>") for ln in screen[-3:])
        t.send("q", enter=False)
        t.wait(lambda s: _last_line(s).startswith("lql>"), "the prompt after q")
        t.send("\\q")
    finally:
        t.kill()
