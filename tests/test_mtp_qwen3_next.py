"""Qwen3-Next's multi-token-prediction head (``mtp.*``) as a drafter component.

Fixture: a tiny qwen3_next (gated delta + gated full attention, routed experts with a gated shared
expert) built by transformers with FIVE layers, the fifth a full-attention routed layer; its
checkpoint is then declared as four layers plus one MTP layer: ``model.layers.4.*`` renamed
``mtp.layers.0.*`` (the reference's own layer layout), with ``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden`` and ``mtp.norm`` added (seeded; the norms zero-centred, (1 + w)).
Oracle: a numpy transcription of the formulation around the reference's decoder layer 4:

    logits_i = head((1+w_n) RMSNorm(layer(fc([(1+w_e) RMSNorm(embed(t_{i+1})); (1+w_h) RMSNorm(final_norm(h_i))]))))
"""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import transformers
from fixtures import build_tokenizer
from test_gated_delta_models import FULL, LIN, MOE, TEXT, _rerandomise

import vindex3
from vindex3.draft.mtp import MtpHead, mtp_generate

pytestmark = pytest.mark.numeric

H = TEXT["hidden_size"]
IDS = [int(t) for t in np.random.default_rng(12).integers(3, TEXT["vocab_size"], 40)]


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("mtp_qwen")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = dict(TEXT, **MOE, num_hidden_layers=5, layer_types=[LIN, LIN, LIN, FULL, FULL], num_experts=10,
               mlp_only_layers=[1])
    config = transformers.AutoConfig.for_model("qwen3_next", **cfg)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _rerandomise(model)
    model.eval()
    ck = base / "ck"
    model.save_pretrained(ck)
    build_tokenizer(ck)
    t = load_file(str(ck / "model.safetensors"))
    t = {(f"mtp.layers.0.{k[len('model.layers.4.'):]}" if k.startswith("model.layers.4.") else k): v for k, v in t.items()}
    rng = np.random.default_rng(31)
    own = {"mtp.fc.weight": (rng.standard_normal((H, 2 * H)) / math.sqrt(2 * H)).astype(np.float32)}
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        own[n] = (0.4 * rng.standard_normal(H)).astype(np.float32)
    t.update(own)
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    c = json.loads((ck / "config.json").read_text())
    c.update(num_hidden_layers=4, layer_types=[LIN, LIN, LIN, FULL], mtp_num_hidden_layers=1)
    (ck / "config.json").write_text(json.dumps(c, indent=2))
    path = vindex3.encode(ck, base / "c.vindex3")
    yield ck, path, model, own
    torch.set_num_threads(threads)


def reference(model, own, ids, dtype):
    m = copy.deepcopy(model).to(dtype)
    npd = np.float64 if dtype == torch.float64 else np.float32
    eps = npd(m.config.rms_norm_eps)
    with torch.no_grad():
        out = m.model(torch.tensor([ids]), output_hidden_states=True)
        main_normed = m.model.norm(out.hidden_states[4])  # the residual leaving layer 3, then the final norm
        main_logits = m.lm_head(main_normed)[0].numpy()
        h = main_normed[0].numpy()
        e = m.model.embed_tokens.weight.numpy()[np.asarray(ids[1:])]
        w = {k: v.astype(npd) for k, v in own.items()}
        x = np.concatenate([_rms(e, 1 + w["mtp.pre_fc_norm_embedding.weight"], eps),
                            _rms(h[:-1], 1 + w["mtp.pre_fc_norm_hidden.weight"], eps)], axis=1) @ w["mtp.fc.weight"].T
        T = x.shape[0]
        xt = torch.from_numpy(np.ascontiguousarray(x))[None]
        pos = torch.arange(T)[None]
        pe = m.model.rotary_emb(xt, pos)
        mask = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
        g = m.model.layers[4](xt, position_embeddings=pe, attention_mask=mask, position_ids=pos)[0].numpy()
        head = m.lm_head.weight.numpy()
    return main_logits, _rms(g, 1 + w["mtp.norm.weight"], eps) @ head.T


def test_qwen3_next_mtp_head_is_a_drafter_component(fx):
    ck, path, _, _ = fx
    plan = vindex3.admit(ck)
    assert plan.admissible
    c = vindex3.open(path)
    comps = {x.name: x.role for x in c.graph.components}
    assert comps == {"text": "primary_text", "mtp": "drafter"}
    (m,) = c.graph.objects["mtp"]["drafter"]["modules"]
    assert m["block"]["operator"] == "softmax" and m["block"]["ffn"] == "routed"
    assert c.graph.objects["mtp"]["drafter"]["norm_weight_offset"] == 1.0
    assert "components_not_carried" not in c.provenance
    assert {"0.eh_proj.weight", "0.self_attn.q_norm.weight"} <= set(c.segments["mtp"].entries)


def test_qwen3_next_mtp_parity(fx):
    _, path, model, own = fx
    f32 = reference(model, own, IDS, torch.float32)
    f64 = reference(model, own, IDS, torch.float64)
    c = vindex3.open(path)
    ex = c.executor()
    main = ex.forward(IDS)
    hidden = ex.last_hidden
    head = MtpHead(c)
    pre = head.forward(hidden[:-1], IDS[1:])
    st = head.start()
    dec = np.stack([head.logits(st.step_hidden(head.inputs([IDS[i + 1]], head.normed(hidden[i:i + 1]))))[0]
                    for i in range(len(IDS) - 1)])
    assert 1.0 < np.abs(f64[1]).max() < 30.0
    assert np.abs(main - f32[0]).max() <= 3e-4  # the main model's bar (tests/test_gated_delta_models.py)
    spread = np.abs(f32[1] - f64[1]).max()
    # measured on this fixture (max |logit| 13.4): the transcription's own fp32-vs-fp64 spread is
    # 1.2e-5; ours against fp64 2.1e-5 (prefill) and 2.0e-5 (row by row), prefill vs row by row
    # 4.8e-6. The bar, 6e-5, is 5x the transcription's own spread.
    assert spread <= 3e-5, spread
    assert np.abs(pre - f64[1]).max() <= 6e-5 and np.abs(dec - f64[1]).max() <= 6e-5
    assert np.abs(pre - dec).max() <= 6e-5


