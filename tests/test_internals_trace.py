"""TRACE ... FOR: the logit lens against the reference's own norm and head on its own layer
outputs, the exact DECOMPOSE sum on every fixture family, the parts against the reference's
sublayer outputs, and SAVE INTO."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from conftest import ALL_FAMILIES
from fixtures import load_reference
from internals_oracle import hf_parts, hf_readout, hf_run

import vindex3
from vindex3 import Draft
from vindex3.errors import OutputRefused, QueryRefused, SliceError
from vindex3.internals import FeatureAblation, Internals
from vindex3.internals.lens import ROUNDING_BOUND

PROMPT = [5, 17, 99, 3, 250, 42, 7, 123]
RESIDUES: dict[str, float] = {}  # |residue| / sum |part| per family, for the report below


def _rank_prob(row, t):
    row = row.astype(np.float64)
    p = np.exp(row - row.max())
    p /= p.sum()
    return int(np.count_nonzero(row > row[t])), float(p[t]), int(np.argmax(row))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_decompose_sums_to_the_final_logit(containers, family):
    c = vindex3.open(containers(family))
    ix = Internals(c)
    logits = c.executor().forward(PROMPT)
    target = int(np.argsort(logits[-1])[-3])  # not the argmax: any token decomposes
    r = ix.trace(PROMPT, target, decompose=True)
    d = r.decomposition
    assert d.final_logit == float(logits[-1, target])
    total = math.fsum(p.logit for p in d.parts)
    scale = math.fsum(abs(p.logit) for p in d.parts)
    # the bound the text prints instead of the residue (lens.ROUNDING_BOUND says why 1e-5)
    assert d.bound == ROUNDING_BOUND * scale
    assert abs(d.final_logit - total) <= d.bound, (d.final_logit, total, d.bound)
    assert abs(d.unexplained) <= d.bound
    RESIDUES[family] = abs(d.unexplained) / scale
    assert math.isclose(math.fsum(p.share for p in d.parts), 1.0, abs_tol=1e-4 * max(1.0, scale / abs(d.final_logit)))
    plan = c.op_plan()
    want = [("embedding", None)] + [(op.role, lo.index) for lo in plan.layers for op in lo.slot_ops()]
    assert [(p.site, p.layer) for p in d.parts] == want
    if family == "mamba2":
        assert len(d.notes) == 3 and all("has no FFN" in n for n in d.notes)


@pytest.mark.parametrize("family", ["llama", "granite", "mamba2", "granitemoehybrid"])
def test_decompose_parts_match_the_reference_sublayers(containers, checkpoint_dirs, family):
    """Each part from the reference's own sublayer outputs: s · mult · W_head[t] · (γ ⊙ write)."""
    ix = Internals(containers(family))
    hf = load_reference(checkpoint_dirs(family))
    layers, _, norm, m, mult = hf_parts(hf)
    logits, rec = hf_run(hf, PROMPT)
    t = int(np.argmax(logits[-1]))
    d = ix.trace(PROMPT, t, decompose=True).decomposition
    h = rec["layer"][len(layers) - 1][-1].astype(np.float64)
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    s = 1.0 / np.sqrt(np.mean(h**2) + eps)
    u = norm.weight.detach().numpy().astype(np.float64) * hf.lm_head.weight.detach().numpy()[t] * mult
    for p in d.parts[1:]:
        w = rec[p.site][p.layer][-1] * m
        assert math.isclose(p.logit, float(s * (u @ w)), rel_tol=1e-4, abs_tol=1e-4), p.name
    assert math.isclose(d.final_logit, float(logits[-1, t]), rel_tol=1e-5, abs_tol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "mamba2", "granitemoehybrid"])
def test_the_lens_reads_each_layer_through_the_models_own_head(containers, checkpoint_dirs, family):
    ix = Internals(containers(family))
    hf = load_reference(checkpoint_dirs(family))
    logits, rec = hf_run(hf, PROMPT)
    t = int(np.argmax(logits[-1]))
    r = ix.trace(PROMPT, t, positions="all")
    n = len(rec["layer"])
    assert [x.layer for x in r.rows] == [None] * len(PROMPT) + [i for i in range(n) for _ in PROMPT]
    for row in r.rows[len(PROMPT):]:
        want = hf_readout(hf, rec["layer"][row.layer])[row.position]
        rank, prob, top = _rank_prob(want, t)
        assert math.isclose(row.prob, prob, rel_tol=1e-3, abs_tol=1e-6)
        assert math.isclose(row.logit, float(want[t]), rel_tol=1e-4, abs_tol=1e-4)
        margin = np.sort(want)[-2:]
        if margin[1] - margin[0] > 1e-3:
            assert row.top_id == top
        if abs(np.sort(np.abs(want - want[t]))[1]) > 1e-3:  # no near-tie with the target
            assert row.rank == rank


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_lens_at_the_last_layer_is_the_models_own_output(containers, family):
    c = vindex3.open(containers(family))
    logits = c.executor().forward(PROMPT)
    t = int(np.argmax(logits[-1]))
    r = Internals(c).trace(PROMPT, t, positions="all")
    last = [x for x in r.rows if x.layer == c.graph.num_layers - 1]
    for row in last:
        rank, prob, top = _rank_prob(logits[row.position], t)
        assert row.top_id == top and row.rank == rank
        assert math.isclose(row.logit, float(logits[row.position, t]), rel_tol=1e-6, abs_tol=1e-5)
        assert math.isclose(row.prob, prob, rel_tol=1e-4)
    assert r.final.logit == float(logits[-1, t]) and r.final.rank == 0 and r.final.top_id == t
    assert last[-1].rank == 0 and last[-1].top_id == t


