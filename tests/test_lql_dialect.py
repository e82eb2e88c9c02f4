"""The reference dialect (issue 19): a corpus of the reference system's statement forms
(tests/data/reference_dialect.lql, written from its documented syntax) parses; each statement
either runs on the tiny llama container or is refused by name at planning — never a syntax
error, never an internal error — as its trailing comment says. Then the mappings that run,
checked against what they map onto (ENCODE, OPEN, the SELECT oracle, a container's index)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from lql_fixtures import ROOT

import lql
from lql import loop, parser
from lql.errors import LqlError, LqlSyntaxError, StatementError
from lql.planner import plan

CORPUS = ROOT / "tests" / "data" / "reference_dialect.lql"
_EXPECT = re.compile(r"\s*--\s*(run|refused)\b")


def corpus() -> list[tuple[loop.Chunk, str]]:
    """(statement chunk, "run" | "refused") in order; the expectation is the comment after ';'."""
    text = CORPUS.read_text(encoding="utf-8")
    out = []
    for ch in loop.chunks(text):
        m = _EXPECT.match(text, ch.start + len(ch.text))
        assert m, f"line {ch.line}: no '-- run' or '-- refused' after the statement"
        out.append((ch, m.group(1)))
    return out


@pytest.fixture
def dialect_dir(tmp_path, monkeypatch, tiny_llama_container, tiny_llama_dir):
    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    (tmp_path / "tiny-checkpoint").symlink_to(tiny_llama_dir)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _keywords(source: str) -> set[str]:
    return {t.value.upper() for t in parser.lex(source) if t.type in parser.KEYWORDS}


def test_the_corpus_is_large_enough_and_every_statement_parses():
    items = corpus()
    assert len(items) >= 150
    text = CORPUS.read_text(encoding="utf-8")
    for ch, _ in items:
        stmts = loop.parse_chunk(text, ch)  # raises LqlSyntaxError: the test fails naming the line
        assert stmts, ch.text


def test_every_statement_runs_or_is_refused_by_name_at_planning(dialect_dir, capsys):
    text = CORPUS.read_text(encoding="utf-8")
    s = lql.Session()
    s.execute("OPEN 'tiny.vindex3'")
    counts = {"statements": 0, "parsed": 0, "run": 0, "refused": 0}
    wrong: list[str] = []
    for ch, expect in corpus():
        try:
            stmts = loop.parse_chunk(text, ch)
        except LqlSyntaxError as e:
            wrong.append(f"line {ch.line}: syntax error: {e}")
            continue
        for stmt in stmts:
            counts["statements"] += 1
            counts["parsed"] += 1
            try:
                plan(stmt, s.context())
            except LqlSyntaxError as e:  # pragma: no cover - a refusal is never a syntax error
                wrong.append(f"line {ch.line}: {stmt.source!r}: a syntax error at planning: {e}")
                continue
            except LqlError as e:
                counts["refused"] += 1
                if expect != "refused":
                    wrong.append(f"line {ch.line}: {stmt.source!r} was refused: {e.message}")
                elif not (_keywords(stmt.source) & set(re.findall(r"[A-Z_]+", e.message))):
                    wrong.append(f"line {ch.line}: the refusal names nothing of the statement: {e.message}")
                continue
            if expect == "refused":
                wrong.append(f"line {ch.line}: {stmt.source!r} planned, and it should be refused")
                continue
            try:
                result = s.execute_statement(stmt)
            except LqlError as e:
                wrong.append(f"line {ch.line}: {stmt.source!r} planned, then was refused running: {e.message}")
                continue
            assert result.to_text()  # every result renders
            counts["run"] += 1
    with capsys.disabled():
        print(f"\nreference dialect corpus: {counts['statements']} statements, {counts['parsed']} parse, "
              f"{counts['run']} run, {counts['refused']} refused by name at planning")
    assert not wrong, "\n".join(wrong)
    assert counts["run"] + counts["refused"] == counts["statements"]


def test_use_path_opens_the_container(dialect_dir):
    s = lql.Session()
    for text in ('USE "tiny.vindex3"', "use 'tiny.vindex3'"):
        r = s.execute_one(text)
        assert r.kind == "open" and Path(r.path).resolve() == (dialect_dir / "tiny.vindex3").resolve()
    assert s.bound


def test_use_model_encodes_a_local_checkpoint_beside_it_once(dialect_dir):
    import vindex3

    (dialect_dir / "oracle").mkdir()
    oracle = vindex3.encode(dialect_dir / "tiny-checkpoint", dialect_dir / "oracle" / "encoded.vindex3")
    s = lql.Session()
    r = s.execute_one("USE MODEL 'tiny-checkpoint' AUTO_EXTRACT")
    out = dialect_dir / "tiny-checkpoint.vindex3"
    assert Path(r.path).resolve() == out.resolve() and s.bound
    assert vindex3.open(out).digest == vindex3.open(oracle).digest  # what ENCODE writes
    stamp = (out / "index.json").stat().st_mtime_ns
    s.execute_one("USE MODEL 'tiny-checkpoint'")  # encoded already: opened, not written again
    assert (out / "index.json").stat().st_mtime_ns == stamp


def test_use_model_refuses_a_hub_id_and_downloads_nothing(dialect_dir):
    before = sorted(p.name for p in dialect_dir.iterdir())
    s = lql.Session()
    with pytest.raises(StatementError, match="model hub id.*downloads nothing"):
        s.execute_one("USE MODEL 'google/gemma-3-4b-it'")
    assert sorted(p.name for p in dialect_dir.iterdir()) == before


def test_extract_is_encode(dialect_dir):
    import vindex3

    s = lql.Session()
    a = s.execute_one("ENCODE 'tiny-checkpoint' INTO 'enc.vindex3'")
    b = s.execute_one("EXTRACT MODEL 'tiny-checkpoint' INTO 'ext.vindex3' WITH ALL FORMAT vindex3")
    assert a.kind == b.kind == "encode"
    ca, cb = vindex3.open(a.path), vindex3.open(b.path)
    assert ca.digest == cb.digest
    assert ca.objects() == cb.objects()
    with pytest.raises(StatementError, match="COMPONENTS ffn_gate narrows what is carried"):
        s.execute_one("EXTRACT MODEL 'tiny-checkpoint' INTO 'x.vindex3' COMPONENTS ffn_gate")
    assert not (dialect_dir / "x.vindex3").exists()


def test_compile_is_a_verified_copy_that_keeps_unknown_index_fields(dialect_dir):
    from fixtures import reseal

    import vindex3

    src = dialect_dir / "tiny.vindex3"
    idx = json.loads((src / "index.json").read_text())
    idx["a_future_field"] = {"kept": [1, 2, 3]}
    idx["model"]["another_future_field"] = "kept too"
    (src / "index.json").write_text(json.dumps(idx))
    reseal(src)
    s = lql.Session()
    s.execute("OPEN 'tiny.vindex3'")
    r = s.execute_one("COMPILE CURRENT INTO VINDEX 'compiled.vindex3' ON CONFLICT last_wins")
    assert r.kind == "compile" and r.files > 0 and r.verified > 0
    out = dialect_dir / "compiled.vindex3"
    assert vindex3.open(out).verify().ok
    new = json.loads((out / "index.json").read_text())
    assert new["a_future_field"] == {"kept": [1, 2, 3]} and new["model"]["another_future_field"] == "kept too"
    assert new["generation"] == idx["generation"] + 1
    assert new["provenance"]["compiled"]["patches"] == []
    assert vindex3.open(out).digest == vindex3.open(src).digest
    d = s.execute_one("DIFF 'tiny.vindex3' 'compiled.vindex3' PHYSICAL")
    assert d.physically_identical and all(x.kind == "physical" for x in d.differences)
    with pytest.raises(StatementError, match="INTO MODEL"):
        s.execute_one("COMPILE CURRENT INTO MODEL 'm'")


def test_show_models_lists_the_containers_in_the_current_directory(dialect_dir):
    (dialect_dir / "not-a-container").mkdir()
    shutil.copytree(dialect_dir / "tiny.vindex3", dialect_dir / "second.vindex3")
    r = lql.Session().execute_one("SHOW MODELS")
    assert [m.path for m in r.models if m.where == "here"] == ["second.vindex3", "tiny.vindex3"]  # then the cache
    assert all(m.layers and m.problem is None for m in r.models)
    assert "tiny.vindex3" in r.to_text()


def test_pipes_run_both_statements_in_order(dialect_dir):
    s = lql.Session()
    s.execute("OPEN 'tiny.vindex3'")
    out = s.execute("SHOW LAYERS 0-1 |> SHOW PATCHES; STATS")
    assert [r.kind for r in out] == ["show_layers", "patches", "stats"]
    assert [r.statement.text for r in out[:2]] == ["SHOW LAYERS 0-1", "SHOW PATCHES"]


def test_show_layers_bare_range_is_show_layers_range(dialect_dir):
    s = lql.Session()
    s.execute("OPEN 'tiny.vindex3'")
    assert s.execute_one("SHOW LAYERS 0-1").to_dict()["result"] == s.execute_one("SHOW LAYERS RANGE 0-1").to_dict()["result"]


def test_stats_path_is_the_stats_of_that_container(dialect_dir):
    s = lql.Session()
    theirs = s.execute_one("STATS 'tiny.vindex3'")  # nothing bound: STATS 'path' needs no open container
    s.execute("OPEN 'tiny.vindex3'")
    ours = s.execute_one("STATS")
    assert theirs.to_dict()["result"] == ours.to_dict()["result"]


def test_in_is_the_union_of_equalities(dialect_dir):
    s = lql.Session()
    s.execute("OPEN 'tiny.vindex3'")

    def rows(text):
        return {(r["layer"], r["feature"]) for r in s.execute_one(text).to_records()}

    both = rows("SELECT layer, feature FROM FEATURES WHERE feature IN (1, 3) AND layer IN (0, 1)")
    one_by_one = set()
    for f in (1, 3):
        for layer in (0, 1):
            one_by_one |= rows(f"SELECT layer, feature FROM FEATURES WHERE feature = {f} AND layer = {layer}")
    assert both == one_by_one and len(both) == 4
    assert rows("SHOW FEATURES 1 WHERE feature IN (2, 5)") == {(1, 2), (1, 5)}


def test_describe_band_is_a_third_of_depth_and_says_so(dialect_dir):
    s = lql.Session()
    s.execute("OPEN 'tiny.vindex3'")
    n = s.catalog.num_layers
    r = s.execute_one("DESCRIBE 'France' OUTPUT")
    lo = (2 * n) // 3
    assert r.layers == list(range(lo, n))
    assert any("last third" in x and "records no layer bands" in x for x in r.notes)
    assert "note: OUTPUT: layers" in r.to_text()
    at = s.execute_one("DESCRIBE 'France' AT LAYER 1")
    assert at.layers == [1]


def test_edits_this_build_does_not_do_are_refused_by_name(dialect_dir):
    s = lql.Session()  # refused before anything else: no container needed to say so
    for text, words in [("MERGE 'other.vindex3'", "MERGE merges another vindex"),
                        ("COMPACT MAJOR", "a container is never modified"), ("REBALANCE", "REBALANCE rescales")]:
        with pytest.raises(StatementError) as e:
            s.execute_one(text)
        assert words in e.value.message
        assert text.split()[0] in s.execute_one(f"HELP {text.split()[0]}").text