@pytest.mark.parametrize("lookahead", [1, 3])
def test_qwen3_next_mtp_speculation_equals_greedy(fx, lookahead):
    c = vindex3.open(fx[1])
    r = mtp_generate(c, IDS[:8], 16, lookahead=lookahead, compare_plain=True)
    assert r.matches_plain is True and len(r.tokens) == 16
    assert r.rollback == "snapshot" and r.proposed > 0  # gated delta layers roll back by snapshot


def test_unknown_mtp_tensor_is_refused_by_name(fx, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    ck = tmp_path / "ck"
    shutil.copytree(fx[0], ck)
    t = load_file(str(ck / "model.safetensors"))
    t["mtp.extra_norm.weight"] = np.ones(H, np.float32)
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    plan = vindex3.admit(ck)
    assert "mtp.extra_norm.weight" in {f.key for f in plan.blocking()}


def test_qwen3_5_vl_checkpoint_mtp_head_runs_as_a_drafter(tmp_path):
    """The released vision-language Qwen3.5 checkpoints: the text model under
    model.language_model., the head's layer count in text_config, the vision tower still set
    aside; the head (here the reference's own fifth layer renamed mtp.layers.0) drafts and the
    tokens equal greedy, and its logits match the transcription around that layer."""
    from safetensors.numpy import load_file, save_file
    from test_gated_delta_models import VISION

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        text = dict(TEXT, num_hidden_layers=5, layer_types=[LIN, FULL, LIN, FULL, FULL],
                    rope_parameters={**TEXT["rope_parameters"], "mrope_section": [2, 2, 2], "mrope_interleaved": True})
        config = transformers.AutoConfig.for_model("qwen3_5", text_config=text, vision_config=VISION)
        config.text_config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        _rerandomise(model)
        model.eval()
        ck = tmp_path / "ck"
        model.save_pretrained(ck)
        build_tokenizer(ck)
        P = "model.language_model.layers.4."
        t = {(f"mtp.layers.0.{k[len(P):]}" if k.startswith(P) else k): v
             for k, v in load_file(str(ck / "model.safetensors")).items()}
        rng = np.random.default_rng(32)
        own = {"mtp.fc.weight": (rng.standard_normal((H, 2 * H)) / math.sqrt(2 * H)).astype(np.float32)}
        for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
            own[n] = (0.4 * rng.standard_normal(H)).astype(np.float32)
        t.update(own)
        save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
        cfg = json.loads((ck / "config.json").read_text())
        cfg["text_config"].update(num_hidden_layers=4, layer_types=[LIN, FULL, LIN, FULL], mtp_num_hidden_layers=1)
        (ck / "config.json").write_text(json.dumps(cfg, indent=2))
        c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
        assert [x.role for x in c.graph.components] == ["primary_text", "drafter"]
        assert [x["component"] for x in c.provenance["components_not_carried"]] == ["vision tower"]
        (m,) = c.graph.objects["mtp"]["drafter"]["modules"]
        assert m["block"]["operator"] == "softmax" and m["block"]["ffn"] == "dense"
        r = mtp_generate(c, IDS[:8], 12, lookahead=2, compare_plain=True)
        assert r.matches_plain is True and r.proposed > 0
        lm = model.model.language_model
        with torch.no_grad():
            out = lm(torch.tensor([IDS]), output_hidden_states=True)
            h = lm.norm(out.hidden_states[4])[0].numpy()
            eps = np.float32(lm.config.rms_norm_eps)
            e = lm.embed_tokens.weight.numpy()[np.asarray(IDS[1:])]
            x = np.concatenate([_rms(e, 1 + own["mtp.pre_fc_norm_embedding.weight"], eps),
                                _rms(h[:-1], 1 + own["mtp.pre_fc_norm_hidden.weight"], eps)], axis=1) @ own["mtp.fc.weight"].T
            T = x.shape[0]
            xt = torch.from_numpy(np.ascontiguousarray(x))[None]
            pos = torch.arange(T)[None]
            mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
            g = lm.layers[4](xt, position_embeddings=lm.rotary_emb(xt, pos), attention_mask=mask,
                             position_ids=pos)[0].numpy()
            want = _rms(g, 1 + own["mtp.norm.weight"], eps) @ model.lm_head.weight.numpy().T
        ex = c.executor()
        ex.forward(IDS)
        got = MtpHead(c).forward(ex.last_hidden[:-1], IDS[1:])
        # measured 9.1e-6 here (max logit 12.8); the bar is the qwen3_next fixture's above (6e-5, 5x its
        # transcription's own fp32-vs-fp64 spread of 1.2e-5): the same operators at the same widths
        print(f"qwen3_5 VL MTP vs transcription: {np.abs(got - want).max():.3g}, max logit {np.abs(want).max():.3g}")
        assert np.abs(got - want).max() <= 6e-5, np.abs(got - want).max()
    finally:
        torch.set_num_threads(threads)
