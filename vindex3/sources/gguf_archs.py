"""GGUF architectures read into the Hugging Face families' own configs: ``gemma2``, ``gemma3``,
``phi3``, ``gpt2`` and ``olmo2`` (llama, qwen2 and qwen3 are read in gguf.py).

Each architecture is one `Arch`: the ``<arch>.*`` metadata keys it reads (every other one is refused
by name), the ones that must be present, the GGUF tensor names of its layers with their Hugging Face
names, and a function that turns the metadata into the config a Hugging Face checkpoint of that
family would carry. Past this module admission runs the same family (vindex3.families) as for the
Hugging Face checkpoint, so the container objects and graph facts are the same.

The reading is the one transformers 5.24.0 applies loading the same file (``gguf_file=``), and where a
key the file states is one that reader ignores (it takes its config class's default instead), the
file is admitted only when the two agree; otherwise it is refused by name, never read one way here
and another way by the reference. Tensor values as transformers reads them: Gemma's norm weights are
stored as ``1 + w`` and read as ``w`` (``stored - 1`` in float32), GPT-2's Conv1D matrices are stored
[out, in] and read back transposed. olmo2 has no reference GGUF reader in transformers 5.24; its
reading is llama.cpp's (no q/k row permutation, post-norms and whole-projection QK-norms under
their own names) and is checked against the Hugging Face model holding the same weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import AdmissionError, ConfigError

GEMMA_REFERENCE_QUERY_SCALAR = 256  # transformers 5.24's Gemma2Config / Gemma3TextConfig default
GEMMA2_REFERENCE_SOFTCAPS = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# llama.cpp scales Gemma's scores by hidden / heads for the 27B models (told apart by layer count),
# by the head width otherwise
LLAMA_CPP_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
FORMAT_ROPE_BASE = 10000.0  # llama.cpp's rope.freq_base when the key is absent (and Gemma2Config's)


@dataclass(frozen=True)
class Arch:
    model_type: str  # the Hugging Face model_type the config carries
    consumed: frozenset[str]  # <arch>.* sub-keys read (or checked against what is read)
    required: tuple[str, ...]
    layer_tensors: dict[str, str]  # GGUF short name -> Hugging Face module under the layer prefix
    global_tensors: dict[str, str]  # GGUF name -> Hugging Face name
    biases: tuple[str, ...] = ()  # GGUF short names that carry a bias (and must)
    layer_prefix: str = "model.layers"
    norm_offset: bool = False  # norm weights stored as 1 + w, read as w
    transposed: tuple[str, ...] = ()  # stored [out, in], read [in, out] (GPT-2's Conv1D)
    neutral: dict[str, tuple] = field(default_factory=dict)  # sub-keys harmless at exactly these values
    config: Callable[[Any], dict] | None = None  # (reader) -> Hugging Face config
    shapes: Callable[[dict], dict[str, tuple[int, ...]]] | None = None  # config -> per-layer HF suffix -> shape


_ATTN = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj"}
_GATED = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BASIC_KEYS = ("context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count")
_LLAMA_GLOBALS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}


class Meta:
    """Typed reads of one file's ``<arch>.*`` keys, refusing by name."""

    def __init__(self, source, arch: str):
        self.source, self.arch, self.name = source, arch, source.path.name
        self.meta = source._meta

    def has(self, sub: str) -> bool:
        return f"{self.arch}.{sub}" in self.meta

    def int(self, sub: str) -> int:
        value = self.meta[f"{self.arch}.{sub}"]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"{self.name}: {self.arch}.{sub} = {value!r} is not a positive int")
        return int(value)

    def float(self, sub: str) -> float:
        value = self.meta[f"{self.arch}.{sub}"]
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not (value > 0 and np.isfinite(value)):
            raise ConfigError(f"{self.name}: {self.arch}.{sub} = {value!r} is not a positive finite number")
        return float(value)

    def refuse(self, sub: str, value, why: str):
        raise AdmissionError(f"{self.name}: {self.arch}.{sub} = {value!r}: {why}",
                             [{"category": "unsupported", "key": f"{self.arch}.{sub}", "value": value, "blocks": True}])

    def same(self, sub: str, want: int, what: str) -> None:
        """An optional key that must equal what the model is read with."""
        if self.has(sub) and self.int(sub) != want:
            self.refuse(sub, self.int(sub), f"differs from the {what} ({want}) the reference loader reads; refused "
                                            "rather than read one way here and another there")

    def vocab(self) -> int:
        if self.has("vocab_size"):
            return self.int("vocab_size")
        tokens = self.source._reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise AdmissionError(f"{self.name}: the vocabulary size is not stated "
                                 f"({self.arch}.vocab_size and tokenizer.ggml.tokens are both absent)")
        return len(tokens.data)

    def heads(self) -> tuple[int, int, int]:
        """(hidden, heads, kv heads), checked to divide."""
        hidden, heads = self.int("embedding_length"), self.int("attention.head_count")
        kv = self.int("attention.head_count_kv") if self.has("attention.head_count_kv") else None
        if kv is None:
            raise AdmissionError(f"{self.name}: {self.arch}.attention.head_count_kv is absent",
                                 [{"category": "missing", "key": f"{self.arch}.attention.head_count_kv", "blocks": True}])
        if heads % kv:
            raise AdmissionError(f"{self.name}: {self.arch}.attention.head_count {heads} is not a multiple of "
                                 f"{self.arch}.attention.head_count_kv {kv}")
        return hidden, heads, kv

    def tied(self) -> bool:
        # llama.cpp writes output.weight only when the head is not the embedding matrix
        return all(t.name != "output.weight" for t in self.source._reader.tensors)

    def rope(self, theta: float) -> dict:
        return {"rope_theta": theta, "rope_type": "default"}


