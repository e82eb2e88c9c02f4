"""Gemma (``gemma``), Gemma 2 (``gemma2``), Gemma 3 (``gemma3_text``) and the text component of
the Gemma 3 vision-language checkpoint (``gemma3``) against transformers 5.24.0 (fp32, eager):
admission with every key graded, parity over 120 positions (prefill and token by token), drafts,
speculation, STATS / EXPLAIN, refusals.

Fixtures (tests/family_models.py): hidden 45 (44 for Gemma 2, whose config needs heads to divide it), odd vocab 301, GQA (3 over 1, 4 over 2), explicit
head widths (16, 12), zero-centred (1 + w) norms re-randomised, sliding windows the prompt
exceeds (7, 6), softcaps that bind (attention 5, final 8 on Gemma 2), a query_pre_attn_scalar
unlike head_dim, Gemma 3's full layers with their own theta and a linear rope scaling.
Tolerance: the reference's own float32-vs-float64 spread on these fixtures is 3-4e-6 at logits
of 7-15 (measured; asserted under half the bar)."""

from __future__ import annotations

import re

import numpy as np
import pytest
from family_models import (
    blocking,
    build,
    check_draft_bit_identical,
    check_every_key_graded,
    check_parity,
    check_speculation,
    copy_with_config,
)

import lql
import vindex3

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

IDS = [int(x) for x in np.random.default_rng(1).integers(3, 298, 120)]
S, F = "sliding_attention", "full_attention"
COMMON = {"vocab_size": 301, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_size": 45,
          "intermediate_size": 70, "rms_norm_eps": 1e-6, "max_position_embeddings": 256}
G3 = dict(COMMON, num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1, head_dim=16, layer_types=[S, S, F, S],
          sliding_window=6, query_pre_attn_scalar=24,
          rope_parameters={S: {"rope_type": "default", "rope_theta": 10000.0},
                           F: {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0}})
VISION = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 28,
          "patch_size": 14, "num_channels": 3}
