"""GGUF architectures read into the Hugging Face families: gemma2, gemma3, phi3, gpt2 and olmo2.

Each tiny file is written here the way llama.cpp's converter writes that architecture (its metadata
keys, its tensor names from ``gguf.get_tensor_name_map``, Gemma's norms stored as 1 + w, GPT-2's
Conv1D matrices stored [out, in] and its head written beside the embedding) from a seeded tiny
Hugging Face model, its matrices quantized with ``gguf.quants`` to a mix of block types (Q4_K from
random blocks with small finite scales, which gguf.quants cannot quantize). The oracle is that
Hugging Face model (transformers 5.24.0, fp32, eager) holding the file's dequantized values; where
transformers reads the architecture from GGUF itself (all but olmo2), its reading of the file is
also checked to be exactly ours: config and every tensor, bit for bit."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from family_models import rerandomise
from fixtures import token_by_token
from gguf import GGMLQuantizationType as Q
from test_gguf_import import _tiny_vocab, bits

import vindex3
from vindex3.encode import encode
from vindex3.errors import AdmissionError
from vindex3.sources.gguf import GgufCheckpoint

pytestmark = pytest.mark.numeric

F32 = np.float32
TOKENS, TOKEN_TYPES, MERGES = _tiny_vocab()
V = len(TOKENS)  # 266: not a power of two
IDS = [200, 12, 260, 77, 261, 5, 90, 262, 31, 140, 7, 33, 250, 64]
TYPES = [Q.Q8_0, Q.Q4_1, Q.Q5_0, Q.F16, Q.Q4_K, Q.BF16, Q.Q5_1, Q.Q4_0, Q.Q6_K, Q.F32]
IDS_OF = {"bos_token_id": TOKENS.index("<s>"), "eos_token_id": TOKENS.index("</s>"),
          "pad_token_id": TOKENS.index("<|endoftext|>")}

# model_type, HF config, rerandomise scale, GGUF arch
CASES = {
    "gemma2": ("gemma2", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 2,
                              "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 4, "max_position_embeddings": 256},
               {"zero_centred": True, "emb": 0.1}),
    "gemma3": ("gemma3_text", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 2,
                                   "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 4, "max_position_embeddings": 256},
               {"zero_centred": True, "emb": 0.1}),
    "phi3": ("phi3", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False},
             {}),
    "gpt2": ("gpt2", {"n_embd": 256, "n_layer": 2, "n_head": 4, "n_positions": 1024}, {"emb": 0.15}),
    "olmo2": ("olmo2", {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False,
                            "rope_theta": 500000.0}, {}),
}
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_model(arch: str, vocab: int = V):
    mt, cfg, scale = CASES[arch]
    config = transformers.AutoConfig.for_model(mt, vocab_size=vocab, **IDS_OF, **cfg)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    rerandomise(model, **scale)
    return model.eval()


def _to_file(arch: str, hf: str, x: np.ndarray) -> np.ndarray:
    """The converter's change of a Hugging Face tensor (and `_from_file`, transformers' inverse)."""
    if arch.startswith("gemma") and hf.endswith("norm.weight"):
        return x + F32(1)
    if arch == "gpt2" and hf.endswith(CONV1D):
        return np.ascontiguousarray(x.T)
    return x


def _from_file(arch: str, hf: str, x: np.ndarray) -> np.ndarray:
    if arch.startswith("gemma") and hf.endswith("norm.weight"):
        return x - F32(1)
    if arch == "gpt2" and hf.endswith(CONV1D):
        return np.ascontiguousarray(x.T)
    return x


def _add(w, name, x, qtype, rng):
    if x.ndim == 1 or qtype == Q.F32:
        w.add_tensor(name, x.astype(F32))
    elif qtype == Q.F16:
        w.add_tensor(name, x.astype(np.float16))
    elif qtype in (Q.Q4_K, Q.Q6_K):  # random blocks with small finite f16 scales
        _, bb = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(x.shape[0], x.shape[1] // 256, bb), dtype=np.uint8)
        offsets = (0, 2) if qtype == Q.Q4_K else (bb - 2,)
        for off in offsets:  # Q4_K: d, dmin; Q6_K: d (its int8 sub-scales stay random)
            # weights then within ~0.06 (Q4_K: d·63·15; Q6_K: d·127·32), a unit-gain matrix's scale
            raw[:, :, off:off + 2] = (rng.uniform(0.5, 1.0, raw.shape[:2]) * 2.0**(-14 if qtype == Q.Q4_K else -16)
                                      ).astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
        w.add_tensor(name, raw.reshape(x.shape[0], -1), raw_dtype=qtype)
    else:
        w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)


def write_gguf(path, arch: str, model, *, meta: dict | None = None, extra_tensors: dict | None = None, seed: int = 1,
               spm: tuple | None = None):
    """The model as llama.cpp's converter writes ``arch``; ``meta`` overrides or (None) drops keys;
    ``spm``: a SentencePiece vocabulary (tokens, types, scores) instead of the byte-level one."""
    rng = np.random.default_rng(seed)
    c = model.config
    L = c.num_hidden_layers
    keys = {"context_length": c.max_position_embeddings, "embedding_length": c.hidden_size,
            "block_count": L, "feed_forward_length": getattr(c, "intermediate_size", None) or 4 * c.hidden_size,
            "attention.head_count": c.num_attention_heads}
    if arch != "gpt2":
        keys.update({"attention.head_count_kv": c.num_key_value_heads, "attention.layer_norm_rms_epsilon": c.rms_norm_eps})
    if arch.startswith("gemma"):
        keys.update({"attention.key_length": c.head_dim, "attention.value_length": c.head_dim,
                     "attention.sliding_window": c.sliding_window})
    if arch == "gemma2":
        keys.update({"attn_logit_softcapping": c.attn_logit_softcapping, "final_logit_softcapping": c.final_logit_softcapping})
    if arch == "gemma3":
        keys["rope.freq_base"] = c.rope_parameters["full_attention"]["rope_theta"]
    if arch in ("phi3", "olmo2"):
        keys["rope.freq_base"] = c.rope_parameters["rope_theta"]
    if arch == "phi3":
        keys.update({"rope.dimension_count": c.hidden_size // c.num_attention_heads, "attention.sliding_window": 2047,
                     "rope.scaling.original_context_length": 4096})
    if arch == "gpt2":
        keys["attention.layer_norm_epsilon"] = c.layer_norm_epsilon
    keys.update(meta or {})
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}-test")
    for k, v in keys.items():
        if v is None:
            continue
        if isinstance(v, float):
            w.add_float32(f"{arch}.{k}", v)
        elif isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", int(v))
    if spm is None:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(TOKENS)
        w.add_token_types(TOKEN_TYPES)
        w.add_token_merges(MERGES)
        w.add_bos_token_id(IDS_OF["bos_token_id"])
        w.add_eos_token_id(IDS_OF["eos_token_id"])
        w.add_pad_token_id(IDS_OF["pad_token_id"])
        w.add_add_bos_token(False)
    else:
        toks, types, scores = spm
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(toks)
        w.add_token_types(types)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(toks.index("<unk>"))
        w.add_pad_token_id(toks.index("<pad>"))
        w.add_add_bos_token(True)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], L)
    k = 0
    state = {n: p.detach().numpy() for n, p in model.state_dict().items()}
    tied = c.tie_word_embeddings
    for hf, x in state.items():
        if hf == "lm_head.weight" and tied:
            continue
        base, suffix = hf.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, hf
        x = _to_file(arch, hf, x)
        if x.ndim == 2 and name not in ("token_embd", "position_embd", "output"):  # embeddings and head: Q8_0
            qtype = TYPES[k % len(TYPES)]
            k += 1
            if qtype in (Q.Q4_K, Q.Q6_K) and x.shape[1] % 256:
                qtype = Q.Q8_0
        else:
            qtype = Q.Q8_0 if x.ndim == 2 else Q.F32
        _add(w, f"{name}.{suffix}", x, qtype, rng)
        if arch == "gpt2" and name == "token_embd":  # the converter writes GPT-2's head beside its embedding
            _add(w, "output.weight", x, Q.Q8_0, rng)
    for name, x in (extra_tensors or {}).items():
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def oracle(arch: str, model, path):
    """The Hugging Face model holding the file's values, read back as transformers reads them."""
    reader = gguf.GGUFReader(path)
    stored = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], model.config.num_hidden_layers)
    ref = copy.deepcopy(model)
    if arch == "gpt2":  # untie: the file's head is its own tensor
        ref.config.tie_word_embeddings = False
        ref.lm_head.weight = torch.nn.Parameter(ref.lm_head.weight.detach().clone())
    with torch.no_grad():
        for hf, p in ref.named_parameters():
            base, suffix = hf.rsplit(".", 1)
            name = "output" if (arch == "gpt2" and hf == "lm_head.weight") else names.get_name(base)
            t = stored[f"{name}.{suffix}"]
            x = gguf.quants.dequantize(t.data, t.tensor_type).reshape(
                tuple(reversed(p.shape)) if (arch == "gpt2" and hf.endswith(CONV1D)) else tuple(p.shape))
            p.copy_(torch.from_numpy(_from_file(arch, hf, x.astype(F32))))
    return ref


