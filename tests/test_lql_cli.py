"""The batch CLI: scripts, -e, stdin, exit codes, --keep-going, --json, --debug; data on
stdout, diagnostics on stderr."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from lql_fixtures import ROOT

from lql import cli


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def run(argv, stdin: str = "", tty: bool = False):
    out, err = io.StringIO(), io.StringIO()
    sin = Tty(stdin) if tty else io.StringIO(stdin)
    rc = cli.main(argv, stdin=sin, stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def c(tiny_llama_container):
    return str(tiny_llama_container)


def test_execute_option(c):
    rc, out, err = run(["-e", f"OPEN '{c}'; SHOW COMPONENTS;"])
    assert rc == 0 and err == ""
    assert out.startswith("opened llama\n")
    assert "text       primary_text" in out


def test_container_option_opens_first(c):
    rc, out, _err = run(["--container", c, "-e", "SHOW COMPONENTS"])
    assert rc == 0 and out.count("opened llama") == 1


def test_c_runs_a_command_as_in_psql(c, tmp_path):
    rc, out, err = run(["-c", f"OPEN '{c}'; SHOW COMPONENTS;"])
    assert rc == 0 and err == "" and out.startswith("opened llama\n") and "primary_text" in out
    rc, out, _ = run(["--command", "STATS", "-c", "VERIFY", "--container", c])
    assert rc == 0 and "verified" in out
    rc, out, _ = run([c], stdin="VERIFY;")  # a container directory as the argument: opened, then stdin
    assert rc == 0 and out.count("opened llama") == 1 and "verified" in out
    rc, _, err = run([c, "--container", c])
    assert rc == 2 and "give one" in err
    # an old script's `lql -c PATH ...` is told what changed, and runs nothing
    for old in (c, "model.vindex3", "m.gguf"):
        rc, out, err = run(["-c", old, "-e", "VERIFY"])
        assert rc == 2 and out == "" and "-c runs a command now" in err and f"--container {old}" in err


def test_script_stops_at_the_first_error_naming_its_line(c, tmp_path):
    script = tmp_path / "s.lql"
    script.write_text(f"OPEN '{c}';\nSHOW COMPONENTS;\n  DRAFT DEPTH 9;\nVERIFY;\n")
    rc, out, err = run([str(script)])
    assert rc == 1
    assert "primary_text" in out and "verified" not in out
    assert err.startswith(f"{script}:3:3: error: draft depth 9 is deeper than the model")
    assert "  in: DRAFT DEPTH 9" in err


def test_keep_going_runs_on_and_still_fails(c):
    rc, out, err = run(["--keep-going", "-e", f"OPEN '{c}'; DRAFT DEPTH 9; VERIFY"])
    assert rc == 1
    assert "verified" in out
    assert err.rstrip().endswith("lql: 1 of 3 statement(s) failed")


def test_a_syntax_error_stops_the_script_where_it_is(c):
    """As sqlite3 and psql do: the statements before it run; the error names its own line."""
    rc, out, err = run(["--no-timing", "-e", f"OPEN '{c}';\nSTATS\nSHOW LAYERS; VERIFY"])
    assert rc == 1
    assert out.startswith("opened llama\n") and "verified" not in out
    assert err == (
        "<-e>:3:1: syntax error: expected a quoted string, ';', '|>', AT or DEFAULT, found keyword SHOW\n"
        "  SHOW LAYERS; VERIFY\n"
        "  ^\n"
        "  hint: end the previous statement with ';' before SHOW\n"
    )


def test_statements_on_stdin(c):
    rc, out, _err = run([], stdin=f"OPEN '{c}';\nVERIFY;\n")
    assert rc == 0 and "verified" in out


def test_dash_reads_stdin(c):
    rc, out, _ = run(["-"], stdin=f"OPEN '{c}'; VERIFY")
    assert rc == 0 and "verified" in out


def test_json_output_one_object_per_statement(c):
    rc, out, err = run(["--json", "--keep-going", "-e", f"OPEN '{c}'; SHOW COMPONENTS; DRAFT DEPTH 0"])
    assert rc == 1
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["kind"] for o in objs] == ["open", "show_components", "draft_depth"]
    assert [list(o) for o in objs[:2]] == [["statement", "kind", "ok", "result"]] * 2
    assert objs[1]["statement"] == {"kind": "show_components", "line": 1, "column": 1 + len(f"OPEN '{c}'; "),
                                    "text": "SHOW COMPONENTS"}
    assert objs[2]["ok"] is False
    assert objs[2]["error"]["type"] == "SliceError" and "draft depth 0" in objs[2]["error"]["message"]
    assert "draft depth 0" in err  # the diagnostic also goes to stderr


def test_set_format_switches_output_mid_script(c):
    _rc, out, _ = run(["-e", f"OPEN '{c}'; SET format = json; VERIFY"])
    lines = out.splitlines()
    assert lines[0] == "opened llama"
    assert json.loads(lines[-1])["kind"] == "verify"


def test_no_timing(c):
    rc, out, _ = run(["--no-timing", "-e", f"OPEN '{c}'; INFER 'Hi' GENERATE 2"])
    assert rc == 0 and "prefill" not in out and "tok/s" not in out
    rc, out, _ = run(["-e", f"OPEN '{c}'; INFER 'Hi' GENERATE 2"])
    assert "prefill" in out and "tok/s" in out


def test_internal_error_has_no_traceback_unless_debug(c, monkeypatch):
    from lql import registry
    from lql.statements.container import Verify

    def boom(session, node):
        raise RuntimeError("kaboom")

    monkeypatch.setitem(registry.RUNNERS, Verify, (boom, "test"))
    rc, _out, err = run(["-e", f"OPEN '{c}';\nVERIFY"])
    assert rc == 3
    assert "<-e>:2:1: internal error: RuntimeError: kaboom" in err and "Traceback" not in err
    rc, _out, err = run(["--debug", "-e", f"OPEN '{c}';\nVERIFY"])
    assert rc == 3 and "Traceback" in err


def test_debug_shows_the_traceback_of_a_refusal(c):
    rc, _, err = run(["--debug", "-e", f"OPEN '{c}'; DRAFT DEPTH 9"])
    assert rc == 1 and "Traceback" in err and "SliceError" in err


def test_missing_script():
    rc, _out, err = run(["no-such-script.lql"])
    assert rc == 1 and err == "lql: script 'no-such-script.lql': does not exist\n"


def test_no_arguments_at_a_terminal_without_the_repl(monkeypatch):
    monkeypatch.setitem(sys.modules, "lql.repl", None)
    rc, out, err = run([], tty=True)
    assert rc == 2 and out == ""
    assert "interactive shell is not part of this build" in err


def test_no_arguments_at_a_terminal_calls_the_repl(monkeypatch):
    import types

    calls = []
    fake = types.ModuleType("lql.repl")
    fake.main = lambda path=None, debug=False: calls.append((path, debug)) or 0
    monkeypatch.setitem(sys.modules, "lql.repl", fake)
    rc, _, _ = run([], tty=True)
    assert rc == 0 and calls == [(None, False)]
    rc, _, _ = run(["--repl", "m.vindex3", "--debug"])
    assert calls[-1] == ("m.vindex3", True)


def test_the_real_command_runs(c):
    p = subprocess.run([sys.executable, "-m", "lql", "-e", f"OPEN '{c}'; DRAFT DEPTH 7"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert p.returncode == 1
    assert "opened llama" in p.stdout
    assert "<-e>:1:" in p.stderr and "Traceback" not in p.stderr


def test_show_models_lists_the_current_directory_and_the_cache_with_the_default_marked(tiny_llama_container, tmp_path,
                                                                                      monkeypatch):
    import shutil

    from vindex3 import default_model

    here, cache = tmp_path / "here", tmp_path / "cache"
    shutil.copytree(tiny_llama_container, here / "mine.vindex3")
    shutil.copytree(tiny_llama_container, cache / default_model.CONTAINER_NAME)  # stands in for the default model
    shutil.copytree(tiny_llama_container, cache / "peers" / "other.vindex3")  # one level down
    (cache / "peers" / "broken.vindex3").mkdir()
    (cache / "peers" / "broken.vindex3" / "index.json").write_text("{")
    monkeypatch.setenv("VINDEX3_CACHE", str(cache))
    monkeypatch.chdir(here)
    rc, out, err = run(["--json", "-e", "SHOW MODELS"])
    assert rc == 0, err
    r = json.loads(out)["result"]
    rows = [(m["path"], m["where"], m["default"], m["problem"] is None) for m in r["models"]]
    assert rows == [("mine.vindex3", "here", False, True),
                    (str(cache / "peers" / "broken.vindex3"), "cache", False, False),  # listed, with why it fails
                    (str(cache / "peers" / "other.vindex3"), "cache", False, True),
                    (str(cache / default_model.CONTAINER_NAME), "cache", True, True)]
    assert r["cache"] == str(cache) and r["default_encoded"] is True
    rc, text, _ = run(["--no-timing", "-e", "SHOW MODELS"])
    assert f"1 container(s) in {here}:" in text and f"3 container(s) in the cache {cache}:" in text
    assert "llama (DEFAULT)" in text and "not encoded yet" not in text
    shutil.rmtree(cache / default_model.CONTAINER_NAME)
    rc, text, _ = run(["--no-timing", "-e", "SHOW MODELS"])
    assert "the default model is not encoded yet: OPEN DEFAULT encodes it into the cache" in text
    monkeypatch.chdir(cache / "peers")  # a container both here and in the cache is listed once, here
    rc, out, _ = run(["--json", "-e", "SHOW MODELS"])
    assert [m["path"] for m in json.loads(out)["result"]["models"]] == ["broken.vindex3", "other.vindex3"]


def test_stats_default_is_the_default_models_facts_and_the_bound_container_stays(tiny_llama_container, tmp_path,
                                                                                  monkeypatch):
    import shutil

    import lql
    from lql.statements.facts import Stats
    from vindex3 import default_model

    cache = tmp_path / "cache"
    shutil.copytree(tiny_llama_container, cache / default_model.CONTAINER_NAME)  # stands in for the default model
    monkeypatch.setenv("VINDEX3_CACHE", str(cache))
    s = lql.Session()
    st = s.execute_one("STATS DEFAULT AT 8 POSITIONS")
    want = lql.connect(cache / default_model.CONTAINER_NAME).execute_one("STATS AT 8 POSITIONS")
    assert st.to_dict()["result"] == want.to_dict()["result"] and not s.bound  # nothing was bound
    assert Stats(default=True).refused_read_only().startswith("STATS DEFAULT may encode the default model")
    assert Stats(path="m.vindex3").refused_read_only() is None
    rc, out, _ = run(["--json", "-e", "STATS DEFAULT"])
    assert rc == 0 and json.loads(out)["result"]["name"] == want.name
