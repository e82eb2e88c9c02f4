"""JSON output: one object per statement with stable keys, for every kind of result; and the
text renderer's layout helpers."""

from __future__ import annotations

import json

import pytest
from lql_fixtures import ROOT  # noqa: F401

import lql
from lql import render
from lql import results as R

STATEMENTS = [
    ("STATS AT 16 POSITIONS", "stats", ["name", "path", "generation", "digest", "component", "role", "layers",
                                        "operator_mix", "objects", "parameters", "bytes", "vocab", "head_tied",
                                        "tokenizer", "continuation", "positions", "state_bytes_at_positions", "placement",
                                        "reads", "session_draft"]),
    ("EXPLAIN DRAFT DEPTH 1", "explain", ["slice", "depth", "model_layers", "executed_layers", "skipped_layers",
                                          "prompt", "state_bytes_after_prompt", "operation", "steps", "reads", "placement",
                                          "per_position", "activations", "adapter"]),
    ("SHOW LAYERS", "show_layers", ["model_layers", "layers"]),
    ("SHOW COMPONENTS", "show_components", ["components"]),
    ("SHOW REPRESENTATIONS", "show_representations", ["filter", "representations", "derived"]),
    ("SHOW PROVENANCE", "show_provenance", ["provenance"]),
    ("SHOW OPERANDS LAYER 0", "show_operands", ["layer", "operands", "total_bytes"]),
    ("SHOW SETTINGS", "show_settings", ["settings"]),
    ("INFER 'x' TOP 2 GENERATE 2", "infer", ["slice", "depth", "executed_layers", "prompt", "top",
                                             "generated_ids", "generated_text", "generated_tokens", "stopped_at", "interrupted",
                                             "prepared_reads", "prepared_bytes", "intervention", "interventions", "prefill_bytes",
                                             "decode_bytes", "expert_layers", "activations", "timing"]),
    ("INFER 'x' GENERATE 3 SPECULATE DEPTH 1", "speculate", None),
    ("TRACE 'x'", "trace", ["slice", "depth", "model_layers", "prompt", "rows", "intervention", "interventions",
                   "expert_layers"]),
    ("DRAFT DEPTH 2", "draft", ["depth", "model_layers", "executed_layers", "reads", "adapter"]),
    ("DRAFT OFF", "draft", ["depth", "model_layers", "executed_layers", "reads", "adapter"]),
    ("VERIFY", "verify", ["path", "ok", "checked", "problems"]),
    ("HELP", "help", ["topic", "text"]),
    ("SET top = 4", "set", ["name", "value", "previous"]),
]


@pytest.fixture(scope="module")
def session(tiny_llama_container):
    return lql.connect(tiny_llama_container)


@pytest.mark.parametrize("text,kind,keys", STATEMENTS, ids=[s[0] for s in STATEMENTS])
def test_json_object_per_statement(session, text, kind, keys):
    r = session.execute(text)[0]
    obj = json.loads(render.dumps_json(render.to_json(r)))
    assert list(obj) == ["statement", "kind", "ok", "result"]
    assert obj["kind"] == kind and obj["ok"] is True
    assert obj["statement"] == {"kind": obj["statement"]["kind"], "line": 1, "column": 1, "text": text}
    if keys is not None:
        assert list(obj["result"]) == keys


def test_json_keys_are_stable_across_runs(session):
    a = render.to_json(session.execute("STATS")[0])
    b = render.to_json(session.execute("STATS")[0])
    assert json.dumps(a) == json.dumps(b)


def test_error_json(session):
    with pytest.raises(lql.LqlError) as e:
        session.execute("SHOW OPERANDS LAYER 12")
    ref = R.StatementRef(kind="show_operands", line=1, column=1, text="SHOW OPERANDS LAYER 12")
    obj = render.error_json(e.value, ref)
    assert obj == {"statement": ref.model_dump(), "kind": "show_operands", "ok": False,
                   "error": {"type": "StatementError", "message": "layer 12 does not exist: the model has 4 layers (0..3)",
                             "hint": None, "line": 1, "column": 1, "expected": []}}


def test_syntax_errors_and_refusals_have_one_json_shape(session):
    outs = list(session.run("SHOW LAYERS RANGE 1-2; SHOW OPERANDS LAYER 12", keep_going=True))
    outs += list(session.run("SHOW LAYERS;\nSTATS AT x POSITIONS"))
    refusal, syntax = outs[1], outs[-1]
    a, b = render.error_json(refusal.error, refusal.ref), render.error_json(syntax.error, syntax.ref)
    assert list(a) == list(b) == ["statement", "kind", "ok", "result"][:3] + ["error"]
    assert list(a["error"]) == list(b["error"]) == ["type", "message", "hint", "line", "column", "expected"]
    assert list(a["statement"]) == list(b["statement"]) == ["kind", "line", "column", "text"]
    assert b["statement"] == {"kind": None, "line": 2, "column": 1, "text": "STATS AT x POSITIONS"}
    assert (b["error"]["type"], b["error"]["line"], b["error"]["column"]) == ("LqlSyntaxError", 2, 10)
    assert "a whole number" in b["error"]["expected"]


def test_non_finite_numbers_use_the_tagged_spelling():
    assert render.dumps_json({"x": float("nan")}) == '{"x": {"__float__": "NaN"}}'


def test_table_alignment():
    from lql import text

    assert text.table(["name", text.num("n")], [["a", 1], ["bbb", 22]]) == [
        "name   n", "----  --", "a      1", "bbb   22"]


def test_layout_helpers():
    from lql import text

    assert text.fmt_layers([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert text.fmt_bytes(512) == "512 bytes"
    assert text.fmt_bytes(4_194_304) == "4,194,304 bytes (4.0 MiB)"
    assert text.fields([("a", "1"), ("long", None), ("bb", "2")]) == ["a   1", "bb  2"]
