"""The executor's two internals hooks: an observer that sees every slot's write and the residual
after it without changing a byte, and an ablation that zeroes named FFN features, checked
against transformers forward hooks and a numpy FFN written here from the checkpoint's tensors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from conftest import ALL_FAMILIES
from fixtures import MOE_FAMILIES, load_reference
from internals_oracle import checkpoint_tensors, hf_run

import vindex3
from vindex3 import Draft, Full
from vindex3.errors import QueryRefused, UnsupportedOperator
from vindex3.exec.engine import Executor, Observer
from vindex3.exec.intervention import FeatureAblation
from vindex3.internals.capture import capture

IDS = [5, 17, 99, 3, 250, 42, 7, 7, 123, 31, 64]
DENSE = [f for f in ALL_FAMILIES if f != "mamba2" and f not in MOE_FAMILIES]  # every FFN the dense gated one


class Log(Observer):
    def __init__(self):
        self.events = []

    def begin(self, p0, h):
        self.events.append(("begin", None, None, p0, h))

    def slot_input(self, layer, site, p0, x):
        self.events.append(("input", layer, site, p0, x))

    def write(self, layer, site, p0, write, residual):
        self.events.append(("write", layer, site, p0, (write, residual)))


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_observing_changes_no_byte(containers, family):
    c = vindex3.open(containers(family))
    ex = c.executor()
    plain = ex.start()
    a = np.concatenate([plain.prefill(IDS[:7]), plain.step(IDS[7])[None]])
    log = Log()
    seen = ex.start(observer=log)
    b = np.concatenate([seen.prefill(IDS[:7]), seen.step(IDS[7])[None]])
    assert np.array_equal(a, b)
    assert np.array_equal(plain.last_hidden, seen.last_hidden)
    assert sum(1 for e in log.events if e[0] == "begin") == 2  # one per pass


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_writes_are_exactly_what_the_residual_adds(containers, family):
    """Replaying begin + each write in float32 reproduces every recorded residual bit for bit,
    and the last one is the stream's final hidden state."""
    c = vindex3.open(containers(family))
    log = Log()
    st = c.executor().start(observer=log)
    st.prefill(IDS)
    h = None
    for kind, layer, site, p0, arr in log.events:
        if kind == "begin":
            h = arr
        elif kind == "write":
            w, r = arr
            assert w.dtype == np.float32 and r.dtype == np.float32
            h = h + w
            assert np.array_equal(h, r), (layer, site)
    assert np.array_equal(h, st.last_hidden)
    sites = [(e[1], e[2]) for e in log.events if e[0] == "write"]
    plan = c.op_plan()
    assert sites == [(lo.index, op.role) for lo in plan.layers for op in lo.slot_ops()]
    if family == "mamba2":
        assert all(s == "mixer" for _, s in sites)  # mixer-only layers: no FFN write is invented


@pytest.mark.parametrize("family", ["llama", "granite", "mamba2", "granitemoehybrid"])
def test_writes_match_the_reference(containers, checkpoint_dirs, family):
    """Each write against the reference module's output times the residual multiplier, and each
    residual against the reference decoder layer's output."""
    c = vindex3.open(containers(family))
    ref = load_reference(checkpoint_dirs(family))
    _, rec = hf_run(ref, IDS)
    m = float(getattr(ref.config, "residual_multiplier", 1.0) or 1.0)
    run = capture(c.executor(), IDS, inputs=True)
    # 1e-4 of the largest value: 100x the reference's own fp32-vs-fp64 spread of these writes, residuals
    # and FFN inputs, 1.0e-6 of it (mamba2; a float64 copy with its float32 casts float64 too); ours 1.3e-6
    for w in run.writes:
        want = rec[w.site][w.layer] * np.float32(m)
        assert np.max(np.abs(w.write - want)) <= 1e-4 * max(1.0, np.abs(want).max()), (w.layer, w.site)
        if w.site == "ffn" or family == "mamba2":
            got = rec["layer"][w.layer]
            assert np.max(np.abs(w.residual - got)) <= 1e-4 * max(1.0, np.abs(got).max())
        if w.site == "ffn":
            x = run.inputs[(w.layer, "ffn")]
            assert np.max(np.abs(x - rec["ffn_in"][w.layer])) <= 1e-4 * max(1.0, np.abs(x).max())


def test_a_draft_is_observed_only_where_it_runs(containers):
    c = vindex3.open(containers("granitemoehybrid"))
    log = Log()
    c.executor(Draft(2)).start(observer=log).prefill(IDS)
    assert sorted({e[1] for e in log.events if e[0] == "write"}) == [0, 1]


# ---- ablation --------------------------------------------------------------------------------

def _pick(c, seed=0, per_layer=24):
    rng = np.random.default_rng(seed)
    plan = c.op_plan()
    pairs = []
    for lo in plan.layers:
        ffn = [op for op in lo.slot_ops() if op.role == "ffn"]
        if ffn and lo.index % 2 == 1:
            n = ffn[0].params.intermediate_size
            pairs += [(lo.index, int(f)) for f in rng.choice(n, per_layer, replace=False)]
    return pairs