def _common(m: Meta, hidden: int, heads: int, kv: int) -> dict:
    return {"vocab_size": m.vocab(), "hidden_size": hidden, "intermediate_size": m.int("feed_forward_length"),
            "num_hidden_layers": m.int("block_count"), "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": m.int("context_length"),
            "rms_norm_eps": m.float("attention.layer_norm_rms_epsilon"), "tie_word_embeddings": m.tied()}


# ---- Gemma 2 and Gemma 3 -------------------------------------------------------------------------

def _gemma_config(m: Meta) -> dict:
    hidden, heads, kv = m.heads()
    hd = m.int("attention.key_length")  # Gemma's head width is its own, not hidden / heads
    m.same("attention.value_length", hd, "head width (attention.key_length)")
    m.same("rope.dimension_count", hd, "rotary width (the whole head)")
    L = m.int("block_count")
    # The file does not state query_pre_attn_scalar. transformers 5.24 reads its class default (256);
    # llama.cpp scales by the head width, or by hidden / heads for the 27B layer count.
    llama_cpp = hidden // heads if L == LLAMA_CPP_GEMMA_27B_LAYERS[m.arch] else hd
    if not hd == llama_cpp == GEMMA_REFERENCE_QUERY_SCALAR:
        m.refuse("attention.key_length", hd,
                 f"the file states no query_pre_attn_scalar: transformers 5.24 reads {GEMMA_REFERENCE_QUERY_SCALAR}, "
                 f"llama.cpp {llama_cpp} (the head width, or hidden / heads at {LLAMA_CPP_GEMMA_27B_LAYERS[m.arch]} "
                 "layers); admitted only where the two agree")
    window = m.int("attention.sliding_window")
    cfg = {"model_type": m.arch if m.arch == "gemma2" else "gemma3_text", **_common(m, hidden, heads, kv),
           "head_dim": hd, "sliding_window": window, "query_pre_attn_scalar": GEMMA_REFERENCE_QUERY_SCALAR,
           "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False}
    if m.arch == "gemma2":
        for sub, want in GEMMA2_REFERENCE_SOFTCAPS.items():
            got = m.float(sub)
            if got != want:
                m.refuse(sub, got, f"transformers 5.24 does not read this key and softcaps at its default {want}")
            cfg[sub] = want
        # Gemma 2's converter writes no rope base: llama.cpp and Gemma2Config both run 10000
        theta = m.float("rope.freq_base") if m.has("rope.freq_base") else FORMAT_ROPE_BASE
        cfg["rope_parameters"] = m.rope(theta)
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    else:
        cfg["rope_parameters"] = {"sliding_attention": m.rope(FORMAT_ROPE_BASE),  # llama.cpp's and the reference's local base
                                  "full_attention": m.rope(m.float("rope.freq_base"))}
        cfg["layer_types"] = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(L)]
        cfg.update({"attn_logit_softcapping": None, "final_logit_softcapping": None})
    return cfg


