"""MEMIT keyed at the subject (ROME / MEMIT as the literature does it) on the tiny llama: the subject's
last token is found in the prompt's tokenization or refused by name, the value fit lowers the
target's loss with the exact gradient and is deterministic, the closed form delivers the fitted
residual change at the subject, and the bounds refuse before work starts."""

from __future__ import annotations

import shutil

import edits_fixtures
import numpy as np
import pytest

import lql
import vindex3
from lql.errors import LqlError
from vindex3.edits import EditedModel, FitSettings, Patch
from vindex3.edits.fit import (
    context_prefixes,
    fit_value,
    make_edits,
    probe,
    request,
    subject_position,
)
from vindex3.errors import QueryRefused

pytestmark = pytest.mark.numeric

PROMPT = "The capital of France is"
SETTINGS = {"lam": 10.0, "lam_subject": 10.0}  # a random tiny model's keys: a light covariance weight (test_edits.py)


@pytest.fixture(autouse=True, scope="module")
def small_bank(tmp_path_factory):
    with edits_fixtures.small_bank(tmp_path_factory.mktemp("bank")) as path:
        yield path


@pytest.fixture(scope="module")
def c(tiny_llama_container):
    return vindex3.open(tiny_llama_container)


def test_the_subjects_last_token_is_located_in_the_tokenization(c):
    tok = c.tokenizer
    ids, pos = subject_position(tok, PROMPT, "France")
    assert ids == list(tok.encode(PROMPT))
    assert tok.decode(ids[: pos + 1]).endswith("France") and not tok.decode(ids[:pos]).endswith("France")
    ids2, pos2 = subject_position(tok, PROMPT, "France", "Once upon a time. ")
    assert tok.decode(ids2[: pos2 + 1]).endswith("France") and pos2 > pos


@pytest.mark.parametrize(("entity", "says"), [
    ("Berlin", "the entity 'Berlin' does not occur in the prompt"),
    ("Fra", "the end of the entity 'Fra' in the prompt 'The capital of France is' is not a token boundary"),
    (None, "names no entity"),
])
def test_a_subject_that_cannot_be_located_is_refused_by_name(c, entity, says):
    p = Patch(name="x", base_digest=c.digest, base_name=c.name)
    with pytest.raises(QueryRefused, match=says):
        make_edits(c, p, [request(c, PROMPT, " Rome", entity=entity)], "memit", [1, 2], FitSettings(**SETTINGS))
    assert p.edits == []


def test_the_value_cannot_sit_at_the_last_layer_when_the_subject_ends_early(c):
    p = Patch(name="x", base_digest=c.digest, base_name=c.name)
    with pytest.raises(QueryRefused, match="layer 3, the model's last, cannot reach the prompt's last token"):
        make_edits(c, p, [request(c, PROMPT, " Rome", entity="France")], "memit", [2, 3], FitSettings(**SETTINGS))


def test_the_value_fit_is_bounded_before_it_starts(c):
    r = request(c, PROMPT, " Rome", entity="France")
    with pytest.raises(QueryRefused, match=r"GFLOP \(25 steps, 7 prompts\), above the bound of 0"):
        fit_value(c, r, 2, FitSettings(max_gflop=1e-6), context_prefixes(c, FitSettings()))
    with pytest.raises(QueryRefused, match="0..1000 steps; 5000 were asked"):
        fit_value(c, r, 2, FitSettings(v_steps=5000), [])


def test_the_value_fit_lowers_the_loss_and_is_deterministic(c):
    r = request(c, PROMPT, " Rome", entity="France")
    st = FitSettings(**SETTINGS)
    ctx = context_prefixes(c, st)
    assert len(ctx) == 5 and all(t.endswith(". ") for t in ctx)
    h, d, fig = fit_value(c, r, 2, st, ctx)
    h2, d2, _ = fit_value(c, r, 2, st, ctx)
    assert np.array_equal(d, d2) and np.array_equal(h, h2)  # fixed steps, no randomness
    assert d.dtype == np.float32 and fig["key"] == "subject"
    assert fig["nll"] < fig["nll_before"] and fig["steps"] <= st.v_steps
    assert fig["dz_norm"] <= st.v_clamp * fig["h_norm"] * (1 + 1e-6)  # the clamp holds


def test_memit_delivers_the_fitted_residual_at_the_subject(c):
    # with a negligible covariance weight and the bare prompt's key alone (no context prefixes to
    # average over) the closed form writes each layer's whole share, so the residual at the
    # subject must move by the fitted delta (the layers' shares add up to it)
    st = FitSettings(lam=1e-3, lam_subject=1e-3, contexts=0)
    r = request(c, PROMPT, " Rome", entity="France")
    p = Patch(name="x", base_digest=c.digest, base_name=c.name)
    make_edits(c, p, [r], "memit", [1, 2], st)
    e = p.edits[0]
    assert e.fit["key"] == "subject" and e.fit["lambda"] == 1e-3 and e.fit["value_fit"]["v_steps"] == 25
    assert [w.label.split("/")[1] for w in e.writes] == ["1.mlp.down_proj.weight", "2.mlp.down_proj.weight"]
    _, delta, _ = fit_value(c, r, 2, st, context_prefixes(c, st))
    ids, pos = subject_position(c.tokenizer, PROMPT, "France")
    before = probe(c.executor(), ids, [2]).h[2][pos]
    after = probe(EditedModel(c, [p]).executor(), ids, [2]).h[2][pos]
    moved = after - before
    cos = float(moved @ delta / (np.linalg.norm(moved) * np.linalg.norm(delta)))
    ratio = float(np.linalg.norm(moved) / np.linalg.norm(delta))
    # measured cos 1 - 6e-8 and ratio 1 - 5e-7 (float32 rounding); 1e-3 leaves room for another BLAS's
    # summation order and still fails a closed form that writes a wrong share
    assert cos > 0.999 and abs(ratio - 1) < 1e-3, (cos, ratio)


def test_lql_insert_names_the_memit_key(tiny_llama_container, tmp_path, monkeypatch):
    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    monkeypatch.chdir(tmp_path)
    s = lql.Session(str(tmp_path / "tiny.vindex3"))
    r = s.execute_one("INSERT INTO EDGES (prompt, target, entity) VALUES ('The capital of France is', ' Rome', 'France') "
                      "LAYERS 1-2 MODE MEMIT")
    assert r.edits[0].fit["key"] == "subject" and r.edits[0].entity == "France"
    r = s.execute_one("INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Paris') LAYERS 1-2 MODE MEMIT")
    assert r.edits[0].fit["key"] == "last-token" and any("keyed at the prompt's last token" in n for n in r.notes)
    r = s.execute_one("UPDATE EDGES SET target = 'Berlin' WHERE entity = 'France'")
    assert r.edits[0].fit["key"] == "subject"
    with pytest.raises(LqlError, match="the entity 'Berlin' does not occur in the prompt"):
        s.execute_one("INSERT INTO EDGES (prompt, target, entity) VALUES ('The capital of France is', ' Rome', 'Berlin') "
                      "LAYERS 1-2 MODE MEMIT")
