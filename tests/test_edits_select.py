"""SELECT ... FROM EDGES (issue 30): the active patches' inserted edges, one row per edit and layer,
a source column naming the patch, and a score that is the target's probability at the prompt
through the session's overlay (recomputed here); the edges DESCRIBE computes are not listed, and
the result says so."""

from __future__ import annotations

import json

import edits_fixtures
import numpy as np
import pytest

from lql.errors import LqlError

BANK = [{"id": "fact-01", "category": "fact", "text": "The capital of France is"},
        {"id": "code-01", "category": "code", "text": "def add(a, b):"}]


@pytest.fixture(autouse=True, scope="module")
def small_bank(tmp_path_factory):
    with edits_fixtures.small_bank(tmp_path_factory.mktemp("bank"), BANK) as path:
        yield path


@pytest.fixture
def session(tmp_path, tiny_llama_container, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = edits_fixtures.two_edits(tmp_path, tiny_llama_container)
    return s


def _p(model, prompt, token):
    z = np.asarray(model.executor().forward(model.tokenizer.encode(prompt))[-1], dtype=np.float64)
    z = np.exp(z - z.max())
    return z[token] / z.sum()


@pytest.mark.numeric
def test_select_from_edges_lists_the_patch_edges_with_their_source(session):
    r = session.execute_one("SELECT entity, target, layer, score, source FROM EDGES")
    assert r.columns == ["entity", "target", "layer", "score", "source"]
    assert [(x["entity"], x["target"], x["layer"]) for x in r.rows] == [(None, " Rome", 1), (None, " Rome", 2),
                                                                       ("Italy", " Paris", 3)]
    assert {x["source"] for x in r.rows} == {"patch:facts"}
    for x, e in zip(r.rows[1:], session.container.edits()):
        # the score is the overlay's probability of the target's first token (float32 softmax,
        # rounded to 6 places, against a float64 one here: the rounding is the tolerance)
        assert abs(x["score"] - _p(session.container, e.prompt, e.target_id)) < 1e-6
    assert "DESCRIBE computes" in r.to_text()
    r = session.execute_one("SELECT * FROM EDGES WHERE layer = 2")
    assert [(x["id"], x["mode"]) for x in r.rows] == [(1, "memit")]
    r = session.execute_one("SELECT id, layer FROM EDGES WHERE target LIKE '%Par%' ORDER BY layer DESC LIMIT 1")
    assert r.rows == [{"id": 2, "layer": 3}]
    session.execute("INSERT INTO EDGES (entity, relation, target) VALUES ('Atlantis', 'capital', 'Poseidonia') MODE KNN")
    r = session.execute_one("SELECT * FROM EDGES WHERE mode = 'knn'")
    assert [x["mode"] for x in r.rows] == ["knn (retrieval overlay)"] and "retrieval overlay" in r.to_text()
    session.execute("REMOVE PATCH 'facts'")
    assert session.execute_one("SELECT * FROM EDGES").rows == []


@pytest.mark.parametrize("text, words", [
    ("SELECT confidence FROM EDGES", "no column 'confidence'"),
    ("SELECT * FROM EDGES NEAREST TO 'France'", "NEAREST TO"),
    ("SELECT * FROM ENTITIES", "knowledge graph"),
])
def test_select_from_edges_refusals_name_the_thing(session, text, words):
    with pytest.raises(LqlError) as e:
        session.execute_one(text)
    assert words in e.value.message


def test_set_templates_adds_relations_insert_reads(session, tmp_path):
    (tmp_path / "templates.json").write_text(json.dumps({"flies-to": "{entity} flies to", "capital": "{entity}'s capital is"}))
    with pytest.raises(LqlError, match="relation 'flies-to' has no prompt template"):
        session.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Icarus', 'flies-to', 'Sun')")
    session.execute_one("SET templates = 'templates.json'")
    assert "templates.json" in session.execute_one("SHOW SETTINGS").to_text()
    r = session.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Icarus', 'flies-to', 'Sun') MODE KNN")
    assert r.edits[0].prompt == "Icarus flies to"
    r = session.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Spain', 'capital', 'Rome') MODE KNN")
    assert r.edits[0].prompt == "Spain's capital is"  # the file's template over the built-in one
    (tmp_path / "templates.json").write_text(json.dumps({"flies-to": "flies to"}))
    with pytest.raises(LqlError, match=r"relation 'flies-to'.*\{entity\}"):
        session.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Icarus', 'flies-to', 'Sun')")
    session.execute_one("SET templates = default")
    r = session.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Spain', 'capital', 'Rome') MODE KNN")
    assert r.edits[0].prompt == "The capital of Spain is"
    session.execute_one("SET templates = 'missing.json'")
    with pytest.raises(LqlError, match="missing.json"):
        session.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Spain', 'capital', 'Rome')")
