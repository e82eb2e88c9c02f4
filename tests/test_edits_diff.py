"""DIFF with edits (issue 30): DIFF CURRENT lists the tensors the session's patches change, with
sizes recomputed here from the arrays; DIFF 'a' 'b' INTO PATCH writes a patch that, applied on a,
computes b's logits bit for bit, bound to a's digest, and refuses by name containers that differ
in more than tensor values."""

from __future__ import annotations

import json

import edits_fixtures
import numpy as np
import pytest

import lql
import vindex3
from lql.errors import LqlError

pytestmark = pytest.mark.numeric

PROMPT = "The capital of France is"


@pytest.fixture(autouse=True, scope="module")
def small_bank(tmp_path_factory):
    with edits_fixtures.small_bank(tmp_path_factory.mktemp("bank")) as path:
        yield path


@pytest.fixture
def edited(tmp_path, tiny_llama_container, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = edits_fixtures.two_edits(tmp_path, tiny_llama_container)
    return s, tmp_path


def test_diff_current_lists_each_changed_tensor_with_its_size(edited):
    s, _ = edited
    r = s.execute_one("DIFF CURRENT")
    assert r.kind == "overlay_diff" and r.edits == 2 and "2 edit(s)" in r.against
    base = s.base_container
    arrays = s.container.overrides()
    refs = {x.label: x for lo in base.op_plan().layers for x in lo.operands()}
    assert {c.tensor for c in r.changes} == set(arrays)
    for c in r.changes:
        before = np.asarray(base.tensor_source().weight(refs[c.tensor]).dense(), dtype=np.float32)
        delta = arrays[c.tensor] - before
        assert c.frobenius == float(np.linalg.norm(delta)) and c.max_abs == float(np.abs(delta).max())
        assert c.rows == int((delta != 0).any(axis=1).sum()) and c.cols == int((delta != 0).any(axis=0).sum())
        assert c.rank <= c.rank_bound
        assert f".{c.layer}." in c.tensor or f"/{c.layer}." in c.tensor
    memit = [c for c in r.changes if c.modes == ["MEMIT"]]
    assert sorted(c.layer for c in memit) == [1, 2]
    assert all(c.rank == 1 and c.rank_bound == 1 and c.edits == ["facts#1"] for c in memit)  # one rank-one term each
    compose = [c for c in r.changes if c.modes == ["COMPOSE"]]
    assert compose and all(c.layer == 3 and c.edits == ["facts#2"] for c in compose)
    # a feature written over one slot: one row of gate and up, one column of down
    assert sorted(min(c.rows, c.cols) for c in compose) == [1] * len(compose)
    text = r.to_text()
    assert "|Δ|F" in text and "MEMIT" in text and "COMPOSE" in text
    assert [c.layer for c in s.execute_one("DIFF CURRENT LAYER 3").changes] == [3] * len(compose)
    assert len(s.execute_one("DIFF CURRENT LIMIT 1").changes) == 1


def test_diff_current_names_a_retrieval_overlay_and_an_empty_one(edited):
    s, _ = edited
    s.execute("REMOVE PATCH 'facts'")
    r = s.execute_one("DIFF CURRENT")
    assert r.edits == 0 and r.changes == [] and "as it is" in r.to_text()
    s.execute("INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Rome') MODE KNN")
    r = s.execute_one("DIFF CURRENT")
    assert r.changes == [] and "retrieval overlay and change no tensor" in r.to_text()


def test_diff_into_patch_reproduces_the_compiled_container_bit_for_bit(edited, containers):
    s, d = edited
    s.execute("COMPILE CURRENT INTO VINDEX 'baked.vindex3'")
    before = edits_fixtures.hashes(d / "tiny.vindex3")
    ids = s.base_container.tokenizer.encode(PROMPT)
    baked = vindex3.open(d / "baked.vindex3").executor().forward(ids)
    fresh = lql.Session()
    r = fresh.execute_one("DIFF 'tiny.vindex3' 'baked.vindex3' INTO PATCH 'diffed.vlp'")
    assert r.patch and (d / "diffed.vlp").is_file() and "bit for bit" in r.to_text()
    # the tensors the overlay changed, and no other
    assert {c.tensor for c in r.changes} == set(s.container.overrides())
    saved = json.loads((d / "diffed.vlp").read_text())
    assert saved["base_digest"] == s.base_container.digest and {e["mode"] for e in saved["edits"]} == {"values"}
    t = lql.Session("tiny.vindex3")
    t.execute_one("APPLY PATCH 'diffed.vlp'")
    assert np.array_equal(t.container.executor().forward(ids), baked)
    assert not np.array_equal(t.base_container.executor().forward(ids), baked)
    shown = t.execute_one("SHOW PATCHES").to_text()
    assert "VALUES" in shown
    with pytest.raises(LqlError, match="no target to refit"):
        t.execute("BEGIN PATCH 'diffed.vlp'; UPDATE EDGES SET target = 'x'")
    other = lql.Session(str(containers("llama_tied")))
    with pytest.raises(LqlError, match="only to the container it was made on"):
        other.execute_one(f"APPLY PATCH '{d / 'diffed.vlp'}'")
    # the reverse patch makes the compiled container the base again
    fresh.execute_one("DIFF 'baked.vindex3' 'tiny.vindex3' INTO PATCH 'back.vlp'")
    b = lql.Session("baked.vindex3")
    b.execute_one("APPLY PATCH 'back.vlp'")
    assert np.array_equal(b.container.executor().forward(ids), s.base_container.executor().forward(ids))
    assert edits_fixtures.hashes(d / "tiny.vindex3") == before


def test_diff_into_patch_refuses_containers_that_differ_in_more_than_values(edited, containers):
    _, d = edited
    fresh = lql.Session()
    with pytest.raises(LqlError) as e:
        fresh.execute_one(f"DIFF 'tiny.vindex3' '{containers('llama_tied')}' INTO PATCH 'x.vlp'")
    assert "differ in more than tensor values" in e.value.message
    from vindex3.represent import represent

    represent(d / "tiny.vindex3", d / "int8.vindex3", "int8")
    with pytest.raises(LqlError) as e:
        fresh.execute_one("DIFF 'tiny.vindex3' 'int8.vindex3' INTO PATCH 'x.vlp'")
    assert "other encodings" in e.value.message
    assert not (d / "x.vlp").exists()
    with pytest.raises(LqlError, match="inside"):
        fresh.execute_one("DIFF 'tiny.vindex3' 'int8.vindex3' INTO PATCH 'int8.vindex3/x.vlp'")
    assert not (d / "int8.vindex3" / "x.vlp").exists()


@pytest.mark.parametrize("text, words", [
    ("DIFF 'a.vindex3' CURRENT INTO PATCH 'p.vlp'", "takes two containers"),
    ("DIFF 'a.vindex3' 'b.vindex3' LAYER 1 INTO PATCH 'p.vlp'", "LAYER would leave some out"),
    ("DIFF CURRENT PHYSICAL", "no physical form"),
    ("DIFF CURRENT INTO PATCH 'p.vlp'", "SAVE PATCH"),
])
def test_diff_refusals_name_the_thing(edited, text, words):
    s, _ = edited
    with pytest.raises(LqlError) as e:
        s.execute_one(text)
    assert words in (e.value.message + " " + (e.value.hint or ""))
