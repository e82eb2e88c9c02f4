"""GPT-2 (``gpt2``) and GPT-NeoX / Pythia (``gpt_neox``) against transformers 5.24.0
(``GPT2LMHeadModel``, ``GPTNeoXForCausalLM``; fp32, eager): admission with every key graded,
parity over 120 positions (prefill and token by token), drafts, speculation, STATS / EXPLAIN,
refusals.

Fixtures (tests/family_models.py): GPT-2 of width 45 with 5 heads of 9, MLP 70, 3 layers,
vocab 301, 200 learned positions, tied head; GPT-NeoX of width 57 with 3 heads of 19 rotating
4 dims each (partial_rotary_factor 0.25), MLP 70, 3 layers, untied, parallel residual (and a
sequential variant). Tolerance: the reference's own float32-vs-float64 spread on these fixtures
is 4-6e-6 at logits of 12-15 (measured; asserted below half the bar)."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
from family_models import TOL, build, reference, spreads
from fixtures import hf_greedy, our_greedy, token_by_token

import lql
import vindex3
from vindex3.draft import greedy_generate, speculative_generate

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [int(x) for x in np.random.default_rng(0).integers(3, 300, 120)]
COMMON = {"vocab_size": 301, "bos_token_id": 1, "eos_token_id": 2}
MODELS = {
    "gpt2": ("gpt2", dict(COMMON, n_embd=45, n_layer=3, n_head=5, n_positions=200, n_inner=70), {"emb": 0.5}),
    "gpt_neox": ("gpt_neox", dict(COMMON, hidden_size=57, num_hidden_layers=3, num_attention_heads=3, intermediate_size=70,
                                  max_position_embeddings=256,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}),
                 {"head_gain": 3.0}),
    "gpt_neox_sequential": ("gpt_neox", dict(COMMON, hidden_size=57, num_hidden_layers=3, num_attention_heads=3,
                                             intermediate_size=70, max_position_embeddings=256, use_parallel_residual=False,
                                             hidden_act="gelu_new", rotary_pct=0.45, rotary_emb_base=500.0),
                            {"head_gain": 3.0}),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt")
    cache: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def get(name):
        if name not in cache:
            mt, cfg, scale = MODELS[name]
            ck = build(mt, cfg, base / name, **scale)
            cache[name] = (ck, vindex3.encode(ck, base / f"{name}.vindex3"))
        return cache[name]

    yield get
    torch.set_num_threads(threads)


# -- parity -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_parity_prefill_decode_and_greedy(built, name):
    ck, c = built(name)
    ref = reference(ck)
    ex = vindex3.open(c).executor()
    s = spreads(ref, ex, IDS)
    assert 1.0 < s["max_logit"] < 30.0  # logits of order 1-10: a 1e-4 bar means something
    assert s["hf32_vs_hf64"] <= TOL / 2  # the reference's own float32 floor (measured 4-6e-6)
    assert s["dtype"] == (np.float32,) * 3
    # 1e-4: ten times the reference's own float32-vs-float64 spread on these fixtures
    assert s["prefill_vs_hf"] <= TOL and s["decode_vs_hf"] <= TOL and s["decode_vs_hf_decode"] <= TOL
    assert s["ours_vs_hf64"] <= TOL
    assert our_greedy(ex, IDS[:8], 16) == hf_greedy(ref, IDS[:8], 16)


def test_continued_prefill_equals_one_piece(built):
    """Learned positions follow the stream's position: a prompt in three pieces equals one piece
    within float32 rounding (7.6e-6 measured on the GPT-2 fixture, where the reference's own
    decode and prefill differ by 6.7e-6; the bar is a quarter of parity's)."""
    ex = vindex3.open(built("gpt2")[1]).executor()
    st = ex.start()
    parts = np.concatenate([st.prefill(IDS[:5]), st.prefill(IDS[5:70]), st.prefill(IDS[70:])])
    assert np.abs(parts - ex.forward(IDS)).max() <= TOL / 4


# -- drafts and speculation -------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_draft_at_full_depth_is_bit_identical(built, name):
    c = vindex3.open(built(name)[1])
    L = c.graph.num_layers
    full, draft = c.executor(slice=vindex3.Full()), c.executor(slice=vindex3.Draft(L))
    assert np.array_equal(full.forward(IDS), draft.forward(IDS))
    assert np.array_equal(full.last_hidden, draft.last_hidden)
    assert full.trace.executed_layers == draft.trace.executed_layers == list(range(L))
    assert np.array_equal(token_by_token(full, IDS[:30]), token_by_token(draft, IDS[:30]))


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox"])
def test_speculation_equals_greedy(built, name):
    c = vindex3.open(built(name)[1])
    want = greedy_generate(c, IDS[:6], 12).tokens
    for depth, lookahead in [(1, 3), (2, 4)]:
        r = speculative_generate(c, IDS[:6], 12, depth, lookahead)
        assert r.tokens == want and r.rollback == "truncate"


# -- graph and description --------------------------------------------------------------------------

def test_graph_facts(built):
    g = vindex3.open(built("gpt2")[1]).graph
    s = g.surface
    assert s["norms"] == {"kind": "layer", "eps": 1e-5, "weight_offset": 0.0, "placement": "pre_only", "bias": True}
    assert s["embedding"] == {"multiplier": 1.0, "positions": "learned"}
    assert s["ffn"] == {"kind": "mlp", "activation": "gelu_tanh", "intermediate_size": 70, "bias": True}
    assert "position_embedding" in g.objects and g.objects["final_norm"]["operands"] == {"weight": "weight", "bias": "bias"}
    assert all(lp.position == {"kind": "none"} and lp.ffn == "mlp" for lp in g.layers)
    n = vindex3.open(built("gpt_neox")[1]).graph
    assert n.surface["norms"]["placement"] == "parallel"
    assert n.layers[0].position == {"kind": "rope", "theta": 10000.0, "rotary_dims": 4, "scaling": None}
    seq = vindex3.open(built("gpt_neox_sequential")[1]).graph
    assert seq.surface["norms"]["placement"] == "pre_only" and seq.layers[0].position["rotary_dims"] == 8
    assert seq.layers[0].position["theta"] == 500.0


def test_stats_and_explain_name_each_layer(built):
    s = lql.Session()
    _, stats, explain = s.execute(f"OPEN '{built('gpt_neox')[1]}'; STATS AT 100 POSITIONS; EXPLAIN;")
    text = stats.to_text(timing=False)
    kv = 2 * 57 * 4  # a K and a V row of 3 heads x 19 floats per position and layer
    assert re.search(rf"kv +{3 * kv:,} bytes .*per position over 3 layer\(s\)", text)
    ex = explain.to_text(timing=False)
    for i in range(3):
        assert f"layer {i}: softmax (full); state Kv{{kv_dim=57}}, {kv} bytes/position" in ex
    assert len(re.findall(r"^mlp_ffn +ffn +ffn_up", ex, re.MULTILINE)) == 3
    assert len(re.findall(r"^parallel_fork +ffn_norm +weight .* norm=layer", ex, re.MULTILINE)) == 3
    assert len(re.findall(r"^layer_norm +(attn_norm|final_norm) +weight", ex, re.MULTILINE)) == 4
    _, explain2 = s.execute(f"OPEN '{built('gpt2')[1]}'; EXPLAIN;")
    ex2 = explain2.to_text(timing=False)
    assert re.search(r"^embed +embedding +weight .* positions=learned", ex2, re.MULTILINE)
    assert re.search(r"^ +positions +position_embedding/weight +f32 +\[200, 45\]", ex2, re.MULTILINE)


# -- admission --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", MODELS)
def test_every_key_is_graded(built, name):
    ck = built(name)[0]
    plan = vindex3.admit(ck)
    assert plan.admissible
    cfg = json.loads((ck / "config.json").read_text())
    assert set(cfg) <= {f.key for f in plan.findings}
    assert not [f for f in plan.findings if f.category == "unknown"]


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is ...:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("name, changes, key, needle", [
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx", "score scale per layer"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention", "cross-attention"),
    ("gpt2", {"activation_function": "relu6"}, "activation_function", "not supported"),
    ("gpt2", {"n_positions": ...}, "n_positions", "required key is absent"),
    ("gpt2", {"mystery": 1}, "mystery", "not understood"),
    ("gpt_neox", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.3}},
     "rope_parameters", "rotate-half needs an even count"),
    ("gpt_neox", {"layer_norm_eps": ...}, "layer_norm_eps", "required key is absent"),
])
def test_refusals_name_the_key(built, tmp_path, name, changes, key, needle):
    ck = _copy_with_config(built(name)[0], tmp_path / "ck", **changes)
    plan = vindex3.admit(ck)
    assert not plan.admissible
    blocking = {f.key: f.message for f in plan.blocking()}
    assert key in blocking and needle in blocking[key]