@pytest.fixture(scope="module", params=list(CASES))
def tiny(request, tmp_path_factory):
    arch = request.param
    model = hf_model(arch)
    path = write_gguf(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch, model)
    return arch, path, oracle(arch, model, path)


def test_reading_matches_transformers_gguf_reader(tiny):
    """Config keys and every tensor exactly as transformers 5.24.0 reads the same file (olmo2: the
    tensors as the oracle holds them; transformers has no olmo2 GGUF reader)."""
    arch, path, ref = tiny
    src = GgufCheckpoint(path)
    assert src.config["model_type"] == ref.config.model_type
    if arch == "olmo2":
        with pytest.raises(ValueError, match="olmo2 is not supported"):
            transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        theirs = ref
    else:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        got = theirs.config.to_dict()
        for key, value in src.config.items():
            assert key in got and got[key] == value, (key, value, got.get(key))
    params = {k: v.detach().numpy() for k, v in theirs.named_parameters()}
    if getattr(theirs.config, "tie_word_embeddings", False):
        params.pop("lm_head.weight", None)
    specs = src.tensor_specs()
    assert set(specs) == set(params)
    for name in specs:
        assert np.array_equal(bits(src.load(name)), bits(params[name])), name
    plan = vindex3.admit(path)
    assert plan.admissible, [f.text() for f in plan.blocking()]


