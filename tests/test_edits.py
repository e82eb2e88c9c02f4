"""Knowledge edits (vindex3.edits, the LQL edits family) on the tiny llama fixture: an overlay never
modifies the container, a patch is refused on any container but its own, KNN is named a retrieval
overlay wherever its output appears, MEMIT's closed form is the numpy one, and the statements run."""

from __future__ import annotations

import shutil
from pathlib import Path

import edits_fixtures
import numpy as np
import pytest

import lql
import vindex3
from lql.errors import LqlError
from vindex3.edits import EditedModel, FitSettings, Patch, memit_solve
from vindex3.edits.fit import make_edits, request

PROMPT = "The capital of France is"
SMALL_BANK = [  # the first prompts of each kind in the frozen bank: the whole bank costs minutes here
    {"id": "fact-01", "category": "fact", "text": "The capital of France is"},
    {"id": "fact-02", "category": "fact", "text": "Water boils at a temperature of"},
    {"id": "code-01", "category": "code", "text": "def add(a, b):"},
    {"id": "narr-01", "category": "narrative", "text": "Once upon a time, there was a small model"},
    {"id": "list-01", "category": "list", "text": "1 + 1 = 2, 2 + 2 = 4,"},
]


@pytest.fixture(autouse=True, scope="module")
def small_bank(tmp_path_factory):
    with edits_fixtures.small_bank(tmp_path_factory.mktemp("bank"), SMALL_BANK) as path:
        yield path


@pytest.fixture
def tiny(tmp_path, tiny_llama_container):
    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    return tmp_path / "tiny.vindex3"


@pytest.fixture(scope="module")
def fitted(tiny_llama_container):
    """One patch per mode on the tiny llama, fitted once."""
    c = vindex3.open(tiny_llama_container)
    out = {}
    for mode in ("memit", "compose", "knn"):
        p = Patch(name=mode, base_digest=c.digest, base_name=c.name)
        # a random tiny model's keys are typical of its corpus, so MEMIT's default weight on the
        # covariance (set on SmolLM2, docs/editing.md) would keep almost nothing: a lighter one here
        # MEMIT keyed at the prompt's last token here (a random tiny model barely carries a change at
        # the subject to the last position; the subject-keyed fit is tested in test_edits_memit.py)
        make_edits(c, p, [request(c, PROMPT, " Rome")], mode, None, FitSettings(lam=10.0, key="last-token"))
        out[mode] = p
    return c, out


def test_memit_closed_form_is_the_numpy_one():
    rng = np.random.default_rng(0)
    I, H, n, N = 24, 8, 3, 40
    X = rng.standard_normal((N, I))
    C = X.T @ X / N
    K = rng.standard_normal((I, n)).astype(np.float32)
    R = rng.standard_normal((H, n)).astype(np.float32)
    lam, ridge = 2.0, 0.01
    left, A = memit_solve(K, R, C, lam, ridge)
    # the same formula written out independently: dW = R K^T (lam (C + r I) + K K^T)^-1, by inverse
    Kd = K.astype(np.float64)
    reg = C + ridge * np.mean(np.diag(C)) * np.eye(I)
    want = R.astype(np.float64) @ Kd.T @ np.linalg.inv(lam * reg + Kd @ Kd.T)
    got = left.astype(np.float64) @ A.astype(np.float64)
    # A is rounded to float32 once: its relative error (6e-8) times |R| bounds the difference (measured 2e-7 here)
    assert np.max(np.abs(got - want)) < 1e-5 * np.max(np.abs(want))
    # and it is MEMIT's least-squares solution: the gradient of |dW K - R|^2 + lam tr(dW reg dW^T) is zero
    grad = (want @ Kd - R) @ Kd.T + lam * want @ reg
    assert np.max(np.abs(grad)) < 1e-9


def test_memit_overlay_adds_exactly_its_rank_one_terms(fitted):
    c, patches = fitted
    p = patches["memit"]
    m = EditedModel(c, [p])
    ov = m.overrides()
    writes = p.edits[0].writes
    assert sorted(ov) == sorted(w.label for w in writes) and all(w.op == "add_lowrank" for w in writes)
    src = c.tensor_source()
    refs = {r.label: r for lo in c.op_plan().layers for op in lo.ops for r in op.operands.values()}
    for w in writes:
        base = np.array(src.weight(refs[w.label]).dense(), dtype=np.float32)
        from vindex3.edits.overlay import dec

        expect = base + dec(w.left, (w.shape[0], w.rank)) @ dec(w.right, (w.rank, w.shape[1]))
        assert ov[w.label].dtype == np.float32 and np.array_equal(ov[w.label], expect)
    assert p.edits[0].fit["covariance"]["corpus"] == "small-bank.jsonl"  # the corpus travels with the edit


def test_an_overlay_without_writes_runs_the_same_bytes(fitted):
    c, _patches = fitted
    ids = c.tokenizer.encode(PROMPT)
    empty = EditedModel(c, [Patch(name="empty", base_digest=c.digest, base_name=c.name)])
    assert np.array_equal(empty.executor().forward(ids), c.executor().forward(ids))