def test_neox_legacy_rope_keys_are_read_as_5_24_reads_them(built, tmp_path):
    """rope_parameters wins over rotary_pct / rotary_emb_base (the reference fills a legacy key in
    only where rope_parameters lacks it); with neither, the factor is the reference's 0.25."""
    ck = _copy_with_config(built("gpt_neox")[0], tmp_path / "a", rotary_pct=0.5, rotary_emb_base=77.0)
    plan = vindex3.admit(ck)
    grades = {f.key: f.category for f in plan.findings}
    assert plan.admissible and grades["rotary_pct"] == "ignored" and grades["rotary_emb_base"] == "ignored"
    ck = _copy_with_config(built("gpt_neox")[0], tmp_path / "b", rope_parameters=...)
    plan = vindex3.admit(ck)
    found = {f.key: f for f in plan.findings}
    assert plan.admissible and found["rotary_pct"].category == "reference_default" and found["rotary_pct"].value == 0.25


def test_mask_buffers_of_old_checkpoints_are_dropped_by_name(built, tmp_path):
    from safetensors.numpy import load_file, save_file

    ck = _copy_with_config(built("gpt2")[0], tmp_path / "ck")
    t = load_file(ck / "model.safetensors")
    t["transformer.h.0.attn.bias"] = np.tril(np.ones((1, 1, 200, 200), np.float32))
    save_file(t, ck / "model.safetensors", metadata={"format": "pt"})
    plan = vindex3.admit(ck)
    assert plan.admissible
    assert any(f.key == "transformer.h.0.attn.bias" and "causal-mask buffer" in f.message for f in plan.findings)


