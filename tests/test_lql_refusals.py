"""Every refusal LQL can give, each asserting that the message names the thing refused and
that the error is positioned at its statement."""

from __future__ import annotations

import json
import shutil

import lql_fixtures  # noqa: F401
import pytest

import lql
from lql.errors import (
    EngineRefusal,
    LqlError,
    NoContainer,
    SettingError,
    StatementError,
)


def refuse(session: lql.Session, text: str, kind: type = LqlError) -> LqlError:
    with pytest.raises(kind) as e:
        session.execute(text)
    return e.value


@pytest.fixture
def s(tiny_llama_container):
    return lql.connect(tiny_llama_container)


@pytest.fixture
def copy(tiny_llama_container, tmp_path):
    """A private copy of the fixture container, to break."""
    dst = tmp_path / "copy.vindex3"
    shutil.copytree(tiny_llama_container, dst)
    return dst


# ---- no container bound ---------------------------------------------------------------

NEEDS_CONTAINER = [
    ("STATS", "STATS"), ("EXPLAIN", "EXPLAIN"), ("SHOW LAYERS", "SHOW LAYERS"),
    ("SHOW COMPONENTS", "SHOW COMPONENTS"), ("SHOW REPRESENTATIONS", "SHOW REPRESENTATIONS"),
    ("SHOW PROVENANCE", "SHOW PROVENANCE"), ("SHOW OPERANDS", "SHOW OPERANDS"), ("INFER", "INFER 'x'"),
    ("TRACE", "TRACE 'x'"), ("DRAFT DEPTH", "DRAFT DEPTH 1"), ("VERIFY", "VERIFY"),
    ("DUMP LOGITS", "DUMP LOGITS 'x' INTO 'f.f32'"), ("DRAFT LADDER", "DRAFT LADDER DEPTHS (1) ON 'p.jsonl'"),
]


@pytest.mark.parametrize("keyword,text", NEEDS_CONTAINER, ids=[n[0] for n in NEEDS_CONTAINER])
def test_statement_without_a_container_is_refused_by_name(keyword, text):
    err = refuse(lql.Session(), f"SHOW SETTINGS;\n  {text};", NoContainer)
    assert err.message == f"{keyword} needs an open container, and none is open"
    assert "OPEN" in err.hint
    assert (err.line, err.column, err.statement) == (2, 3, text)


# ---- OPEN -----------------------------------------------------------------------------


def test_open_a_path_that_does_not_exist(tmp_path):
    err = refuse(lql.Session(), f"OPEN '{tmp_path / 'missing.vindex3'}'", EngineRefusal)
    assert "missing.vindex3" in err.message and "does not exist" in err.message
    assert err.kind == "ContainerNotFound"


def test_open_a_file_is_not_a_directory(tmp_path):
    f = tmp_path / "model.bin"
    f.write_bytes(b"x")
    err = refuse(lql.Session(), f"OPEN '{f}'", EngineRefusal)
    assert "model.bin" in err.message and "not a directory" in err.message


def test_open_a_directory_without_index(tmp_path):
    err = refuse(lql.Session(), f"OPEN '{tmp_path}'", EngineRefusal)
    assert "index.json" in err.message


def test_open_a_vindex2_container(copy):
    idx = json.loads((copy / "index.json").read_text())
    idx.update(format="VINDEX2", version=2)
    (copy / "index.json").write_text(json.dumps(idx))
    err = refuse(lql.Session(), f"OPEN '{copy}'", EngineRefusal)
    assert "VINDEX2" in err.message and err.kind == "FormatVersionError"
    assert err.hint and "re-encode" in err.hint


def test_open_a_graph_at_another_schema(copy):
    g = json.loads((copy / "system_graph.json").read_text())
    g["schema"] = 5
    (copy / "system_graph.json").write_text(json.dumps(g))
    err = refuse(lql.Session(), f"OPEN '{copy}'", EngineRefusal)
    assert "schema 5" in err.message and err.kind == "GraphSchemaError"


def test_open_with_closure_defects(copy):
    g = json.loads((copy / "system_graph.json").read_text())
    g["layers"][1]["operands"]["q_proj"] = "1.self_attn.q_missing.weight"
    (copy / "system_graph.json").write_text(json.dumps(g))
    err = refuse(lql.Session(), f"OPEN '{copy}'", EngineRefusal)
    assert err.kind == "ClosureError"
    assert "q_missing" in str(err)