@pytest.mark.parametrize("mode", ["memit", "compose"])
def test_weight_edits_raise_the_target_and_the_container_is_untouched(mode, fitted, tiny_llama_container):
    before = edits_fixtures.hashes(Path(tiny_llama_container))
    c, patches = fitted
    ids = c.tokenizer.encode(PROMPT)
    t = c.tokenizer.encode(" Rome", special=False)[0]

    def p(model):
        z = model.executor().forward(ids)[-1].astype(np.float64)
        e = np.exp(z - z.max())
        return e[t] / e.sum()

    m = EditedModel(c, [patches[mode]])
    fit = patches[mode].edits[0].fit
    # a random tiny model's logits span little, so no edit makes any token likely; the fit records
    # what its search reached, and the edit must carry the model most of the way there
    reached = fit["p_reached"] if mode == "memit" else fit["p_fitted"]
    assert reached > 1.5 * p(c) and p(m) - p(c) > 0.8 * (reached - p(c))
    assert edits_fixtures.hashes(Path(tiny_llama_container)) == before
    assert vindex3.open(tiny_llama_container).verify().ok


def test_knn_is_a_retrieval_overlay(fitted):
    c, patches = fitted
    p = patches["knn"]
    e = p.edits[0]
    assert e.writes == [] and e.knn is not None and e.label == "KNN (retrieval overlay)"
    m = EditedModel(c, [p])
    assert m.overrides() == {} and "retrieval overlay" in m.describe()
    ex = m.executor()
    assert ex.overlay == "retrieval overlay"
    st = ex.start()
    logits = st.prefill(c.tokenizer.encode(PROMPT))
    assert st.retrieval_hits and st.retrieval_hits[-1][0] == len(c.tokenizer.encode(PROMPT)) - 1
    assert int(np.argmax(logits[-1])) == e.knn.token_id