def test_positions_past_the_learned_table_are_refused_by_name(built):
    ex = vindex3.open(built("gpt2")[1]).executor(max_positions=400)
    with pytest.raises(vindex3.errors.SliceError, match="learned position embedding"):
        ex.forward([5] * 201)


# -- internals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["gpt_neox", "gpt2"])
def test_observing_changes_no_byte(built, name):
    """The observed pass spells the parallel fork out (the mixer's write joins the residual where
    the FFN's norm reads the layer input); it computes the same bytes as the plain pass."""
    from vindex3.exec.engine import Observer

    class Keep(Observer):
        def __init__(self):
            self.writes = []

        def write(self, layer, site, p0, write, residual):
            self.writes.append((layer, site))

    ex = vindex3.open(built(name)[1]).executor()
    obs = Keep()
    seen = ex.start(observer=obs).prefill(IDS[:20])
    assert np.array_equal(seen, ex.forward(IDS[:20]))
    assert obs.writes == [(i, s) for i in range(3) for s in ("mixer", "ffn")]


def test_mlp_features_walk_and_ablate_and_the_layer_norm_readout_is_refused_by_name(built):
    s = lql.Session()
    s.execute(f"OPEN '{built('gpt_neox')[1]}'")
    (walk,) = s.execute("WALK 'Paris' TOP 2 LAYERS 1")
    assert not walk.skipped and re.search(r"^ +1 +\d+ ", walk.to_text(), re.MULTILINE)  # layer 1's mlp_ffn features
    (plain,) = s.execute("INFER TOKENS (5, 6, 7) GENERATE 4")
    (ablated,) = s.execute("INFER TOKENS (5, 6, 7) GENERATE 4 ABLATE FEATURES (1:3, 2:0)")
    assert len(ablated.generated_ids) == len(plain.generated_ids) == 4
    with pytest.raises(Exception, match="LayerNorm"):
        s.execute("TRACE 'Paris' FOR 5 DECOMPOSE")


def test_released_gpt2_config_spellings(built, tmp_path):
    """The released GPT-2 configs carry n_ctx (the older spelling of n_positions) and
    task_specific_params (generation presets): graded, not refused; an n_ctx that disagrees is."""
    ck = _copy_with_config(built("gpt2")[0], tmp_path / "a", n_ctx=200, task_specific_params={"text-generation": {}})
    plan = vindex3.admit(ck)
    grades = {f.key: f.category for f in plan.findings}
    assert plan.admissible and grades["n_ctx"] == "metadata" and grades["task_specific_params"] == "metadata"
    ck = _copy_with_config(built("gpt2")[0], tmp_path / "b", n_ctx=1024)
    assert not vindex3.admit(ck).admissible
