"""The vindex3 command line has one error boundary: a named refusal prints its message (exit 2),
an unexpected exception prints ``internal error`` naming the command (exit 3), and a traceback
appears only with --debug."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vindex3
from vindex3 import cli

COMMANDS = ["plan", "encode", "inspect", "verify", "ops", "exec", "default", "label"]


def run(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("cmd", COMMANDS)
def test_an_unexpected_exception_is_an_internal_error_naming_the_command(cmd, monkeypatch, capsys, tmp_path):
    def boom(a):
        raise RuntimeError("something we did not foresee")

    monkeypatch.setattr(cli, f"cmd_{cmd}", boom)
    argv = {"plan": ["plan", "x"], "encode": ["encode", "x", "y"], "inspect": ["inspect", "x"],
            "verify": ["verify", "x"], "ops": ["ops", "x"], "exec": ["exec", "x"], "default": ["default"],
            "label": ["label", "x", "--name", "n"]}[cmd]
    code, _out, err = run(capsys, *argv)
    assert code == 3
    assert f"vindex3 {cmd}: internal error: RuntimeError: something we did not foresee" in err
    assert "Traceback" not in err and "--debug" in err
    with pytest.raises(RuntimeError):
        cli.main(["--debug", *argv])


def test_memory_exhaustion_is_named(monkeypatch, capsys):
    def oom(a):
        raise MemoryError()

    monkeypatch.setattr(cli, "cmd_inspect", oom)
    code, _, err = run(capsys, "inspect", "x")
    assert code == 3 and "internal error: out of memory" in err


@pytest.mark.parametrize("target", ["nope", "/dev/null", ".", "fifo", "file"])
def test_every_command_refuses_a_non_container_by_name(target, tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / target) if target in ("nope", "fifo", "file", ".") else target
    for argv in (["inspect", path], ["verify", path], ["ops", path], ["exec", path, "--tokens", "1"],
                 ["label", path, "--name", "n"], ["plan", path], ["encode", path, str(tmp_path / "out")]):
        code, _, err = run(capsys, *argv)
        assert code == 2, (argv, err)
        assert f"vindex3 {argv[0]}: error:" in err and "Traceback" not in err


def test_exec_refusals_are_named(tiny_llama_container, tmp_path, capsys):
    c = str(tiny_llama_container)
    code, _, err = run(capsys, "exec", c, "--prompt", "caf\udce9")  # a non-UTF-8 byte in argv
    assert code == 2 and "lone surrogate" in err
    code, _, err = run(capsys, "exec", c, "--tokens", "1,2", "--top", "0")
    assert code == 2 and "--top" in err
    code, _, err = run(capsys, "exec", c, "--tokens", "1,999999")
    assert code == 2 and "outside the vocabulary" in err
    code, _, err = run(capsys, "exec", c, "--tokens", ",".join(["1"] * 300))
    assert code == 2 and "context length" in err
    dump = tmp_path / "d.f32"
    dump.write_bytes(b"mine")
    code, _, err = run(capsys, "exec", c, "--tokens", "1,2", "--logit-dump", str(dump))
    assert code == 2 and "already exists" in err and dump.read_bytes() == b"mine"
    code, _, err = run(capsys, "exec", c, "--tokens", "1,2", "--logit-dump", str(dump), "--overwrite")
    assert code == 0 and dump.stat().st_size == 2 * 320 * 4
    code, _, err = run(capsys, "exec", c, "--tokens", "1,2", "--logit-dump", str(Path(c) / "x.f32"), "--overwrite")
    assert code == 2 and "inside the open container" in err


def test_the_installed_command_prints_no_traceback(tmp_path):
    """Through a real process: stderr carries the one-line refusal, nothing else."""
    r = subprocess.run([sys.executable, "-m", "vindex3", "inspect", str(tmp_path / "missing")], check=False, capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(Path(vindex3.__file__).parents[1])})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "does not exist" in r.stderr


def test_label_with_text_that_is_not_unicode_is_refused(tiny_llama_container, tmp_path, capsys):
    import shutil

    c = tmp_path / "c"
    shutil.copytree(tiny_llama_container, c)
    before = (c / "index.json").read_bytes()
    code, _, err = run(capsys, "label", str(c), "--name", "caf\udce9")
    assert code == 2 and "not valid Unicode" in err
    assert (c / "index.json").read_bytes() == before and not [p for p in c.iterdir() if p.name.startswith(".")]
    code, _, _ = run(capsys, "label", str(c), "--name", "café")
    assert code == 0 and vindex3.open(c).name == "café"


def test_random_command_lines_never_end_in_an_internal_error(tiny_llama_container, tiny_llama_dir, tmp_path, capsys):
    """Random subcommands over hostile paths and values: every run exits 0, 1 or 2 (or argparse's
    usage error), never 3, never with a traceback."""
    import random
    import shutil

    box = tmp_path / "c.vindex3"  # a copy: label rewrites it
    shutil.copytree(tiny_llama_container, box)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("x")
    rng = random.Random(0)
    paths = [str(box), str(tiny_llama_dir), str(tmp_path / "fifo"), str(tmp_path / "file"),
             str(tmp_path), "/dev/null", "/", "", "x" * 300, "caf\udce9", str(tmp_path / "nope"),
             str(box / "index.json")]
    values = ["1", "-1", "0", "9" * 30, "1,2,3", "", ",", "1,,2", "abc", "1.5", "\udce9", "x" * 10000, "3" * 5000]
    for i in range(150):
        cmd = rng.choice(["plan", "encode", "inspect", "verify", "ops", "exec", "label"])
        argv = [cmd, rng.choice(paths)]
        if cmd == "encode":
            argv.append(rng.choice([str(tmp_path / f"o{i}"), str(box), "/dev/null", "",
                                    str(tmp_path / "nope" / "x")]))
        if cmd == "exec":
            argv += rng.choice([["--tokens", rng.choice(values)], ["--prompt", rng.choice(values)], []])
            for flag in ("--draft-depth", "--top"):
                if rng.random() < 0.3:
                    argv += [flag, rng.choice(values)]
            if rng.random() < 0.3:
                argv += ["--logit-dump", rng.choice([*paths, str(tmp_path / f"d{i}.f32")])]
        if cmd == "label":
            argv += ["--name", rng.choice(values)]
        try:
            code = cli.main(argv)
        except SystemExit as e:  # argparse's own usage errors
            code = e.code
        _, err = capsys.readouterr()
        assert code in (0, 1, 2) and "Traceback" not in err and "internal error" not in err, (argv[:5], err[-300:])
    assert vindex3.verify(box).ok  # nothing but labels was written to it
