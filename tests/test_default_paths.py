"""DEFAULT wherever a statement takes a container path (issue 31): DIFF (both operands, CURRENT,
INTO PATCH), COMPILE, SCORE REPRESENTATION (candidate and reference) and STATS name the built-in
default model by DEFAULT and compute exactly what they compute on its path. Planning encodes
nothing (EXPLAIN and plans read no file); a read-only server refuses DEFAULT by name (it may encode
the default model); a full server confines the other operand's path as before and does not treat
DEFAULT as one. A copy of the tiny fixture in $VINDEX3_CACHE stands in for the default model, so
that nothing is encoded or downloaded."""

from __future__ import annotations

import json
import shutil

import edits_fixtures
import numpy as np
import pytest

import lql
import vindex3
from lql.errors import LqlError
from lql.parser import parse_one


@pytest.fixture
def default(tmp_path, tiny_llama_container, monkeypatch):
    """The default model's cached container (a copy of the tiny fixture), with the working
    directory at tmp_path holding another copy, 'tiny.vindex3'."""
    from vindex3 import default_model

    cache = tmp_path / "cache"
    shutil.copytree(tiny_llama_container, cache / default_model.CONTAINER_NAME)
    monkeypatch.setenv("VINDEX3_CACHE", str(cache))
    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    monkeypatch.chdir(tmp_path)
    return cache / default_model.CONTAINER_NAME


@pytest.fixture
def no_encode(monkeypatch):
    """Fails the test if anything asks for the default model's container (planning must not)."""
    from vindex3 import default_model

    def refuse(*_a, **_k):
        raise AssertionError("the default model was asked for while planning")

    monkeypatch.setattr(default_model, "ensure", refuse)
    monkeypatch.setattr(default_model, "ensure_detailed", refuse)


def _ast(text: str) -> dict:
    s = parse_one(text)
    return {k: v for k, v in s.model_dump().items() if k in type(s).model_fields and k not in (
        "line", "column", "end_line", "end_column", "start_pos", "end_pos", "source")}


@pytest.mark.parametrize("text, want", [
    ("DIFF DEFAULT 'b'", {"a": None, "a_default": True, "b": "b", "b_default": False}),
    ("DIFF 'a' DEFAULT", {"a": "a", "a_default": False, "b": None, "b_default": True}),
    ("DIFF DEFAULT", {"a": None, "a_default": True, "b": None, "b_default": False}),
    ("diff default current limit 2", {"a": None, "a_default": True, "b_current": True, "limit": 2}),
    ("DIFF DEFAULT CURRENT", {"a": None, "a_default": True, "b": None, "b_current": True}),
    ("DIFF 'a' CURRENT", {"a": "a", "a_default": False, "b": None, "b_current": True}),  # no option needed
    ("DIFF DEFAULT 'b' INTO PATCH 'p.vlp'", {"a": None, "a_default": True, "b": "b", "into_patch": "p.vlp"}),
    ("DIFF 'a' DEFAULT PHYSICAL", {"a": "a", "b": None, "b_default": True, "physical": True}),
    ("COMPILE DEFAULT INTO VINDEX 'o'", {"path": None, "default": True, "into": "o", "target": "vindex"}),
    ("COMPILE DEFAULT INTO MODEL 'o' FORMAT gguf", {"path": None, "default": True, "format": "gguf"}),
    ("COMPILE CURRENT INTO VINDEX 'o'", {"path": None, "default": False}),
    ("SCORE REPRESENTATION DEFAULT AGAINST 'r' ON 'p'",
     {"candidate": None, "candidate_default": True, "reference": "r", "reference_default": False, "prompts": "p"}),
    ("SCORE REPRESENTATION 'c' AGAINST DEFAULT ON 'p'",
     {"candidate": "c", "candidate_default": False, "reference": None, "reference_default": True, "prompts": "p"}),
    ("SCORE REPRESENTATION DEFAULT AGAINST DEFAULT ON 'p' GREEDY 2",
     {"candidate": None, "candidate_default": True, "reference": None, "reference_default": True, "greedy": 2}),
])
def test_default_parses_where_a_container_path_does(text, want):
    got = _ast(text)
    assert {k: got[k] for k in want} == want, got


