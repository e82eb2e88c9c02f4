"""Output that fits the screen and the notebook: formats (CSV, TSV, Markdown, JSON lines,
JSON), table fitting and expanded display, the pager, \\o and \\once, wall time per statement,
shell commands in scripts, and results in a notebook (HTML, records, pandas, numpy, a plot).

The REPL is driven through prompt_toolkit's pipe input, as a person would type."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import signal
import sys

import lql_fixtures  # noqa: F401
import numpy as np
import pytest
from fixtures import reseal
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput

import lql
from lql import cli, repl

ENTER = "\r"


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LQL_RC", "")
    monkeypatch.delenv("LQL_HISTORY", raising=False)
    monkeypatch.delenv("PAGER", raising=False)


class Tty(io.StringIO):
    """A captured stream that claims to be a terminal."""

    def isatty(self) -> bool:
        return True


def q(path) -> str:
    return "'" + str(path).replace("\\", "\\\\").replace("'", "\\'") + "'"


def drive(keys: str, tmp_path, stdout=None, stderr=None) -> tuple[str, str]:
    """Type ``keys`` into a shell; return what it printed (results, diagnostics)."""
    out, err = stdout or io.StringIO(), stderr or io.StringIO()
    with create_pipe_input() as inp:
        inp.send_text(keys)
        inp.close()
        sh = repl.Shell(input=inp, output=DummyOutput(), history_path=tmp_path / "history", stdout=out, stderr=err)
        assert sh.loop() == 0
    return out.getvalue(), err.getvalue()


def run_cli(argv, stdin: str = ""):
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(argv, stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture
def c(tiny_llama_container):
    return str(tiny_llama_container)


# ---- formats ---------------------------------------------------------------------------


def test_csv_of_show_layers_parses_into_one_row_per_layer(c):
    rc, out, err = run_cli(["--format", "csv", "-e", f"OPEN {q(c)}; SHOW LAYERS"])
    assert rc == 0, err
    blocks = out.strip("\n").split("\n\n")
    rows = list(csv.DictReader(io.StringIO(blocks[-1])))
    import vindex3

    graph = vindex3.open(c).graph
    assert len(rows) == graph.num_layers
    assert [int(r["layer"]) for r in rows] == list(range(graph.num_layers))
    assert [r["operator"] for r in rows] == [lp.operator for lp in graph.layers]
    assert all(int(r["bytes_per_position"]) == 256 for r in rows)  # raw numbers, no thousands separators


def test_markdown_renders_as_a_table(c):
    _, out, _ = run_cli(["--format", "markdown", "-e", f"OPEN {q(c)}; SHOW OPERANDS LAYER 0"])
    table = out.strip("\n").split("\n\n")[-1].split("\n")
    header, rule, body = table[0], table[1], table[2:]
    cols = [h.strip() for h in header.strip("|").split("|")]
    assert cols[:3] == ["stage", "layer", "op"]
    assert re.fullmatch(r"\|(---\|)+", rule) and rule.count("---") == len(cols)
    assert len(body) == 9  # the nine operands of a llama layer
    for line in body:  # every row is a row of the same table: unescaped pipes = columns + 1
        assert line.startswith("| ") and line.endswith(" |")
        assert len(re.findall(r"(?<!\\)\|", line)) == len(cols) + 1


def test_tsv_and_jsonl_rows(c):
    _, out, _ = run_cli(["--format", "tsv", "-e", f"OPEN {q(c)}; SHOW LAYERS RANGE 0-1"])
    lines = out.strip("\n").split("\n\n")[-1].split("\n")
    assert lines[0].split("\t")[:2] == ["layer", "operator"] and len(lines) == 3
    _, out, _ = run_cli(["--format", "jsonl", "-e", f"OPEN {q(c)}; SHOW LAYERS RANGE 1-3"])
    objs = [json.loads(line) for line in out.splitlines()]
    assert [o["layer"] for o in objs[-3:]] == [1, 2, 3]


def test_in_json_modes_errors_are_json_too(c):
    rc, out, err = run_cli(["--format", "jsonl", "-e", f"OPEN {q(c)}; SHOW OPERANDS LAYER 9"])
    last = json.loads(out.splitlines()[-1])
    assert rc == 1 and last["ok"] is False and last["error"]["type"] == "StatementError"
    assert "layer 9 does not exist" in err


def test_text_tables_fit_the_width_or_go_vertical(c):
    r = lql.connect(c).execute_one("SHOW OPERANDS LAYER 0")
    wide = r.to_text()
    fitted = r.to_text(width=80)
    assert max(map(len, wide.splitlines())) > 80
    table = fitted.splitlines()[:-1]  # the last line is the total, not the table
    assert max(map(len, table)) <= 80 and "…" in fitted
    assert [ln.split()[-1] for ln in table[2:]] == [ln.split()[-1] for ln in wide.splitlines()[2:-1]]  # bytes intact
    vertical = r.to_text(width=80, expanded="auto")
    assert vertical.startswith("-[ RECORD 1 ]")
    assert re.search(r"^tensor +\| decoder_stack/0\.input_layernorm\.weight$", vertical, re.MULTILINE)
    assert r.to_text(width=200, expanded="auto") == wide  # it fits: a table
    assert r.to_text(expanded="on").count("-[ RECORD") == 9


# ---- the REPL: \T, \x, \o, \once, the pager, timing -------------------------------------


def test_repl_formats_and_expanded_display(c, tmp_path):
    out, err = drive(f"OPEN {q(c)};{ENTER}\\T csv{ENTER}SHOW LAYERS;{ENTER}\\T markdown{ENTER}SHOW COMPONENTS;{ENTER}"
                     f"\\T text{ENTER}\\x{ENTER}SHOW LAYERS RANGE 2;{ENTER}\\json{ENTER}DRAFT DEPTH 1;{ENTER}", tmp_path)
    assert "output format is csv" in err and "expanded display is on" in err
    assert "\nlayer,operator,span,window,position,ffn,continuation,bytes_per_position,fixed_bytes\n0,softmax," in out
    assert "| name | role | objects | executes |" in out
    assert "-[ RECORD 1 ]" in out and re.search(r"^operator +\| softmax$", out, re.MULTILINE)
    obj = json.loads(out[out.index('{\n  "statement"'):])  # indented in the REPL
    assert obj["kind"] == "draft" and obj["result"]["depth"] == 1


def test_repl_redirect_and_once(c, tmp_path):
    dest, once = tmp_path / "out.txt", tmp_path / "layers.csv"
    out, err = drive(f"OPEN {q(c)};{ENTER}\\o {dest}{ENTER}SHOW COMPONENTS;{ENTER}VERIFY;{ENTER}\\o{ENTER}"
                     f"HELP TRACE;{ENTER}\\T csv{ENTER}\\once {once}{ENTER}SHOW LAYERS;{ENTER}SHOW SETTINGS;{ENTER}",
                     tmp_path)
    written = dest.read_text()
    assert "executes" in written and "verified" in written
    assert "executes" not in out and "verified" not in out  # they went to the file
    assert "TRACE 'prompt'" in out  # after \o alone, to the screen again
    assert f"results go to {dest}" in err and "results go to the screen" in err
    assert len(list(csv.DictReader(io.StringIO(once.read_text())))) == 4
    assert "name,value,description" in out  # \once lasted one statement


def test_a_missing_directory_is_refused_by_name(tmp_path):
    _, err = drive(f"\\o {tmp_path}/nowhere/x.txt{ENTER}\\once {tmp_path}/no/y{ENTER}", tmp_path)
    assert "nowhere' does not exist" in err and "no' does not exist" in err


def test_long_output_goes_through_the_pager(c, tmp_path, monkeypatch):
    paged = tmp_path / "paged.txt"
    monkeypatch.setenv("PAGER", f"cat > {paged}")
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setenv("LINES", "20")
    out, _ = drive(f"OPEN {q(c)};{ENTER}SHOW OPERANDS;{ENTER}SHOW COMPONENTS;{ENTER}", tmp_path, stdout=Tty())
    text = paged.read_text()
    assert "39 operands" in text and text.count("\n") > 20  # long: paged
    assert "39 operands" not in out and "executes" in out  # short: printed
    assert max(len(ln) for ln in text.splitlines()[:-2]) <= 100  # fitted to the terminal first


def test_a_short_wide_result_is_folded_and_printed_not_paged(c, tmp_path, monkeypatch):
    paged = tmp_path / "paged.txt"
    monkeypatch.setenv("PAGER", f"cat > {paged}")
    monkeypatch.setenv("COLUMNS", "80")
    monkeypatch.setenv("LINES", "80")
    prompt = "water boils at one hundred degrees " * 2
    out, _ = drive(f"OPEN {q(c)};{ENTER}INFER {prompt!r} TOP 2;{ENTER}", tmp_path, stdout=Tty())
    assert not paged.exists()  # wider than the terminal, but not taller: printed
    block = out[out.index("slice"):].splitlines()
    assert max(len(ln) for ln in block) <= 80  # the key/value lines fold instead of wrapping
    start = next(i for i, ln in enumerate(block) if ln.startswith("prompt ids"))
    pad = " " * len("prompt ids  ")
    end = next(i for i in range(start + 1, len(block)) if not block[i].startswith(pad))
    folded = [ln[len(pad):] for ln in block[start:end]]
    want = lql.connect(c).execute_one(f"INFER {prompt!r} TOP 2").prompt.ids
    assert len(folded) > 1 and json.loads(" ".join(folded)) == want  # every id, in order, under its label
    wide, _ = drive(f"OPEN {q(c)};{ENTER}INFER {prompt!r} TOP 2;{ENTER}", tmp_path)  # not a terminal: unfitted
    assert any(ln.startswith("prompt ids") and len(ln) > 80 for ln in wide.splitlines())


def test_the_pager_opens_exactly_when_the_output_is_taller_than_the_screen(c, tmp_path, monkeypatch):
    """A fake terminal of LINES rows: a result of LINES - 2 lines (room for the prompt) prints,
    one line more goes to the pager."""
    paged = tmp_path / "paged.txt"
    monkeypatch.setenv("PAGER", f"cat > {paged}")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("LINES", "200")
    out, _ = drive(f"OPEN {q(c)};{ENTER}\\timing off{ENTER}SHOW OPERANDS;{ENTER}", tmp_path, stdout=Tty())
    body = out[out.index("layer "):].rstrip("\n") + "\n"  # the result and the blank line after it
    height = body.count("\n") + 1
    monkeypatch.setenv("LINES", str(height + 2))
    out, _ = drive(f"OPEN {q(c)};{ENTER}\\timing off{ENTER}SHOW OPERANDS;{ENTER}", tmp_path, stdout=Tty())
    assert not paged.exists() and "39 operands" in out
    monkeypatch.setenv("LINES", str(height + 1))
    out, _ = drive(f"OPEN {q(c)};{ENTER}\\timing off{ENTER}SHOW OPERANDS;{ENTER}", tmp_path, stdout=Tty())
    assert "39 operands" in paged.read_text() and "39 operands" not in out


def test_fold_keeps_every_character_or_says_how_many_it_cut():
    from lql.text import FOLD_LINES, fields, fitting, fold

    value = ", ".join(str(i) for i in range(40))
    lines = fold("ids  ", value, 30)
    assert all(len(ln) <= 30 for ln in lines) and all(ln.startswith("     ") for ln in lines[1:])
    assert " ".join(ln[5:] for ln in lines) == value  # folded after a space: joined back with one
    long = "x" * 1000
    lines = fold("text  ", long, 40)
    assert len(lines) == FOLD_LINES and all(len(ln) <= 40 for ln in lines)
    shown = "".join(ln[6:] for ln in lines)
    kept, cut = shown.split("… (+")
    assert len(kept) + int(cut.split(" ")[0].replace(",", "")) == 1000  # the cut names what it left out
    assert fold("a very long label indeed  ", long, 30) == [("a very long label indeed  " + long)[:29] + "…"]
    with fitting(None):
        assert fields([("text", long)]) == [f"text  {long}"]  # no width: nothing folds
    with fitting(50):
        assert fields([("a", "short"), ("text", long)])[0] == "a     short"


def test_pager_off(c, tmp_path, monkeypatch):
    paged = tmp_path / "paged.txt"
    monkeypatch.setenv("PAGER", f"cat > {paged}")
    monkeypatch.setenv("LINES", "10")
    out, _ = drive(f"OPEN {q(c)};{ENTER}\\pager{ENTER}SHOW OPERANDS;{ENTER}SET pager = on;{ENTER}", tmp_path,
                   stdout=Tty())
    assert not paged.exists() and "39 operands" in out


def test_wall_time_for_every_statement(c, tmp_path):
    out, _ = drive(f"OPEN {q(c)};{ENTER}VERIFY;{ENTER}TRACE 'Hi';{ENTER}\\timing off{ENTER}VERIFY;{ENTER}", tmp_path)
    assert len(re.findall(r"^time: \d+(\.\d+)? m?s$", out, re.MULTILINE)) == 3  # OPEN, VERIFY, TRACE


def test_encode_time_is_not_called_prepare(tiny_llama_dir, tmp_path):
    r = lql.Session().execute_one(f"ENCODE {q(tiny_llama_dir)} INTO {q(tmp_path / 'e.vindex3')}")
    assert "encode time" in r.to_text() and "prepare" not in r.to_text()
    assert r.seconds > 0


def test_completion_through_the_pipe_input(c, tmp_path):
    """Typed keys: a fuzzy keyword and a draft depth of the bound model are completed."""
    import asyncio

    async def scenario(keys: list[str]) -> str:
        with create_pipe_input() as inp:
            sh = repl.Shell(input=inp, output=DummyOutput(), history_path=tmp_path / "history",
                            stdout=io.StringIO(), stderr=io.StringIO())
            sh.run_text(f"OPEN {q(c)};")
            task = asyncio.ensure_future(sh.prompt.prompt_async())
            for k in keys:
                inp.send_text(k)
                await asyncio.sleep(0.3)
            return await asyncio.wait_for(task, 10)

    assert asyncio.run(scenario(["SHOW opd", "\t", ";", ENTER])) == "SHOW operands;"
    assert asyncio.run(scenario(["DRAFT LADDER DEPTHS (1, 2, 3, ", "\t", ") ON 'p';", ENTER])) == (
        "DRAFT LADDER DEPTHS (1, 2, 3, 4) ON 'p';")


# ---- scripts --------------------------------------------------------------------------


def test_shell_commands_work_in_scripts(c, tmp_path):
    script = tmp_path / "s.lql"
    script.write_text(f"OPEN {q(c)};\n\\timing off\n\\T csv\nSHOW LAYERS RANGE 0-1;\n")
    rc, out, err = run_cli([str(script)])
    assert rc == 0, err
    last = out.strip().split("\n\n")[-1]
    assert last.splitlines()[0].startswith("layer,operator") and len(last.splitlines()) == 3
    assert "time:" not in last


def test_an_interactive_only_command_is_refused_in_a_script_with_a_hint(c, tmp_path):
    script = tmp_path / "s.lql"
    script.write_text(f"OPEN {q(c)};\n\\history\nVERIFY;\n")
    rc, out, err = run_cli([str(script)])
    assert rc == 1 and "verified" not in out
    assert f"{script}:2: \\history works only in the interactive shell" in err and "hint:" in err


def test_keep_going_counts_every_failure(c):
    rc, out, err = run_cli(["--keep-going", "--no-timing", "-e",
                            f"OPEN {q(c)}; DRAFT DEPTH 9; STATS AT x POSITIONS; VERIFY;\n\\bogus\nSHOW COMPONENTS"])
    assert rc == 1 and "verified" in out and "primary_text" in out
    assert err.rstrip().endswith("lql: 3 of 6 statement(s) failed")


def test_a_script_stops_at_its_first_error_like_psql(c, tmp_path):
    script = tmp_path / "s.lql"
    script.write_text(f"OPEN {q(c)};\nDRAFT DEPTH 2;\nSHOW LAYERS RANGE x;\nDRAFT OFF;\n")
    rc, out, err = run_cli([str(script)])
    s = lql.Session()
    results = list(s.run(script.read_text()))
    assert rc == 1 and "draft depth 2: later" in out and "draft off" not in out
    assert err.startswith(f"{script}:3:19: syntax error")
    assert [o.error is None for o in results] == [True, True, False]  # Session.run: the same rule


# ---- notebooks --------------------------------------------------------------------------


def test_results_in_a_notebook(c):
    s = lql.connect(c)
    r = s.execute_one("SHOW LAYERS")
    assert str(r) == r.to_text()
    html = r._repr_html_()
    assert html.count("<tr>") == 1 + 4 and '<code>SHOW LAYERS</code></div>' in html  # the caption, above the table
    assert r.to_dict() == json.loads(r.to_json()) and r.to_dict()["kind"] == "show_layers"
    assert [rec["layer"] for rec in r.to_records()] == [0, 1, 2, 3]
    pd = pytest.importorskip("pandas", reason="SKIPPED LOUDLY: pandas (the notebook extra) is not installed")
    df = r.to_pandas()
    assert isinstance(df, pd.DataFrame) and list(df["layer"]) == [0, 1, 2, 3]
    assert "<table>" in s.execute_one("STATS")._repr_html_()


def test_to_pandas_refuses_by_name_without_pandas(c, monkeypatch):
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(lql.NotAvailable, match="needs pandas"):
        lql.connect(c).execute_one("SHOW LAYERS").to_pandas()


def test_execute_one_takes_one_statement(c):
    s = lql.connect(c)
    assert s.execute_one("VERIFY;").kind == "verify"
    with pytest.raises(lql.LqlError, match="exactly one statement"):
        s.execute_one("VERIFY; VERIFY")


def test_infer_logits_are_the_runs_logits(c):
    import vindex3

    r = lql.connect(c).execute_one("INFER 'Water boils' TOP 3")
    ex = vindex3.open(c).executor()
    expected = ex.forward(r.prompt.ids)[-1]
    assert r.logits.dtype == np.float32 and np.array_equal(r.logits, expected)
    assert "logits" not in r.to_dict()["result"]


# ---- generation: end of sequence, chat, partial work --------------------------------------


@pytest.fixture
def copy(tiny_llama_container, tmp_path):
    dst = tmp_path / "copy.vindex3"
    shutil.copytree(tiny_llama_container, dst)
    return dst


def test_generate_stops_at_end_of_sequence_unless_exactly(copy):
    s = lql.connect(copy)
    ids = s.execute_one("INFER 'Once upon a time' GENERATE 8 EXACTLY").generated_ids
    eos = ids[3]
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 99999]}))
    reseal(copy)  # a hand-edited container records its new hashes, as a tool writing one would
    s = lql.connect(copy)
    r = s.execute_one("INFER 'Once upon a time' GENERATE 8")
    stop = ids.index(eos)
    assert r.generated_ids == ids[: stop + 1] and r.stopped_at == eos
    assert f"stopped at end-of-sequence id {eos}" in r.to_text()
    assert s.execute_one("INFER 'Once upon a time' GENERATE 8 EXACTLY").generated_ids == ids


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_chat_wraps_the_prompt_in_the_models_template(copy):
    (copy / "chat_template.jinja").write_text(CHATML)
    s = lql.connect(copy)
    r = s.execute_one("INFER 'Hello there' CHAT TOP 2")
    expected_text = "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n"
    tok = s.container.tokenizer._tok
    assert r.prompt.ids == tok.encode(expected_text, add_special_tokens=False).ids and r.prompt.chat
    s.execute("SET chat = on")
    assert s.execute_one("INFER 'Hello there' TOP 2").prompt.ids == r.prompt.ids
    assert s.execute_one("INFER TOKENS (5, 6) TOP 2").prompt.ids == [5, 6]  # the setting leaves ids alone


def test_ladder_interrupted_shows_the_depths_it_finished(c, tmp_path):
    bank = tmp_path / "p.jsonl"
    bank.write_text("".join(json.dumps({"id": f"p{i}", "category": "x", "text": t}) + "\n"
                            for i, t in enumerate(["Water boils", "The sky is"])))

    def progress(done, total, label):
        if label.startswith("depth 2"):
            raise KeyboardInterrupt  # Ctrl-C while depth 2 runs

    s = lql.Session(c, on_progress=progress)
    r = s.execute_one(f"DRAFT LADDER DEPTHS (1, 2, 4) ON {q(bank)}")
    assert r.interrupted and r.depths == [1] and len(r.rows) == 1
    assert "interrupted; depths finished: 1" in r.to_text()


def test_ladder_plots(c, tmp_path):
    pytest.importorskip("matplotlib", reason="SKIPPED LOUDLY: matplotlib (the notebook extra) is not installed")
    bank = tmp_path / "p.jsonl"
    bank.write_text(json.dumps({"id": "a", "category": "x", "text": "Water boils at"}) + "\n")
    s = lql.connect(c)
    r = s.execute_one(f"DRAFT LADDER DEPTHS (1, 2, 4) ON {q(bank)} INTO {q(tmp_path / 'l.json')} "
                      f"PLOT INTO {q(tmp_path / 'l.png')}")
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "chart written to" in r.to_text()
    fig = r.plot(str(tmp_path / "l.svg"))
    assert "<svg" in (tmp_path / "l.svg").read_text()
    ax = fig.axes[0]
    assert list(ax.lines[0].get_xdata()) == [1, 2, 4]
    assert list(ax.lines[0].get_ydata()) == [row["summary"]["kl_p50"] for row in r.rows]
    with pytest.raises(lql.LqlError, match=r"\.png or \.svg"):
        s.execute_one(f"DRAFT LADDER DEPTHS (1) ON {q(bank)} PLOT INTO {q(tmp_path / 'l.gif')}")


def test_plot_refuses_by_name_without_matplotlib(c, tmp_path, monkeypatch):
    bank = tmp_path / "p.jsonl"
    bank.write_text(json.dumps({"id": "a", "category": "x", "text": "Hi"}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(lql.NotAvailable, match="needs matplotlib"):
        lql.connect(c).execute_one(f"DRAFT LADDER DEPTHS (1) ON {q(bank)} PLOT INTO {q(tmp_path / 'x.png')}")


def test_score_shows_token_text_only_for_the_container_it_came_from(c, tmp_path):
    s = lql.connect(c)
    s.execute(f"DUMP LOGITS 'Hi there' INTO {q(tmp_path / 'f.f32')}; "
              f"DUMP LOGITS 'Hi there' DRAFT DEPTH 1 INTO {q(tmp_path / 'd.f32')}")
    text = f"SCORE DRAFT {q(tmp_path / 'd.f32')} AGAINST {q(tmp_path / 'f.f32')}"
    bound = s.execute_one(text)
    assert bound.tokens and "target token" in bound.to_text()
    assert bound.positions[0]["target_token"] == s.container.tokenizer.token_text(bound.positions[0]["target_argmax"])
    unbound = lql.Session().execute_one(text)
    assert not unbound.tokens and "target token" not in unbound.to_text()


def test_ctrl_c_during_speculation_keeps_the_tokens(c):
    count = 0

    def press(tok, text):
        nonlocal count
        count += 1
        if count == 3:
            signal.raise_signal(signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        s = lql.Session(c, on_token=press)
        r = s.execute_one("INFER 'Once upon a time' GENERATE 50 SPECULATE DEPTH 2")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert r.interrupted and 3 <= len(r.generated_ids) < 50 and r.acceptance_rate is None
    assert "interrupted" in r.to_text()


def test_lql_lays_out_vindex3_reports_through_the_entry_point(tiny_llama_dir, c):
    """vindex3's command line finds lql's layout through the ``vindex3.reports`` entry point
    (vindex3 imports nothing from lql); the text is the one the LQL statement prints."""
    from importlib.metadata import entry_points

    import vindex3
    from lql import reports

    assert [ep.value for ep in entry_points(group="vindex3.reports")] == ["lql.reports:render"]
    plan = vindex3.admit(tiny_llama_dir)
    text = reports.render("admission", plan)
    assert text.startswith(f"checkpoint  {plan.source} (") and "admissible  yes" in text
    assert not hasattr(plan, "to_text") and not hasattr(vindex3.container.VerifyReport, "to_text")
    assert reports.render("verify", vindex3.open(c).verify()).startswith("verified ")
    with pytest.raises(KeyError, match="no vindex3 report of kind"):
        reports.render("nonsense", plan)


# ---- tuples-only, GENERATE rows -----------------------------------------------------------


def test_tuples_only_prints_the_last_statements_rows(c):
    rc, out, _ = run_cli(["-t", "--format", "csv", "-e", f"OPEN {q(c)}; SHOW LAYERS;"])
    rows = list(csv.reader(io.StringIO(out)))
    assert rc == 0 and len(rows) == 4 and [r[0] for r in rows] == ["0", "1", "2", "3"]  # no header, no OPEN
    _, full, _ = run_cli(["--format", "csv", "-e", f"OPEN {q(c)}; SHOW LAYERS;"])
    assert full.endswith(out) and "layer,operator" in full
    rc, out, _ = run_cli(["--tuples-only", "--format", "tsv", "-e", f"OPEN {q(c)}; SHOW LAYERS RANGE 1"])
    assert out.split("\t")[0] == "1" and out.count("\n") == 1
    rc, out, _ = run_cli(["-t", "-e", f"OPEN {q(c)}; VERIFY"])
    assert "verified" in out and "time:" not in out and "opened" not in out.lower()
    rc, out, err = run_cli(["-t", "--format", "csv", "-e", f"OPEN {q(c)}; SHOW OPERANDS LAYER 9"])
    assert rc == 1 and out == "" and "layer 9" in err  # the last statement failed: nothing to pipe
    rc, out, _ = run_cli(["-t", "--json", "-e", f"OPEN {q(c)}; DRAFT DEPTH 1"])
    assert [json.loads(ln)["kind"] for ln in out.splitlines()] == ["draft"]


def test_generate_rows_carry_the_token_text(c):
    s = lql.connect(c)
    r = s.execute_one("INFER 'Water boils' GENERATE 5")
    want = [s.catalog.token_text(t) for t in r.generated_ids]
    _, out, _ = run_cli(["-t", "--format", "csv", "-e", f"OPEN {q(c)}; INFER 'Water boils' GENERATE 5"])
    rows = list(csv.reader(io.StringIO(out)))
    assert [int(x[1]) for x in rows] == r.generated_ids and [x[2] for x in rows] == want
    _, out, _ = run_cli(["--format", "markdown", "-e", f"OPEN {q(c)}; INFER 'Water boils' GENERATE 5"])
    assert "| position | id | token |" in out