def _gemma_shapes(c: dict) -> dict:
    h, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
           "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
           "post_attention_layernorm.weight": (h,), "pre_feedforward_layernorm.weight": (h,),
           "post_feedforward_layernorm.weight": (h,), "mlp.gate_proj.weight": (inter, h),
           "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
    if c["model_type"] == "gemma3_text":
        out.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    return out


_GEMMA_LAYERS = {"attn_norm": "input_layernorm", **_ATTN, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm", **_GATED}
_GEMMA_KEYS = frozenset({*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                         "attention.key_length", "attention.value_length", "attention.sliding_window",
                         "rope.dimension_count", "rope.freq_base", "vocab_size"})
_GEMMA_REQUIRED = (*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "attention.key_length",
                   "attention.sliding_window")


# ---- Phi-3 ---------------------------------------------------------------------------------------

def _phi3_config(m: Meta) -> dict:
    hidden, heads, kv = m.heads()
    hd = hidden // heads
    if hidden % heads:
        m.refuse("embedding_length", hidden, f"not a multiple of attention.head_count {heads}")
    m.same("rope.dimension_count", hd, "rotary width (transformers 5.24 does not read this key: partial_rotary_factor 1)")
    # attention.sliding_window: transformers 5.24 does not read it (Phi3Config's None: full attention),
    # and llama.cpp switches Phi-3's sliding window off; both attend over the whole context.
    # rope.scaling.original_context_length: read only by a longrope scaling, which is refused (its
    # rope_factors_* tensors are not mapped), so inert.
    return {"model_type": "phi3", **_common(m, hidden, heads, kv), "hidden_act": "silu", "sliding_window": None,
            "rope_parameters": {**m.rope(m.float("rope.freq_base")), "partial_rotary_factor": 1.0}}


def _phi3_shapes(c: dict) -> dict:
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {"input_layernorm.weight": (h,), "self_attn.qkv_proj.weight": (q + 2 * kv, h), "self_attn.o_proj.weight": (h, q),
            "post_attention_layernorm.weight": (h,), "mlp.gate_up_proj.weight": (2 * inter, h),
            "mlp.down_proj.weight": (h, inter)}


# ---- GPT-2 ---------------------------------------------------------------------------------------

def _gpt2_config(m: Meta) -> dict:
    hidden, heads = m.int("embedding_length"), m.int("attention.head_count")
    m.same("attention.head_count_kv", heads, "key/value heads (GPT-2 has one per query head)")
    if m.int("feed_forward_length") != 4 * hidden:
        m.refuse("feed_forward_length", m.int("feed_forward_length"),
                 f"transformers 5.24 does not read this key and builds GPT-2's MLP 4 * {hidden} wide")
    eps = m.float("attention.layer_norm_epsilon")
    rows = next((int(t.shape[1]) for t in m.source._reader.tensors if t.name == "position_embd.weight"), None)
    ctx = m.int("context_length")
    if rows is not None and rows != ctx:
        m.refuse("context_length", ctx, f"disagrees with position_embd.weight's {rows} rows")
    return {"model_type": "gpt2", "vocab_size": m.vocab(), "n_embd": hidden, "n_layer": m.int("block_count"),
            "n_head": heads, "n_positions": ctx, "layer_norm_epsilon": eps, "activation_function": "gelu_new",
            "n_inner": None, "tie_word_embeddings": m.tied()}


def _gpt2_shapes(c: dict) -> dict:
    h = c["n_embd"]
    return {"ln_1.weight": (h,), "ln_1.bias": (h,), "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,),
            "attn.c_proj.weight": (h, h), "attn.c_proj.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
            "mlp.c_fc.weight": (h, 4 * h), "mlp.c_fc.bias": (4 * h,), "mlp.c_proj.weight": (4 * h, h),
            "mlp.c_proj.bias": (h,)}


# ---- OLMo 2 --------------------------------------------------------------------------------------

def _olmo2_config(m: Meta) -> dict:
    hidden, heads, kv = m.heads()
    if hidden % heads:
        m.refuse("embedding_length", hidden, f"not a multiple of attention.head_count {heads}")
    hd = hidden // heads
    for sub in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
        m.same(sub, hd, "head width (hidden / heads: OLMo 2 has no head width of its own)")
    return {"model_type": "olmo2", **_common(m, hidden, heads, kv), "hidden_act": "silu", "attention_bias": False,
            "rope_parameters": m.rope(m.float("rope.freq_base"))}


def _olmo2_shapes(c: dict) -> dict:
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    return {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q), "self_attn.q_norm.weight": (q,), "self_attn.k_norm.weight": (kv,),
            "post_attention_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}


_NO_SCALING = {"rope.scaling.type": ("none",), "expert_count": (0,), "expert_used_count": (0,)}

ARCHS: dict[str, Arch] = {
    "gemma2": Arch("gemma2", _GEMMA_KEYS | {"attn_logit_softcapping", "final_logit_softcapping"},
                   (*_GEMMA_REQUIRED, "attn_logit_softcapping", "final_logit_softcapping"), _GEMMA_LAYERS,
                   {k: v for k, v in _LLAMA_GLOBALS.items() if k != "output.weight"},  # Gemma 2's head is the embedding
                   norm_offset=True, neutral=_NO_SCALING, config=_gemma_config, shapes=_gemma_shapes),
    "gemma3": Arch("gemma3_text", _GEMMA_KEYS, (*_GEMMA_REQUIRED, "rope.freq_base"),
                   {**_GEMMA_LAYERS, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
                   _LLAMA_GLOBALS, norm_offset=True, neutral=_NO_SCALING, config=_gemma_config, shapes=_gemma_shapes),
    "phi3": Arch("phi3", frozenset({*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                                    "rope.dimension_count", "rope.freq_base", "vocab_size", "attention.sliding_window",
                                    "rope.scaling.original_context_length"}),
                 (*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base"),
                 {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
                  "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
                 _LLAMA_GLOBALS, neutral=_NO_SCALING, config=_phi3_config, shapes=_phi3_shapes),
    "gpt2": Arch("gpt2", frozenset({*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_epsilon", "vocab_size"}),
                 (*_BASIC_KEYS, "attention.layer_norm_epsilon"),
                 {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                  "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                 {"token_embd.weight": "transformer.wte.weight", "position_embd.weight": "transformer.wpe.weight",
                  "output_norm.weight": "transformer.ln_f.weight", "output_norm.bias": "transformer.ln_f.bias",
                  "output.weight": "lm_head.weight"},
                 biases=("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"),
                 layer_prefix="transformer.h", transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down"),
                 neutral={"expert_count": (0,), "expert_used_count": (0,)}, config=_gpt2_config, shapes=_gpt2_shapes),
    "olmo2": Arch("olmo2", frozenset({*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
                                      "rope.freq_base", "vocab_size", "attention.key_length", "attention.value_length",
                                      "rope.dimension_count"}),
                  (*_BASIC_KEYS, "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base"),
                  {**_ATTN, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                   "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm", **_GATED},
                  _LLAMA_GLOBALS, neutral=_NO_SCALING, config=_olmo2_config, shapes=_olmo2_shapes),
}


def grade_keys(source, arch: Arch) -> None:
    """Every ``<arch>.*`` key: read, harmless at its value, or refused by name; required keys present."""
    prefix = f"{source.architecture}."
    findings = []
    for key, value in source._meta.items():
        if not key.startswith(prefix):
            continue
        sub = key[len(prefix):]
        if sub in arch.consumed or (sub in arch.neutral and value in arch.neutral[sub]):
            continue
        findings.append({"category": "unknown", "key": key, "value": value, "blocks": True})
    for sub in arch.required:
        if f"{prefix}{sub}" not in source._meta:
            findings.append({"category": "missing", "key": f"{prefix}{sub}", "value": None, "blocks": True})
    if findings:
        parts = [f"{f['key']}={f['value']!r}" if f["category"] == "unknown" else f"{f['key']} (absent)" for f in findings]
        raise AdmissionError(
            f"{source.path.name}: metadata this importer cannot judge: {'; '.join(parts)}", findings,
            hint=f"unknown {prefix}* keys (rope scaling, experts, ...) change the model and are refused rather than "
                 "ignored; required keys are never defaulted")


def expected_shapes(arch: Arch, config: dict) -> dict[str, tuple[int, ...]]:
    per_layer = arch.shapes(config)
    L = config.get("num_hidden_layers", config.get("n_layer"))
    h = config.get("hidden_size", config.get("n_embd"))
    globals_: dict[str, tuple[int, ...]] = {}
    for hf in arch.global_tensors.values():
        if hf.endswith(("embed_tokens.weight", "wte.weight")):
            globals_[hf] = (config["vocab_size"], h)
        elif hf.endswith("wpe.weight"):
            globals_[hf] = (config["n_positions"], h)
        elif hf == "lm_head.weight":
            if not config["tie_word_embeddings"]:
                globals_[hf] = (config["vocab_size"], h)
        else:
            globals_[hf] = (h,)
    shapes = {n: s for n, s in globals_.items() if not n.startswith("lm_head")}
    for i in range(L):
        for suffix, shape in per_layer.items():
            shapes[f"{arch.layer_prefix}.{i}.{suffix}"] = shape
    shapes.update({n: s for n, s in globals_.items() if n.startswith("lm_head")})
    return shapes


def hf_name(arch: Arch, gguf_name: str, layer_re, n_layers: int) -> str | None:
    hf = arch.global_tensors.get(gguf_name)
    if hf is not None:
        return hf
    m = layer_re.fullmatch(gguf_name)
    if m and m.group(2) in arch.layer_tensors and int(m.group(1)) < n_layers and (
            m.group(3) == "weight" or m.group(2) in arch.biases):
        return f"{arch.layer_prefix}.{int(m.group(1))}.{arch.layer_tensors[m.group(2)]}.{m.group(3)}"
    return None


def stored_shape(arch: Arch, gguf_name: str, hf_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of a tensor stored with ``hf_shape`` read as [out, in]."""
    return tuple(reversed(hf_shape)) if is_transposed(arch, gguf_name) else hf_shape


def is_transposed(arch: Arch, gguf_name: str) -> bool:
    parts = gguf_name.split(".")
    return len(parts) == 4 and parts[2] in arch.transposed and parts[3] == "weight"


def is_offset_norm(arch: Arch, gguf_name: str) -> bool:
    # transformers subtracts 1 from every tensor whose name holds "norm.weight" (Gemma2TensorProcessor)
    return arch.norm_offset and "norm.weight" in gguf_name


def read_values(arch: Arch, gguf_name: str, w: np.ndarray) -> np.ndarray:
    """Stored values as the Hugging Face tensor holds them (exactly transformers' reading)."""
    if is_offset_norm(arch, gguf_name):
        w = w - np.float32(1)
    if is_transposed(arch, gguf_name):
        w = w.T
    return w
