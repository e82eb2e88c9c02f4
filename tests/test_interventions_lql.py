"""PATCH SWEEP and CAPTURE (lql/statements/interventions.py): their cells and files against the
executor's own interventions and run-with-cache, and their refusals by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

import lql
import vindex3
from vindex3.exec.intervention import Patch, site_key

pytestmark = pytest.mark.numeric  # compares numbers: scripts/test runs it again under a second numba target

CLEAN = [5, 17, 99, 3, 250, 42, 7]
CORRUPT = [5, 17, 88, 3, 250, 42, 7]  # one token differs: position 2


def _tokens(ids) -> str:
    return "TOKENS (" + ", ".join(map(str, ids)) + ")"


def run(path, *texts):
    s = lql.Session()
    out = []
    for text in [f"OPEN '{path}';", *texts]:
        out.extend(s.run(text))
    return out[1:]


def sweep_text(site: str, extra: str = "", target: int = 3) -> str:
    return f"PATCH SWEEP {_tokens(CORRUPT)} FROM {_tokens(CLEAN)} FOR {target} SITE {site} {extra};"


@pytest.mark.parametrize("family,site", [("llama", "RESIDUAL"), ("llama", "MIXER"), ("granitemoehybrid", "FFN"),
                                         ("mamba2", "RESIDUAL POST")])
def test_sweep_cells_are_the_executors_patched_runs(containers, family, site):
    path = containers(family)
    (o,) = run(path, sweep_text(site))
    assert o.error is None, o.error
    r = o.result
    ex = vindex3.open(path).executor()
    key_site = site.lower().replace(" ", "_")
    plan = ex.plan
    want_layers = [lo.index for lo in plan.layers if key_site not in ("mixer", "ffn")
                   or any(op.role == key_site for op in lo.slot_ops())]
    assert r.layers == want_layers
    assert len(r.cells) == len(want_layers) * len(CORRUPT) and r.passes == 2 + len(r.cells)
    clean = ex.run_with_cache(CLEAN, sites=[site_key(i, key_site) for i in want_layers])
    corrupt = float(ex.forward(CORRUPT)[-1, 3])
    assert r.clean_logit == float(clean["logits"][-1, 3]) and r.corrupted_logit == corrupt
    for c in r.cells[:: max(1, len(r.cells) // 6)]:
        vals = clean[site_key(c.layer, key_site)][c.position:c.position + 1]
        got = float(ex.forward(CORRUPT, interventions=[Patch(key_site, c.layer, (c.position,), vals)])[-1, 3])
        assert c.logit == got  # the same run, the same bytes
        if c.position < 2:  # before the first differing token the clean values are the corrupted ones
            assert c.recovered == 0.0
    if key_site == "residual":  # the one differing position patched at layer 0: the whole residual is clean
        first = next(c for c in r.cells if c.layer == 0 and c.position == 2)
        assert first.recovered == 1.0
    text = r.to_text(timing=False)
    assert text.startswith(f"patch sweep of {site} for ")
    assert "recovered = (patched - corrupted) / (clean - corrupted)" in text


def test_a_hybrid_sweep_recovers_fully_at_the_differing_position(containers):
    (o,) = run(containers("granitemoehybrid"), sweep_text("RESIDUAL", "LAYERS 0-1"))
    assert o.error is None, o.error
    cells = {(c.layer, c.position): c.recovered for c in o.result.cells}
    assert cells[(0, 2)] == 1.0 and cells[(0, 0)] == 0.0 and set(o.result.layers) == {0, 1}


def test_sweep_refusals_name_the_layer_and_its_operator(containers):
    mamba = containers("mamba2")
    (o,) = run(mamba, sweep_text("FFN"))
    assert "no layer that the full model executes has a FFN site (its layers are mamba2 layers)" in str(o.error)
    (o,) = run(mamba, sweep_text("HEADS", "LAYERS 1-1"))
    assert "layer 1 is a mamba2 layer, which has no attention heads" in str(o.error)
    hybrid = vindex3.open(containers("granitemoehybrid"))
    ops = [lo.operator for lo in hybrid.op_plan().layers]
    (o,) = run(containers("granitemoehybrid"), sweep_text("HEADS", f"LAYERS {ops.index('softmax')}-{ops.index('softmax')}"))
    assert "a sweep cell is one layer and position, and a HEADS patch names heads too" in str(o.error)
    (o,) = run(containers("llama"), f"PATCH SWEEP {_tokens(CORRUPT[:-1])} FROM {_tokens(CLEAN)} FOR 3 SITE RESIDUAL;")
    assert "the corrupted prompt is 6 tokens and the clean one 7" in str(o.error)
    (o,) = run(containers("llama"), sweep_text("RESIDUAL", "LAYERS 2-3 DRAFT DEPTH 2"))
    assert "layer 2 is not run by the" in str(o.error)


def test_capture_writes_the_cached_values_and_a_provenance_sidecar(containers, tmp_path):
    path = containers("granitemoehybrid")
    into = tmp_path / "acts.npz"
    (o,) = run(path, f"CAPTURE {_tokens(CLEAN)} SITES RESIDUAL, MIXER, FFN LAYERS 0-1 INTO '{into}';")
    assert o.error is None, o.error
    ex = vindex3.open(path).executor()
    keys = [site_key(i, s) for i in (0, 1) for s in ("residual", "mixer", "ffn")]
    want = ex.run_with_cache(CLEAN, sites=keys)
    with np.load(into) as z:
        assert sorted(z.files) == sorted([*keys, "token_ids"])
        for k in keys:
            assert np.array_equal(z[k], want[k]), k
        assert z["token_ids"].tolist() == CLEAN
    meta = json.loads((tmp_path / "acts.meta.json").read_text())
    import hashlib

    assert meta["format"] == "vindex3-capture" and meta["data_sha256"] == hashlib.sha256(into.read_bytes()).hexdigest()
    assert meta["container_digest"] == str(vindex3.open(path).digest) and meta["token_ids"] == CLEAN
    assert meta["sites"] == sorted(keys) and meta["interventions"] == []
    assert o.result.to_text(timing=False).startswith(f"captured 6 site(s) over 7 positions (full model) into {into}")
    (again,) = run(path, f"CAPTURE {_tokens(CLEAN)} SITES RESIDUAL INTO '{into}';")
    assert "already exists" in str(again.error)
    (ok,) = run(path, f"CAPTURE {_tokens(CLEAN)} SITES RESIDUAL INTO '{into}' OVERWRITE;")
    assert ok.error is None


def test_capture_refuses_a_site_a_layer_lacks(containers, tmp_path):
    (o,) = run(containers("mamba2"), f"CAPTURE {_tokens(CLEAN)} SITES FFN LAYERS 1-1 INTO '{tmp_path / 'a.npz'}';")
    assert "layer 1 is a mamba2 layer with no FFN (layers with one: none)" in str(o.error)
    assert not (tmp_path / "a.npz").exists()
    (o,) = run(containers("llama"), f"CAPTURE {_tokens(CLEAN)} SITES MIXER, MIXER INTO '{tmp_path / 'b.npz'}';")
    assert "names a site twice" in str(o.error)


def test_the_statements_are_registered_and_writing_is_declared():
    from lql.statements.interventions import Capture, PatchSweep

    assert Capture.paths == ("into", "steer_vector") and isinstance(Capture.read_only, str)
    assert PatchSweep.paths == ("plot",) and isinstance(PatchSweep.read_only, str)
    corrupted, clean = lql.ast.TokenPrompt(ids=[1]), lql.ast.TokenPrompt(ids=[2])
    sweep = PatchSweep(corrupted=corrupted, clean=clean, token=3, site="residual")
    assert sweep.refused_read_only() is None  # without PLOT INTO it only reads
    assert "PLOT INTO writes a file" in sweep.model_copy(update={"plot": "g.png"}).refused_read_only()
    s = lql.Session()
    (o,) = list(s.run("HELP PATCH SWEEP;"))
    assert "PATCH SWEEP 'corrupted' FROM 'clean'" in o.result.to_text(timing=False)


@pytest.mark.parametrize("family", ["llama", "mistral", "granitemoehybrid"])
def test_show_attention_rows_are_the_layers_weights(containers, family):
    from vindex3.internals.attention import attention

    path = containers(family)
    ex = vindex3.open(path).executor()
    layer = next(lo.index for lo in ex.plan.layers if lo.operator == "softmax")
    (o,) = run(path, f"SHOW ATTENTION {_tokens(CLEAN)} AT LAYER {layer};")
    assert o.error is None, o.error
    w, _ = attention(ex, CLEAN, layer)
    rows = o.result.rows
    assert len(rows) == w.shape[0] * len(CLEAN) * (len(CLEAN) + 1) // 2  # causal: keys up to the query
    assert all(r.weight == float(w[r.head, r.query, r.key]) for r in rows)
    (one,) = run(path, f"SHOW ATTENTION {_tokens(CLEAN)} AT LAYER {layer} HEAD 1;")
    assert {r.head for r in one.result.rows} == {1}
    assert one.result.to_text(timing=False).startswith(f"attention at layer {layer} (head 1), 7 positions")


def test_show_attention_refuses_layers_without_heads(containers):
    (o,) = run(containers("mamba2"), f"SHOW ATTENTION {_tokens(CLEAN)} AT LAYER 1;")
    assert "layer 1 is a mamba2 layer, which has no attention heads" in str(o.error)
    (o,) = run(containers("llama"), f"SHOW ATTENTION {_tokens(CLEAN)} AT LAYER 1 HEAD 9;")
    assert "layer 1 has 4 heads (0..3); no head 9" in str(o.error)


# ---- INFER / TRACE ... PATCH / STEER ------------------------------------------------------------

def test_infer_with_patch_is_the_executors_patched_run(containers, tmp_path):
    path = containers("llama")
    (o,) = run(path, f"INFER {_tokens(CORRUPT)} PATCH RESIDUAL AT LAYER 1 POSITION 2 FROM {_tokens(CLEAN)} TOP 3;")
    assert o.error is None, o.error
    r = o.result
    ex = vindex3.open(path).executor()
    key = site_key(1, "residual")
    vals = ex.run_with_cache(CLEAN, sites=[key])[key][2:3]
    want = ex.forward(CORRUPT, interventions=[Patch("residual", 1, (2,), vals)])[-1]
    assert np.array_equal(r.logits, want)  # the same run, the same bytes
    assert not np.array_equal(r.logits, ex.forward(CORRUPT)[-1])
    (rec,) = r.interventions
    assert rec["kind"] == "patch" and rec["layer"] == 1 and rec["positions"] == [2]
    text = r.to_text(timing=False)
    assert "intervened  PATCH RESIDUAL AT LAYER 1 POSITION 2 FROM 'TOKENS (5, 17, 99, 3, 250, 42, 7)'" in text
    rows = r.records()
    assert all(row["interventions"].startswith("PATCH RESIDUAL AT LAYER 1") for row in rows)
    (clean,) = run(path, f"INFER {_tokens(CORRUPT)} TOP 3;")
    assert clean.result.interventions is None and "interventions" not in clean.result.records()[0]


@pytest.mark.parametrize("clause", ["PATCH HEADS 0, 2 AT LAYER 2 POSITIONS ALL FROM {clean}",
                                    "PATCH MIXER AT LAYER 0 POSITIONS 2, 5 FROM {clean}",
                                    "STEER AT LAYER 1 WITH {clean} MINUS TOKENS (4, 5, 6) SCALE 2.5"])
def test_infer_generate_and_trace_run_under_the_clause(containers, clause):
    path = containers("llama")
    cl = clause.format(clean=_tokens(CLEAN))
    plain, under, trace = run(path, f"INFER {_tokens(CORRUPT)} GENERATE 6 EXACTLY;",
                              f"INFER {_tokens(CORRUPT)} GENERATE 6 EXACTLY {cl};", f"TRACE {_tokens(CORRUPT)} {cl};")
    for o in (plain, under, trace):
        assert o.error is None, o.error
    (rec,) = under.result.interventions
    assert rec["text"].split(" AT LAYER")[0] == cl.split(" AT LAYER")[0]
    assert trace.result.interventions == under.result.interventions
    assert trace.result.to_text(timing=False).splitlines()[1] == f"with {rec['text']}"
    # the trace steps one position at a time under the same intervention: its last next token is
    # the first one the patched INFER generates
    assert [r.next_id for r in trace.result.rows][-1] == under.result.generated_ids[0]


def test_patch_and_steer_refusals_name_the_thing(containers, tmp_path):
    path = containers("granitemoehybrid")
    ops = [lo.operator for lo in vindex3.open(path).op_plan().layers]
    m = ops.index("mamba2")
    short = _tokens(CLEAN[:4])
    outs = run(path,
               f"INFER {_tokens(CORRUPT)} PATCH HEADS 0 AT LAYER {m} POSITION 1 FROM {_tokens(CLEAN)};",
               f"INFER {_tokens(CORRUPT)} PATCH RESIDUAL AT LAYER 0 POSITIONS ALL FROM {short};",
               f"INFER {_tokens(CORRUPT)} PATCH RESIDUAL AT LAYER 0 POSITION 5 FROM {short};",
               f"INFER {_tokens(CORRUPT)} PATCH HEADS 7 AT LAYER 0 POSITION 1 FROM {_tokens(CLEAN)};",
               f"INFER {_tokens(CORRUPT)} PATCH RESIDUAL AT LAYER 3 POSITION 1 FROM {_tokens(CLEAN)} DRAFT DEPTH 2;",
               f"INFER {_tokens(CORRUPT)} STEER AT LAYER 1 WITH VECTOR '{tmp_path / 'nope.npy'}' SCALE 2;",
               f"INFER {_tokens(CORRUPT)} SPECULATE DEPTH 1 GENERATE 4 STEER AT LAYER 1 WITH {short} MINUS {short} SCALE 1;")
    errors = [o.error for o in outs]
    assert all(e is not None for e in errors), errors
    assert f"layer {m} is a mamba2 layer, which has no attention heads" in str(errors[0])
    assert "the prompt is 7 tokens and the source 4" in str(errors[1])
    assert "position 5 is past the source prompt (4 tokens" in str(errors[2])
    assert "layer 0 has 3 heads (0..2); no head 7" in str(errors[3])
    assert "layer 3 is not run by the draft depth 2" in str(errors[4])
    assert "nope.npy" in str(errors[5])
    assert "PATCH and STEER change one run" in str(errors[6])


def test_steer_with_a_vector_file_is_the_executors_steered_run(containers, tmp_path):
    from vindex3.exec.intervention import Steer

    path = containers("llama")
    hidden = vindex3.open(path).op_plan().hidden_size
    vec = np.linspace(-1, 1, hidden, dtype=np.float32)
    f = tmp_path / "v.npy"
    np.save(f, vec)
    (o,) = run(path, f"INFER {_tokens(CORRUPT)} STEER AT LAYER 2 WITH VECTOR '{f}' SCALE -3 TOP 2;")
    assert o.error is None, o.error
    ex = vindex3.open(path).executor()
    assert np.array_equal(o.result.logits, ex.forward(CORRUPT, interventions=[Steer(2, vec, -3.0)])[-1])
    assert o.result.interventions[0]["text"] == f"STEER AT LAYER 2 WITH VECTOR '{f}' SCALE -3"
    np.save(f, vec.astype(np.float64))
    (bad,) = run(path, f"INFER {_tokens(CORRUPT)} STEER AT LAYER 2 WITH VECTOR '{f}' SCALE 1;")
    assert "a steering vector is float32 [hidden]" in str(bad.error)


def test_sweep_plot_into_draws_the_grid(containers, tmp_path):
    path = containers("llama")
    svg = tmp_path / "grid.svg"
    (o,) = run(path, sweep_text("RESIDUAL", f"LAYERS 0-1 PLOT INTO '{svg}'"))
    assert o.error is None, o.error
    body = svg.read_text()
    assert body.lstrip().startswith("<?xml") and "<svg" in body and "patch sweep of RESIDUAL" in body
    assert o.result.plot_path == str(svg) and f"plot             {svg}" in o.result.to_text(timing=False)
    (again,) = run(path, sweep_text("RESIDUAL", f"LAYERS 0-1 PLOT INTO '{svg}'"))
    assert "exists" in str(again.error)  # never replaced without OVERWRITE
    (ok,) = run(path, sweep_text("RESIDUAL", f"LAYERS 0-1 PLOT INTO '{svg}' OVERWRITE"))
    assert ok.error is None, ok.error
    (bad,) = run(path, sweep_text("RESIDUAL", f"PLOT INTO '{tmp_path / 'grid.txt'}'"))
    assert "PATCH SWEEP ... PLOT INTO writes .png or .svg, not 'grid.txt'" in str(bad.error)
    assert o.result.layer_runs == 7 * (4 + 3)  # each cell runs from its layer on: 4 layers from 0, 3 from 1


def test_dump_logits_and_capture_under_a_patch_name_it_in_their_sidecars(containers, tmp_path):
    path = containers("llama")
    cl = f"PATCH FFN AT LAYER 1 POSITIONS 2, 4 FROM {_tokens(CLEAN)}"
    dump, plain, cap = (tmp_path / "p.f32", tmp_path / "c.f32", tmp_path / "a.npz")
    outs = run(path, f"DUMP LOGITS {_tokens(CORRUPT)} {cl} INTO '{dump}';", f"DUMP LOGITS {_tokens(CORRUPT)} INTO '{plain}';",
               f"CAPTURE {_tokens(CORRUPT)} SITES FFN LAYERS 1-1 {cl} INTO '{cap}';")
    for o in outs:
        assert o.error is None, o.error
    ex = vindex3.open(path).executor()
    key = site_key(1, "ffn")
    vals = ex.run_with_cache(CLEAN, sites=[key])[key][[2, 4]]
    patch = Patch("ffn", 1, (2, 4), vals, source="TOKENS (5, 17, 99, 3, 250, 42, 7)")
    meta = json.loads((tmp_path / "p.meta.json").read_text())
    assert meta["interventions"] == [patch.record()]
    assert "interventions" not in json.loads((tmp_path / "c.meta.json").read_text())  # a clean dump is as before
    got = np.fromfile(dump, dtype=np.float32).reshape(len(CORRUPT), -1)
    want = ex.forward(CORRUPT, interventions=[patch])
    # 2e-5: the dump decodes token by token, the forward is one prefill; our own prefill-vs-decode
    # spread on this fixture, measured 1.5e-6
    assert np.max(np.abs(got - want)) <= 2e-5
    assert not np.allclose(got, np.fromfile(plain, dtype=np.float32).reshape(len(CORRUPT), -1), atol=1e-3)
    side = json.loads(cap.with_suffix(".meta.json").read_text())
    assert side["interventions"] == [patch.record()]
    with np.load(cap) as z:
        assert np.array_equal(z[key][[2, 4]], vals)  # the patched values are what the run wrote


def test_explain_infer_shows_the_intervention_it_would_run(containers):
    path = containers("llama")
    (o,) = run(path, f"EXPLAIN INFER {_tokens(CORRUPT)} STEER AT LAYER 2 WITH {_tokens(CLEAN)} MINUS TOKENS (4, 5) "
                     f"SCALE 0.5 PATCH HEADS 1 AT LAYER 3 POSITION 6 FROM {_tokens(CLEAN)} GENERATE 3;")
    assert o.error is None, o.error
    assert o.result.operation == (
        "INFER: prefill 7 tokens, then 3 greedy tokens, stopping at end-of-sequence (2), with PATCH HEADS 1 AT LAYER 3 "
        "POSITION 6 FROM TOKENS (5, 17, 99, 3, 250, 42, 7); STEER AT LAYER 2 WITH TOKENS (5, 17, 99, 3, 250, 42, 7) "
        "MINUS TOKENS (4, 5) SCALE 0.5")


def test_a_server_confines_the_steering_vector_file(containers, tmp_path):
    from server_fixtures import config

    from lql.parser import parse_one
    from lql.server.policy import check_statement  # the policy a server applies

    data = tmp_path / "data"
    data.mkdir()
    cfg = config(containers("llama"), data_dir=data)
    for kw in ("INFER 'x'", "TRACE 'x'", "CAPTURE 'x' SITES RESIDUAL", "DUMP LOGITS 'x'"):
        tail = " INTO 'o.npz'" if kw.startswith(("CAPTURE", "DUMP")) else ""
        stmt = parse_one(f"{kw} STEER AT LAYER 1 WITH VECTOR '../v.npy' SCALE 1{tail};")
        with pytest.raises(Exception, match="'..'") as e:
            check_statement(stmt, cfg)
        assert type(e.value).__name__ == "PathRefusal", kw
        ok = check_statement(parse_one(f"{kw} STEER AT LAYER 1 WITH VECTOR 'v.npy' SCALE 1{tail};"), cfg)
        assert ok.steer_vector == str(data / "v.npy")
