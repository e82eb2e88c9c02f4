"""Progress on standard error: every bar says how long it has run and about how long is left; the
first WALK / DESCRIBE / SELECT that builds feature metadata says so, with progress, in a script as
in the shell; Ctrl-C in BUILD FEATURES keeps the layers finished and clears the bar line."""

from __future__ import annotations

import io
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

import lql
import vindex3
from lql import cli, repl
from lql.console import ProgressLine, fmt_duration

ENTER = "\r"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Tty(io.StringIO):
    """A captured stream that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LQL_RC", "")
    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("LQL_HISTORY", raising=False)


@pytest.fixture
def fresh(tiny_llama_container, tmp_path):
    """A copy of the fixture container with no feature metadata yet (builds write into it)."""
    dst = tmp_path / "fresh.vindex3"
    shutil.copytree(tiny_llama_container, dst)
    derived = dict(vindex3.open(dst).index.get("derived") or {})
    if derived.pop("feature_tokens", None) is not None:  # another test built it in the shared fixture
        from vindex3.container import rewrite_index

        shutil.rmtree(dst / "derived" / "feature_tokens")
        rewrite_index(dst, derived=derived)
    assert "feature_tokens" not in (vindex3.open(dst).index.get("derived") or {})
    return dst


def q(path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def test_durations_read_as_a_person_says_them():
    assert [fmt_duration(s) for s in (0, 8.4, 59.6, 65, 3599, 7380)] == \
        ["0 s", "8 s", "1 min 00 s", "1 min 05 s", "59 min 59 s", "2 h 03 min"]


def test_a_bar_on_a_terminal_shows_time_elapsed_and_an_estimate_then_is_erased():
    clock, err = Clock(), Tty()
    bar = ProgressLine(err, "walk", clock=clock)
    bar(0, 30, "layer 0")
    clock.now = 20.0
    bar(10, 30, "layer 9")
    frames = err.getvalue().split("\r")
    assert frames[-1].startswith("walk [" + "#" * 10 + "-" * 20 + "] 10/30, 20 s elapsed, about 40 s left: layer 9")
    assert all(len(f) <= 119 for f in frames)  # one line: never wider than the terminal
    bar.finish()
    assert err.getvalue().endswith("\r" + " " * 119 + "\r")  # the line is cleared


def test_the_clock_restarts_at_a_new_phase():
    clock, err = Clock(), Tty()
    bar = ProgressLine(err, "walk", clock=clock)
    clock.now = 50.0  # the prompt's encoding took a while before the build began
    bar(0, 4, "layer 0")
    clock.now = 53.0
    bar(1, 4, "layer 0")
    assert err.getvalue().split("\r")[-1].startswith("walk [" + "#" * 8 + "-" * 22 + "] 1/4, 3 s elapsed, about 9 s left")


def test_a_log_gets_a_line_every_ten_seconds_and_a_quick_statement_none():
    clock, log = Clock(), io.StringIO()
    bar = ProgressLine(log, "describe", clock=clock)
    for t, done in [(0, 0), (5, 1), (12, 3), (15, 4), (23, 6), (30, 30)]:
        clock.now = float(t)
        bar(done, 30, f"layer {done}")
    bar.finish()
    assert log.getvalue().splitlines() == [
        "describe: 3/30, 12 s elapsed, about 1 min 48 s left: layer 3",
        "describe: 6/30, 23 s elapsed, about 1 min 32 s left: layer 6",
    ]
    quick = io.StringIO()
    bar = ProgressLine(quick, "walk", clock=Clock())
    bar(0, 4, "")
    bar(4, 4, "")
    assert quick.getvalue() == ""


def test_a_script_says_it_builds_feature_metadata_with_progress(fresh):
    err = Tty()
    rc = cli.main(["-e", f"OPEN {q(fresh)}; WALK 'The capital of France' TOP 2;"], stdout=io.StringIO(), stderr=err)
    text = err.getvalue()
    assert rc == 0
    assert ("notice: building the feature metadata of layers 0-3 (4 FFN layers, first use; kept in fresh.vindex3 "
            "for later statements)") in text
    assert re.search(r"\rwalk \[#{30}\] 4/4, \d+ s elapsed: layer 3", text)  # the bar on standard error, complete
    assert text.endswith("\r")  # and erased when WALK finished
    log = io.StringIO()  # the second WALK reads what the first built: nothing to say
    rc = cli.main(["-e", f"OPEN {q(fresh)}; WALK 'The capital of France' TOP 2;"], stdout=io.StringIO(), stderr=log)
    assert rc == 0 and log.getvalue() == ""


def test_a_script_logging_to_a_file_is_told_without_a_bar(fresh):
    log = io.StringIO()
    rc = cli.main(["-e", f"OPEN {q(fresh)}; DESCRIBE 'France';"], stdout=io.StringIO(), stderr=log)
    assert rc == 0
    assert log.getvalue().startswith("notice: building the feature metadata of layers 0-3") and "\r" not in log.getvalue()


def test_ctrl_c_in_build_features_keeps_the_layers_built_and_clears_the_bar(fresh, tmp_path, monkeypatch):
    from vindex3.internals import metadata

    real, calls = metadata.top_tokens, []

    def interrupted_at_the_third_layer(*a, **kw):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(metadata, "top_tokens", interrupted_at_the_third_layer)
    out, err = io.StringIO(), Tty()
    with create_pipe_input() as inp:
        inp.send_text(f"OPEN {q(fresh)};{ENTER}BUILD FEATURES;{ENTER}")
        inp.close()
        sh = repl.Shell(input=inp, output=DummyOutput(), history_path=tmp_path / "history", stdout=out, stderr=err)
        sh.loop()
    text = err.getvalue()
    kept = "notice: stopped: the feature metadata of layers 0-1 built before it is kept in fresh.vindex3"
    assert kept in text and "interrupted: BUILD FEATURES stopped" in text
    text = ANSI.sub("", text)
    erase = "\r" + " " * 119 + "\r"
    assert text.index(erase + kept) < text.index("interrupted")  # the bar line was cleared before the notice
    assert text.rindex(erase) > text.rindex("\rbuild features [")  # and no bar was drawn after
    entry = vindex3.open(fresh).index["derived"]["feature_tokens"]
    assert sorted(entry["layers"]) == ["0", "1"]  # on disk, with their hashes: they survive the session

    monkeypatch.setattr(metadata, "top_tokens", real)
    again = lql.connect(fresh).execute_one("BUILD FEATURES")
    assert again.metadata.built_layers == [2, 3]  # only what Ctrl-C left unbuilt
    assert sorted(vindex3.open(fresh).index["derived"]["feature_tokens"]["layers"]) == ["0", "1", "2", "3"]


def test_the_vindex3_command_bar_shows_elapsed_and_eta_in_a_real_terminal(tiny_llama_dir, tmp_path):
    """vindex3 encode's prompt_toolkit bar, in a pseudo-terminal: the time elapsed and the
    estimate beside the count."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, ["-m", "vindex3", "encode", str(tiny_llama_dir), str(tmp_path / "x.vindex3")],
                          encoding="utf-8", dimensions=(24, 150), timeout=120, cwd=str(tmp_path),
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    child.expect(pexpect.EOF)
    seen = ANSI.sub("", child.before)
    assert re.search(r"tensors\s+100\.0% \[=+>\]\s+39/\s*39 \d\d:\d\d elapsed, eta \d\d:\d\d", seen), seen[-600:]