def test_containers_match_the_reference_prefill_and_decode(tiny, tmp_path):
    arch, path, ref = tiny
    with torch.no_grad():
        theirs = ref(torch.tensor([IDS])).logits[0].numpy()
        truth = copy.deepcopy(ref).double()(torch.tensor([IDS])).logits[0].numpy()
    floor = float(np.abs(theirs - truth).max())
    assert 1.0 < np.abs(theirs).max() < 100.0  # logits O(1-10): the tolerance means something
    # 1e-4, the GGUF bar: the reference's own float32-vs-float64 spread on these files is
    # 0.7-5.5e-6 (measured per architecture at logits of 4-15, printed below), asserted under 1e-5
    assert floor <= 1e-5, floor
    native = vindex3.open(encode(path, tmp_path / "n.vindex3", native=True))
    widened = vindex3.open(encode(path, tmp_path / "w.vindex3"))
    encs = {e.dtype for s in native.segments.values() for e in s.entries.values()}
    figures = {}
    for label, c in (("native", native), ("f32", widened)):
        ex = c.executor()
        ours, dec = ex.forward(IDS), token_by_token(c.executor(), IDS)
        assert ours.dtype == dec.dtype == np.float32
        figures[label] = (float(np.abs(ours - theirs).max()), float(np.abs(dec - theirs).max()))
        assert max(figures[label]) <= 1e-4, (label, figures)
        assert np.array_equal(c.executor(slice=vindex3.Draft(c.graph.num_layers)).forward(IDS), ours)
    print(f"{arch}: max logit {np.abs(theirs).max():.3g}, hf32 vs hf64 {floor:.3g}; native {figures['native']}; f32 {figures['f32']}; encodings {sorted(encs)}")
    if arch not in ("gpt2",):  # GPT-2's matrices are transposed or split at encode: widened
        assert {"q8_0", "q4_1"} & encs


# ---- refusals by name --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models():
    return {a: hf_model(a) for a in ("gemma2", "phi3", "gpt2", "olmo2")}


