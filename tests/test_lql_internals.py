"""LQL's statements for looking inside (issue 15): statement text in, rendered text out
(lql_cases/internals.txt), JSON that carries every field vindex3.internals computes, rows for
CSV / Markdown / pandas, refusals by name, the planner's typed nodes, the REPL's completion of the
new keywords, columns and layers, and the server's table of them.

Each test works on its own copy of a fixture container: feature metadata is written into the
container it is built for, and the shared fixtures must stay as they are."""

from __future__ import annotations

import csv
import io
import json
import re
import shutil

import pytest
from lql_fixtures import HERE, check_case, normalise, read_cases
from prompt_toolkit.completion import CompleteEvent
from prompt_toolkit.document import Document

import lql
from lql import ast, catalog, planner, render
from lql.errors import EngineRefusal, LqlError, LqlSyntaxError, StatementError
from lql.repl_complete import LqlCompleter, context_at
from lql.statements import features, lens, records

CASES_FILE = HERE / "lql_cases" / "internals.txt"
CASES = read_cases(CASES_FILE)
FAMILIES = ("granitemoehybrid", "mamba2", "qwen3_moe")
TAB = CompleteEvent(completion_requested=True)

_RUN = re.compile(r"\brun [0-9a-f]{32}\b")
_SHA = re.compile(r"\bsha256 [0-9a-f]{64}\b")


def _family(case) -> tuple[str, str]:
    head, sep, rest = case.name.partition(": ")
    return (head, rest) if sep and head in FAMILIES else ("llama", case.name)


def own_copy(containers, family: str, dest) -> str:
    """A private copy of a fixture container (metadata gets written into it)."""
    path = dest / f"{family}.vindex3"
    if not path.exists():
        shutil.copytree(containers(family), path)
    return str(path)


def run_text(session: lql.Session, text: str) -> str:
    chunks: list[str] = []
    try:
        for out in session.run(text):
            if out.error is not None:
                chunks.append(f"error: {out.error}")
                break
            chunks.append(out.result.to_text(timing=False))
    except LqlError as e:
        chunks.append(f"error: {e}")
    return "\n\n".join(chunks)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_statement_renders(case, containers, tmp_path, monkeypatch):
    family, _ = _family(case)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    container = own_copy(containers, family, tmp_path)
    s = lql.Session()
    s.execute(f"OPEN '{container}'")
    got = normalise(run_text(s, case.text.replace("<container>", container)), container, work)
    got = _SHA.sub("sha256 <sha256>", _RUN.sub("run <run>", got))
    check_case(case, got, CASES_FILE)


def test_case_names_are_unique():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))


# ---- one session on a private llama -------------------------------------------------------