def test_planning_a_default_operand_encodes_nothing(default, no_encode):
    s = lql.Session()
    for text in ("DIFF DEFAULT 'tiny.vindex3'", "DIFF 'tiny.vindex3' DEFAULT INTO PATCH 'p.vlp'",
                 "COMPILE DEFAULT INTO VINDEX 'copy.vindex3'",
                 "SCORE REPRESENTATION DEFAULT AGAINST 'tiny.vindex3' ON 'bank.jsonl'"):
        node = s.plan(text)
        assert None in (getattr(node, f, "") for f in ("a", "b", "source", "candidate")), (text, node)
    with pytest.raises(LqlError, match="asked for"):  # running it does ask
        s.execute_one("DIFF DEFAULT 'tiny.vindex3'")


def test_diff_default_is_the_diff_of_the_default_models_path(default):
    from vindex3.represent import represent

    represent("tiny.vindex3", "int8.vindex3", "int8")
    s = lql.Session()
    by_default = s.execute_one("DIFF DEFAULT 'int8.vindex3'")
    by_path = s.execute_one(f"DIFF '{default}' 'int8.vindex3'")
    assert by_default.to_dict()["result"] == by_path.to_dict()["result"]
    assert by_default.a == str(default) and not by_default.physically_identical and by_default.logically_identical
    assert s.execute_one("DIFF 'int8.vindex3' DEFAULT PHYSICAL LIMIT 3").to_dict()["result"] == \
        s.execute_one(f"DIFF 'int8.vindex3' '{default}' PHYSICAL LIMIT 3").to_dict()["result"]
    # one operand: the bound container against the default; DEFAULT CURRENT: the default against it
    b = lql.Session("int8.vindex3")
    assert b.execute_one("DIFF DEFAULT").to_dict()["result"] == \
        s.execute_one(f"DIFF 'int8.vindex3' '{default}'").to_dict()["result"]
    assert b.execute_one("DIFF DEFAULT CURRENT").to_dict()["result"] == by_path.to_dict()["result"]
    with pytest.raises(LqlError, match="none is open"):
        s.execute_one("DIFF DEFAULT")


@pytest.mark.numeric
def test_diff_default_into_patch_and_compile_default(default, tmp_path):
    with edits_fixtures.small_bank(tmp_path):
        e = lql.Session("tiny.vindex3")  # tiny.vindex3 is the default model's bytes under another path
        e.execute("BEGIN PATCH 'facts'; INSERT INTO EDGES (entity, relation, target) VALUES ('Italy', 'capital', "
                  "'Paris') AT LAYER 1 MODE COMPOSE; COMPILE CURRENT INTO VINDEX 'baked.vindex3'")
    before = edits_fixtures.hashes(default)
    s = lql.Session()
    r = s.execute_one("DIFF DEFAULT 'baked.vindex3' INTO PATCH 'p.vlp'")
    assert r.base == str(default) and r.edits >= 1 and (tmp_path / "p.vlp").is_file()
    s.execute_one(f"DIFF '{default}' 'baked.vindex3' INTO PATCH 'q.vlp'")
    p, q = (json.loads((tmp_path / n).read_text()) for n in ("p.vlp", "q.vlp"))
    p.pop("name"), q.pop("name")
    assert p == q and p["base_digest"] == vindex3.open(default).digest
    # applied on the default, the patch computes the baked container's logits bit for bit
    ids = vindex3.open(default).tokenizer.encode("The capital of Italy is")
    d = lql.Session()
    d.execute("OPEN DEFAULT; APPLY PATCH 'p.vlp'")
    assert np.array_equal(d.container.executor().forward(ids), vindex3.open("baked.vindex3").executor().forward(ids))
    # the reverse: a patch bound to baked that gives back the default's logits
    s.execute_one("DIFF 'baked.vindex3' DEFAULT INTO PATCH 'back.vlp'")
    assert json.loads((tmp_path / "back.vlp").read_text())["base_digest"] == vindex3.open("baked.vindex3").digest
    with pytest.raises(LqlError, match="inside"):  # never written into the default model's container
        s.execute_one(f"DIFF DEFAULT 'baked.vindex3' INTO PATCH '{default / 'x.vlp'}'")
    # COMPILE DEFAULT: a verified copy of the default model, as COMPILE 'its path' makes
    c = s.execute_one("COMPILE DEFAULT INTO VINDEX 'copy.vindex3'")
    want = s.execute_one(f"COMPILE '{default}' INTO VINDEX 'copy2.vindex3'")
    assert c.source == want.source == str(default) and c.files == want.files and c.verified == want.verified > 0
    assert vindex3.open("copy.vindex3").digest == vindex3.open("copy2.vindex3").digest
    assert edits_fixtures.hashes(default) == before  # the default model's container was only read