# ---- depths, layers, prompts ----------------------------------------------------------


@pytest.mark.parametrize("text", ["DRAFT DEPTH 9", "INFER 'x' DRAFT DEPTH 9", "EXPLAIN DRAFT DEPTH 9",
                                  "TRACE 'x' DRAFT DEPTH 9", "DUMP LOGITS 'x' DRAFT DEPTH 9 INTO 'f.f32'"])
def test_depth_deeper_than_the_model(s, text):
    err = refuse(s, text, EngineRefusal)
    assert "depth 9 is deeper than the model" in err.message and "4 layers" in err.message
    assert err.kind == "SliceError"


@pytest.mark.parametrize("text", ["DRAFT DEPTH 0", "INFER 'x' DRAFT DEPTH 0", "EXPLAIN DRAFT DEPTH 0",
                                  "EXPLAIN INFER 'x' DRAFT DEPTH 0", "TRACE 'x' DRAFT DEPTH 0",
                                  "INFER 'x' GENERATE 2 SPECULATE DEPTH 0", "DRAFT LADDER DEPTHS (0) ON 'p.jsonl'",
                                  "DUMP LOGITS 'x' DRAFT DEPTH 0 INTO 'f.f32'"])
def test_depth_zero_is_the_same_refusal_everywhere(s, text):
    err = refuse(s, text, EngineRefusal)
    assert err.kind == "SliceError"
    assert "draft depth 0" in err.message and "smallest draft is depth 1" in err.message


def test_a_refused_draft_depth_leaves_the_session_as_it_was(s):
    s.execute("DRAFT DEPTH 2")
    refuse(s, "DRAFT DEPTH 9")
    assert s.draft_depth == 2


def test_token_outside_the_vocabulary(s):
    err = refuse(s, "INFER TOKENS (1, 320)", StatementError)
    assert err.message == "token id 320 is outside the vocabulary [0, 320)"


def test_text_prompt_without_a_tokenizer(copy):
    (copy / "tokenizer.json").unlink()
    idx = json.loads((copy / "index.json").read_text())
    idx.get("capabilities", {}).pop("tokenizer.json", None)
    (copy / "index.json").write_text(json.dumps(idx))
    from fixtures import reseal

    reseal(copy)  # a container written without a tokenizer records its own hashes
    s = lql.connect(copy)
    err = refuse(s, "INFER 'hello'", EngineRefusal)
    assert err.kind == "TokenizerMissing" and "tokenizer" in err.message
    assert "TOKENS" in err.hint
    r = s.execute("INFER TOKENS (1, 2) TOP 1")[0]  # token ids still work
    assert r.top[0].token is None


@pytest.mark.parametrize("text,message", [
    ("SHOW LAYERS RANGE 2-9", "layer 9 does not exist: the model has 4 layers (0..3)"),
    ("SHOW LAYERS RANGE 3-1", "RANGE 3-1 runs backwards"),
    ("SHOW OPERANDS LAYER 4", "layer 4 does not exist: the model has 4 layers (0..3)"),
])
def test_layers_the_model_does_not_have(s, text, message):
    assert refuse(s, text, StatementError).message == message


# ---- statements that contradict themselves ---------------------------------------------

PLANNER = [
    ("INFER 'x' TOP 0", "TOP must be at least 1, got 0"),
    ("INFER 'x' GENERATE 0", "GENERATE must be at least 1, got 0"),
    ("STATS AT 0 POSITIONS", "STATS AT ... POSITIONS must be at least 1, got 0"),
    ("INFER 'x' LOOKAHEAD 3", "LOOKAHEAD only applies to speculative decoding"),
    ("INFER 'x' SPECULATE DEPTH 2", "SPECULATE needs GENERATE n: speculation is a way of generating tokens"),
    ("INFER 'x' GENERATE 3 SPECULATE DEPTH 2 DRAFT DEPTH 1",
     "SPECULATE verifies with the full model, so DRAFT DEPTH cannot be combined with it"),
    ("INFER 'x' GENERATE 3 SPECULATE DEPTH 2 TOP 2", "TOP cannot be combined with SPECULATE"),
    ("INFER 'x' GENERATE 3 SPECULATE DEPTH 2 LOOKAHEAD 0", "LOOKAHEAD must be at least 1, got 0"),
    ("DRAFT LADDER DEPTHS (1, 2, 1) ON 'p.jsonl'", "DRAFT LADDER lists depth 1 twice"),
]