SCALE = {"zero_centred": True, "head_gain": 1.0}
# name -> (model_type, config, scale, vision)
MODELS = {
    "gemma": ("gemma", dict(COMMON, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1, head_dim=16,
                            hidden_act="gelu"), dict(SCALE, emb=0.3)),
    "gemma2": ("gemma2", dict(COMMON, hidden_size=44, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                              query_pre_attn_scalar=20, attn_logit_softcapping=5.0, final_logit_softcapping=8.0,
                              sliding_window=7), dict(SCALE, emb=0.3)),
    "gemma3_text": ("gemma3_text", G3, dict(SCALE, emb=0.3)),
    "gemma3": ("gemma3", {"text_config": G3, "vision_config": VISION, "mm_tokens_per_image": 4, "image_token_index": 1000,
                          "boi_token_index": 298, "eoi_token_index": 299}, dict(SCALE, emb=0.3)),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    base = tmp_path_factory.mktemp("gemma")
    cache: dict = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def get(name):
        if name not in cache:
            mt, cfg, scale = MODELS[name]
            ck = build(mt, cfg, base / name, vision="vision_config" in cfg, **scale)
            cache[name] = (ck, vindex3.encode(ck, base / f"{name}.vindex3"))
        return cache[name]

    yield get
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", MODELS)
def test_parity_prefill_decode_and_greedy(built, name):
    # 1e-4: twenty times the reference's own float32-vs-float64 spread (3-4e-6, measured)
    check_parity(*built(name), IDS, vision="vision_config" in MODELS[name][1])


@pytest.mark.parametrize("name", MODELS)
def test_draft_at_full_depth_is_bit_identical(built, name):
    check_draft_bit_identical(built(name)[1], IDS)


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_speculation_equals_greedy(built, name):
    check_speculation(built(name)[1], IDS)


@pytest.mark.parametrize("name", MODELS)
def test_every_key_is_graded(built, name):
    check_every_key_graded(built(name)[0])


def test_graph_facts(built):
    g = vindex3.open(built("gemma2")[1]).graph
    s = g.surface
    assert s["norms"] == {"kind": "rms", "eps": 1e-6, "weight_offset": 1.0, "placement": "pre_post"}
    assert s["embedding"]["multiplier"] == 44 ** 0.5 and s["head"]["softcap"] == 8.0
    assert s["attention"]["logit_softcap"] == 5.0 and s["attention"]["score_scale"] == 20 ** -0.5
    assert [lp.span for lp in g.layers] == ["sliding", "full", "sliding", "full"]
    g3 = vindex3.open(built("gemma3")[1]).graph
    assert [lp.position["theta"] for lp in g3.layers] == [10000.0, 10000.0, 1000000.0, 10000.0]
    assert g3.layers[2].position["scaling"] == {"type": "linear", "factor": 4.0}
    assert g3.surface["attention"]["qk_norm"] == {"kind": "rms", "eps": 1e-6, "weight_offset": 1.0, "scope": "head"}
    assert vindex3.open(built("gemma")[1]).graph.surface["ffn"]["activation"] == "gelu_tanh"  # legacy "gelu", as 5.24


def test_the_vision_tower_is_set_aside_by_name(built):
    plan = vindex3.admit(built("gemma3")[0])
    found = {f.key: f.message for f in plan.findings}
    assert "vision tower (perception)" in found["vision_tower.*"] and "not carried" in found["vision_tower.*"]
    assert "multi_modal_projector.*" in found
    c = vindex3.open(built("gemma3")[1])
    assert [x.role for x in c.graph.components] == ["primary_text"]


def test_gemma3_in_transformers_own_layout_runs_the_same(built, tmp_path):
    """Saved with transformers 5's in-memory names (model.language_model.*, model.vision_tower.*)
    the same weights give the same container tensors, hence the same bytes out."""
    mt, cfg, scale = MODELS["gemma3"]
    ck = build(mt, cfg, tmp_path / "ck", vision=True, runtime_layout=True, **scale)
    names = list(__import__("safetensors.numpy", fromlist=["load_file"]).load_file(ck / "model.safetensors"))
    assert any(n.startswith("model.language_model.") for n in names)
    plan = vindex3.admit(ck)
    assert plan.admissible and "model.vision_tower.*" in {f.key for f in plan.findings}
    c = vindex3.encode(ck, tmp_path / "c.vindex3")
    ours, theirs = vindex3.open(c).executor(), vindex3.open(built("gemma3")[1]).executor()
    assert np.array_equal(ours.forward(IDS[:40]), theirs.forward(IDS[:40]))


def test_stats_and_explain_name_each_layer(built):
    s = lql.Session()
    _, stats, explain = s.execute(f"OPEN '{built('gemma3_text')[1]}'; STATS AT 100 POSITIONS; EXPLAIN;")
    text = stats.to_text(timing=False)
    assert re.search(r"kv +.* over 4 layer\(s\)", text)
    ex = explain.to_text(timing=False)
    for i in (0, 1, 3):
        assert f"layer {i}: softmax (sliding); state Kv{{kv_dim=16, window=6}}" in ex
    assert "layer 2: softmax (full); state Kv{kv_dim=16}, 128 bytes/position" in ex
    assert len(re.findall(r"^rms_norm +post_ffn_norm +weight", ex, re.MULTILINE)) == 4


@pytest.mark.parametrize("name, text, changes, key, needle", [
    ("gemma2", False, {"hidden_act": "silu"}, "hidden_act", "disagrees with hidden_activation"),
    ("gemma2", False, {"query_pre_attn_scalar": ...}, "query_pre_attn_scalar", "required key is absent"),
    ("gemma3_text", False, {"use_bidirectional_attention": True}, "use_bidirectional_attention", "not causal"),
    ("gemma3_text", False, {"layer_types": [S, "chunked_attention", F, S]}, "layer_types", "expected 4 entries"),
    ("gemma3", True, {"final_logit_softcapping": 30.0}, "text_config.final_logit_softcapping", "applies no final-logit"),
    ("gemma3", True, {"mystery": 1}, "text_config.mystery", "not understood"),
    ("gemma", False, {"head_dim": ...}, "head_dim", "required key is absent"),
])
def test_refusals_name_the_key(built, tmp_path, name, text, changes, key, needle):
    got = blocking(copy_with_config(built(name)[0], tmp_path / "ck", text=text, **changes))
    assert key in got and needle in got[key], got


def test_gemma3_legacy_rope_keys_fill_in_as_5_24_does(built, tmp_path):
    """No rope_parameters: rope_theta is the full layers' theta, rope_local_base_freq the sliding
    layers', rope_scaling the full layers' scaling."""
    ck = copy_with_config(built("gemma3_text")[0], tmp_path / "ck", rope_parameters=..., rope_theta=5e5,
                          rope_local_base_freq=2e3, rope_scaling={"rope_type": "linear", "factor": 2.0})
    from vindex3.admit import lower
    from vindex3.sources import open_source

    plan, low = lower(open_source(ck))
    assert plan.admissible
    pos = [lp["position"] for lp in low.graph["layers"]]
    assert [p["theta"] for p in pos] == [2e3, 2e3, 5e5, 2e3]
    assert pos[2]["scaling"] == {"type": "linear", "factor": 2.0} and pos[0]["scaling"] is None


def test_released_config_spellings(built, tmp_path):
    """Gemma 2's released configs repeat the window as sliding_window_size (equal: metadata;
    different: refused); released Gemma 3 VL configs leave text keys to Gemma3TextConfig's
    defaults, which the reference runs (recorded as reference defaults)."""
    ck = copy_with_config(built("gemma2")[0], tmp_path / "a", sliding_window_size=7, cache_implementation="hybrid")
    assert vindex3.admit(ck).admissible
    got = blocking(copy_with_config(built("gemma2")[0], tmp_path / "b", sliding_window_size=8))
    assert "disagrees with sliding_window" in got["sliding_window_size"]
    ck = copy_with_config(built("gemma3")[0], tmp_path / "c", text=True, query_pre_attn_scalar=...)
    from vindex3.admit import lower
    from vindex3.sources import open_source

    plan, low = lower(open_source(ck))
    found = {f.key: f for f in plan.findings}
    assert plan.admissible and found["text_config.query_pre_attn_scalar"].category == "reference_default"
    assert low.graph["surface"]["attention"]["score_scale"] == 256 ** -0.5


def test_feature_values_carry_the_post_norm_weight(built):
    """A sandwich layer's FFN write passes its post-norm before the residual: a feature's value,
    as WALK and its metadata read it, is the (1 + w) post-norm weight times its down column."""
    from safetensors.numpy import load_file

    from vindex3.internals.model import ModelView

    ck, c = built("gemma2")
    t = load_file(ck / "model.safetensors")
    layer = ModelView(vindex3.open(c)).ffn_layer(1)
    w = 1.0 + t["model.layers.1.post_feedforward_layernorm.weight"]
    assert np.allclose(layer.view.values, t["model.layers.1.mlp.down_proj.weight"] * w[:, None], rtol=1e-6, atol=0)
    s = lql.Session()
    s.execute(f"OPEN '{c}'")
    (walk,) = s.execute("WALK 'Paris' TOP 2 LAYERS 1")
    assert not walk.skipped