@pytest.mark.numeric
def test_score_representation_default_as_the_candidate(default, tmp_path):
    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"id": "p", "category": "c", "text": "Water boils at"}) + "\n")
    s = lql.Session()
    by_default = s.execute_one("SCORE REPRESENTATION DEFAULT AGAINST 'tiny.vindex3' ON 'bank.jsonl' GREEDY 2")
    by_path = s.execute_one(f"SCORE REPRESENTATION '{default}' AGAINST 'tiny.vindex3' ON 'bank.jsonl' GREEDY 2")
    assert by_default.prompts == 1 and by_default.kl_p95 == by_path.kl_p95 == 0.0  # the same bytes
    with pytest.raises(LqlError, match="compares two containers; smollm2-135m-instruct.vindex3 was given as both"):
        s.execute_one("SCORE REPRESENTATION DEFAULT AGAINST DEFAULT ON 'bank.jsonl' GREEDY 2")


def test_read_only_refusal_names_default():
    from lql.statements.container import Compile
    from lql.statements.representations import Diff, ScoreRepresentation

    for stmt, kw in ((Diff(a=None, a_default=True, b="b"), "DIFF"), (Diff(a="a", b_default=True), "DIFF"),
                     (Compile(path=None, default=True, into="o", target="vindex"), "COMPILE"),
                     (ScoreRepresentation(candidate=None, candidate_default=True, reference="r", prompts="p"),
                      "SCORE REPRESENTATION")):
        assert stmt.refused_read_only() == (f"{kw} DEFAULT may encode the default model on the server; this server "
                                            "serves fixed models")
    assert Diff(a="a", b="b").refused_read_only() == "it opens containers on the server by path"


def test_servers_refuse_or_confine_default_operands(default, tiny_llama_container, tmp_path):
    pytest.importorskip("starlette", reason="SKIPPED LOUDLY: the server extra is not installed")
    from server_fixtures import config
    from starlette.testclient import TestClient

    from lql.server.app import create_app

    data = tmp_path / "data"
    data.mkdir()
    shutil.copytree(tiny_llama_container, data / "tiny.vindex3")

    def ask(c, text):
        return c.post("/v1/query", json={"lql": text}).json()["results"][-1]

    with TestClient(create_app(config(tiny_llama_container, profile="read-only", data_dir=data))) as c:
        for text, kw in (("DIFF DEFAULT 'tiny.vindex3'", "DIFF"), ("DIFF 'tiny.vindex3' DEFAULT INTO PATCH 'p.vlp'", "DIFF"),
                         ("COMPILE DEFAULT INTO VINDEX 'o.vindex3'", "COMPILE"),
                         ("SCORE REPRESENTATION 'tiny.vindex3' AGAINST DEFAULT ON 'b.jsonl'", "SCORE REPRESENTATION"),
                         ("STATS DEFAULT", "STATS")):
            o = ask(c, text)
            assert o["ok"] is False and o["error"]["type"] == "ProfileRefusal", (text, o)
            assert f"{kw} DEFAULT may encode the default model" in o["error"]["message"], o
    with TestClient(create_app(config(tiny_llama_container, data_dir=data))) as c:
        o = ask(c, "DIFF DEFAULT '../x.vindex3'")  # the other operand is confined as before
        assert o["error"]["type"] == "PathRefusal" and "'..'" in o["error"]["message"], o
        o = ask(c, "DIFF DEFAULT 'tiny.vindex3'")  # DEFAULT itself is no path to confine
        assert o["ok"] is True and o["result"]["logically_identical"] is True, o
