"""Issue 10 on the LQL side: one error boundary (the session, `lql` in every format, the REPL,
the server), paths checked before any work and never overwritten by surprise, named limits
refused before anything is allocated, and OPEN DEFAULT saying when it rebuilds its cache. Each
test names the failure class it guards; tests/test_lql_fuzz.py throws generated statements at
all of it."""

from __future__ import annotations

import io
import json
import os
import shutil

import lql_fixtures  # noqa: F401
import pytest

import lql
from lql import cli, registry
from lql.errors import EngineRefusal, InternalError, LimitError, LqlError, SettingError
from lql.statements import infer
from lql.statements.container import Verify


@pytest.fixture
def work(tiny_llama_container, tmp_path, monkeypatch):
    """A directory holding a private copy of the fixture container, a prompt bank and one file
    that must never be replaced by surprise."""
    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"id": f"p{i}", "category": "c", "text": t}) + "\n"
                for i, t in enumerate(["Water boils", "Hello there", "a b c"])))
    (tmp_path / "keep.txt").write_text("precious\n")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def s(work):
    return lql.connect("tiny.vindex3")


def run_cli(argv, stdin=""):
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(argv, stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def refused(session, text, kind=LqlError):
    with pytest.raises(kind) as e:
        session.execute(text)
    assert e.value.message
    assert not isinstance(e.value, InternalError), e.value
    return e.value


def _boom(session, node):
    raise RuntimeError("kaboom")


# ---- the error boundary -----------------------------------------------------------------


def test_a_bug_in_a_command_is_an_internal_error_naming_the_statement(s, monkeypatch):
    monkeypatch.setitem(registry.RUNNERS, Verify, (_boom, "test"))
    with pytest.raises(InternalError) as e:
        s.execute("SHOW COMPONENTS;\nVERIFY;\nSTATS")
    err = e.value
    assert err.message == "internal error: RuntimeError: kaboom" and err.kind == "InternalError"
    assert (err.line, err.column, err.statement) == (2, 1, "VERIFY")
    assert isinstance(err.original, RuntimeError) and err.__cause__ is err.original
    assert [r.kind for r in err.results] == ["show_components"]  # what ran before it


def test_an_internal_error_stops_a_run_even_when_keeping_going(s, monkeypatch):
    monkeypatch.setitem(registry.RUNNERS, Verify, (_boom, "test"))
    outs = list(s.run("VERIFY; STATS; VERIFY", keep_going=True))
    assert len(outs) == 1 and isinstance(outs[0].error, InternalError)


def test_a_bug_in_the_parser_is_an_internal_error_not_a_visit_error(s, monkeypatch):
    from lql import syntax

    def broken(c):
        raise ZeroDivisionError("parser bug")

    monkeypatch.setitem(syntax.RULES, "verify_stmt", (broken, "test"))
    with pytest.raises(InternalError) as e:
        s.execute("VERIFY")
    assert "ZeroDivisionError: parser bug" in e.value.message and e.value.statement == "VERIFY"
    with pytest.raises(InternalError):
        s.plan("VERIFY")
    rc, _out, err = run_cli(["--container", "tiny.vindex3", "-e", "VERIFY"])
    assert rc == 3 and "internal error: ZeroDivisionError: parser bug" in err and "Traceback" not in err


def test_non_text_is_refused_by_name(s):
    with pytest.raises(LqlError, match="must be a str"):
        s.execute(b"STATS")


@pytest.mark.parametrize("fmt", ["text", "json", "csv", "tsv", "markdown", "jsonl"])
def test_a_bug_while_printing_is_an_internal_error_in_every_format(work, monkeypatch, fmt):
    from lql import render

    def broken(*a, **k):
        raise ValueError("render bug")

    monkeypatch.setattr(render, "format_result", broken)
    rc, _out, err = run_cli(["--format", fmt, "-e", "OPEN 'tiny.vindex3'; STATS; VERIFY"])
    assert rc == 3 and "Traceback" not in err
    assert "<-e>:1:1: internal error: ValueError: render bug" in err and "in: OPEN 'tiny.vindex3'" in err
    rc, _out, err = run_cli(["--debug", "--format", fmt, "-e", "OPEN 'tiny.vindex3'"])
    assert rc == 3 and "Traceback" in err


def test_a_bug_outside_any_statement_still_exits_3_without_a_traceback(work, monkeypatch):
    from lql import console

    def broken(self, *a, **k):
        raise KeyError("console bug")

    monkeypatch.setattr(console.Console, "run_script", broken)
    rc, _out, err = run_cli(["-e", "STATS"])
    assert rc == 3 and "lql: internal error: KeyError: 'console bug'" in err and "Traceback" not in err


def test_json_output_names_an_internal_error(work, monkeypatch):
    monkeypatch.setitem(registry.RUNNERS, Verify, (_boom, "test"))
    rc, out, _err = run_cli(["--json", "-e", "OPEN 'tiny.vindex3'; VERIFY"])
    assert rc == 3
    last = json.loads(out.splitlines()[-1])
    assert last["ok"] is False and last["error"]["type"] == "InternalError"
    assert last["error"]["message"] == "internal error: RuntimeError: kaboom" and last["statement"]["text"] == "VERIFY"


def test_stdin_that_is_not_utf8_is_refused_by_name(work):
    class Bytes(io.StringIO):
        buffer = io.BytesIO(b"STATS; \xff\xfe INFER 'x'")

    out, err = io.StringIO(), io.StringIO()
    rc = cli.main([], stdin=Bytes(), stdout=out, stderr=err)
    assert rc == 1 and "standard input is not UTF-8 text (byte 7" in err.getvalue()


def test_text_no_encoding_can_print_is_escaped_not_a_crash(work):
    # a lone surrogate (as surrogateescape makes of a bad byte) outside any string
    rc, out, err = run_cli(["-e", "STATS \udcff"])
    assert rc == 1 and "\\udcff" in err and "Traceback" not in err
    rc, out, err = run_cli(["--json", "-e", "INFER '\udcff'"])
    assert rc == 1 and json.loads(out)["error"]["type"] == "LqlSyntaxError"


def test_the_shell_reports_a_printing_bug_and_goes_on(work, monkeypatch):
    from lql import render, repl

    sh = repl.Shell(stdout=io.StringIO(), stderr=io.StringIO(), history_path=work / "history")
    real = render.format_result
    calls = []

    def once_broken(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("render bug")
        return real(*a, **k)

    monkeypatch.setattr(render, "format_result", once_broken)
    assert sh.run_text("SHOW SETTINGS;") == "internal"
    assert sh.run_text("SHOW SETTINGS;") == "ok"
    assert "internal error: ValueError: render bug" in sh.stderr.getvalue()


def test_the_server_answers_500_for_a_parser_bug(work, monkeypatch):
    pytest.importorskip("starlette")
    from server_fixtures import config
    from starlette.testclient import TestClient

    from lql import syntax
    from lql.server.app import create_app

    def broken(c):
        raise ZeroDivisionError("parser bug")

    monkeypatch.setitem(syntax.RULES, "verify_stmt", (broken, "test"))
    app = create_app(config(work / "tiny.vindex3"))
    with TestClient(app) as client:
        r = client.post("/v1/query", json={"lql": "STATS; VERIFY"})
    assert r.status_code == 500
    res = r.json()["results"]
    assert [o["ok"] for o in res] == [True, False] and res[1]["error"]["type"] == "InternalError"
    assert "ZeroDivisionError: parser bug" in res[1]["error"]["message"] and "Traceback" not in r.text


# ---- paths: checked before any work, never overwritten by surprise ----------------------


def _mtime_and_text(p):
    return p.stat().st_mtime_ns, p.read_text()


def test_dump_into_an_existing_file_is_refused_unless_overwrite(s, work):
    before = _mtime_and_text(work / "keep.txt")
    err = refused(s, "DUMP LOGITS 'x' INTO 'keep.txt'", EngineRefusal)
    assert err.kind == "PathRefused" and "already exists" in err.message and "OVERWRITE" in err.hint
    assert _mtime_and_text(work / "keep.txt") == before
    s.execute("DUMP LOGITS 'x' INTO 'a.f32'")
    refused(s, "DUMP LOGITS 'y' INTO 'a.f32'", EngineRefusal)
    s.execute("DUMP LOGITS 'yy' INTO 'a.f32' OVERWRITE")
    s.execute("SET overwrite = on; DUMP LOGITS 'yyy' INTO 'a.f32'")
    from vindex3.draft import read_dump

    meta, logits = read_dump(work / "a.f32")
    assert logits.shape[0] == len(meta["token_ids"]) == len(s.catalog.tokenize("yyy"))


@pytest.mark.parametrize("target, reason", [
    ("tiny.vindex3/index.json", "inside"), ("tiny.vindex3/new.f32", "inside"), ("tiny.vindex3", "not_a_file"),
    (".", "not_a_file_name"), ("", "empty"), ("x" * 300 + ".f32", "name_too_long"), ("nowhere/x.f32", "parent_missing"),
    ("fifo", "special"),
])
def test_dump_targets_refused_before_any_work(s, work, target, reason):
    os.mkfifo(work / "fifo")
    index = (work / "tiny.vindex3" / "index.json").read_bytes()
    err = refused(s, f"DUMP LOGITS 'x' INTO '{target}' OVERWRITE", EngineRefusal)
    assert err.kind == "PathRefused", err
    assert (work / "tiny.vindex3" / "index.json").read_bytes() == index
    assert not list(work.glob("*.tmp-*")) and not list((work / "tiny.vindex3").glob("*.f32"))


def test_ladder_outputs_are_checked_before_the_first_dump(s, work):
    progress = []
    s.on_progress = lambda *a: progress.append(a)
    for text in ["DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO 'keep.txt'",
                 "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' PLOT INTO 'keep.txt'",
                 "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO 'tiny.vindex3/r.json'",
                 "DRAFT LADDER DEPTHS (1) ON 'tiny.vindex3' INTO 'r.json'",
                 "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO 'r.json' PLOT INTO 'r.json'"]:
        refused(s, text)
    assert progress == [] and (work / "keep.txt").read_text() == "precious\n"
    s.execute("DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO 'r.json'")
    refused(s, "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO 'r.json'", EngineRefusal)
    s.execute("DRAFT LADDER DEPTHS (1, 2) ON 'prompts.jsonl' INTO 'r.json' OVERWRITE")
    assert json.loads((work / "r.json").read_text())["depths"] == [1, 2]


def test_score_plan_and_open_paths_are_named(s, work):
    os.mkfifo(work / "fifo")
    assert refused(s, "SCORE DRAFT 'fifo' AGAINST 'keep.txt'", EngineRefusal).kind == "PathRefused"
    assert refused(s, "SCORE DRAFT 'tiny.vindex3' AGAINST 'keep.txt'", EngineRefusal).kind == "PathRefused"
    assert refused(s, "PLAN 'fifo'", EngineRefusal).kind == "PathRefused"
    assert refused(s, "OPEN ''", EngineRefusal).kind == "PathRefused"
    assert refused(s, "OPEN '" + "y" * 256 + "'", EngineRefusal).kind == "PathRefused"
    assert refused(s, "OPEN 'fifo'", EngineRefusal).kind == "ContainerNotFound"


def test_encode_overwrite_replaces_only_a_container_and_never_the_open_one(s, work, tiny_llama_dir):
    s.execute(f"ENCODE '{tiny_llama_dir}' INTO 'copy.vindex3'")
    (work / "copy.vindex3" / "marker").write_text("old")
    assert refused(s, f"ENCODE '{tiny_llama_dir}' INTO 'copy.vindex3'", EngineRefusal).kind == "PathRefused"
    s.execute(f"ENCODE '{tiny_llama_dir}' INTO 'copy.vindex3' OVERWRITE")
    assert not (work / "copy.vindex3" / "marker").exists()  # a new container, complete
    assert lql.connect("copy.vindex3").execute_one("VERIFY").ok
    (work / "plain").mkdir()
    (work / "plain" / "mine.txt").write_text("x")
    err = refused(s, f"ENCODE '{tiny_llama_dir}' INTO 'plain' OVERWRITE", EngineRefusal)
    assert "only a container" in err.message and (work / "plain" / "mine.txt").exists()
    for target in ("tiny.vindex3", "."):
        err = refused(s, f"ENCODE '{tiny_llama_dir}' INTO '{target}' OVERWRITE", EngineRefusal)
        assert "open container" in err.message
    assert s.execute_one("VERIFY").ok
    assert not [p for p in work.iterdir() if ".replac" in p.name or ".encoding-" in p.name]


def test_shell_outputs_refuse_an_existing_file_unless_overwrite_is_on(work):
    from lql import repl

    err = io.StringIO()
    sh = repl.Shell(stdout=io.StringIO(), stderr=err, history_path=work / "history")
    os.mkfifo(work / "fifo")
    assert sh.run_text("\\o keep.txt") == "failed" and "already exists" in err.getvalue()
    assert sh.run_text("\\once keep.txt") == "failed"
    assert sh.run_text("\\o fifo") == "failed" and "FIFO" in err.getvalue()
    assert sh.run_text("\\i fifo") == "failed"
    assert sh.run_text("\\i tiny.vindex3") == "failed" and "directory" in err.getvalue()
    assert (work / "keep.txt").read_text() == "precious\n"
    sh.run_text("SET overwrite = on;")
    assert sh.run_text("\\once keep.txt") == "ok" and sh.run_text("SHOW SETTINGS;") == "ok"
    assert "overwrite" in (work / "keep.txt").read_text()


def test_a_script_that_is_a_fifo_is_refused_without_waiting_and_a_directory_is_a_container(work):
    os.mkfifo(work / "fifo")
    rc, _, err = run_cli(["fifo"])
    assert rc == 1 and "FIFO" in err
    (work / "notes").mkdir()
    rc, _, err = run_cli(["notes"])  # a directory is opened as a container, and this one is not
    assert rc == 1 and "not a VINDEX3 container" in err
    with pytest.raises(LqlError, match="FIFO"):
        lql.Session().run_file(work / "fifo")


def test_the_history_setting_refuses_text_no_file_can_have(work):
    from lql import repl

    sh = repl.Shell(stdout=io.StringIO(), stderr=io.StringIO(), history_path=work / "history")
    assert sh.run_text("SET history = 'a\\tb\U0001F600';") == "ok"
    err = io.StringIO()
    sh._stderr = err
    assert sh.run_text("SET history = '" + "h" * 300 + "';") == "failed" and "255 bytes" in err.getvalue()


# ---- named limits -------------------------------------------------------------------------


def test_generate_and_lookahead_over_their_limits_are_refused_before_any_work(s, monkeypatch):
    ran = []
    monkeypatch.setitem(registry.RUNNERS, infer.Speculate, (lambda *a: ran.append(a), "infer"))
    err = refused(s, "INFER 'x' GENERATE 1000000000000", LimitError)
    assert "max_generate" in err.message and "SET max_generate" in err.hint
    err = refused(s, "INFER 'x' GENERATE 8 SPECULATE DEPTH 1 LOOKAHEAD 1000000000", LimitError)
    assert "LOOKAHEAD 1,000,000,000" in err.message and "max_lookahead (64) allows" in err.message
    refused(s, "SET lookahead = 1000000000; INFER 'x' GENERATE 8 SPECULATE DEPTH 1", LimitError)
    assert ran == []


def test_the_context_length_bounds_prompt_plus_generation(s):
    assert s.catalog.context_length == 256
    err = refused(s, "INFER TOKENS (" + ", ".join(["5"] * 250) + ") GENERATE 7", LimitError)
    assert err.message == "INFER (250 prompt tokens + 7 generated) needs 257 positions; the model's context length is 256"
    assert "SET max_positions" in err.hint
    r = s.execute_one("INFER TOKENS (" + ", ".join(["5"] * 250) + ") GENERATE 6 EXACTLY")
    assert len(r.generated_ids) == 6
    for text in ("TRACE TOKENS (" + ", ".join(["5"] * 257) + ")", "DUMP LOGITS TOKENS (" + ", ".join(["5"] * 257) +
                 ") INTO 'd.f32'", "EXPLAIN INFER TOKENS (" + ", ".join(["5"] * 250) + ") GENERATE 7"):
        refused(s, text, LimitError)
    s.execute("SET max_positions = 300")
    r = s.execute_one("INFER TOKENS (" + ", ".join(["5"] * 250) + ") GENERATE 20 EXACTLY")
    assert len(r.generated_ids) == 20  # past the model's context length, asked for explicitly
    err = refused(s, "INFER TOKENS (" + ", ".join(["5"] * 250) + ") GENERATE 60", LimitError)
    assert "max_positions is 300" in err.message
    s.execute("SET max_positions = model")
    refused(s, "INFER TOKENS (" + ", ".join(["5"] * 250) + ") GENERATE 20", LimitError)


@pytest.mark.parametrize("lookahead", [1, 4, 64])
def test_speculation_fits_exactly_at_the_context_length(s, lookahead):
    """A round never proposes past the tokens still wanted, so prompt + GENERATE = the context
    length runs (the lookahead adds no position), and one more is refused up front."""
    prompt = "TOKENS (" + ", ".join(["7"] * 240) + ")"
    s.execute("SET compare = off")
    r = s.execute_one(f"INFER {prompt} GENERATE 16 SPECULATE DEPTH 2 LOOKAHEAD {lookahead}")
    assert len(r.generated_ids) == 16
    refused(s, f"INFER {prompt} GENERATE 17 SPECULATE DEPTH 2 LOOKAHEAD {lookahead}", LimitError)


def test_speculation_past_the_context_length_when_asked(s):
    s.execute("SET max_positions = 400; SET compare = on")
    r = s.execute_one("INFER TOKENS (" + ", ".join(["7"] * 240) + ") GENERATE 40 SPECULATE DEPTH 2 LOOKAHEAD 8")
    assert len(r.generated_ids) == 40 and r.matches_plain


def test_memory_limit_refuses_with_the_bytes_needed(s):
    s.execute("SET memory_limit = '64 KiB'")
    for text in ("INFER 'Water boils'", "TRACE 'x'", "DUMP LOGITS 'x' INTO 'm.f32'",
                 "INFER 'x' GENERATE 4 SPECULATE DEPTH 1", "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl'"):
        err = refused(s, text, LimitError)
        assert "would need about" in err.message and "memory_limit is 65,536 bytes (64.0 KiB)" in err.message
        assert "SET memory_limit" in err.hint
    s.execute("SET memory_limit = 4294967296")
    assert s.execute_one("INFER 'Water boils' TOP 1").top


def test_memory_limit_values(s):
    assert s.execute_one("SET memory_limit = '1.5 GiB'").value == "1536 MiB"
    assert s.execute_one("SET memory_limit = '2GB'").value == "2,000,000,000 bytes (1.9 GiB)"
    for bad in ("'lots'", "0", "1.5", "'-1 GiB'"):
        refused(s, f"SET memory_limit = {bad}", SettingError)


def test_huge_positions_print_and_huge_numbers_never_reach_numpy(s):
    r = s.execute_one(f"STATS AT {2**63 - 1} POSITIONS")
    assert "9,223,372,036,854,775,807" in r.to_text() and "EiB" in r.to_text()
    refused(s, "INFER TOKENS (9223372036854775807)")
    refused(s, "SHOW OPERANDS LAYER 9223372036854775807")


def test_a_prompt_bank_over_max_prompts_is_refused_by_name(s, work):
    s.execute("SET max_prompts = 2")
    err = refused(s, "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl'", LimitError)
    assert "max_prompts is 2" in err.message and "SET max_prompts" in err.hint


def test_settings_show_every_limit_with_its_default(s):
    rows = {r.name: r.value for r in s.execute_one("SHOW SETTINGS").settings}
    assert {k: rows[k] for k in ("overwrite", "max_positions", "max_generate", "max_lookahead", "max_prompts",
                                 "memory_limit")} == {"overwrite": "off", "max_positions": "model",
                                                      "max_generate": 4096, "max_lookahead": 64,
                                                      "max_prompts": 1000, "memory_limit": "4 GiB"}
    text = s.execute_one("HELP SET").text
    for name in rows:
        assert name in text
    assert "(4 GiB)" in text and "(model)" in text


# ---- OPEN DEFAULT says when it rebuilds ----------------------------------------------------


def test_open_default_says_when_it_rebuilds_a_damaged_cache(work, monkeypatch):
    from vindex3 import default_model

    def ensure_detailed(progress=None, notice=None, *, rebuild=False):
        if notice is not None:
            notice("the cached default model at X is being rebuilt: it does not open (damaged)")
        return default_model.Ensured(work / "tiny.vindex3", True, "it does not open (damaged)")

    monkeypatch.setattr(default_model, "ensure_detailed", ensure_detailed)
    notices = []
    r = lql.Session(on_notice=notices.append).execute_one("OPEN DEFAULT")
    assert r.rebuilt == "it does not open (damaged)" and len(notices) == 1
    assert "rebuilt: it does not open (damaged)" in r.to_text()
    rc, _out, err = run_cli(["-e", "OPEN DEFAULT"])
    assert rc == 0 and "notice: the cached default model at X is being rebuilt" in err


# ---- root causes the fuzzer found (each a regression test) ---------------------------------


def test_a_long_output_name_never_makes_its_temporary_name_invalid(s, work, tiny_llama_dir):
    """Found by fuzzing: ENCODE INTO a 250-byte name failed with ENAMETOOLONG inside vindex3
    (its temporary directory '.<name>.encoding-<pid>' passed 255 bytes), an internal error."""
    name = "d" * 250
    r = s.execute_one(f"ENCODE '{tiny_llama_dir}' INTO '{name}'")
    assert r.path == name and (work / name / "index.json").is_file()
    s.execute(f"ENCODE '{tiny_llama_dir}' INTO '{name}' OVERWRITE")
    report = "r" * 250 + ".json"
    s.execute(f"DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO '{report}'")
    assert json.loads((work / report).read_text())["depths"] == [1]
    assert not [p for p in work.iterdir() if p.name.startswith(".")]


def test_use_remote_refuses_a_url_with_a_blank_or_a_control_character(s):
    """Found by fuzzing: 'http:// 127.0.0.1' passed the URL check and urllib's InvalidURL (a
    ValueError) escaped the client as an internal error."""
    from lql.errors import StatementError

    for url in ("http:// 127.0.0.1", "http://127.0.0.1:9/\x01", "http://127.0.0.1\t:9"):
        err = refused(s, f"USE REMOTE '{url}'", StatementError)
        assert "blank or a control character" in err.message


def test_a_run_the_machine_cannot_give_memory_is_refused_by_name(s, monkeypatch):
    """memory_limit refuses what its estimate says will not fit; when a user raised it past the
    machine (or the estimate fell short) the run's MemoryError is the machine, not a bug: a
    LimitError naming memory_limit, positioned at the statement, and the session stays usable.
    (Planted: a real allocation past this machine's memory could meet the OOM killer instead.)"""
    from lql.errors import LimitError

    def starving(session, node):
        raise MemoryError

    with monkeypatch.context() as m:
        m.setitem(registry.RUNNERS, infer.Run, (starving, "infer"))
        s.execute("SET memory_limit = '64 GiB'")
        err = refused(s, "STATS;\nINFER 'Water boils'", LimitError)
    assert "INFER ran out of memory" in err.message and "memory_limit is 68,719,476,736 bytes (64.0 GiB)" in err.message
    assert err.line == 2 and "SET memory_limit" in err.hint
    assert s.execute_one("INFER 'Water boils' TOP 1").logits is not None


def test_use_model_refuses_a_path_no_file_system_can_hold(s):
    """Found by fuzzing the merged dialect: USE MODEL with a 300-byte name reached os.stat and
    its ENAMETOOLONG escaped as an internal error."""
    from lql.errors import LqlError

    for name in ("a" * 300, "ab " * 200):
        with pytest.raises(LqlError) as e:
            s.execute(f"USE MODEL '{name}'")
        assert "internal" not in type(e.value).__name__.lower()
