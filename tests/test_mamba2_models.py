"""Mamba2, pure and hybrid: admission, graph, parity with transformers 5.24.0
(``Mamba2ForCausalLM``, ``GraniteMoeHybridForCausalLM``), continuation state, drafts and
speculation, refusals.

The fixtures (tests/fixtures.py) are tiny random models with odd widths, n_groups = 3 and a
chunk size the prompt exceeds without dividing, with A_log, dt_bias, D, conv biases and every
norm weight re-randomised."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from fixtures import hf_greedy, hf_logits, load_reference, our_greedy, token_by_token

import lql
import vindex3
from vindex3.continuation import KV, RECURRENT
from vindex3.draft import greedy_generate, speculative_generate
from vindex3.errors import AdmissionError, StateError
from vindex3.operators.mamba2 import Mamba2State
from vindex3.operators.softmax import KvRows

MODELS = ["mamba2", "granitemoehybrid"]
IDS = [5, 17, 99, 3, 250, 42, 7, 7, 123, 310, 64, 1, 200, 11, 180, 33, 90, 2, 301, 77]
# 10x the reference's own largest spread on these fixtures: its prefill vs cached decode, 3.8e-6
# (granitemoehybrid with rope; its fp32-vs-fp64 spread there 3.0e-6, a float64 copy with its float32
# casts float64 too). Also the bar between two of our own paths (measured <= 3.5e-6), where the former
# 1e-5 was 2.9x ours; the former parity bar 1e-4 was 26x the spread. Ours vs the reference: <= 4.3e-6.
TOL = 4e-5


# -- the oracle ----------------------------------------------------------------------------------

def hf_decode(model, ids, carry=True):
    """Token by token through transformers' own cache. In 5.24 the state goes in and out as
    ``cache``; ``carry=False`` drops it each step (what passing the wrong keyword does)."""
    import torch

    rows, cache = [], None
    with torch.no_grad():
        for t in ids:
            out = model(torch.tensor([[t]]), cache=cache if carry else None, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0, -1].numpy())
    return np.stack(rows)


@pytest.fixture(scope="module")
def refs(checkpoint_dirs):
    """The oracles, run at one torch thread: on a shared two-core machine spinning intra-op
    workers make each tiny forward some 30x slower."""
    import torch

    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_reference(checkpoint_dirs(family))
        return cache[family]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield get
    torch.set_num_threads(threads)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None and k.startswith("-"):
            cfg.pop(k[1:], None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


# -- parity ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
def test_parity_prefill_decode_and_greedy(refs, containers, family):
    ref = refs(family)
    theirs = hf_logits(ref, IDS)
    # The oracle carries its state: its own decode equals its prefill, and a decode that drops
    # the cache (the wrong-keyword failure) does not.
    assert np.abs(hf_decode(ref, IDS) - theirs).max() <= TOL
    assert np.abs(hf_decode(ref, IDS, carry=False) - theirs).max() > 1e-2

    ex = vindex3.open(containers(family)).executor()
    ours = ex.forward(IDS)
    assert ours.dtype == np.float32 and ex.last_hidden.dtype == np.float32
    assert np.abs(ours - theirs).max() <= TOL
    dec = token_by_token(ex, IDS)
    assert dec.dtype == np.float32
    assert np.abs(dec - theirs).max() <= TOL
    assert our_greedy(ex, IDS[:6], 16) == hf_greedy(ref, IDS[:6], 16)


@pytest.mark.parametrize("family", MODELS)
def test_prefill_then_decode_equals_token_by_token(containers, family):
    ex = vindex3.open(containers(family)).executor()
    st = ex.start()
    head = st.prefill(IDS[:11])
    tail = np.stack([st.step(t) for t in IDS[11:]])
    both = np.concatenate([head, tail])
    assert np.abs(both - token_by_token(ex, IDS)).max() <= TOL
    st2 = ex.start()
    parts = np.concatenate([st2.prefill(IDS[:3]), st2.prefill(IDS[3:12]), st2.prefill(IDS[12:])])
    assert np.abs(parts - ex.forward(IDS)).max() <= TOL


def test_binding_time_step_limit_follows_the_reference(refs, checkpoint_dirs, tmp_path):
    """A finite Δ limit binds in the chunk form and not in the recurrent step, in transformers
    and here alike: prefill and decode both match the oracle with the limit in force."""
    ck = _copy_with_config(checkpoint_dirs("mamba2"), tmp_path / "ck", time_step_limit=[0.05, 0.3])
    refs("mamba2")  # the module's oracles hold torch at one thread
    ref = load_reference(ck)
    ex = vindex3.open(vindex3.encode(ck, tmp_path / "c")).executor()
    assert np.abs(ex.forward(IDS) - hf_logits(ref, IDS)).max() <= TOL
    assert np.abs(token_by_token(ex, IDS) - hf_decode(ref, IDS)).max() <= TOL
    free = vindex3.open(vindex3.encode(checkpoint_dirs("mamba2"), tmp_path / "free")).executor()
    assert np.abs(free.forward(IDS) - ex.forward(IDS)).max() > 1e-3  # the limit is real


# -- drafts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
def test_draft_at_full_depth_is_bit_identical(containers, family):
    c = vindex3.open(containers(family))
    L = c.graph.num_layers
    full, draft = c.executor(slice=vindex3.Full()), c.executor(slice=vindex3.Draft(L))
    assert np.array_equal(full.forward(IDS), draft.forward(IDS))
    assert np.array_equal(full.last_hidden, draft.last_hidden)
    assert full.trace.executed_layers == draft.trace.executed_layers == list(range(L))
    assert np.array_equal(token_by_token(full, IDS), token_by_token(draft, IDS))


def test_hybrid_draft_is_charged_only_for_the_layers_it_runs(containers):
    """Layer 0 of the hybrid attends; layers 1-2 are Mamba2. A depth-1 draft holds KV only,
    reads no mixer operand, and rolls back by truncation."""
    c = vindex3.open(containers("granitemoehybrid"))
    ex = c.executor(slice=vindex3.Draft(1))
    st = ex.start()
    st.prefill(IDS)
    assert list(st.state.layers) == [0]
    assert isinstance(st.state.layers[0]["mixer"], KvRows) and set(st.state.layers[0].ops) == {"mixer"}
    assert st.state.nbytes == c.continuation()[0].bytes_at(len(IDS))
    assert not any(lbl.startswith(("decoder_stack/1.", "decoder_stack/2.")) for lbl in ex.prepared.read_log)
    st.truncate(5)  # nothing recurrent in the slice: truncation is allowed
    r = speculative_generate(c, IDS[:6], 8, 1, 3)
    assert r.rollback == "snapshot"  # the full model keeps recurrent state
    assert r.tokens == greedy_generate(c, IDS[:6], 8).tokens


# -- continuation geometry and state ---------------------------------------------------------------

def test_pure_mamba2_geometry_is_recurrent_only(containers):
    c = vindex3.open(containers("mamba2"))
    geoms = c.continuation()
    assert [[p.kind for p in g.parts] for g in geoms] == [[RECURRENT, RECURRENT]] * 3
    g = geoms[0]
    assert not g.has(KV) and g.bytes_per_position == 0 and g.rollback == "snapshot"
    assert [(b.name, b.shape, b.dtype) for b in g.parts] == [("ssm", (6, 15, 13), "f32"), ("conv", (168, 3), "f32")]
    assert g.bytes_at(1) == g.bytes_at(100_000) == (6 * 15 * 13 + 168 * 3) * 4
    ex = c.executor()
    st = ex.start()
    st.prefill(IDS)
    assert all(isinstance(ls["mixer"], Mamba2State) for ls in st.state.layers.values())
    assert st.state.nbytes == sum(x.fixed_bytes for x in geoms)


def test_hybrid_geometry_mixes_kv_and_recurrent(containers):
    c = vindex3.open(containers("granitemoehybrid"))
    geoms = c.continuation()
    assert [sorted({p.kind for p in g.parts}) for g in geoms] == [[KV], [RECURRENT], [RECURRENT], [KV]]
    assert geoms[0].of(KV)[0].shape == (2, 15) and geoms[0].bytes_per_position == 2 * 15 * 4
    st = c.executor().start()
    st.prefill(IDS)
    assert [type(ls["mixer"]) for ls in st.state.layers.values()] == [KvRows, Mamba2State, Mamba2State, KvRows]
    assert all(ls["ffn"] is None for ls in st.state.layers.values())  # the dense FFN keeps no state
    assert st.state.nbytes == sum(g.bytes_at(len(IDS)) for g in geoms)


@pytest.mark.parametrize("family", MODELS)
def test_recurrent_state_rolls_back_by_snapshot_not_truncate(containers, family):
    ex = vindex3.open(containers(family)).executor()
    st = ex.start()
    st.prefill(IDS[:8])
    snap = st.snapshot()
    a = st.step(IDS[8])
    st.step(IDS[9])
    with pytest.raises(StateError, match="keep recurrent state, which rolls back only through snapshot"):
        st.truncate(9)
    st.restore(snap)
    assert st.position == 8
    assert np.array_equal(st.step(IDS[8]), a)


# -- speculation -------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
def test_lql_speculate_equals_plain_greedy(containers, family):
    path = containers(family)
    s = lql.Session()
    s.execute(f"OPEN '{path}'")
    toks = ", ".join(map(str, IDS[:6]))
    (plain,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 12")
    for depth in (1, 2):
        (spec,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 12 SPECULATE DEPTH {depth} LOOKAHEAD 3")
        assert spec.kind == "speculate" and spec.rollback == "snapshot"
        assert spec.generated_ids == plain.generated_ids


# -- graph -----------------------------------------------------------------------------------------

def test_pure_mamba2_graph(containers):
    c = vindex3.open(containers("mamba2"))
    s = c.graph.surface
    assert "attention" not in s and "ffn" not in s
    assert s["norms"]["placement"] == "pre_mixer"
    assert s["residual"] == {"multiplier": 1.0, "fp32": True}
    m = s["operators"]["mamba2"]
    assert (m["num_heads"], m["head_dim"], m["state_size"], m["n_groups"], m["conv_kernel"]) == (6, 15, 13, 3, 3)
    assert m["time_step_limit"] == [0.0, math.inf]
    assert {lp.operator for lp in c.graph.layers} == {"mamba2"}
    layer = c.op_plan().layers[0]
    assert [(op.kind, op.role) for op in layer.ops] == [("rms_norm", "mixer_norm"), ("mamba2", "mixer"),
                                                        ("residual_add", "mixer_residual")]
    assert sorted(layer.ops[1].operands) == sorted(["in_proj", "in_proj_bias", "conv_weight", "conv_bias", "A_log", "D",
                                                    "dt_bias", "gated_norm", "out_proj", "out_proj_bias"])


def test_hybrid_graph(containers):
    c = vindex3.open(containers("granitemoehybrid"))
    s = c.graph.surface
    assert s["ffn"]["fused_gate_up"] is True and s["attention"]["score_scale"] == 0.09
    assert [lp.operator for lp in c.graph.layers] == ["softmax", "mamba2", "mamba2", "softmax"]
    assert c.graph.layers[0].position == {"kind": "none"}
    kinds = [[(op.kind, op.role) for op in lo.ops] for lo in c.op_plan().layers]
    ffn = [("rms_norm", "ffn_norm"), ("gated_ffn", "ffn"), ("residual_add", "ffn_residual")]
    assert kinds[0] == [("rms_norm", "mixer_norm"), ("softmax", "mixer"), ("residual_add", "mixer_residual")] + ffn
    assert kinds[1] == [("rms_norm", "mixer_norm"), ("mamba2", "mixer"), ("residual_add", "mixer_residual")] + ffn
    assert c.op_plan().layers[1].ops[0].operands["weight"].tensor == "1.input_layernorm.weight"
    assert c.op_plan().layers[1].ops[3].operands["weight"].tensor == "1.post_attention_layernorm.weight"


# -- admission ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", MODELS)
def test_every_key_is_graded(checkpoint_dirs, family):
    ck = checkpoint_dirs(family)
    plan = vindex3.admit(ck)
    assert plan.admissible, plan.model_dump_json(indent=2)
    cfg = json.loads((ck / "config.json").read_text())
    assert set(cfg) <= {f.key for f in plan.findings}


@pytest.mark.parametrize("spelling", ["bare", "tagged"])
def test_infinite_time_step_limit_in_both_spellings(checkpoint_dirs, tmp_path, spelling):
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint_dirs("mamba2"), ck)
    text = (ck / "config.json").read_text()
    cfg = json.loads(text)
    cfg["time_step_limit"] = [0.0, "INF"]
    text = json.dumps(cfg).replace('"INF"', "Infinity" if spelling == "bare" else '{"__float__": "Infinity"}')
    (ck / "config.json").write_text(text)
    plan = vindex3.admit(ck)
    assert plan.admissible
    (f,) = [f for f in plan.findings if f.key == "time_step_limit"]
    assert f.category == "consumed" and f.value == [0.0, "inf"]
    c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
    assert c.graph.surface["operators"]["mamba2"]["time_step_limit"] == [0.0, math.inf]


def test_legacy_layer_type_spellings_are_read(checkpoint_dirs, tmp_path):
    """Released Granite 4.0 configs write layers_block_type with mamba/attention, 'nope' for no
    position encoding and normalization_function 'rmsnorm'."""
    ck = _copy_with_config(checkpoint_dirs("granitemoehybrid"), tmp_path / "ck",
                           layers_block_type=["attention", "mamba", "mamba", "attention"],
                           position_embedding_type="nope", normalization_function="rmsnorm")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["layer_types"]
    (ck / "config.json").write_text(json.dumps(cfg))
    c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
    assert [lp.operator for lp in c.graph.layers] == ["softmax", "mamba2", "mamba2", "softmax"]
    assert c.graph.layers[0].position == {"kind": "none"}


def _blocking(plan):
    return {f.key: f.message for f in plan.blocking()}


@pytest.mark.parametrize("family, changes, key, needle", [
    ("granitemoehybrid", {"num_local_experts": -1}, "num_local_experts", "expected a non-negative integer"),
    ("mamba2", {"ssm_frobnication": 3}, "ssm_frobnication", "not understood by this build"),
    ("mamba2", {"rms_norm": False}, "rms_norm", "declares LayerNorm"),
    ("mamba2", {"hidden_act": "gelu"}, "hidden_act", "conv activation 'gelu' has no executor"),
    ("mamba2", {"norm_before_gate": True}, "norm_before_gate", "gates before the norm"),
    ("mamba2", {"expand": 3}, "expand", "does not equal num_heads * head_dim"),
    ("mamba2", {"time_step_limit": [0.0, float("nan")]}, "time_step_limit", "expected 0 <= lower <= upper"),
    ("granitemoehybrid", {"layer_types": ["attention", "mamba", "moe", "attention"]}, "layer_types", "layer 2 has type 'moe'"),
    ("granitemoehybrid", {"position_embedding_type": "alibi"}, "position_embedding_type", "'alibi' is not a position encoding"),
    ("granitemoehybrid", {"normalization_function": "layernorm"}, "normalization_function", "the reference runs RMSNorm"),
])
def test_refusals_name_the_key(checkpoint_dirs, tmp_path, family, changes, key, needle):
    ck = tmp_path / "ck"
    shutil.copytree(checkpoint_dirs(family), ck)
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(changes)
    (ck / "config.json").write_text(json.dumps(cfg).replace("NaN", '{"__float__": "NaN"}'))
    plan = vindex3.admit(ck)
    assert not plan.admissible
    assert needle in _blocking(plan).get(key, ""), plan.model_dump_json(indent=2)
    with pytest.raises(AdmissionError, match=key):
        vindex3.encode(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family, extra, operator", [
    ("mamba2", "backbone.layers.1.mixer.x_proj.weight", "mamba2"),
    ("mamba2", "backbone.layers.0.mixer.norm.bias", "mamba2"),
    # a mixer tensor under an attention layer fails closed too: tables are per operator
    ("granitemoehybrid", "model.layers.0.mamba.A_log", "softmax"),
    ("granitemoehybrid", "model.layers.1.self_attn.q_proj.weight", "mamba2"),
])
def test_unclassified_mixer_tensor_is_refused(checkpoint_dirs, tmp_path, family, extra, operator):
    from safetensors.numpy import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(checkpoint_dirs(family), ck)
    t = load_file(ck / "model.safetensors")
    t[extra] = np.ones(6, np.float32)
    save_file(t, ck / "model.safetensors", metadata={"format": "pt"})
    plan = vindex3.admit(ck)
    msg = _blocking(plan).get(extra, "")
    assert "unclassified tensor suffix" in msg and f"under the {operator} operator" in msg, plan.model_dump_json(indent=2)


def test_hybrid_with_rotary_attention(refs, tmp_path):
    """position_embedding_type 'rope' lowers rope_parameters to the attention layers (the
    fixture's default is NoPE); an explicit even head_dim (rotary needs one) is read; parity
    holds on prefill and decode."""
    from fixtures import build_checkpoint

    refs("granitemoehybrid")  # the module's oracles hold torch at one thread
    ck = build_checkpoint("granitemoehybrid", tmp_path / "ck", tokenizer=False, position_embedding_type="rope",
                          head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    ref = load_reference(ck)
    c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
    assert c.graph.layers[0].position["kind"] == "rope" and c.graph.layers[0].position["theta"] == 500.0
    assert c.graph.surface["attention"]["head_dim"] == 16
    ex = c.executor()
    theirs = hf_logits(ref, IDS)
    assert np.abs(ex.forward(IDS) - theirs).max() <= TOL
    assert np.abs(token_by_token(ex, IDS) - theirs).max() <= TOL
    assert our_greedy(ex, IDS[:6], 16) == hf_greedy(ref, IDS[:6], 16)


def test_rotary_attention_needs_an_even_head_width(checkpoint_dirs, tmp_path):
    ck = _copy_with_config(checkpoint_dirs("granitemoehybrid"), tmp_path / "ck", position_embedding_type="rope")
    plan = vindex3.admit(ck)
    assert "rotary embedding needs an even head width, found 15" in _blocking(plan).get("position_embedding_type", "")