@pytest.fixture
def s(containers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return lql.connect(own_copy(containers, "llama", tmp_path))


def one(session, text):
    return session.execute_one(text)


# ---- JSON: every field the internals API computes ------------------------------------------


def _without_times(d):
    if isinstance(d, dict):
        return {k: _without_times(v) for k, v in d.items()
                if k not in ("seconds", "build_seconds", "built_layers", "kind", "rebuilt")}
    if isinstance(d, list):
        return [_without_times(x) for x in d]
    return d


def test_json_carries_every_field_of_the_internals_results(s):
    """The LQL result is the vindex3.internals result field for field: compared with the API's
    own answer to the same question (times and build notes aside)."""
    from vindex3.internals import Condition, FeatureQuery

    one(s, "BUILD FEATURES")
    ix = s.internals()
    pairs = [
        ("WALK 'The capital of France is' TOP 3", ix.walk("The capital of France is", top=3)),
        ("DESCRIBE 'France' TOP 4", ix.describe("France", top=4)),
        ("SELECT * FROM FEATURES NEAREST TO 'Paris' WHERE score > 0.1 LIMIT 6",
         ix.select(FeatureQuery(nearest_to="Paris", where=[Condition(column="score", op=">", value=0.1)], limit=6))),
        ("SHOW FEATURES AT LAYER 2 LIMIT 4", ix.show_features(2, limit=4)),
        ("EXPLAIN INFER 'Water' FEATURES TOP 2", ix.feature_activity("Water", top=2)),
        ("TRACE 'Water' FOR 'e' DECOMPOSE", ix.trace("Water", "e", decompose=True)),
    ]
    for text, api in pairs:
        got = render.to_json(one(s, text))
        assert json.loads(render.dumps_json(got))  # strict JSON
        assert got["result"].pop("notes", []) == []  # LQL's own: how a reference-dialect option was read
        if text.startswith("TRACE"):  # LQL's own: which lens read the rows (LENS TUNED reads vindex3.draft's)
            assert got["result"].pop("lens") == "logit"
        want = api.model_dump(mode="json")
        assert _without_times(got["result"]) == _without_times(want), text
        assert set(got["result"]) == set(want) - {"kind"}, text


JSON_KEYS = [
    ("WALK 'x' TOP 1", "walk", ["prompt", "query_id", "query_token", "query", "top", "layers", "skipped", "metadata",
                                "seconds", "notes"]),
    ("DESCRIBE 'France'", "describe", ["entity", "prompt", "query", "threshold", "top", "layers", "skipped", "passing",
                                       "excluded", "excluded_tokens", "total_edges", "edges", "metadata", "notes", "seconds"]),
    ("SELECT layer FROM FEATURES LIMIT 1", "select_features", ["query", "columns", "score", "layers", "skipped", "total",
                                                              "rows", "metadata", "seconds"]),
    ("SHOW FEATURES AT LAYER 0 LIMIT 1", "show_features", ["layer", "mixer", "ffn", "features", "rows", "metadata"]),
    ("EXPLAIN INFER 'x' FEATURES", "explain_features", ["prompt", "position", "slice", "executed_layers",
                                                        "intervention", "next_id", "next_token", "top", "layers",
                                                        "skipped", "metadata", "seconds"]),
    ("TRACE 'x' FOR 'e'", "trace_for", ["prompt", "target_id", "target", "positions", "slice", "executed_layers",
                                        "intervention", "rows", "final", "decomposition", "saved", "seconds", "lens"]),
    ("OBSERVE 'x' RECORD INTO 'r.jsonl'", "observe", ["path", "run_id", "prompt", "generated_ids", "generated_text",
                                                      "slice", "executed_layers", "intervention", "lens_tokens",
                                                      "events", "write_events", "token_events", "sha256", "status",
                                                      "seconds"]),
    ("BUILD FEATURES", "build_features", ["metadata", "layers", "skipped", "directory", "files", "bytes", "summary",
                                          "ffn_layers"]),
]


@pytest.mark.parametrize("text,kind,keys", JSON_KEYS, ids=[k[0] for k in JSON_KEYS])
def test_json_object_per_statement(s, text, kind, keys):
    obj = json.loads(render.dumps_json(render.to_json(one(s, text))))
    assert list(obj) == ["statement", "kind", "ok", "result"]
    assert obj["kind"] == kind and obj["ok"] is True and obj["statement"]["text"] == text
    assert list(obj["result"]) == keys


def test_decompose_in_json_carries_final_logit_and_parts_that_sum_to_it(s):
    d = render.to_json(one(s, "TRACE 'The capital of France is' FOR ' capital' DECOMPOSE"))["result"]["decomposition"]
    assert set(d["parts"][0]) == {"name", "layer", "site", "operator", "logit", "share"}
    assert [p["site"] for p in d["parts"]] == ["embedding"] + ["mixer", "ffn"] * 4
    # ROUNDING_BOUND: 66x the float32 residue measured here, 1.5e-7 of the parts' absolute sum
    assert abs(sum(p["logit"] for p in d["parts"]) - d["final_logit"]) <= 1e-5 * sum(abs(p["logit"]) for p in d["parts"])


def test_json_results_round_trip_as_a_remote_session_rebuilds_them(s):
    """A server sends a result as JSON; the client rebuilds it by kind (lql.server.client)."""
    from lql.server.client import _result_classes

    for text in ("WALK 'x' TOP 1", "DESCRIBE 'France'", "SELECT * FROM FEATURES LIMIT 2", "SHOW FEATURES AT LAYER 1 LIMIT 1",
                 "EXPLAIN INFER 'x' ABLATE FEATURES (1:3) FEATURES", "TRACE 'x' FOR 'e' DECOMPOSE SAVE INTO 't.npz'",
                 "OBSERVE 'x' GENERATE 1 RECORD INTO 'r.jsonl'", "BUILD FEATURES", "SHOW REPRESENTATIONS"):
        r = one(s, text)
        obj = render.to_json(r)
        back = _result_classes()[obj["kind"]].model_validate({**json.loads(render.dumps_json(obj))["result"],
                                                             "kind": obj["kind"]})
        assert back.to_text(timing=False) == r.to_text(timing=False), text


# ---- rows: CSV, Markdown, JSON lines, pandas -----------------------------------------------


def test_rows_per_result(s):
    walk = one(s, "WALK 'x' TOP 2 LAYERS 1-2")
    rows = walk.to_records()
    assert [(r["layer"], r["feature"]) for r in rows] == [(x.layer, h.feature) for x in walk.layers for h in x.features]
    sel = one(s, "SELECT layer, token FROM FEATURES LIMIT 3")
    assert [list(r) for r in sel.to_records()] == [["layer", "token", "token_id"]] * 3
    trace = one(s, "TRACE 'x' FOR 'e' DECOMPOSE")
    kinds = [r["row"] for r in trace.to_records()]
    assert kinds == ["lens"] * 5 + ["part"] * 9
    desc = one(s, "DESCRIBE 'France' TOP 2")
    assert len(desc.to_records()) == len(desc.edges)
    build = one(s, "BUILD FEATURES")
    assert [r["layer"] for r in build.to_records()] == [0, 1, 2, 3]
    feats = one(s, "SHOW FEATURES AT LAYER 3 LIMIT 2")
    assert [r["feature"] for r in feats.to_records()] == [0, 1] and len(feats.to_records()[0]["tokens"]) == 5
    act = one(s, "EXPLAIN INFER 'x' FEATURES TOP 2")
    assert len(act.to_records()) == 8 and {"activation", "gate", "ablated"} <= set(act.to_records()[0])


@pytest.mark.parametrize("fmt", ["csv", "tsv", "markdown", "jsonl"])
def test_formats_write_the_rows(s, fmt):
    r = one(s, "SELECT layer, feature, token, score FROM FEATURES NEAREST TO 'Paris' LIMIT 3")
    out = render.format_result(r, fmt)
    if fmt == "csv":
        rows = list(csv.reader(io.StringIO(out)))
        assert rows[0] == ["layer", "feature", "token", "score", "token_id"] and len(rows) == 4
        assert [int(x[1]) for x in rows[1:]] == [x.feature for x in r.rows]
    elif fmt == "tsv":
        assert out.split("\n")[0] == "layer\tfeature\ttoken\tscore\ttoken_id"
    elif fmt == "markdown":
        assert out.startswith("| layer | feature | token | score | token_id |") and len(out.split("\n")) == 5
    else:
        assert [json.loads(x)["feature"] for x in out.split("\n")] == [x.feature for x in r.rows]


def test_to_pandas_for_the_tabular_results(s):
    pd = pytest.importorskip("pandas", reason="SKIPPED LOUDLY: pandas (the notebook extra) is not installed")
    df = one(s, "WALK 'x' TOP 2").to_pandas()
    assert isinstance(df, pd.DataFrame) and list(df.columns[:5]) == ["layer", "mixer", "ffn", "feature", "score"]
    assert len(df) == 8
    df = one(s, "TRACE 'x' FOR 'e' DECOMPOSE").to_pandas()
    parts = df[df["row"] == "part"]
    # the parts' absolute sum is 0.38 here: its rounding bound is 3.8e-6; the residue measured 1.3e-8
    assert abs(parts["logit"].sum() - one(s, "TRACE 'x' FOR 'e' DECOMPOSE").decomposition.final_logit) < 1e-5
    assert len(one(s, "SELECT * FROM FEATURES AT LAYER 1").to_pandas()) == 96


def test_tables_fit_the_screen(s):
    r = one(s, "WALK 'The capital of France is' TOP 3")
    for line in r.to_text(width=60).split("\n")[1:]:  # the first line is a sentence, not a table
        if line.startswith(("metadata", "skipped", "time")):
            continue
        assert len(line) <= 60, line
    vertical = r.to_text(expanded="on")
    assert "-[ RECORD 1 ]" in vertical


# ---- the planner --------------------------------------------------------------------------


def plan(session, text):
    return session.plan(text)


def test_plans_are_typed_values(s):
    w = plan(s, "WALK 'The capital' TOP 3 LAYERS 1-2")
    assert isinstance(w, features.WalkPlan) and w.top == 3 and w.layers == (1, 2)
    assert w.prompt.ids == tuple(s.catalog.tokenize("The capital", special=False))  # a query has no BOS
    d = plan(s, "DESCRIBE 'France'")
    assert isinstance(d, features.DescribePlan) and d.threshold == 3.0 and d.top == 10 and d.layers is None
    s.execute("SET threshold = 0.25")
    assert plan(s, "DESCRIBE 'France'").threshold == 0.25
    q = plan(s, "SELECT token, layer FROM FEATURES AT LAYER 2 WHERE score > 1 AND token LIKE 'P%' ORDER BY layer ASC LIMIT 2")
    assert q.columns == ("token", "layer") and q.layers == (2,) and q.order_by == "layer" and q.descending is False
    assert q.where == (features.Where("score", ">", 1.0), features.Where("token", "LIKE", "P%")) and q.limit == 2
    assert isinstance(q.where[0].value, float)
    star = plan(s, "SELECT * FROM FEATURES")
    assert star.columns == tuple(catalog.FEATURE_COLUMNS) and star.descending is True and star.layers is None
    t = plan(s, "TRACE 'Hi' FOR ' capital' LAYERS 0-1 POSITIONS ALL DECOMPOSE DRAFT DEPTH 2 ABLATE FEATURES (1:3)")
    assert isinstance(t, lens.TraceForPlan) and t.target == s.catalog.tokenize(" capital", special=False)[0]
    assert t.positions == "all" and t.decompose and t.slice.depth == 2 and t.layers == (0, 1)
    assert t.intervention.features == ((1, 3),) and t.overwrite is False and t.save is None
    assert plan(s, "TRACE 'Hi' FOR 5").positions == "last"
    o = plan(s, "OBSERVE 'Hi' LENS ('e', 7) RECORD INTO 'r.jsonl'")
    assert o.generate == 0 and o.lens == (73, 7) and o.into == "r.jsonl" and o.overwrite is False
    e = plan(s, "EXPLAIN INFER 'Hi' DRAFT DEPTH 3 FEATURES TOP 2")
    assert isinstance(e, features.ExplainFeaturesPlan) and e.slice.executed_layers == [0, 1, 2] and e.top == 2
    assert plan(s, "BUILD FEATURES LAYERS 1-3").layers == (1, 2, 3)


def test_an_ablation_is_bound_into_every_statement_that_runs(s):
    from vindex3.exec.intervention import FeatureAblation

    want = FeatureAblation.of([(1, 3), (2, 0)])
    for text in ("INFER 'x' ABLATE FEATURES (2:0, 1:3)", "TRACE 'x' ABLATE FEATURES (2:0, 1:3)",
                 "DUMP LOGITS 'x' ABLATE FEATURES (2:0, 1:3) INTO 'a.f32'", "TRACE 'x' FOR 5 ABLATE FEATURES (2:0, 1:3)",
                 "OBSERVE 'x' ABLATE FEATURES (2:0, 1:3) RECORD INTO 'r.jsonl'",
                 "EXPLAIN INFER 'x' ABLATE FEATURES (2:0, 1:3) FEATURES"):
        assert plan(s, text).intervention == want, text
    explained = plan(s, "EXPLAIN INFER 'x' ABLATE FEATURES (1:3)")
    assert explained.target.intervention == FeatureAblation.of([(1, 3)])
    assert "with ABLATE FEATURES (1:3)" in explained.target.describe()


def test_the_overwrite_field_defaults_to_refusing(s):
    """The plan field another statement family (issue 10) wires to OVERWRITE and SET overwrite."""
    assert plan(s, "TRACE 'x' FOR 5 SAVE INTO 't.npz'").overwrite is False
    assert plan(s, "OBSERVE 'x' RECORD INTO 'r.jsonl'").overwrite is False
    stmt = lens.TraceFor(prompt=ast.TextPrompt(text="x"), token=5, save="t.npz", overwrite=True)
    assert planner.plan(stmt, s.context()).overwrite is True


@pytest.mark.parametrize("text,message", [
    ("SELECT layer, tokn FROM FEATURES", "FEATURES has no column 'tokn' (the column list)"),
    ("SELECT * FROM FEATURES WHERE weight > 1", "FEATURES has no column 'weight' (WHERE)"),
    ("SELECT * FROM FEATURES ORDER BY size", "FEATURES has no column 'size' (ORDER BY)"),
    ("SELECT layer, layer FROM FEATURES", "column 'layer' is listed twice"),
    ("SELECT * FROM FEATURES WHERE token < 'a'", "column 'token' does not take <"),
    ("SELECT * FROM FEATURES WHERE layer LIKE '1%'", "column 'layer' does not take LIKE"),
    ("SELECT * FROM FEATURES WHERE token = 3", "token = needs text, got the number 3"),
    ("SELECT * FROM FEATURES WHERE score >= 'x'", "score >= needs a number, got the text 'x'"),
    ("SELECT * FROM FEATURES WHERE feature = 2.5", "feature = needs a whole number, got 2.5"),
    ("SELECT * FROM FEATURES LAYERS 3-1", "LAYERS 3-1 runs backwards"),
    ("SELECT * FROM FEATURES AT LAYER 4", "layer 4 does not exist: the model has 4 layers (0..3)"),
    ("WALK 'x' LAYERS 0-4", "LAYERS names layer 4, which does not exist: the model has 4 layers (0..3)"),
    ("WALK 'x' TOP 0", "TOP must be at least 1, got 0"),
    ("DESCRIBE ' '", "DESCRIBE needs an entity: the text is empty"),
    ("SHOW FEATURES AT LAYER 4", "layer 4 does not exist"),
    ("TRACE 'x' FOR 'capital'", "TRACE ... FOR: 'capital' is not one token of this vocabulary (it is 2: 'cap', 'ital')"),
    ("TRACE 'x' FOR 320", "TRACE ... FOR: token id 320 is outside the vocabulary [0, 320)"),
    ("TRACE 'x' FOR 5 LAYERS 2 DRAFT DEPTH 1", "TRACE ... LAYERS: layer 2 is not run by the draft depth 1 (layer 0)"),
    ("EXPLAIN INFER 'x' GENERATE 3 FEATURES", "EXPLAIN INFER ... FEATURES looks at one run of the prompt; GENERATE"),
    ("OBSERVE 'x' LENS ('capital') RECORD INTO 'r.jsonl'", "OBSERVE ... LENS: 'capital' is not one token"),
    ("INFER 'x' GENERATE 2 SPECULATE DEPTH 1 ABLATE FEATURES (0:1)", "ABLATE FEATURES cannot be combined with SPECULATE"),
])
def test_refusals_name_what_is_refused(s, text, message):
    with pytest.raises(StatementError) as e:
        plan(s, text)
    assert message in e.value.message


def test_an_unknown_column_is_refused_where_it_was_written(s):
    with pytest.raises(StatementError) as e:
        s.execute("SELECT layer,\n  tokn FROM FEATURES")
    assert (e.value.line, e.value.column) == (2, 3) and "did you mean token?" in e.value.hint


@pytest.mark.parametrize("text,kind,message", [
    ("INFER 'x' ABLATE FEATURES (1:96)", "QueryRefused", "ABLATE FEATURES names feature 1:96, but layer 1 has 96 features"),
    ("INFER 'x' ABLATE FEATURES (4:0)", "QueryRefused", "ABLATE FEATURES names layer 4, but the model has 4 layers"),
    ("INFER 'x' DRAFT DEPTH 1 ABLATE FEATURES (1:0)", "QueryRefused", "which draft depth 1 does not execute"),
])
def test_ablation_refusals_are_vindex3s_own(s, text, kind, message):
    with pytest.raises(EngineRefusal) as e:
        s.execute(text)
    assert e.value.kind == kind and message in e.value.message


def test_layers_without_features_are_refused_or_skipped_by_name(containers, tmp_path):
    mamba = lql.connect(own_copy(containers, "mamba2", tmp_path))
    for text in ("WALK 'x'", "DESCRIBE 'France'", "SELECT * FROM FEATURES", "BUILD FEATURES", "EXPLAIN INFER 'x' FEATURES"):
        with pytest.raises(StatementError, match=r"no layer of this model has FFN features \(layers 0-2: mamba2 layer "
                                                 r"with no FFN \(mixer only\)"):
            mamba.execute(text)
    with pytest.raises(StatementError, match="SHOW FEATURES AT LAYER 2: mamba2 layer with no FFN"):
        mamba.execute("SHOW FEATURES AT LAYER 2")
    with pytest.raises(EngineRefusal, match="ABLATE FEATURES names layer 0, a mamba2 layer with no FFN"):
        mamba.execute("TRACE 'x' FOR 5 ABLATE FEATURES (0:0)")
    moe = lql.connect(own_copy(containers, "qwen3_moe", tmp_path))
    w = moe.execute_one("WALK 'x' TOP 1")
    assert [x.layer for x in w.layers] == [1]
    assert [(x.layer, x.operator) for x in w.skipped] == [(0, "softmax"), (2, "softmax")]
    assert all("FFN operator 'moe_ffn' has no fixed features: a router picks" in x.reason for x in w.skipped)
    with pytest.raises(StatementError, match="SHOW FEATURES AT LAYER 2: FFN operator 'moe_ffn' has no fixed features"):
        moe.execute("SHOW FEATURES AT LAYER 2")
    with pytest.raises(StatementError, match="no layer of layer 0 has FFN features"):
        moe.execute("SELECT * FROM FEATURES AT LAYER 0")
    with pytest.raises(EngineRefusal, match="layer 0's FFN operator 'moe_ffn' does not support ablating features"):
        moe.execute("INFER 'x' ABLATE FEATURES (0:0)")


# ---- derived data: SHOW REPRESENTATIONS, freshness, the stale setting ------------------------


def test_show_representations_lists_derived_data_with_its_freshness(s, containers, tmp_path):
    import vindex3

    assert one(s, "SHOW REPRESENTATIONS").derived == []
    one(s, "BUILD FEATURES LAYERS 1-2")
    r = one(s, "SHOW REPRESENTATIONS")
    (d,) = r.derived
    assert (d.key, d.kind, d.fresh, d.stale, d.files, d.params) == ("feature_tokens", "feature_tokens", True, None, 2,
                                                                    {"k": 10})
    assert "feature_tokens  feature_tokens  top 10 tokens per feature, layers 1-2" in r.to_text()
    assert [x.get("authority") for x in r.to_records()][-1] == "derived"
    assert one(s, "SHOW REPRESENTATIONS 'embedding'").derived == []
    # the container changes under its derived data: listed as stale, refused or rebuilt
    path = s.base_container.path
    c = vindex3.open(path)
    derived = c.index["derived"]
    derived["feature_tokens"]["source_digest"] = "0" * 64
    c.rewrite_index(derived=derived)
    s2 = lql.connect(path)
    (d,) = one(s2, "SHOW REPRESENTATIONS").derived
    assert d.fresh is False and d.stale.startswith("the container changed since the feature metadata was built")
    assert "no: the container changed" in one(s2, "SHOW REPRESENTATIONS 'feature_*'").to_text()
    s2.execute("SET stale = refuse")
    with pytest.raises(EngineRefusal) as e:
        s2.execute("WALK 'x' TOP 1 LAYERS 1")
    assert e.value.kind == "DerivedStale" and "is stale: the container changed" in e.value.message
    s2.execute("SET stale = rebuild")
    w = one(s2, "WALK 'x' TOP 1 LAYERS 1")
    assert "the container changed" in w.metadata.rebuilt and w.metadata.built_layers == [1]
    assert "rebuilt   the container changed" in w.to_text(timing=False)
    assert one(s2, "SHOW REPRESENTATIONS").derived[0].fresh is True
    assert one(s2, "VERIFY").ok


def test_build_features_builds_once_and_reports_progress(containers, tmp_path):
    seen = []
    s = lql.Session(own_copy(containers, "llama", tmp_path), on_progress=lambda d, t, label: seen.append((d, t, label)))
    r = s.execute_one("BUILD FEATURES LAYERS 1-2")
    assert [x.built for x in r.layers] == [True, True] and r.files == 2 and r.metadata.cached
    assert seen == [(1, 2, "layer 1"), (2, 2, "layer 2")]
    seen.clear()
    r = s.execute_one("BUILD FEATURES")
    assert [x.built for x in r.layers] == [True, False, False, True] and seen == [(1, 2, "layer 0"), (2, 2, "layer 3")]
    again = lql.connect(s.base_container.path).execute_one("BUILD FEATURES")  # a new session reads them
    assert not any(x.built for x in again.layers) and again.metadata.built_layers == []
    text = again.to_text(timing=False)
    assert "built now      none" in text and "already fresh  layers 0-3" in text


def test_trace_save_refuses_an_existing_file_unless_the_plan_overwrites(s, tmp_path):
    one(s, "TRACE 'x' FOR 5 SAVE INTO 't.npz'")
    with pytest.raises(EngineRefusal) as e:
        s.execute("TRACE 'x' FOR 5 SAVE INTO 't.npz'")
    assert e.value.kind == "PathRefused" and "already exists" in e.value.message
    stmt = lql.parser.parse_one("TRACE 'x' FOR 6 SAVE INTO 't.npz'").model_copy(update={"overwrite": True})
    r = s.execute_statement(stmt)
    import numpy as np

    with np.load(tmp_path / "t.npz") as z:
        assert int(z["target_id"]) == 6 and r.saved.path == "t.npz"


def test_observe_writes_a_record_that_verifies(s, tmp_path):
    from vindex3.internals import verify_record

    r = one(s, "OBSERVE 'Hello' GENERATE 2 ABLATE FEATURES (1:3) RECORD INTO 'run.jsonl'")
    rep = verify_record(tmp_path / "run.jsonl")
    assert rep.ok and rep.status == "complete" and rep.events == r.events and rep.run_id == r.run_id
    header = json.loads((tmp_path / "run.jsonl").read_text().split("\n")[0])
    assert header["intervention"]["text"] == "ABLATE FEATURES (1:3)" and header["prompt_text"] is None
    assert r.prompt.text == "Hello" and r.intervention == header["intervention"]


# ---- the REPL: keywords from the grammar, columns, layers ------------------------------------


@pytest.fixture
def completer():
    return LqlCompleter(model_layers=lambda: 4)


def texts(completer, text):
    return [c.text for c in completer.get_completions(Document(text), TAB)]


@pytest.mark.parametrize("text,expected", [
    ("", ["BUILD", "DESCRIBE", "OBSERVE", "SELECT", "WALK"]),
    ("SHOW ", ["FEATURES"]),
    ("TRACE 'x' ", ["ABLATE", "DRAFT", "FOR"]),
    ("TRACE 'x' FOR 'y' ", ["ABLATE", "DECOMPOSE", "DRAFT", "LAYERS", "POSITIONS", "SAVE"]),
    ("TRACE 'x' FOR 'y' POSITIONS ", ["ALL", "LAST"]),
    ("SELECT * FROM FEATURES ", ["AT", "LAYERS", "LIMIT", "NEAREST", "ORDER", "WHERE"]),
    ("SELECT * FROM FEATURES WHERE score > 1 ", ["AND", "LIMIT", "ORDER"]),
    ("SELECT * FROM FEATURES ORDER BY score ", ["ASC", "DESC", "LIMIT"]),
    ("OBSERVE 'x' ", ["ABLATE", "DRAFT", "GENERATE", "LENS", "RECORD"]),
    ("EXPLAIN INFER 'x' ", ["ABLATE", "CHAT", "DRAFT", "FEATURES", "GENERATE", "SPECULATE", "TOP"]),
    ("INFER 'x' ABLATE ", ["FEATURES"]),
    ("BUILD ", ["FEATURES"]),
])
def test_new_keywords_come_from_the_grammar(completer, text, expected):
    got = texts(completer, text)
    assert set(expected) <= set(got), (text, got)
    accepted = sorted(lql.parser.KEYWORDS[n] for n in lql.parser.interactive(text).accepts() if n in lql.parser.KEYWORDS)
    assert set(got) <= set(accepted)


def test_a_clause_given_already_is_not_offered_again(completer):
    assert "LAYERS" in texts(completer, "WALK 'x' TOP 3 ") and "TOP" not in texts(completer, "WALK 'x' TOP 3 ")
    assert "DECOMPOSE" not in texts(completer, "TRACE 'x' FOR 'y' DECOMPOSE ")
    assert texts(completer, "EXPLAIN INFER 'x' FEATURES TOP 2 ") == ["LAYERS"]
    assert "ABLATE" not in texts(completer, "OBSERVE 'x' ABLATE FEATURES (1:2) ")
    assert "TOP" in texts(completer, "EXPLAIN INFER 'x' ABLATE FEATURES (1:2) FEATURES ")


def test_column_names_after_select_where_and_order_by(completer):
    assert texts(completer, "SELECT ") == ["*", "layer", "feature", "token", "score"]
    assert texts(completer, "SELECT layer, ") == ["feature", "token", "score"]
    assert texts(completer, "select sc") == ["score"]
    assert texts(completer, "SELECT * FROM FEATURES WHERE ") == ["layer", "feature", "token", "score"]
    assert texts(completer, "SELECT * FROM FEATURES WHERE layer = 1 AND t") == ["token"]
    assert texts(completer, "SELECT * FROM FEATURES ORDER BY ") == ["layer", "feature", "token", "score"]
    assert context_at("SELECT * FROM FEATURES WHERE ").kind == "column"
    assert list(catalog.FEATURE_COLUMNS) == ["layer", "feature", "token", "score"]


def test_the_columns_are_the_relation_vindex3_serves():
    from vindex3.internals import COLUMNS
    from vindex3.internals.select import OPS

    assert tuple(catalog.FEATURE_COLUMNS) == COLUMNS
    assert {k: tuple(v) for k, v in catalog.FEATURE_COLUMN_OPS.items()} == {k: tuple(v) for k, v in OPS.items()}


def test_layer_numbers_after_layers_at_layer_and_in_ablate(completer):
    four = ["0", "1", "2", "3"]
    assert texts(completer, "WALK 'x' LAYERS ") == four
    assert texts(completer, "DESCRIBE 'x' LAYERS 1-") == ["1", "2", "3"]
    assert texts(completer, "SHOW FEATURES AT LAYER ") == four
    assert texts(completer, "SELECT * FROM FEATURES AT LAYER ") == four
    assert texts(completer, "TRACE 'x' FOR 'y' LAYERS ") == four
    assert texts(completer, "INFER 'x' ABLATE FEATURES (") == four
    assert texts(completer, "INFER 'x' ABLATE FEATURES (1:2, ") == four
    assert texts(completer, "BUILD FEATURES LAYERS ") == four
    assert texts(completer, "SELECT * FROM FEATURES LIMIT ") == ["5", "10", "20", "50", "100"]
    assert texts(LqlCompleter(), "WALK 'x' LAYERS ") == []  # no model bound: layers are not guessed


def test_paths_inside_save_into_and_record_into(completer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.npz").write_bytes(b"")
    assert texts(completer, "TRACE 'x' FOR 'y' SAVE INTO 'ol") == ["old.npz'"]
    assert texts(completer, "OBSERVE 'x' RECORD INTO 'ol") == ["old.npz'"]
    assert texts(completer, "DESCRIBE 'ol") == []  # an entity is not a path


def test_help_knows_the_new_statements():
    from lql.statements.help import help_text

    for topic in ("WALK", "DESCRIBE", "SELECT", "SHOW FEATURES", "BUILD FEATURES", "OBSERVE", "ABLATE", "TRACE"):
        assert help_text(topic) is not None, topic
    assert "ABLATE FEATURES" in help_text("INFER")
    assert "FOR 'token'" in help_text("TRACE FOR") and "DECOMPOSE" in help_text("DECOMPOSE")


# ---- the server's table ----------------------------------------------------------------------


def test_every_statement_is_in_the_servers_table():
    from lql import registry
    from lql.server import policy

    table = policy.path_fields()
    classes = {c.__name__: c for c in registry.statement_classes()}
    assert set(classes.values()) - {classes["UseRemote"]} <= set(table)  # USE REMOTE: never on a server
    assert table[classes["TraceFor"]] == ("save",) and table[classes["Observe"]] == ("into",)
    for text in ("WALK 'x'", "DESCRIBE 'x'", "SELECT * FROM FEATURES", "SHOW FEATURES AT LAYER 0",
                 "EXPLAIN INFER 'x' FEATURES", "TRACE 'x' FOR 5", "INFER 'x' ABLATE FEATURES (1:2)"):
        assert policy.read_only(lql.parser.parse_one(text)), text
    for text in ("TRACE 'x' FOR 5 SAVE INTO 't.npz'", "OBSERVE 'x' RECORD INTO 'r.jsonl'", "BUILD FEATURES"):
        assert not policy.read_only(lql.parser.parse_one(text)), text


def test_a_read_only_server_answers_without_writing(containers, tmp_path):
    pytest.importorskip("starlette", reason="SKIPPED LOUDLY: the server extra is not installed")
    from server_fixtures import config
    from starlette.testclient import TestClient

    from lql.server.app import create_app

    path = own_copy(containers, "llama", tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    before = sorted(p.name for p in (tmp_path / "llama.vindex3").iterdir())
    with TestClient(create_app(config(path, profile="read-only", data_dir=data))) as c:
        q = lambda text: c.post("/v1/query", json={"lql": text}).json()["results"][-1]
        for text in ("WALK 'x' TOP 1", "DESCRIBE 'France'", "SELECT * FROM FEATURES LIMIT 2", "SHOW FEATURES AT LAYER 0",
                     "EXPLAIN INFER 'x' FEATURES", "TRACE 'x' FOR 'e' DECOMPOSE", "INFER 'x' ABLATE FEATURES (1:2)"):
            o = q(text)
            assert o["ok"] is True, (text, o)
        assert o["result"]["intervention"]["features"] == [[1, 2]]
        walk = q("WALK 'x' TOP 1")["result"]["metadata"]
        assert walk["cached"] is False and "does not write into the container" in walk["note"]
        for text, word in (("TRACE 'x' FOR 5 SAVE INTO 't.npz'", "TRACE"), ("OBSERVE 'x' RECORD INTO 'r.jsonl'", "OBSERVE"),
                           ("BUILD FEATURES", "BUILD FEATURES")):
            o = q(text)
            assert o["error"]["type"] == "ProfileRefusal" and f"read-only profile refuses {word}" in o["error"]["message"]
    assert sorted(p.name for p in (tmp_path / "llama.vindex3").iterdir()) == before  # no derived/ appeared
    assert not list(data.iterdir())


def test_a_full_server_confines_save_and_record_paths(containers, tmp_path):
    pytest.importorskip("starlette", reason="SKIPPED LOUDLY: the server extra is not installed")
    from server_fixtures import config
    from starlette.testclient import TestClient

    from lql.server.app import create_app

    path = own_copy(containers, "llama", tmp_path)
    data = tmp_path / "data"
    data.mkdir()
    with TestClient(create_app(config(path, data_dir=data))) as c:
        q = lambda text: c.post("/v1/query", json={"lql": text}).json()["results"][-1]
        assert q("TRACE 'x' FOR 5 SAVE INTO 't.npz'")["ok"] is True and (data / "t.npz").exists()
        assert q("OBSERVE 'x' RECORD INTO 'r.jsonl'")["ok"] is True and (data / "r.jsonl").exists()
        o = q("OBSERVE 'x' RECORD INTO '../r.jsonl'")
        assert o["error"]["type"] == "PathRefusal" and "climbs out" in o["error"]["message"]
        assert q("BUILD FEATURES")["ok"] is True


def test_syntax_errors_for_the_new_statements_read_well():
    for text, words in (("SELECT * FROM FEATURES WHERE token = Paris", "text is a quoted string"),
                        ("INFER 'x' ABLATE FEATURES 3:17", "ABLATE FEATURES (3:17, 5:2)"),
                        ("TRACE 'x' FOR 'y' SAVE INTO t.npz", "paths are strings"),
                        ("WALK 'x' LAYERS", "LAYERS takes a layer or an inclusive range of layers"),
                        ("WALK 'x' TOP 2 TOP 3", "keep one TOP clause")):
        with pytest.raises(LqlSyntaxError) as e:
            lql.parser.parse(text)
        assert words in str(e.value), (text, str(e.value))


def test_results_are_the_registered_kinds():
    kinds = {"walk": features.WalkResult, "describe": features.DescribeResult, "select_features": features.SelectFeaturesResult,
             "show_features": features.ShowFeaturesResult, "explain_features": features.FeatureActivityResult,
             "trace_for": lens.TraceForResult, "observe": records.ObserveResult, "build_features": features.BuildFeaturesResult}
    for kind, cls in kinds.items():
        assert cls.model_fields["kind"].default == kind


def test_the_shell_draws_a_progress_bar_while_features_are_built(containers, tmp_path):
    import io

    from prompt_toolkit.output import DummyOutput

    from lql import repl

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out, err = io.StringIO(), Tty()
    sh = repl.Shell(output=DummyOutput(), history_path=tmp_path / "history", stdout=out, stderr=err)
    path = own_copy(containers, "llama", tmp_path)
    sh.run_text(f"OPEN '{path}'; BUILD FEATURES;")
    drawn = err.getvalue()
    assert re.search(r"build features \[#{30}\] 4/4, \d+ s elapsed: layer 3", drawn) and drawn.endswith("\r")
    assert "built now  layers 0-3" in out.getvalue()