def test_lql_edits_run_and_are_labelled(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = edits_fixtures.hashes(tiny)
    s = lql.Session(str(tiny))
    r = s.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('France', 'capital', 'Rome') MODE KNN")
    assert "retrieval overlay" in r.to_text() and r.edits[0].prompt == PROMPT and r.edits[0].target == " Rome"
    s.execute_one("BEGIN PATCH 'facts.vlp'")
    r = s.execute_one("INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Paris') AT LAYER 2 "
                      "MODE COMPOSE")
    assert r.patch == "facts.vlp" and r.edits[0].layers == [2]
    r = s.execute_one("INSERT INTO EDGES (entity, relation, target) VALUES ('Eiffel Tower', 'sits-in', 'Rome') "
                      "TEMPLATE 'The {entity} is located in' LAYERS 1-2 MODE MEMIT")
    assert r.edits[0].prompt == "The Eiffel Tower is located in" and r.edits[0].layers == [1, 2]
    shown = s.execute_one("SHOW PATCHES")
    assert [p["name"] for p in shown.patches] == ["session", "facts.vlp"]
    assert "KNN (retrieval overlay)" in shown.to_text()
    s.execute_one("SAVE PATCH")
    saved = tmp_path / "facts.vlp"
    assert saved.is_file() and not list(tmp_path.glob(".facts.vlp*"))  # written atomically, nothing left over
    r = s.execute_one("DELETE FROM EDGES WHERE mode = 'COMPOSE'")
    assert [e.mode for e in r.edits] == ["COMPOSE"]
    r = s.execute_one("UPDATE EDGES SET target = 'Paris' WHERE layer = 2 AND mode = 'memit'")
    assert r.edits[0].target == " Paris"
    s.execute_one("REMOVE PATCH 'facts.vlp'")
    r = s.execute_one("APPLY PATCH 'facts.vlp'")
    assert len(r.edits) == 3 and {e.mode for e in r.edits} == {"KNN (retrieval overlay)", "COMPOSE", "MEMIT"}
    assert s.execute_one(f"INFER '{PROMPT}'").to_text()
    assert edits_fixtures.hashes(tiny) == before  # nothing the session did wrote into the container


def test_a_patch_is_refused_on_another_container(tiny, tmp_path, containers, monkeypatch):
    monkeypatch.chdir(tmp_path)
    s = lql.Session(str(tiny))
    s.execute("BEGIN PATCH 'p.vlp'; INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Rome') "
              "MODE KNN; SAVE PATCH")
    other = containers("llama_tied")
    s2 = lql.Session(str(other))
    with pytest.raises(LqlError) as e:
        s2.execute_one(f"APPLY PATCH '{tmp_path / 'p.vlp'}'")
    msg = e.value.message
    assert "patch 'p.vlp'" in msg and "made on container" in msg and "only to the container it was made on" in msg
    assert s2.execute_one("SHOW PATCHES").patches == []


def test_a_patch_is_never_written_inside_a_container(tiny):
    s = lql.Session(str(tiny))
    s.execute("INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Rome')")
    with pytest.raises(LqlError) as e:
        s.execute_one(f"SAVE PATCH INTO '{tiny / 'p.vlp'}'")
    assert "inside" in e.value.message and not (tiny / "p.vlp").exists()


@pytest.mark.parametrize("text, words", [
    ("INSERT INTO EDGES (entity, relation, target) VALUES ('a', 'flies-to', 'b')", "relation 'flies-to' has no prompt template"),
    ("INSERT INTO EDGES (prompt, target) VALUES ('a b', 'c') MODE KNN CONFIDENCE 0.5", "CONFIDENCE"),
    ("INSERT INTO EDGES (prompt, target) VALUES ('a b', 'c') MODE MEMIT ALPHA 0.5", "ALPHA"),
    ("INSERT INTO EDGES (prompt, target) VALUES ('a b', 'c') MODE ROME", "MODE ROME is not an edit mode"),
    ("INSERT INTO EDGES (prompt, target) VALUES ('a b', 'c') MODE COMPOSE LAYERS 1-2", "MODE COMPOSE writes at one layer"),
    ("INSERT INTO EDGES (prompt, target) VALUES ('a b', 'c') AT LAYER 9", "layer 9"),
    ("UPDATE EDGES SET confidence = 0.5 WHERE id = 1", "only the target"),
    ("DELETE FROM EDGES WHERE colour = 'red'", "no column 'colour'"),
    ("REBALANCE", "REBALANCE"), ("COMPACT MAJOR", "never modified"), ("MERGE 'x.vindex3'", "MERGE"),
])
def test_refusals_name_the_thing(tiny, text, words):
    s = lql.Session(str(tiny))
    with pytest.raises(LqlError) as e:
        s.execute_one(text)
    assert words in e.value.message


def test_score_edits_reports_counterfact_metrics(tiny, tmp_path):
    import json

    cases = tmp_path / "edits.jsonl"
    # the tiny tokenizer spells ' Rome' and ' Paris' from the same first token (' '): words without it
    case = {"prompt": PROMPT, "target": "Rome", "original": "Paris", "paraphrases": ["France's capital is"],
            "neighbors": [{"prompt": "The capital of Italy is", "answer": "Italy"}]}
    cases.write_text(json.dumps(case) + "\n")
    s = lql.Session(str(tiny))
    r = s.execute_one(f"SCORE EDITS ON '{cases}'")
    assert r.overlay == "the unedited model" and r.kl == 0.0 and r.kl_positions > 0
    r = s.execute_one(f"SCORE EDITS ON '{cases}' MODE KNN")
    assert "retrieval overlay" in r.overlay and "retrieval overlay" in r.to_text() and r.efficacy == 1.0
    assert r.rows[0].p_target == 1.0 and r.rows[0].rank == 0 and r.kl > 0
    assert s.execute_one("SHOW PATCHES").patches == []  # what SCORE fitted was dropped
    cases.write_text(json.dumps({**case, "target": " Rome", "original": " Paris"}) + "\n")
    with pytest.raises(LqlError) as e:
        s.execute_one(f"SCORE EDITS ON '{cases}'")
    assert "begin with the same token" in e.value.message


def test_score_edits_scores_the_sessions_draft_depth(tiny, tmp_path):
    """Under the session's DRAFT DEPTH d, SCORE EDITS scores Draft(d) — the probabilities are the
    draft's own, computed here from the container's executor — and its KL reference is the base
    model's draft at the same depth (0 for the unedited model); DRAFT OFF scores the full model."""
    import json

    from vindex3.exec.slice import Draft

    cases = tmp_path / "edits.jsonl"
    case = {"prompt": PROMPT, "target": "Rome", "original": "Paris", "paraphrases": ["France's capital is"],
            "neighbors": [{"prompt": "The capital of Italy is", "answer": "Italy"}]}
    cases.write_text(json.dumps(case) + "\n")
    c = vindex3.open(tiny)
    target = c.tokenizer.encode("Rome", special=False)[0]

    def p_target(sl):
        z = np.asarray(c.executor(slice=sl).forward(c.tokenizer.encode(PROMPT))[-1], dtype=np.float64)
        z = np.exp(z - z.max())
        return z[target] / z.sum()

    s = lql.Session(str(tiny))
    full = s.execute_one(f"SCORE EDITS ON '{cases}'")
    s.execute_one("DRAFT DEPTH 1")
    r = s.execute_one(f"SCORE EDITS ON '{cases}'")
    assert r.depth == 1 and full.depth is None and r.kl == 0.0
    # scores are float32 softmaxes; float64 here: 1e-6 is far above their rounding (~1e-7 at p ~ 1e-3)
    assert abs(r.rows[0].p_target - p_target(Draft(1))) < 1e-6
    assert r.rows[0].p_target != full.rows[0].p_target
    assert "at draft depth 1" in r.to_text()
    with pytest.raises(LqlError) as e:
        s.execute_one("DRAFT DEPTH 99")
    s.execute_one("DRAFT OFF")
    assert s.execute_one(f"SCORE EDITS ON '{cases}'").rows[0].p_target == full.rows[0].p_target
    assert "99" in e.value.message
