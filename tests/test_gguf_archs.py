"""GGUF architectures beyond llama: qwen2 (q/k/v biases) and qwen3 (per-head q/k norms), with the
tokenizer rebuilt from the file's own vocabulary (byte-level BPE with Qwen2's split), against
transformers 5.24.0 loading the same tiny file with ``gguf_file=``.

The tiny files are written here with ``gguf.GGUFWriter``: weights drawn at unit gain (so logits
are O(1-10)), quantized with ``gguf.quants`` to a mix of block types, plus a Q4_K tensor built
from random blocks with small finite scales (gguf.quants cannot quantize K-quants)."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
tokenizers = pytest.importorskip("tokenizers")
from gguf import GGMLQuantizationType as Q
from test_gguf_import import _tiny_vocab, bits

import vindex3
from vindex3.encode import encode
from vindex3.errors import AdmissionError
from vindex3.sources.gguf import GgufCheckpoint

F32 = np.float32
DIMS = {"qwen2": {"hidden": 256, "heads": 4, "kv": 2, "head_dim": 64, "inter": 512, "layers": 2},
        "qwen3": {"hidden": 256, "heads": 4, "kv": 2, "head_dim": 128, "inter": 512, "layers": 2}}
TYPES = [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.F16, Q.Q4_K, Q.BF16, Q.Q5_1, Q.Q4_0, Q.F32]
IDS = [200, 12, 260, 77, 261, 5, 90, 262, 31, 140, 7]  # below the 266-token vocabulary
TEXTS = ["the thin in", " in the <think> €", "<s>the</s>", "café €€ ", "it's 12345 apples\n\n  ok", ""]


def _matrix(w, rng, name, shape, qtype):
    fan_in = shape[1]
    x = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(F32)
    if qtype == Q.F32:
        w.add_tensor(name, x)
    elif qtype == Q.F16:
        w.add_tensor(name, x.astype(np.float16))
    elif qtype == Q.Q4_K:
        _, bb = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(shape[0], shape[1] // 256, bb), dtype=np.uint8)
        for off in (0, 2):  # d and dmin: small finite f16 values
            raw[:, :, off : off + 2] = (rng.uniform(0.5, 1.0, raw.shape[:2]) * 2.0**-11).astype(np.float16).view(
                np.uint8).reshape(*raw.shape[:2], 2)
        w.add_tensor(name, raw.reshape(shape[0], -1), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)


def write_gguf(path, arch: str, *, key_length: int | None = None, seed: int = 1):
    d = DIMS[arch]
    rng = np.random.default_rng(seed)
    h, nh, kv, hd, inter, L = d["hidden"], d["heads"], d["kv"], d["head_dim"], d["inter"], d["layers"]
    tokens, token_types, merges = _tiny_vocab()
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}-test")
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(nh)
    w.add_head_count_kv(kv)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    if arch == "qwen3":
        w.add_key_length(key_length or hd)
        w.add_value_length(key_length or hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    V = len(tokens)
    _matrix(w, rng, "token_embd.weight", (V, h), Q.Q8_0)
    k = 0
    for i in range(L):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1.0 + 0.2 * rng.standard_normal(h)).astype(F32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1.0 + 0.2 * rng.standard_normal(h)).astype(F32))
        for name, shape in (("attn_q", (nh * hd, h)), ("attn_k", (kv * hd, h)), ("attn_v", (kv * hd, h)),
                            ("attn_output", (h, nh * hd)), ("ffn_gate", (inter, h)), ("ffn_up", (inter, h)),
                            ("ffn_down", (h, inter))):
            _matrix(w, rng, f"blk.{i}.{name}.weight", shape, TYPES[k % len(TYPES)])
            k += 1
        if arch == "qwen2":
            for name, n in (("attn_q", nh * hd), ("attn_k", kv * hd), ("attn_v", kv * hd)):
                w.add_tensor(f"blk.{i}.{name}.bias", (0.3 * rng.standard_normal(n)).astype(F32))
        if arch == "qwen3":
            for name in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{name}.weight", (1.0 + 0.2 * rng.standard_normal(hd)).astype(F32))
    w.add_tensor("output_norm.weight", (1.0 + 0.2 * rng.standard_normal(h)).astype(F32))
    _matrix(w, rng, "output.weight", (V, h), Q.Q5_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def tiny(request, tmp_path_factory):
    arch = request.param
    path = write_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return arch, path, model


def test_config_tensors_and_tokenizer_match_transformers(tiny):
    from transformers import AutoTokenizer

    arch, path, model = tiny
    src = GgufCheckpoint(path)
    assert src.config["model_type"] == arch == model.config.model_type
    ref = model.config.to_dict()
    for key, value in src.config.items():
        assert key in ref, key
        assert ref[key] == value, (key, value, ref[key])
    params = {k: v.detach().numpy() for k, v in model.named_parameters()}
    specs = src.tensor_specs()
    assert set(specs) == set(params)
    for name, spec in specs.items():
        ours = src.load(name)
        assert ours.shape == params[name].shape == spec.shape, name
        assert np.array_equal(bits(ours), bits(params[name])), f"{name} ({spec.dtype})"
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in specs
    else:
        assert "model.layers.1.self_attn.q_norm.weight" in specs and src.config["head_dim"] == 128

    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    blob = src.capability_files()["tokenizer.json"].decode()
    assert json.loads(blob) == json.loads(tok.backend_tokenizer.to_str())
    ours = tokenizers.Tokenizer.from_str(blob)
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_native_container_matches_transformers(tiny, tmp_path):
    arch, path, model = tiny
    c = vindex3.open(encode(path, tmp_path / "n.vindex3", native=True))
    enc = {e.dtype for s in c.segments.values() for e in s.entries.values()}
    assert {"q8_0", "q4_1", "q4_k", "f16", "bf16"} <= enc
    with torch.no_grad():
        ref = model(torch.tensor([IDS])).logits[0].numpy()
    assert 1.0 < np.abs(ref).max() < 100.0  # logits O(1-10): the tolerance means something
    ours = c.executor().forward(IDS)
    st = c.executor().start()
    steps = np.stack([st.prefill(IDS[:1])[0]] + [st.step(t) for t in IDS[1:]])
    d_prefill, d_decode = float(np.abs(ours - ref).max()), float(np.abs(steps - ref).max())
    print(f"{arch} native vs transformers: prefill {d_prefill:.3g}, token by token {d_decode:.3g}")
    assert d_prefill <= 1e-4 and d_decode <= 1e-4  # the GGUF parity bound
    w = vindex3.open(encode(path, tmp_path / "w.vindex3"))
    assert float(np.abs(w.executor().forward(IDS) - ref).max()) <= 1e-4
    assert np.array_equal(c.executor(slice=vindex3.Draft(c.graph.num_layers)).forward(IDS), ours)


def test_qwen3_head_width_the_reference_would_misread_is_refused(tmp_path):
    path = write_gguf(tmp_path / "q3.gguf", "qwen3", key_length=64)  # the width is refused before any tensor
    with pytest.raises(AdmissionError, match=r"qwen3 head width 64 .* not 128"):
        GgufCheckpoint(path)


def test_other_architectures_are_still_refused_by_name(tmp_path):
    path = tmp_path / "st.gguf"
    w = gguf.GGUFWriter(path, "starcoder2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(AdmissionError, match=r"'starcoder2' is not supported .*llama, qwen2, qwen3, gemma2, gemma3, phi3, gpt2, olmo2"):
        GgufCheckpoint(path)