def test_trace_layers_positions_drafts_and_refusals(containers):
    ix = Internals(containers("llama"))
    r = ix.trace(PROMPT, 17, layers=[1, 2])
    assert [(x.layer, x.position) for x in r.rows] == [(1, 7), (2, 7)]
    d = ix.trace(PROMPT, 17, slice=Draft(2), decompose=True)
    assert d.executed_layers == [0, 1] and [x.layer for x in d.rows] == [None, 0, 1]
    assert [p.layer for p in d.decomposition.parts] == [None, 0, 0, 1, 1]
    dl = vindex3.open(containers("llama")).executor(Draft(2)).forward(PROMPT)
    assert d.decomposition.final_logit == float(dl[-1, 17])
    with pytest.raises(QueryRefused, match="layer 3 is not executed by draft depth 2"):
        ix.trace(PROMPT, 17, slice=Draft(2), layers=[3])
    with pytest.raises(QueryRefused, match="outside the vocabulary"):
        ix.trace(PROMPT, 320)
    with pytest.raises(QueryRefused, match=r"'capital of' is not one token of this vocabulary \(it is 3: 'cap', 'ital', ' of'\)"):
        ix.trace(PROMPT, "capital of")
    with pytest.raises(QueryRefused, match="POSITIONS must be LAST or ALL"):
        ix.trace(PROMPT, 17, positions="first")
    ab = FeatureAblation.of([(0, 1)])
    assert ix.trace(PROMPT, 17, intervention=ab).intervention["text"] == "ABLATE FEATURES (0:1)"
    with pytest.raises(SliceError, match="full model or a draft"):
        ix.trace(PROMPT, 17, slice=vindex3.LayerRange(0, 2))
    with pytest.raises(SliceError, match="draft depth 5 is deeper than the model"):
        ix.trace(PROMPT, 17, slice=5)


def test_save_writes_residuals_and_parts_to_npz(tmp_path, containers):
    path = tmp_path / "c.vindex3"
    shutil.copytree(containers("granitemoehybrid"), path)
    ix = Internals(path)
    out = tmp_path / "trace.npz"
    r = ix.trace(PROMPT, 17, save=out)
    assert r.decomposition is None and r.saved.path == str(out)
    z = np.load(out, allow_pickle=False)
    run = vindex3.open(path).executor()
    from vindex3.internals.capture import capture

    cap = capture(run, PROMPT)
    assert np.array_equal(z["residual"][-1], cap.final) and np.array_equal(z["embedding"], cap.embedding)
    assert z["residual"].shape == (4, len(PROMPT), 45) and z["ffn_write"].shape == (4, len(PROMPT), 45)
    assert z["part_logit"].shape == (9,) and math.isclose(float(z["part_logit"].astype(np.float64).sum()),
                                                          float(z["final_logit"]), rel_tol=1e-5, abs_tol=1e-5)
    prov = json.loads(str(z["provenance"]))
    assert prov["container_digest"] == vindex3.open(path).digest and prov["target_id"] == 17
    with pytest.raises(OutputRefused, match="trace.npz already exists"):
        ix.trace(PROMPT, 17, save=out)
    assert ix.trace(PROMPT, 17, save=out, overwrite=True).saved.bytes == out.stat().st_size
    with pytest.raises(OutputRefused, match="inside the container c.vindex3"):
        ix.trace(PROMPT, 17, save=path / "segments" / "t.npz")
    with pytest.raises(OutputRefused, match="must end in .npz"):
        ix.trace(PROMPT, 17, save=tmp_path / "t.npy")
    m = Internals(containers("mamba2")).trace(PROMPT, 17, save=tmp_path / "m.npz")
    zm = np.load(m.saved.path)
    assert zm["ffn_layers"].tolist() == [] and zm["ffn_write"].shape[0] == 0  # no FFN write is invented


def test_a_residue_past_the_bound_is_printed_not_hidden(containers):
    """The text prints the bound, not the residue; a residue float32 rounding cannot explain (a
    part left out) is printed with its value, so the golden texts would catch it."""
    import lql

    s = lql.Session()
    s.execute(f"OPEN '{containers('llama')}'")
    (r,) = s.execute("TRACE TOKENS (5, 17, 99, 3) FOR 7 DECOMPOSE")
    d = r.decomposition
    ok = r.to_text(timing=False)
    assert abs(d.unexplained) <= d.bound and "equal to the logit up to float32 rounding" in ok
    assert "unexplained" not in ok
    broken = r.model_copy(update={"decomposition": d.model_copy(update={"unexplained": 10 * d.bound + 1e-3})})
    text = broken.to_text(timing=False)
    assert "unexplained, more than float32 rounding's" in text and "equal to the logit" not in text


def test_residues_sit_far_inside_the_bound():
    """The measured residues (test_decompose_sums_to_the_final_logit, run first) are well inside
    ROUNDING_BOUND: at most 1/10 of it, or the bound would sit too close to what CPUs produce."""
    if not RESIDUES:
        pytest.skip("SKIPPED LOUDLY: the decomposition tests did not run first (run the whole file)")
    print("decompose residues / sum |part|:", {k: f"{v:.1e}" for k, v in sorted(RESIDUES.items())})
    assert max(RESIDUES.values()) <= ROUNDING_BOUND / 10, RESIDUES
