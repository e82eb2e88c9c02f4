"""DeepSeek-V3 multi-token-prediction (MTP) modules as a drafter component (vindex3.draft.mtp).

Fixture: a tiny deepseek_v3 (H 40, MLA with q_lora and yarn, routed experts from layer 1) built by
transformers with FOUR layers; its checkpoint is then declared as three decoder layers plus one
MTP module (``num_nextn_predict_layers`` 1), so ``model.layers.3.*`` is a decoder block of the
reference's own layout, and the module's own tensors (enorm, hnorm, eh_proj, shared_head.norm)
are added with seeded random values. transformers does not run MTP, so the oracle is a numpy
transcription of the published formulation around the reference's own decoder layer 3:

    logits_i = head(RMSNorm_s(block(eh_proj([RMSNorm_e(embed(t_{i+1})); RMSNorm_h(final_norm(h_i))]))))
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
from test_kda_mla_models import _scale, ds_config

import vindex3
from vindex3.draft.mtp import MtpHead, mtp_generate
from vindex3.errors import AdmissionError, ComponentError

pytestmark = pytest.mark.numeric

H = 40
VOCAB = 96
IDS = [int(t) for t in np.random.default_rng(11).integers(3, VOCAB, 48)]
MTP_OWN = {"enorm.weight": (H,), "hnorm.weight": (H,), "eh_proj.weight": (H, 2 * H), "shared_head.norm.weight": (H,)}


def _own_tensors(seed: int = 21) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for n, s in MTP_OWN.items():
        if len(s) == 1:
            out[n] = (1.0 + 0.3 * rng.standard_normal(s)).astype(np.float32)
        else:
            out[n] = (rng.standard_normal(s) / math.sqrt(s[1])).astype(np.float32)
    return out


def _add(ck, extra: dict[str, np.ndarray]) -> None:
    from safetensors.numpy import load_file, save_file

    f = ck / "model.safetensors"
    t = load_file(str(f))
    t.update(extra)
    save_file(t, str(f), metadata={"format": "pt"})


def _config(ck, **changes) -> None:
    cfg = json.loads((ck / "config.json").read_text())
    cfg.update(changes)
    (ck / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """(checkpoint, container path, four-layer reference model, the module's own tensors)."""
    base = tmp_path_factory.mktemp("mtp")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = ds_config("ds_yarn", num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=12,
                    num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2, moe_intermediate_size=23,
                    vocab_size=VOCAB)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale(model, 133)
    model.eval()
    ck = base / "ck"
    model.save_pretrained(ck)
    build_tokenizer(ck)
    own = _own_tensors()
    _add(ck, {f"model.layers.3.{n}": a for n, a in own.items()})
    _config(ck, num_hidden_layers=3, num_nextn_predict_layers=1)
    path = vindex3.encode(ck, base / "c.vindex3")
    yield ck, path, model, own
    torch.set_num_threads(threads)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def reference(model, own: dict, ids: list[int], dtype) -> tuple[np.ndarray, np.ndarray]:
    """(main logits [T, V], MTP logits [T-1, V]) of the published formulation: numpy around the
    reference's decoder layer 3, everything in ``dtype`` (torch.float32 or torch.float64)."""
    m = copy.deepcopy(model).to(dtype)
    npd = np.float64 if dtype == torch.float64 else np.float32
    eps = npd(m.config.rms_norm_eps)
    with torch.no_grad():
        out = m.model(torch.tensor([ids]), output_hidden_states=True)
        h3 = out.hidden_states[3]  # the residual leaving layer 2, the last of the main model
        main_normed = m.model.norm(h3)
        main_logits = m.lm_head(main_normed)[0].numpy()
        h = main_normed[0].numpy()
        emb = m.model.embed_tokens.weight.numpy()
        head = m.lm_head.weight.numpy()
        e = emb[np.asarray(ids[1:])]
        w = {k: v.astype(npd) for k, v in own.items()}
        x = np.concatenate([_rms(e, w["enorm.weight"], eps), _rms(h[:-1], w["hnorm.weight"], eps)], axis=1)
        x = x @ w["eh_proj.weight"].T
        T = x.shape[0]
        xt = torch.from_numpy(np.ascontiguousarray(x))[None]
        pos = torch.arange(T)[None]
        pe = m.model.rotary_emb(xt, pos)
        mask = torch.full((T, T), torch.finfo(dtype).min, dtype=dtype).triu(1)[None, None]
        g = m.model.layers[3](xt, attention_mask=mask, position_ids=pos, position_embeddings=pe)[0].numpy()
    return main_logits, _rms(g, w["shared_head.norm.weight"], eps) @ head.T


@pytest.fixture(scope="module")
def oracle(fx):
    _, _, model, own = fx
    return {"f32": reference(model, own, IDS, torch.float32), "f64": reference(model, own, IDS, torch.float64)}


def test_mtp_module_is_admitted_as_a_drafter_component(fx):
    ck, path, _, _ = fx
    plan = vindex3.admit(ck)
    assert plan.admissible
    assert set(json.loads((ck / "config.json").read_text())) <= {f.key for f in plan.findings}
    c = vindex3.open(path)
    comps = {x.name: x for x in c.graph.components}
    assert comps["mtp"].role == "drafter" and comps["mtp"].objects == ("mtp",)
    d = c.graph.objects["mtp"]["drafter"]
    assert d["edge"] == {"kind": "hidden_state", "component": "text", "after_layer": 2, "site": "final_norm"}
    (m,) = d["modules"]
    assert m["block"]["operator"] == "mla" and m["block"]["ffn"] == "routed"
    assert set(m["operands"]) == {"enorm", "hnorm", "eh_proj", "head_norm"}  # embedding and head: the main model's
    assert "moe_ffn" in d["surface"]["operators"]
    names = set(c.segments["mtp"].entries)
    assert {"0.enorm.weight", "0.eh_proj.weight", "0.self_attn.kv_b_proj.weight"} <= names
    assert not any(x["tensor"].startswith("model.layers.3.") for x in c.provenance.get("dropped_tensors", []))
    assert c.graph.num_layers == 3 and not [n for n in c.segments["decoder_stack"].entries if n.startswith("3.")]


def test_main_model_is_unchanged_by_the_drafter(fx, oracle):
    c = vindex3.open(fx[1])
    ours = c.executor().forward(IDS)
    # the main model's own bar (tests/test_kda_mla_models.py: 1e-4 over logits of order 1-10)
    assert np.abs(ours - oracle["f32"][0]).max() <= 1e-4


def test_mtp_block_parity_prefill_and_decode(fx, oracle):
    """The MTP logits against the transcription, prefill and row by row."""
    c = vindex3.open(fx[1])
    ex = c.executor()
    ex.forward(IDS)
    hidden = ex.last_hidden
    head = MtpHead(c)
    pre = head.forward(hidden[:-1], IDS[1:])
    st = head.start()
    rows = [head.logits(st.step_hidden(head.inputs([IDS[i + 1]], head.normed(hidden[i:i + 1]))))[0]
            for i in range(len(IDS) - 1)]
    dec = np.stack(rows)
    f32, f64 = oracle["f32"][1], oracle["f64"][1]
    assert pre.dtype == dec.dtype == np.float32
    assert 1.0 < np.abs(f64).max() < 30.0
    spread = np.abs(f32 - f64).max()
    # measured on this fixture (max |logit| 7.4): the transcription's own fp32-vs-fp64 spread is
    # 7.0e-6; ours against fp64 7.7e-6 (prefill) and 6.7e-6 (row by row), prefill vs row by row
    # 4.0e-6. The bar, 3e-5, is ~4x the transcription's own spread.
    assert spread <= 1.5e-5, spread
    assert np.abs(pre - f64).max() <= 3e-5 and np.abs(dec - f64).max() <= 3e-5
    assert np.abs(pre - f32).max() <= 3e-5 and np.abs(pre - dec).max() <= 3e-5


@pytest.mark.parametrize("lookahead, chain", [(1, True), (2, True), (3, True), (3, False)])
def test_mtp_speculation_equals_greedy(fx, lookahead, chain):
    c = vindex3.open(fx[1])
    r = mtp_generate(c, IDS[:9], 20, lookahead=lookahead, chain=chain, compare_plain=True)
    assert r.matches_plain is True and r.tokens == r.plain.tokens and len(r.tokens) == 20
    assert r.drafter == "mtp" and r.rollback == "truncate"
    assert r.proposed > 0 and r.draft_steps > 0
    if not chain:
        assert max(i for i, n in enumerate(r.accepted_histogram) if n) <= 1


def test_unknown_mtp_tensor_is_refused_by_name(fx, tmp_path):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(fx[0], ck)
    _add(ck, {"model.layers.3.shared_head.bias": np.zeros(H, np.float32)})
    plan = vindex3.admit(ck)
    hits = [f for f in plan.blocking() if f.key == "model.layers.3.shared_head.bias"]
    assert hits and "unclassified tensor suffix 'shared_head.bias'" in hits[0].message
    assert "multi-token-prediction module" in hits[0].message
    with pytest.raises(AdmissionError, match="shared_head.bias"):
        vindex3.encode(ck, tmp_path / "c")


def test_mtp_module_of_the_wrong_shape_is_refused_by_the_closure(fx, tmp_path):
    import shutil

    from vindex3.errors import ClosureError

    ck = tmp_path / "ck"
    shutil.copytree(fx[0], ck)
    _add(ck, {"model.layers.3.eh_proj.weight": np.zeros((H, H), np.float32)})
    with pytest.raises(ClosureError, match="eh_proj"):
        vindex3.encode(ck, tmp_path / "c")


def test_container_without_mtp_is_refused_by_name(tmp_path, fx):
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(fx[0], ck)
    _config(ck, num_nextn_predict_layers=0, num_hidden_layers=3)
    from safetensors.numpy import load_file, save_file

    t = {k: v for k, v in load_file(str(ck / "model.safetensors")).items() if not k.startswith("model.layers.3.")}
    save_file(t, str(ck / "model.safetensors"), metadata={"format": "pt"})
    c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
    with pytest.raises(ComponentError, match="no multi-token-prediction"):
        MtpHead(c)


def test_lql_speculate_drafter_mtp_show_components_and_explain(fx):
    import lql

    s = lql.Session()
    s.execute(f"OPEN '{fx[1]}'")
    toks = ", ".join(map(str, IDS[:9]))
    (plain,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 12 EXACTLY")
    (r,) = s.execute(f"INFER TOKENS ({toks}) GENERATE 12 EXACTLY SPECULATE DRAFTER MTP LOOKAHEAD 2")
    assert r.kind == "speculate" and r.drafter == "mtp" and r.depth is None and r.lookahead == 2
    assert r.generated_ids == plain.generated_ids and r.matches_plain is True
    assert "multi-token-prediction head (drafter component 'mtp', chained), lookahead 2" in r.to_text()
    (e,) = s.execute(f"EXPLAIN INFER TOKENS ({toks}) GENERATE 12 SPECULATE DRAFTER MTP")
    assert "multi-token-prediction speculation (drafter component 'mtp', module 0 of 1" in e.operation
    assert "after layer 2 through the final norm" in e.operation
    (comps,) = s.execute("SHOW COMPONENTS")
    rows = {x.name: x for x in comps.components}
    assert rows["mtp"].role == "drafter" and rows["mtp"].objects == ["mtp"] and rows["mtp"].executes
    assert "yes, as a drafter (SPECULATE DRAFTER MTP)" in comps.to_text()


def test_lql_speculate_drafter_mtp_is_refused_by_name_without_one(tiny_llama_container):
    import lql
    from lql.errors import LqlError

    s = lql.Session()
    s.execute(f"OPEN '{tiny_llama_container}'")
    with pytest.raises(LqlError, match="no multi-token-prediction \\(MTP\\) drafter component"):
        s.execute("INFER TOKENS (1, 2, 3) GENERATE 4 SPECULATE DRAFTER MTP")


def test_fp8_mtp_module_is_packed_and_runs_like_its_dequantized_twin(fx, tmp_path):
    """Released DeepSeek-V3 MTP modules are FP8 like the decoder: eh_proj and the block's linears
    are packed into fp8_e4m3_b128 (native encode) in the mtp object and run as stored; the MTP
    logits equal those of the twin holding the dequantized weights, within twice the twin's own
    pass-vs-step spread (the bar tests/test_fp8_models.py uses for the decoder)."""
    import shutil

    from safetensors.torch import load_file, save_file
    from test_fp8_models import FP8_CONFIG, _quantize, _quantized_linear

    from vindex3.encode import encode

    fp8, twin = tmp_path / "fp8", tmp_path / "twin"
    shutil.copytree(fx[0], fp8)
    shutil.copytree(fx[0], twin)
    t = load_file(fx[0] / "model.safetensors")
    q_t, twin_t = {}, {}
    for name, w in sorted(t.items()):
        if _quantized_linear(name) and w.dim() == 2:
            codes, scale, deq = _quantize(w)
            q_t[name], q_t[name + "_scale_inv"] = codes, scale
            twin_t[name] = deq
        else:
            q_t[name] = twin_t[name] = w
    assert "model.layers.3.eh_proj.weight_scale_inv" in q_t
    save_file(q_t, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(twin_t, twin / "model.safetensors", metadata={"format": "pt"})
    _config(fp8, quantization_config=FP8_CONFIG)
    c = vindex3.open(encode(fp8, tmp_path / "n.vindex3", native=True))
    w = vindex3.open(encode(twin, tmp_path / "w.vindex3"))
    ent = c.segments["mtp"].entries
    assert ent["0.eh_proj.weight"].dtype == "fp8_e4m3_b128" and ent["0.self_attn.o_proj.weight"].dtype == "fp8_e4m3_b128"
    hc, hw = MtpHead(c), MtpHead(w)
    ex = w.executor()
    ex.forward(IDS)
    hidden = ex.last_hidden
    a, b = hc.forward(hidden[:-1], IDS[1:]), hw.forward(hidden[:-1], IDS[1:])
    st = hw.start()
    steps = np.stack([hw.logits(st.step_hidden(hw.inputs([IDS[i + 1]], hw.normed(hidden[i:i + 1]))))[0]
                      for i in range(len(IDS) - 1)])
    from fixtures import blas_products

    with blas_products():  # a pass this short takes the rows kernel, a step's order
        b_blas = hw.forward(hidden[:-1], IDS[1:])
    spread = float(np.abs(steps - b_blas).max())  # the twin's own pass (BLAS) vs step spread
    # the packed module and the twin may sum in two orders (decoded tiles + BLAS against the rows
    # kernel), each within `spread` of the exact sum, so they are within twice it
    assert float(np.abs(a - b).max()) <= 2 * max(spread, 4 * np.finfo(np.float32).eps * float(np.abs(b).max()))
    r = mtp_generate(c, IDS[:9], 12, lookahead=2, compare_plain=True)
    assert r.matches_plain is True


def test_represent_encodes_the_mtp_matrices_like_the_decoders(fx, tmp_path):
    from vindex3.represent import represent

    represent(fx[1], tmp_path / "r", "bf16")
    c = vindex3.open(tmp_path / "r")
    ent = c.segments["mtp"].entries
    assert ent["0.eh_proj.weight"].dtype == "bf16" and ent["0.self_attn.kv_b_proj.weight"].dtype == "bf16"
    assert ent["0.enorm.weight"].dtype == "f32"  # norms stay float32, as the decoder's
    r = mtp_generate(c, IDS[:9], 10, lookahead=2, compare_plain=True)
    assert r.matches_plain is True


def test_a_module_with_its_own_embedding_and_head_reads_them(fx, tmp_path):
    """Released modules also store embed_tokens and shared_head.head (copies of the model's): they
    are the module's own operands; equal copies give the shared head's logits bit for bit, and a
    changed copy changes them."""
    import shutil

    from safetensors.numpy import load_file

    t = load_file(str(fx[0] / "model.safetensors"))
    emb, head = t["model.embed_tokens.weight"], t["lm_head.weight"]
    ck = tmp_path / "ck"
    shutil.copytree(fx[0], ck)
    _add(ck, {"model.layers.3.embed_tokens.weight": emb.copy(), "model.layers.3.shared_head.head.weight": head.copy()})
    c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
    (m,) = c.graph.objects["mtp"]["drafter"]["modules"]
    assert m["operands"]["embedding"] == "0.embed_tokens.weight" and m["operands"]["head"] == "0.shared_head.head.weight"
    base = vindex3.open(fx[1])
    ex = base.executor()
    ex.forward(IDS)
    hidden = ex.last_hidden[:-1]
    assert np.array_equal(MtpHead(c).forward(hidden, IDS[1:]), MtpHead(base).forward(hidden, IDS[1:]))
    ck2 = tmp_path / "ck2"
    shutil.copytree(ck, ck2)
    _add(ck2, {"model.layers.3.shared_head.head.weight": (head * 2).astype(np.float32)})
    c2 = vindex3.open(vindex3.encode(ck2, tmp_path / "c2"))
    assert not np.array_equal(MtpHead(c2).forward(hidden, IDS[1:]), MtpHead(base).forward(hidden, IDS[1:]))


def test_several_modules_are_admitted_in_order_and_set_aside_after_an_incomplete_one(fx, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    t = load_file(str(fx[0] / "model.safetensors"))
    second = {k.replace("model.layers.3.", "model.layers.4.", 1): v for k, v in t.items()
              if k.startswith("model.layers.3.")}
    ck = tmp_path / "ck"
    shutil.copytree(fx[0], ck)
    _add(ck, second)
    _config(ck, num_nextn_predict_layers=2)
    c = vindex3.open(vindex3.encode(ck, tmp_path / "c"))
    assert [m["module"] for m in c.graph.objects["mtp"]["drafter"]["modules"]] == [0, 1]
    ex = c.executor()
    ex.forward(IDS)
    hidden = ex.last_hidden[:-1]
    assert np.array_equal(MtpHead(c, 1).forward(hidden, IDS[1:]), MtpHead(c, 0).forward(hidden, IDS[1:]))
    with pytest.raises(ComponentError, match="module 2 does not exist"):
        MtpHead(c, 2)
    # module 0 lacks its hnorm: both modules are set aside, each with its reason
    ck2 = tmp_path / "ck2"
    shutil.copytree(ck, ck2)
    t2 = {k: v for k, v in load_file(str(ck2 / "model.safetensors")).items() if k != "model.layers.3.hnorm.weight"}
    save_file(t2, str(ck2 / "model.safetensors"), metadata={"format": "pt"})
    c2 = vindex3.open(vindex3.encode(ck2, tmp_path / "c2"))
    assert [x.role for x in c2.graph.components] == ["primary_text"]
    why = {d["tensor"]: d["why"] for d in c2.provenance["dropped_tensors"]}
    assert "it lacks hnorm.weight" in why["model.layers.3.eh_proj.weight"]
    assert "module 0, which it chains on, is incomplete" in why["model.layers.4.eh_proj.weight"]