@pytest.mark.parametrize("text,message", PLANNER, ids=[p[0] for p in PLANNER])
def test_contradictory_statement(s, text, message):
    err = refuse(s, text, StatementError)
    assert err.message == message
    assert err.statement == text


# ---- settings and help ----------------------------------------------------------------


def test_unknown_setting(s):
    err = refuse(s, "SET colour = red", SettingError)
    assert err.message == "there is no setting named 'colour'"
    assert "format" in err.hint and "timing" in err.hint


@pytest.mark.parametrize("text,message", [
    ("SET format = xml", "setting format takes one of text, json, csv, tsv, markdown, jsonl; got 'xml'"),
    ("SET timing = 3", "setting timing takes on or off; got 3"),
    ("SET top = 0", "setting top takes a whole number of at least 1; got 0"),
    ("SET verify_cost = 1.5", ("setting verify_cost takes measured, or a number of decode steps in (0, 1) that each "
                              "verified position costs; got 1.5")),
    ("SET verify_cost = fast", ("setting verify_cost takes measured, or a number of decode steps in (0, 1) that each "
                               "verified position costs; got 'fast'")),
])
def test_bad_setting_value(s, text, message):
    assert refuse(s, text, SettingError).message == message


def test_help_on_an_unknown_topic_suggests_the_closest():
    err = refuse(lql.Session(), "HELP INFR", StatementError)
    assert err.message == "HELP has no entry for 'INFR'"
    assert "INFER" in err.hint


# ---- files ----------------------------------------------------------------------------


def test_score_a_missing_dump(s, tmp_path):
    err = refuse(s, f"SCORE DRAFT '{tmp_path / 'd.f32'}' AGAINST '{tmp_path / 't.f32'}'", EngineRefusal)
    assert "draft dump" in err.message and "d.f32" in err.message and "does not exist" in err.message
    assert err.kind == "PathRefused"


def test_dump_into_a_missing_directory(s, tmp_path):
    err = refuse(s, f"DUMP LOGITS 'x' INTO '{tmp_path / 'no' / 'f.f32'}'", EngineRefusal)
    assert "does not exist" in err.message and "no" in err.message and err.kind == "PathRefused"


def test_ladder_on_a_missing_prompt_bank(s, tmp_path):
    err = refuse(s, f"DRAFT LADDER DEPTHS (1) ON '{tmp_path / 'p.jsonl'}'", EngineRefusal)
    assert "prompt bank" in err.message and "p.jsonl" in err.message and err.kind == "PathRefused"


def test_encode_over_an_existing_output(s, tiny_llama_dir, tiny_llama_container):
    err = refuse(s, f"ENCODE '{tiny_llama_dir}' INTO '{tiny_llama_container}'", EngineRefusal)
    assert "already exists" in err.message and err.kind == "PathRefused" and "OVERWRITE" in err.hint


def test_plan_a_missing_checkpoint(tmp_path):
    err = refuse(lql.Session(), f"PLAN '{tmp_path / 'nothing'}'", EngineRefusal)
    assert "nothing" in err.message


def test_score_refusal_from_vindex3_passes_through(s, tmp_path):
    s.execute(f"DUMP LOGITS 'Water' INTO '{tmp_path / 'a.f32'}'; DUMP LOGITS 'Fire' INTO '{tmp_path / 'b.f32'}'")
    err = refuse(s, f"SCORE DRAFT '{tmp_path / 'a.f32'}' AGAINST '{tmp_path / 'b.f32'}'", EngineRefusal)
    assert "token" in err.message  # the two arms were computed on different token ids


# ---- statements whose engine is not in this build -------------------------------------


# ---- verify is a result, not a refusal ---------------------------------------------------


def test_verify_names_the_damaged_file(copy):
    seg = copy / "segments" / "final_norm.bin"
    data = bytearray(seg.read_bytes())
    data[-1] ^= 0xFF
    seg.write_bytes(bytes(data))
    r = lql.connect(copy).execute("VERIFY")[0]
    assert not r.ok
    text = r.to_text()
    assert text.startswith("VERIFY FAILED") and "final_norm.bin" in text


def test_failed_script_keeps_earlier_results(s):
    with pytest.raises(LqlError) as e:
        s.execute("SHOW COMPONENTS; DRAFT DEPTH 99; VERIFY")
    assert [r.kind for r in e.value.results] == ["show_components"]
    assert e.value.line == 1 and e.value.column == 18
