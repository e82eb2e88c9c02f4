"""DeepSeek-V3 with its linears in FP8, as the released checkpoints ship them (e4m3 ``weight``, a
float32 ``weight_scale_inv`` per 128 x 128 block, ``quantization_config`` {quant_method fp8, fmt
e4m3, weight_block_size [128, 128], activation_scheme dynamic}): admitted, encoded without
widening (each linear packed into ``fp8_e4m3_b128``, expert banks stacked as bytes), and run.

The witness: a tiny DeepSeek-V3 (routed experts, shared experts, a dense first layer) whose every
layer linear is quantized here block by block (scale = amax / 448, codes rounded by torch's
float8_e4m3fn cast); its twin holds the same linears dequantized (``weight.float() * scale_inv``).
The twin's f32 container is the reference; transformers 5.24.0 on the twin is its oracle."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from fixtures import blas_products, build_tokenizer, hf_logits
from test_kda_mla_models import _scale, ds_config

import vindex3
from vindex3.encode import encode, encode_detailed
from vindex3.errors import AdmissionError
from vindex3.exec.slice import Draft

F32 = np.float32
IDS = [int(t) for t in np.random.default_rng(8).integers(3, 200, 20)]
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (e4m3 codes, scale_inv [ceil(out/128), ceil(in/128)], dequantized)."""
    O, I = w.shape
    sr, sc = -(-O // 128), -(-I // 128)
    pad = torch.zeros(sr * 128, sc * 128)
    pad[:O, :I] = w
    blocks = pad.reshape(sr, 128, sc, 128)
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12).to(torch.float32)
    codes = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    deq = (codes.to(torch.float32) * scale[:, None, :, None]).reshape(sr * 128, sc * 128)[:O, :I]
    return codes.reshape(sr * 128, sc * 128)[:O, :I].contiguous(), scale, deq.contiguous()


def _quantized_linear(name: str) -> bool:
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(FP8 checkpoint, its dequantized float32 twin)."""
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("fp8")
    cfg = ds_config("ds_plain", first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                    topk_group=1, n_shared_experts=1, moe_intermediate_size=128)
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    _scale(model, 7)
    src = base / "src"
    model.save_pretrained(src)
    build_tokenizer(src)
    fp8, twin = base / "fp8", base / "twin"
    shutil.copytree(src, fp8)
    shutil.copytree(src, twin)
    t = load_file(src / "model.safetensors")
    q_t, twin_t = {}, {}
    for name, w in sorted(t.items()):
        if _quantized_linear(name):
            codes, scale, deq = _quantize(w)
            q_t[name], q_t[name + "_scale_inv"] = codes, scale
            twin_t[name] = deq
        else:
            q_t[name] = twin_t[name] = w
    assert sum(n.endswith("_scale_inv") for n in q_t) > 20
    save_file(q_t, fp8 / "model.safetensors", metadata={"format": "pt"})
    save_file(twin_t, twin / "model.safetensors", metadata={"format": "pt"})
    c = json.loads((fp8 / "config.json").read_text())
    c["quantization_config"] = FP8_CONFIG
    (fp8 / "config.json").write_text(json.dumps(c))
    return fp8, twin


def test_fp8_deepseek_is_admitted_and_keeps_its_linears_in_fp8(pair, tmp_path):
    fp8, twin = pair
    plan = vindex3.admit(fp8)
    assert plan.admissible, [f.text() for f in plan.blocking()]
    c = vindex3.open(encode_detailed(fp8, tmp_path / "n.vindex3", native=True).path)
    seg = c.segments["decoder_stack"]
    kept = c.provenance["native"]["kept"]["fp8_e4m3_b128"]
    assert "decoder_stack/1.mlp.experts.gate_up_proj" in kept and "decoder_stack/1.mlp.experts.down_proj" in kept
    assert "decoder_stack/0.mlp.down_proj.weight" in kept and "decoder_stack/1.self_attn.o_proj.weight" in kept
    assert seg.entries["1.mlp.experts.gate_up_proj"].shape == (4, 256, 40)
    assert seg.entries["1.mlp.gate.weight"].dtype == "f32"  # the router is not quantized
    w = vindex3.open(encode(twin, tmp_path / "twin.vindex3"))
    wide = vindex3.open(encode(fp8, tmp_path / "wide.vindex3"))
    for name in seg.entries:
        ref = np.asarray(w.segments["decoder_stack"].tensor(name))
        assert np.array_equal(np.asarray(seg.weight(name).dense()).view(np.uint32), ref.view(np.uint32)), name
        assert np.array_equal(np.asarray(wide.segments["decoder_stack"].tensor(name)).view(np.uint32),
                              ref.view(np.uint32)), name
    assert {e.dtype for e in wide.segments["decoder_stack"].entries.values()} == {"f32"}
    assert c.weight_bytes < 0.5 * wide.weight_bytes


def test_fp8_deepseek_runs_like_its_dequantized_twin_and_transformers(pair, tmp_path):
    fp8, twin = pair
    c = vindex3.open(encode(fp8, tmp_path / "n.vindex3", native=True))
    w = vindex3.open(encode(twin, tmp_path / "twin.vindex3"))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    ref = hf_logits(ref_model, IDS)
    for T in (5, len(IDS)):
        ln, lw = c.executor().forward(IDS[:T]), w.executor().forward(IDS[:T])
        st = w.executor().start()
        steps = np.stack([st.prefill(IDS[:1])[0]] + [st.step(t) for t in IDS[1:T]])
        with blas_products():  # a prefill this short takes the rows kernel, a step's order
            lb = w.executor().forward(IDS[:T])
        spread = float(np.abs(steps - lb).max())  # the twin's own prefill (BLAS) vs decode spread
        diff, oracle = float(np.abs(ln - lw).max()), float(np.abs(ln - ref[:T]).max())
        print(f"T={T}: fp8 vs twin {diff:.3g} (twin prefill vs decode {spread:.3g}); vs transformers {oracle:.3g}")
        # the native side and the twin may sum in two orders (decoded tiles + BLAS against the rows
        # kernel), each within `spread` of the exact sum, so they are within twice it
        assert diff <= 2 * max(spread, 4 * np.finfo(F32).eps * float(np.abs(lw).max()))
        assert oracle <= 1e-4  # the family's parity tolerance (tests/test_kda_mla_models.py)
    assert np.abs(ref).max() > 1.0
    full = c.executor().forward(IDS)
    assert np.array_equal(c.executor(slice=Draft(c.graph.num_layers)).forward(IDS), full)


def test_fp8_weight_without_its_scale_is_refused_by_name(pair, tmp_path):
    from safetensors.torch import load_file, save_file

    fp8, _ = pair
    ck = tmp_path / "ck"
    shutil.copytree(fp8, ck)
    t = load_file(ck / "model.safetensors")
    del t["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(t, ck / "model.safetensors", metadata={"format": "pt"})
    plan = vindex3.admit(ck)
    assert not plan.admissible
    (f,) = [f for f in plan.blocking() if f.key == "model.layers.1.self_attn.o_proj.weight_scale_inv"]
    assert "1 missing" in f.message
    with pytest.raises(AdmissionError):
        encode(ck, tmp_path / "out")
