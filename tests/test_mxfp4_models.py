"""gpt-oss with its experts in MXFP4, as the released checkpoints ship them (``*_blocks`` /
``*_scales`` and ``quantization_config`` {quant_method: mxfp4}): admitted, encoded without
widening (the banks packed into the ``mxfp4`` encoding), and run.

The witness: a tiny gpt-oss checkpoint (tests/fixtures.py, widths multiples of 32) whose expert
banks are quantized to MXFP4 with ``gguf.quants``; its twin holds the same banks dequantized to
float32 (what transformers' ``convert_moe_packed_tensors`` gives, tests/test_codecs_fp.py). The
twin's f32 container is the reference; transformers 5.24.0 on the twin is its oracle."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from fixtures import blas_products, build_checkpoint, hf_logits, load_reference
from gguf.quants import dequantize, quantize

import vindex3
from vindex3.encode import encode, encode_detailed
from vindex3.exec.slice import Draft

F32 = np.float32
IDS = [5, 17, 33, 2, 9, 41, 12, 7, 3, 30, 11]


def _to_blocks(w_out_in: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[E, out, in] float32 -> gpt-oss's blocks [E, out, in/32, 16], scales [E, out, in/32] and
    the dequantized values [E, out, in] (gguf.quants' MXFP4, re-laid out as gpt-oss stores it)."""
    E, O, I = w_out_in.shape
    g = quantize(w_out_in.reshape(E * O, I), gguf.GGMLQuantizationType.MXFP4).reshape(E, O, I // 32, 17)
    deq = dequantize(g.reshape(E * O, -1), gguf.GGMLQuantizationType.MXFP4).reshape(E, O, I)
    scales = g[..., 0].copy()
    q = g[..., 1:]
    codes = np.concatenate([q & 15, q >> 4], axis=-1)  # element j, j < 32
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, scales, deq.astype(F32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(MXFP4 checkpoint, its dequantized float32 twin)."""
    from safetensors.numpy import load_file, save_file

    base = tmp_path_factory.mktemp("mx")
    src = build_checkpoint("gpt_oss", base / "src", hidden_size=64, intermediate_size=32)
    mx, twin = base / "mx", base / "twin"
    shutil.copytree(src, mx)
    shutil.copytree(src, twin)
    t = load_file(src / "model.safetensors")
    mx_t, twin_t = dict(t), dict(t)
    for name in sorted(t):
        if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            continue
        blocks, scales, deq = _to_blocks(np.ascontiguousarray(np.swapaxes(t[name], 1, 2)))  # in-out -> out-in
        del mx_t[name]
        mx_t[name + "_blocks"], mx_t[name + "_scales"] = blocks, scales
        twin_t[name] = np.ascontiguousarray(np.swapaxes(deq, 1, 2))
    save_file(mx_t, mx / "model.safetensors", metadata={"format": "pt"})
    save_file(twin_t, twin / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((mx / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (mx / "config.json").write_text(json.dumps(cfg))
    return mx, twin


def test_mxfp4_gpt_oss_is_admitted_and_keeps_its_banks_packed(pair, tmp_path):
    mx, twin = pair
    plan = vindex3.admit(mx)
    assert plan.admissible, [f.text() for f in plan.blocking()]
    r = encode_detailed(mx, tmp_path / "n.vindex3", native=True)
    c = vindex3.open(r.path)
    seg = c.segments["decoder_stack"]
    banks = [n for n in seg.entries if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert len(banks) == 8
    for n in banks:
        assert seg.entries[n].dtype == "mxfp4"
    assert seg.entries["0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    assert c.provenance["native"]["kept"]["mxfp4"] and not c.provenance["native"]["not_executable"]
    packed = [a for a in c.provenance["assembled_tensors"] if a.get("packed_as") == "mxfp4"]
    assert len(packed) == 8 and packed[0]["sources"][0].endswith("_blocks")
    # decoded, the banks are the dequantized twin's, bit for bit; widening gives the same f32 bytes
    w = vindex3.open(encode(twin, tmp_path / "twin.vindex3"))
    wide = vindex3.open(encode(mx, tmp_path / "wide.vindex3"))
    for n in banks:
        ref = np.asarray(w.segments["decoder_stack"].tensor(n))
        assert np.array_equal(seg.weight(n).dense().view(np.uint32), ref.view(np.uint32)), n
        assert np.array_equal(np.asarray(wide.segments["decoder_stack"].tensor(n)).view(np.uint32), ref.view(np.uint32))
    assert c.weight_bytes < wide.weight_bytes


def test_mxfp4_gpt_oss_runs_like_its_dequantized_twin_and_transformers(pair, tmp_path):
    mx, twin = pair
    c = vindex3.open(encode(mx, tmp_path / "n.vindex3", native=True))
    w = vindex3.open(encode(twin, tmp_path / "twin.vindex3"))
    ref = hf_logits(load_reference(twin), IDS)
    for T in (4, len(IDS)):  # rows kernels and decoded tiles
        ln, lw = c.executor().forward(IDS[:T]), w.executor().forward(IDS[:T])
        # the twin's own spread: its prefill through BLAS against its token-by-token decode
        st = w.executor().start()
        steps = np.stack([st.prefill(IDS[:1])[0]] + [st.step(t) for t in IDS[1:T]])
        with blas_products():  # a prefill this short takes the rows kernel, a step's order
            lb = w.executor().forward(IDS[:T])
        spread = float(np.abs(steps - lb).max())
        diff = float(np.abs(ln - lw).max())
        oracle = float(np.abs(ln - ref[:T]).max())
        print(f"T={T}: mxfp4 vs twin {diff:.3g} (twin prefill vs decode {spread:.3g}); vs transformers {oracle:.3g}")
        # the native side and the twin may sum in two orders (decoded tiles + BLAS against the rows
        # kernel), each within `spread` of the exact sum, so they are within twice it
        assert diff <= 2 * max(spread, 4 * np.finfo(F32).eps * float(np.abs(lw).max()))
        assert oracle <= 1e-4  # the family's parity tolerance (tests/test_moe_models.py)
    assert np.abs(ref).max() > 1.0  # logits O(1-10), so the tolerance means something
    full = c.executor().forward(IDS)
    assert np.array_equal(c.executor(slice=Draft(c.graph.num_layers)).forward(IDS), full)