@pytest.mark.parametrize("family", DENSE)
def test_ablation_equals_the_reference_with_those_features_zeroed(containers, checkpoint_dirs, family):
    c = vindex3.open(containers(family))
    pairs = _pick(c)
    ab = FeatureAblation.of(pairs)
    ours = c.executor(intervention=ab).forward(IDS)
    ref = load_reference(checkpoint_dirs(family))
    by = {}
    for layer, f in pairs:
        by.setdefault(layer, []).append(f)
    want, _ = hf_run(ref, IDS, ablate=by)
    clean, _ = hf_run(ref, IDS)
    err = np.max(np.abs(ours - want))
    assert err <= 1e-4  # 36x the ablated reference's own fp32-vs-fp64 spread, 2.8e-6 (granitemoehybrid); ours 3.3e-6
    assert np.max(np.abs(want - clean)) > 100 * max(err, 1e-7)  # the ablation changed far more than the tolerance


def test_ablating_a_routed_expert_layer_is_refused_by_name(containers):
    """moe_ffn does not opt into features (a feature of which expert?): naming its layer is a
    named refusal before anything runs, never a silent no-op."""
    c = vindex3.open(containers("qwen3_moe"))
    routed = [lo.index for lo in c.op_plan().layers if any(op.kind == "moe_ffn" for op in lo.slot_ops())]
    with pytest.raises(vindex3.errors.VindexError, match=rf"layer {routed[0]}.*moe_ffn"):
        c.executor(intervention=FeatureAblation.of([(routed[0], 0)]))


def test_ablation_equals_a_numpy_ffn_with_those_features_zeroed(containers, checkpoint_dirs):
    """One layer, from the checkpoint's tensors: down @ (silu(gate x) * (up x)) with the named
    activations set to zero, on the FFN input the ablated run actually saw."""
    c = vindex3.open(containers("llama"))
    w = checkpoint_tensors(checkpoint_dirs("llama"))
    feats = [3, 40, 41, 95]
    ab = FeatureAblation.of([(2, f) for f in feats])
    run = capture(c.executor(intervention=ab), IDS, inputs=True)
    x = run.inputs[(2, "ffn")].astype(np.float64)
    p = "model.layers.2.mlp."
    g = x @ w[p + "gate_proj.weight"].T
    a = g / (1 + np.exp(-g)) * (x @ w[p + "up_proj.weight"].T)
    a[:, feats] = 0
    want = a @ w[p + "down_proj.weight"].T
    got = next(s.write for s in run.writes if s.layer == 2 and s.site == "ffn")
    # the same FFN in float32 numpy is 5.8e-9 of the largest value from this float64 one (ours too)
    assert np.max(np.abs(got - want)) <= 1e-5 * max(1.0, np.abs(want).max())
    clean = capture(c.executor(), IDS, inputs=True)
    # layers before the ablated one run the same bytes
    assert np.array_equal(clean.after(1), run.after(1))
    assert not np.array_equal(clean.after(2), run.after(2))


def test_ablation_refuses_by_name(containers):
    llama = vindex3.open(containers("llama"))
    n = llama.op_plan().layers[0].slot_ops()[1].params.intermediate_size
    with pytest.raises(QueryRefused, match=f"layer 0 has {n} features"):
        llama.executor(intervention=FeatureAblation.of([(0, n)]))
    with pytest.raises(QueryRefused, match="layer 9, but the model has 4 layers"):
        llama.executor(intervention=FeatureAblation.of([(9, 0)]))
    with pytest.raises(QueryRefused, match="layer 3, which draft depth 2 does not execute"):
        llama.executor(Draft(2), intervention=FeatureAblation.of([(3, 0)]))
    mamba = vindex3.open(containers("mamba2"))
    with pytest.raises(QueryRefused, match="layer 1, a mamba2 layer with no FFN.*layers with an FFN: none"):
        mamba.executor(intervention=FeatureAblation.of([(1, 0)]))
    for bad in ("3-17", "3:x", "", "(1:2,)"):
        with pytest.raises(QueryRefused, match="ABLATE FEATURES"):
            FeatureAblation.parse(bad)
    ab = FeatureAblation.parse("(3:17, 1:2, 3:17)")
    assert ab.features == ((1, 2), (3, 17)) and ab.describe() == "ABLATE FEATURES (1:2, 3:17)"


def test_an_ffn_operator_that_does_not_opt_in_is_refused_by_name(containers):
    """The intervention is something an FFN operator opts into (FeatureFfn): one that has not —
    here the dense FFN's own numerics behind a plain Operator — is refused, never approximated."""
    from vindex3 import operators

    c = vindex3.open(containers("llama"))
    dense = operators.get("gated_ffn")

    class Plain(operators.Operator):
        name, slot, selects = "plain_ffn", operators.FFN, "plain"

        def roles(self, p):
            return dense.roles(p)

        def bind(self, p, operands):
            return dense.bind(p, operands)

    plan = copy.deepcopy(c.op_plan())
    for lo in plan.layers:
        for op in lo.slot_ops():
            if op.role == "ffn":
                op.operator, op.kind = Plain(), "plain_ffn"
    ex = Executor(plan, c.tensor_source(), Full())
    assert np.array_equal(ex.forward(IDS), c.executor().forward(IDS))
    with pytest.raises(UnsupportedOperator, match="layer 1's FFN operator 'plain_ffn' does not support ablating"):
        Executor(plan, c.tensor_source(), Full(), FeatureAblation.of([(1, 0)]))