@pytest.mark.parametrize("arch, meta, extra, match", [
    ("gemma2", {"attn_logit_softcapping": 20.0}, None, r"gemma2\.attn_logit_softcapping = 20\.0.*default 50"),
    ("gemma2", {"final_logit_softcapping": None}, None, r"gemma2\.final_logit_softcapping \(absent\)"),
    ("gemma2", {"attention.sliding_window": None}, None, r"gemma2\.attention\.sliding_window \(absent\)"),
    ("gemma2", {"rope.scaling.type": "linear"}, None, r"gemma2\.rope\.scaling\.type='linear'"),
    ("gemma2", {"attention.value_length": 128}, None, r"gemma2\.attention\.value_length = 128"),
    ("phi3", {"rope.dimension_count": 32}, None, r"phi3\.rope\.dimension_count = 32.*rotary width"),
    ("phi3", {"rope.freq_base": None}, None, r"phi3\.rope\.freq_base \(absent\)"),
    ("phi3", {}, {"rope_factors_long.weight": np.ones(32, F32)}, r"no phi3 role: rope_factors_long\.weight"),
    ("gpt2", {"feed_forward_length": 512}, None, r"gpt2\.feed_forward_length = 512.*4 \* 256"),
    ("gpt2", {"context_length": 512}, None, r"gpt2\.context_length = 512.*1024 rows"),
    ("olmo2", {"attention.sliding_window": 8}, None, r"olmo2\.attention\.sliding_window=8"),
    ("olmo2", {"attention.head_count_kv": None}, None, r"olmo2\.attention\.head_count_kv \(absent\)"),
])
def test_what_the_reading_cannot_judge_is_refused_by_name(models, tmp_path, arch, meta, extra, match):
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, models[arch], meta=meta, extra_tensors=extra)
    with pytest.raises(AdmissionError, match=match):
        GgufCheckpoint(path)


def test_gemma_head_width_the_two_readers_disagree_on_is_refused(tmp_path):
    model = hf_model("gemma2")
    path = write_gguf(tmp_path / "g.gguf", "gemma2", model, meta={"attention.key_length": 128,
                                                                   "attention.value_length": 128})
    with pytest.raises(AdmissionError, match=r"no query_pre_attn_scalar: transformers 5\.24 reads 256, llama\.cpp 128"):
        GgufCheckpoint(path)


def test_gemma2_head_tensor_is_refused_by_name(models, tmp_path):
    """Gemma 2's head is its embedding: an output.weight in the file has no role (the reference
    would ignore it)."""
    path = write_gguf(tmp_path / "g.gguf", "gemma2", models["gemma2"],
                      extra_tensors={"output.weight": np.zeros((V, 256), F32)})
    with pytest.raises(AdmissionError, match=r"no gemma2 role: output\.weight"):
        GgufCheckpoint(path)


# ---- SentencePiece vocabularies ----------------------------------------------------------------

def _spm_vocab(arch: str):
    from test_gguf_spm import spm_vocab

    toks, types, scores = spm_vocab(False)
    if arch.startswith("gemma"):  # Gemma's spellings, which its tokenizer class names by default
        toks[1:3] = ["<bos>", "<eos>"]
    # Gemma files store tokens of spaces as spaces; control <pad> and <mask> as Gemma's have
    for t, ty, sc in (("  ", 1, -40.0), ("   ", 1, -41.0), ("<pad>", 3, 0.0), ("<mask>", 3, 0.0)):
        toks.append(t)
        types.append(ty)
        scores.append(sc)
    return toks, types, scores


SPM_TEXTS = ["the thin in", " in the <think> é", "café x", "  hi  there ", "a   b", "naïve 東京 🙂", "<s>the</s>", ""]


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "phi3"])
def test_sentencepiece_vocabulary_matches_transformers(arch, tmp_path):
    """Gemma's and Phi-3's SentencePiece vocabularies rebuilt with each architecture's own rules,
    as transformers 5.24.0 builds them from the same file: the same tokenizer.json, ids and text."""
    import tokenizers
    from transformers import AutoTokenizer

    spm = _spm_vocab(arch)
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, hf_model(arch, len(spm[0])), spm=spm)
    src = GgufCheckpoint(path)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    blob = src.capability_files()["tokenizer.json"].decode()
    assert json.loads(blob) == json.loads(tok.backend_tokenizer.to_str())
    ours = tokenizers.Tokenizer.from_str(blob)
    for text in SPM_TEXTS:
        ids = tok(text).input_ids
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_gemma_vocabulary_without_gemmas_special_spellings_is_refused(tmp_path):
    """transformers' Gemma tokenizer names <bos>, <eos>, <unk>, <pad> and <mask> whatever the file
    says, and appends any the vocabulary lacks past the model's embedding rows: refused by name."""
    spm = _spm_vocab("phi3")  # <s> and </s>, no <bos> / <eos>
    path = write_gguf(tmp_path / "g.gguf", "gemma2", hf_model("gemma2", len(spm[0])), spm=spm)
    with pytest.raises(AdmissionError, match=r"lacks <bos>, <eos>"):
        GgufCheckpoint(path)
