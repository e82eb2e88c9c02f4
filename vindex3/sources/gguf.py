"""GGUF import: a llama, qwen2, qwen3, gemma2, gemma3, phi3, gpt2 or olmo2 GGUF file as a checkpoint
source (the last five read through the tables in gguf_archs.py).

The numerical and tokenizer reference is Hugging Face ``transformers==5.24.0`` loading the same
file with ``gguf_file=``. For llama files transformers takes its legacy GGUF path: the config comes
from the ``llama.*`` and ``tokenizer.ggml.*`` metadata, every tensor is dequantized with
``gguf.quants.dequantize`` and the q/k projections are un-permuted from llama.cpp's rotary layout
back to the Hugging Face one. qwen2 and qwen3 files take the same path without the un-permutation
(llama.cpp stores their q/k rows in Hugging Face order); qwen2's q/k/v biases and qwen3's per-head
q/k norms are mapped to their Hugging Face names. This module does the same, written here, and
refuses by name whatever that path would silently misread (rope scaling, partial rotary, a qwen3
head width other than the 128 the reference assumes, unmapped tensors, sharded files, ...).

Opening a file reads metadata and tensor infos only: ``gguf.GGUFReader`` memory-maps the file and
no tensor is dequantized until ``load()`` asks for it.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from .. import jsonio
from ..errors import AdmissionError, ConfigError
from .base import CheckpointSource, TensorSpec
from .gguf_archs import (
    ARCHS,
    Meta,
    expected_shapes,
    grade_keys,
    hf_name,
    is_offset_norm,
    is_transposed,
    read_values,
)

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", *ARCHS)
# qwen3: transformers 5.24's GGUF config mapping does not read qwen3.attention.key_length, so the
# reference model takes Qwen3Config's default head width; a file of another width is refused.
QWEN3_REFERENCE_HEAD_DIM = 128

# The pre-tokenizer split that transformers puts before the byte-level step for a
# tokenizer.ggml.pre value (Qwen2's published split pattern).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# Llama 3's published split: Qwen2's with digits in runs of up to three
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|", 1)
SPLITS = {"qwen2": _QWEN2_SPLIT, "llama-bpe": _LLAMA3_SPLIT}

# Tokenizers that are rebuilt from the GGUF vocabulary exactly as transformers builds them.
# tokenizer.ggml.model -> the tokenizer.ggml.pre values for which transformers keeps the plain
# GPT-2 byte-level split (it swaps in other split regexes for llama-bpe, qwen2, ... which are not
# reproduced here and so are refused by name).
SUPPORTED_TOKENIZERS = {"gpt2": ("gpt2", "smollm", "qwen2", "llama-bpe"), "llama": (None, "default")}

# Architectures whose SentencePiece vocabularies (tokenizer.ggml.model llama) are rebuilt as
# transformers 5.24 builds them: Llama's tokenizer; Phi-3's, whose prefix space comes from a
# normalizer; Gemma's, with whitespace tokens respelled and merges ordered by position.
SENTENCEPIECE_ARCHITECTURES = ("llama", "phi3", "gemma2", "gemma3")
GEMMA_SPECIAL_SPELLINGS = ("<bos>", "<eos>", "<unk>", "<pad>", "<mask>")

# llama.* metadata keys read into the config.
_CONSUMED_ARCH_KEYS = {
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
    # checked against the head width, never consumed on their own
    "attention.key_length",
    "attention.value_length",
}
# llama.* keys that are harmless at exactly these values (anything else blocks).
_NEUTRAL_ARCH_VALUES = {
    "rope.scaling.type": ("none",),
    "expert_count": (0,),
    "expert_used_count": (0,),
}
_REQUIRED_ARCH_KEYS = (
    "context_length",
    "embedding_length",
    "block_count",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
)

# GGUF tensor names -> Hugging Face names (llama).
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
# per architecture: extra per-layer tensors (GGUF name -> HF module) and which of them have biases
_ARCH_LAYER_TENSORS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
}
_ARCH_BIASES = {"llama": (), "qwen2": ("attn_q", "attn_k", "attn_v"), "qwen3": ()}

# token_type values in tokenizer.ggml.token_type (llama.cpp's llama_token_type)
_CONTROL = 3
_USER_DEFINED = 4


def _byte_alphabet() -> list[str]:
    """The printable spelling of each byte used by byte-level BPE vocabularies: bytes that are
    printable Latin-1 characters stand for themselves, the other 68 are shifted to U+0100 and up,
    in byte order."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    spelling, shifted = [], 0
    for b in range(256):
        if b in keep:
            spelling.append(chr(b))
        else:
            spelling.append(chr(0x100 + shifted))
            shifted += 1
    return spelling


class GgufCheckpoint(CheckpointSource):
    """A single-file GGUF checkpoint of one of SUPPORTED_ARCHITECTURES."""

    kind = "gguf"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._sha256: str | None = None
        self._capabilities: dict[str, bytes] | None = None
        self._reader = self._open_reader()
        self._meta = self._read_metadata()
        self.architecture = self._meta.get("general.architecture")
        self._check_architecture()
        self._check_split()
        self.config = self._build_config()
        self._tensors, self._specs = self._map_tensors()
        self._check_dequantizable()
        self._check_tokenizer()

    # ---------------------------------------------------------------- reading the file

    def _open_reader(self):
        import gguf

        try:
            return gguf.GGUFReader(self.path, "r")
        except FileNotFoundError:
            raise ConfigError(f"GGUF file {self.path.name} does not exist") from None
        # GGUFReader reports corruption as ValueError, IndexError, numpy reshape errors...
        except Exception as e:  # noqa: BLE001
            raise ConfigError(
                f"{self.path.name} is not a readable GGUF file: {type(e).__name__}: {e}",
                hint="the file may be truncated or corrupt; re-download or re-convert it",
            ) from None

    def _read_metadata(self) -> dict[str, Any]:
        """Every key-value field except the large token arrays, which are read on demand."""
        meta: dict[str, Any] = {}
        lazy = {
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.scores",
        }
        for key, field in self._reader.fields.items():
            if key in lazy:
                meta[key] = None  # present; read by _array()
                continue
            try:
                meta[key] = field.contents()
            except (UnicodeDecodeError, ValueError, IndexError) as e:
                raise ConfigError(
                    f"{self.path.name}: metadata key {key} cannot be read ({e})"
                ) from None
        return meta

    def _array(self, key: str) -> list | None:
        field = self._reader.fields.get(key)
        if field is None:
            return None
        try:
            return field.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise ConfigError(
                f"{self.path.name}: metadata key {key} cannot be read ({e})"
            ) from None

    # ---------------------------------------------------------------- admission checks

    def _check_architecture(self) -> None:
        arch = self.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise AdmissionError(
                f"{self.path.name}: GGUF architecture {arch!r} is not supported "
                f"(general.architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)})",
                [
                    {
                        "category": "architecture",
                        "key": "general.architecture",
                        "value": arch,
                        "blocks": True,
                    }
                ],
            )
        if arch == "llama" and self._meta.get("general.name") == "mistral":
            # transformers reads a llama file whose general.name is exactly "mistral" as a Mistral
            # model, with that family's own defaults: not the llama this importer describes.
            raise AdmissionError(
                f"{self.path.name}: general.name 'mistral' on a llama-architecture file makes the "
                "reference loader treat it as a Mistral model; this importer does not judge that reading",
                [
                    {
                        "category": "architecture",
                        "key": "general.name",
                        "value": "mistral",
                        "blocks": True,
                    }
                ],
            )

    def _check_split(self) -> None:
        count = self._meta.get("split.count")
        if count is not None and count != 1:
            raise AdmissionError(
                f"{self.path.name}: a split GGUF (split.count={count}) is not supported; "
                "only single-file GGUF checkpoints are",
                [{"category": "layout", "key": "split.count", "value": count, "blocks": True}],
                hint="merge the shards into one file first (llama.cpp's gguf-split --merge)",
            )

    def _build_config(self) -> dict:
        if self.architecture in ARCHS:
            grade_keys(self, ARCHS[self.architecture])
            config = ARCHS[self.architecture].config(Meta(self, self.architecture))
        else:
            config = self._build_llama_config()
        return self._token_ids(config)

    def _build_llama_config(self) -> dict:
        arch = self.architecture
        prefix = f"{arch}."
        findings = []
        for key, value in self._meta.items():
            if not key.startswith(prefix):
                continue
            sub = key[len(prefix) :]
            if sub in _CONSUMED_ARCH_KEYS:
                continue
            if sub in _NEUTRAL_ARCH_VALUES and value in _NEUTRAL_ARCH_VALUES[sub]:
                continue
            findings.append({"category": "unknown", "key": key, "value": value, "blocks": True})
        missing = [f"{prefix}{k}" for k in _REQUIRED_ARCH_KEYS if f"{prefix}{k}" not in self._meta]
        for key in missing:
            findings.append({"category": "missing", "key": key, "value": None, "blocks": True})
        if findings:
            parts = [
                f"{f['key']}={f['value']!r}"
                if f["category"] == "unknown"
                else f"{f['key']} (absent)"
                for f in findings
            ]
            raise AdmissionError(
                f"{self.path.name}: metadata this importer cannot judge: {'; '.join(parts)}",
                findings,
                hint=f"unknown {prefix}* keys (rope scaling, experts, ...) change the model and are refused "
                "rather than ignored; required keys are never defaulted",
            )

        def get(sub: str, kind: type):
            value = self._meta[f"{prefix}{sub}"]
            ok = isinstance(value, kind) and not isinstance(value, bool)
            if kind is float:
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not ok or (kind is int and value <= 0):
                raise ConfigError(
                    f"{self.path.name}: {prefix}{sub} = {value!r} is not a positive {kind.__name__}"
                )
            return kind(value)

        hidden = get("embedding_length", int)
        heads = get("attention.head_count", int)
        kv_heads = get("attention.head_count_kv", int)
        if hidden % heads:
            raise AdmissionError(
                f"{self.path.name}: {prefix}embedding_length {hidden} is not a multiple of "
                f"{prefix}attention.head_count {heads}"
            )
        if heads % kv_heads:
            raise AdmissionError(
                f"{self.path.name}: {prefix}attention.head_count {heads} is not a multiple of "
                f"{prefix}attention.head_count_kv {kv_heads}"
            )
        head_dim = hidden // heads
        if arch == "qwen3":
            # qwen3's head width is its own (attention.key_length), not hidden / heads
            head_dim = get("attention.key_length", int) if f"{prefix}attention.key_length" in self._meta else head_dim
            if head_dim != QWEN3_REFERENCE_HEAD_DIM:
                raise AdmissionError(
                    f"{self.path.name}: qwen3 head width {head_dim} (qwen3.attention.key_length, else "
                    f"embedding_length / head_count) is not {QWEN3_REFERENCE_HEAD_DIM}, the width the reference "
                    "loader assumes (transformers 5.24 does not read qwen3.attention.key_length from a GGUF)",
                    [{"category": "unsupported", "key": f"{prefix}attention.key_length", "value": head_dim,
                      "blocks": True}],
                )
        if head_dim % 2:
            raise AdmissionError(
                f"{self.path.name}: head width {head_dim} is odd; rotary q/k rows come in pairs"
            )
        for sub in ("attention.key_length", "attention.value_length", "rope.dimension_count"):
            if f"{prefix}{sub}" in self._meta:
                value = get(sub, int)
                if value != head_dim:
                    raise AdmissionError(
                        f"{self.path.name}: {prefix}{sub} = {value} differs from the head width "
                        f"{head_dim} (embedding_length / head_count); partial rotary or a separate "
                        "head width is not read correctly by the reference loader and is refused",
                        [
                            {
                                "category": "unknown",
                                "key": f"{prefix}{sub}",
                                "value": value,
                                "blocks": True,
                            }
                        ],
                    )
        if f"{prefix}vocab_size" in self._meta:
            vocab = get("vocab_size", int)
        else:
            tokens = self._reader.fields.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise AdmissionError(
                    f"{self.path.name}: the vocabulary size is not stated "
                    f"({prefix}vocab_size and tokenizer.ggml.tokens are both absent)"
                )
            vocab = len(tokens.data)
        theta = get("rope.freq_base", float)
        eps = get("attention.layer_norm_rms_epsilon", float)
        if not (theta > 0 and np.isfinite(theta)):
            raise ConfigError(
                f"{self.path.name}: {prefix}rope.freq_base = {theta!r} is not a positive finite number"
            )
        if not (eps > 0 and np.isfinite(eps)):
            raise ConfigError(
                f"{self.path.name}: {prefix}attention.layer_norm_rms_epsilon = {eps!r} is not a positive finite number"
            )

        tensor_names = {t.name for t in self._reader.tensors}
        config: dict[str, Any] = {
            "model_type": arch,
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": get("feed_forward_length", int),
            "num_hidden_layers": get("block_count", int),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,  # dropped below for qwen2, whose config has no such key
            "hidden_act": "silu",
            "max_position_embeddings": get("context_length", int),
            "rms_norm_eps": eps,
            "rope_parameters": {"rope_theta": theta, "rope_type": "default"},
            # llama.cpp writes output.weight only when the head is not the embedding matrix
            "tie_word_embeddings": "output.weight" not in tensor_names,
        }
        self.head_dim = head_dim
        if arch == "qwen2":
            del config["head_dim"]
        if arch == "llama":  # bias tensors are refused as unmapped, so their absence is established
            config.update({"attention_bias": False, "mlp_bias": False})
        elif arch == "qwen3":  # qwen3's q/k/v/o biases are unmapped too; qwen2's q/k/v biases are fixed
            config["attention_bias"] = False
        return config

    def _token_ids(self, config: dict) -> dict:
        vocab = config["vocab_size"]
        # Token ids the file states; an absent one stays absent (transformers would fall back to
        # LlamaConfig's defaults 1 and 2 for bos/eos, which are facts about other checkpoints).
        for gguf_key, hf_key in (
            ("tokenizer.ggml.bos_token_id", "bos_token_id"),
            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
            ("tokenizer.ggml.padding_token_id", "pad_token_id"),
        ):
            value = self._meta.get(gguf_key)
            if value is not None:
                if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab:
                    raise ConfigError(
                        f"{self.path.name}: {gguf_key} = {value!r} is not a token id below {vocab}"
                    )
                config[hf_key] = value
        return config

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        if self.architecture in ARCHS:
            return expected_shapes(ARCHS[self.architecture], self.config)
        c = self.config
        h, inter, hd = c["hidden_size"], c["intermediate_size"], self.head_dim
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        per_layer = {
            "input_layernorm": (h,),
            "self_attn.q_proj": (q, h),
            "self_attn.k_proj": (kv, h),
            "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, q),
            "post_attention_layernorm": (h,),
            "mlp.gate_proj": (inter, h),
            "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter),
        }
        if self.architecture == "qwen3":
            per_layer.update({"self_attn.q_norm": (hd,), "self_attn.k_norm": (hd,)})
        biases = {"qwen2": {"self_attn.q_proj": (q,), "self_attn.k_proj": (kv,), "self_attn.v_proj": (kv,)}}
        shapes = {"model.embed_tokens.weight": (c["vocab_size"], h)}
        for i in range(c["num_hidden_layers"]):
            for suffix, shape in per_layer.items():
                shapes[f"model.layers.{i}.{suffix}.weight"] = shape
            for suffix, shape in biases.get(self.architecture, {}).items():
                shapes[f"model.layers.{i}.{suffix}.bias"] = shape
        shapes["model.norm.weight"] = (h,)
        if not c["tie_word_embeddings"]:
            shapes["lm_head.weight"] = (c["vocab_size"], h)
        return shapes

    def _map_tensors(self):
        arch = ARCHS.get(self.architecture)
        n_layers = self.config["num_hidden_layers" if "num_hidden_layers" in self.config else "n_layer"]
        by_hf: dict[str, Any] = {}
        unmapped: list[str] = []
        layer_tensors = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(self.architecture, {})}
        biased = _ARCH_BIASES.get(self.architecture, ())
        for t in self._reader.tensors:
            hf = hf_name(arch, t.name, _LAYER_RE, n_layers) if arch else _GLOBAL_TENSORS.get(t.name)
            if hf is None and arch is None:
                m = _LAYER_RE.fullmatch(t.name)
                if (m and m.group(2) in layer_tensors and int(m.group(1)) < n_layers
                        and (m.group(3) == "weight" or m.group(2) in biased)):
                    hf = f"model.layers.{int(m.group(1))}.{layer_tensors[m.group(2)]}.{m.group(3)}"
            if hf is None:
                unmapped.append(t.name)
                continue
            by_hf[hf] = t
        expected = self._expected_shapes()
        defects: list[str] = []
        if unmapped:
            defects.append(
                f"{len(unmapped)} tensor(s) with no {self.architecture} role: {', '.join(unmapped[:8])}"
                + (" ..." if len(unmapped) > 8 else "")
            )
        missing = [n for n in expected if n not in by_hf]
        if missing:
            defects.append(
                f"{len(missing)} tensor(s) missing: {', '.join(missing[:8])}"
                + (" ..." if len(missing) > 8 else "")
            )
        specs: dict[str, TensorSpec] = {}
        for name, shape in expected.items():
            t = by_hf.get(name)
            if t is None:
                continue
            # GGUF lists dimensions innermost first; Hugging Face order is the reverse ([out, in]).
            hf_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if arch is not None and is_transposed(arch, t.name):  # stored [out, in], read [in, out]
                hf_shape = hf_shape[::-1]
            if hf_shape != shape:
                defects.append(
                    f"{t.name} ({name}) has shape {list(hf_shape)}, the config implies {list(shape)}"
                )
                continue
            if t.data.nbytes != int(t.n_bytes):
                raise ConfigError(
                    f"{self.path.name}: tensor {t.name} needs {int(t.n_bytes)} bytes but the file holds "
                    f"{t.data.nbytes}; the file is truncated or corrupt"
                )
            specs[name] = TensorSpec(name, t.tensor_type.name, hf_shape)
        if defects:
            raise AdmissionError(
                f"{self.path.name}: tensors do not close over the {self.architecture} config: "
                + "; ".join(defects),
                [{"category": "tensors", "defect": d, "blocks": True} for d in defects],
            )
        return by_hf, specs

    def _check_dequantizable(self) -> None:
        """Probe each GGUF type present with one synthetic all-zero block (no file bytes read)."""
        import gguf
        from gguf.quants import dequantize

        by_type: dict[Any, list[str]] = {}
        for t in self._tensors.values():
            by_type.setdefault(t.tensor_type, []).append(t.name)
        for qtype, names in by_type.items():
            _, type_size = gguf.GGML_QUANT_SIZES[qtype]
            reason = None
            try:
                probe = dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
                if probe.dtype != np.float32:
                    reason = f"dequantizes to {probe.dtype}, not exactly float32"
            except NotImplementedError:
                reason = "gguf.quants cannot dequantize it"
            if reason:
                raise AdmissionError(
                    f"{self.path.name}: tensor type {qtype.name} ({reason}) is used by "
                    f"{len(names)} tensor(s): {', '.join(names[:4])}"
                    + (" ..." if len(names) > 4 else ""),
                    [{"category": "encoding", "key": qtype.name, "value": names, "blocks": True}],
                )

    def _check_tokenizer(self) -> None:
        model = self._meta.get("tokenizer.ggml.model")
        if model is None:
            return  # no tokenizer in the file: none is snapshot, and text input is refused later
        pre = self._meta.get("tokenizer.ggml.pre")
        if model not in SUPPORTED_TOKENIZERS or pre not in SUPPORTED_TOKENIZERS[model]:
            supported = "; ".join(
                f"{m} with pre {', '.join(x or '(absent)' for x in p)}" for m, p in SUPPORTED_TOKENIZERS.items()
            )
            raise AdmissionError(
                f"{self.path.name}: tokenizer.ggml.model {model!r} with tokenizer.ggml.pre {pre!r} "
                f"cannot be rebuilt exactly (supported: {supported})",
                [
                    {
                        "category": "tokenizer",
                        "key": "tokenizer.ggml.model",
                        "value": f"{model}/{pre}",
                        "blocks": True,
                    }
                ],
            )
        if self.architecture not in SENTENCEPIECE_ARCHITECTURES and model == "llama":
            raise AdmissionError(
                f"{self.path.name}: a SentencePiece vocabulary on a {self.architecture} file: transformers builds "
                "it with that architecture's own rules, which this importer does not reproduce (it does for "
                f"{', '.join(SENTENCEPIECE_ARCHITECTURES)})",
                [{"category": "tokenizer", "key": "tokenizer.ggml.model", "value": model, "blocks": True}],
            )
        if model == "llama" and self.architecture in ("gemma2", "gemma3"):
            have = set(self._array("tokenizer.ggml.tokens") or [])
            lacking = [t for t in GEMMA_SPECIAL_SPELLINGS if t not in have]
            if lacking:
                raise AdmissionError(
                    f"{self.path.name}: the SentencePiece vocabulary lacks {', '.join(lacking)}: transformers 5.24's Gemma "
                    "tokenizer names these whatever the file says and appends a missing one past the model's "
                    "embedding rows",
                    [{"category": "tokenizer", "key": "tokenizer.ggml.tokens", "value": lacking, "blocks": True}])
        need = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") if model == "gpt2" else ("tokenizer.ggml.tokens",)
        if model == "llama" and "tokenizer.ggml.merges" not in self._meta:
            need = (*need, "tokenizer.ggml.scores")  # merges are recovered from the scores
        for key in need:
            if key not in self._meta:
                kind = "byte-level BPE" if model == "gpt2" else "SentencePiece"
                raise AdmissionError(f"{self.path.name}: {kind} tokenizer without {key}")
        n_tokens = len(self._reader.fields["tokenizer.ggml.tokens"].data)
        if n_tokens > self.config["vocab_size"]:
            raise AdmissionError(
                f"{self.path.name}: tokenizer.ggml.tokens has {n_tokens} entries but the model has "
                f"{self.config['vocab_size']} embedding rows; some token ids would have no row"
            )

    # ---------------------------------------------------------------- CheckpointSource

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)

    def load(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        spec = self._specs.get(name)
        if spec is None:
            raise ConfigError(
                f"{self.path.name}: no tensor {name!r} (it has {len(self._specs)} tensors)"
            )
        t = self._tensors[name]
        w = dequantize(t.data, t.tensor_type)
        if w.dtype != np.float32:
            raise ConfigError(
                f"{self.path.name}: tensor {t.name} dequantized to {w.dtype}, not float32"
            )
        arch = ARCHS.get(self.architecture)
        if arch is not None:
            transposed = is_transposed(arch, t.name)
            w = read_values(arch, t.name, w.reshape(spec.shape[::-1] if transposed else spec.shape))
            return np.array(w, dtype=np.float32, order="C", copy=True)
        w = w.reshape(spec.shape)
        if self.architecture == "llama":  # qwen2 / qwen3 files keep Hugging Face's q/k order
            if name.endswith(".self_attn.q_proj.weight"):
                w = _unpermute_rotary(w, self.config["num_attention_heads"])
            elif name.endswith(".self_attn.k_proj.weight"):
                w = _unpermute_rotary(w, self.config["num_key_value_heads"])
        return np.array(w, dtype=np.float32, order="C", copy=True)

    def native_encoding(self, name: str) -> tuple[str, int] | None:
        """The GGUF type as a container encoding: F32/F16/BF16 as f32/f16/bf16, a block type as
        its lower-cased name (q4_1, q6_k, iq4_nl, ...; vindex3.codecs.ggml executes some of them,
        the others are carried), with the tensor's byte count."""
        spec = self._specs.get(name)
        if spec is None:
            return None
        t = self._tensors[name]
        arch = ARCHS.get(self.architecture)
        if arch is not None and (is_transposed(arch, t.name) or is_offset_norm(arch, t.name)):
            return None  # read with a change of values or layout: widened through `load`
        return spec.dtype.lower(), int(t.n_bytes)

    def encoded(self, name: str) -> np.ndarray:
        """The tensor's bytes as the file stores them (rows of blocks, or 16/32-bit floats), q/k
        rows put back in Hugging Face order: every block lies within one row, so that is a
        permutation of whole rows of bytes, exactly what `load` does to the values."""
        spec = self._specs.get(name)
        if spec is None:
            raise ConfigError(f"{self.path.name}: no tensor {name!r} (it has {len(self._specs)} tensors)")
        t = self._tensors[name]
        raw = np.asarray(t.data).view(np.uint8)
        rows = int(np.prod(spec.shape[:-1]))
        b = raw.reshape(rows, -1)
        if self.architecture == "llama":
            if name.endswith(".self_attn.q_proj.weight"):
                b = _unpermute_rotary(b, self.config["num_attention_heads"])
            elif name.endswith(".self_attn.k_proj.weight"):
                b = _unpermute_rotary(b, self.config["num_key_value_heads"])
        return np.array(b, dtype=np.uint8, order="C", copy=True).reshape(-1)

    def capability_files(self) -> dict[str, bytes]:
        if self._capabilities is None:
            self._capabilities = self._build_capabilities()
        return dict(self._capabilities)

    def provenance(self) -> dict:
        import gguf

        counts = Counter(t.tensor_type.name for t in self._tensors.values())
        file_type = self._meta.get("general.file_type")
        try:
            file_type_name = gguf.LlamaFileType(file_type).name if file_type is not None else None
        except ValueError:
            file_type_name = None
        return {
            "source_kind": "gguf",
            "source_name": self.path.name,
            "file_sha256": self.sha256(),
            "file_bytes": self.path.stat().st_size,
            "gguf_version": self._meta.get("GGUF.version"),
            "architecture": self.architecture,
            "general_name": self._meta.get("general.name"),
            "file_type": file_type_name,
            "tensor_count": len(self._reader.tensors),
            "quantization_types": dict(sorted(counts.items())),
            "tokenizer": (
                f"{self._meta.get('tokenizer.ggml.model')}/{self._meta.get('tokenizer.ggml.pre')}"
                if self._meta.get("tokenizer.ggml.model") is not None
                else None
            ),
        }

    def sha256(self) -> str:
        if self._sha256 is None:
            with open(self.path, "rb") as f:
                self._sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        return self._sha256

    # ---------------------------------------------------------------- tokenizer snapshot

    def _special_token(self, key: str, tokens: list[str]) -> str | None:
        token_id = self._meta.get(f"tokenizer.ggml.{key}")
        if token_id is None:
            return None
        if not isinstance(token_id, int) or not 0 <= token_id < len(tokens):
            raise ConfigError(
                f"{self.path.name}: tokenizer.ggml.{key} = {token_id!r} is not a token id"
            )
        return tokens[token_id]

    def build_tokenizer(self):
        """The byte-level BPE tokenizer the GGUF vocabulary describes, as a ``tokenizers.Tokenizer``,
        built the way transformers builds it for ``AutoTokenizer.from_pretrained(gguf_file=...)``."""
        from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
        from tokenizers.models import BPE

        if self._meta.get("tokenizer.ggml.model") is None:
            raise ConfigError(
                f"{self.path.name} carries no tokenizer (tokenizer.ggml.model is absent)"
            )
        tokens = self._array("tokenizer.ggml.tokens")
        token_types = self._array("tokenizer.ggml.token_type") or []
        if self._meta.get("tokenizer.ggml.model") == "llama":
            return self._sentencepiece(tokens, token_types)
        merges_raw = self._array("tokenizer.ggml.merges")

        spelling = _byte_alphabet()
        alphabet = set(spelling)
        vocab: dict[str, int] = {}
        for index, token in enumerate(tokens):
            # tokens written in the byte alphabet stand as they are; any other is spelled byte by byte
            vocab[
                token
                if set(token) <= alphabet
                else "".join(spelling[b] for b in token.encode("utf-8"))
            ] = index
        merges = []
        for merge in merges_raw:
            pair = merge.split(" ")
            if len(pair) != 2:
                raise ConfigError(
                    f"{self.path.name}: tokenizer.ggml.merges entry {merge!r} is not a pair"
                )
            merges.append((pair[0], pair[1]))

        tk = Tokenizer(
            BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = SPLITS.get(self._meta.get("tokenizer.ggml.pre"))
        if split is None:
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:  # the split the vocabulary's merges were learned with, then bytes
            tk.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ])
        tk.decoder = decoders.ByteLevel()

        specials: list[str] = []
        # transformers' GPT-2 builder names <|endoftext|> its default unk/bos/eos, which marks it
        # special when the vocabulary has it (when it does not, transformers appends a token the
        # model has no row for; that is not reproduced).
        if "<|endoftext|>" in vocab:
            specials.append("<|endoftext|>")
        # control tokens stay whole and are special, if spelled in the byte alphabet
        for token, ttype in zip(tokens, token_types):
            if ttype == _CONTROL and set(token) <= alphabet and token not in specials:
                specials.append(token)
        return self._finish_tokenizer(tk, tokens, token_types, vocab, specials)

    def _sentencepiece(self, tokens: list[str], token_types: list[int]):
        """A SentencePiece vocabulary (tokenizer.ggml.model llama) as transformers builds it: BPE over
        the tokens as spelled, byte fallback, unknown pieces fused; merges from the file, or recovered
        from the scores (`_merges_from_scores`); "▁" prepended to the first word only, no split."""
        from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers
        from tokenizers.models import BPE

        gemma = self.architecture in ("gemma2", "gemma3")
        if gemma:  # a token of spaces is stored as spaces; Gemma's tokenizer looks it up as "▁"s
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {token: index for index, token in enumerate(tokens)}
        if "tokenizer.ggml.merges" in self._meta:
            merges = []
            for merge in self._array("tokenizer.ggml.merges"):
                pair = merge.split(" ")
                if len(pair) != 2:
                    raise ConfigError(f"{self.path.name}: tokenizer.ggml.merges entry {merge!r} is not a pair")
                merges.append((pair[0], pair[1]))
        elif gemma:  # Gemma's scores do not follow its merge order; the tokens' positions do
            merges = _merges_from_scores(vocab, {t: -float(i) for i, t in enumerate(tokens)})
        else:
            merges = _merges_from_scores(vocab, dict(zip(tokens, self._array("tokenizer.ggml.scores"))))
        if gemma:  # transformers 5.24's GemmaTokenizer
            tk = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token="<unk>", dropout=None,
                               byte_fallback=True))
            tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
            tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
            tk.normalizer = normalizers.Replace(" ", "\u2581")
        else:
            tk = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
            tk.normalizer = None
            tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            tk.decoder = decoders.Sequence([
                decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                decoders.Strip(content=" ", left=1),
            ])
        if self.architecture == "phi3":  # the prefix space from a normalizer, no pre-tokenizer
            tk.normalizer = normalizers.Sequence([normalizers.Prepend(prepend="\u2581"),
                                                  normalizers.Replace(pattern=" ", content="\u2581")])
            tk.pre_tokenizer = None
        specials = [t for t, ty in zip(tokens, token_types) if ty == _CONTROL]
        return self._finish_tokenizer(tk, tokens, token_types, vocab, specials)

    def _add_bos_default(self) -> bool:
        """add_bos_token when the file does not say: llama.cpp (and transformers) add BOS to a
        SentencePiece vocabulary, not to a byte-level one."""
        return self._meta.get("tokenizer.ggml.model") == "llama"

    def _finish_tokenizer(self, tk, tokens, token_types, vocab, specials):
        """Special and added tokens, and the post-processor adding bos / eos, as the file states."""
        from tokenizers import AddedToken, processors

        named = {
            name: self._special_token(key, tokens)
            for name, key in (
                ("bos_token", "bos_token_id"),
                ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"),
            )
        }
        for token in named.values():
            if token is not None and token not in specials and vocab.get(token) is not None:
                specials.append(token)
        tk.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
        user_defined = [
            AddedToken(token, normalized=False, special=False)
            for token, ttype in zip(tokens, token_types)
            if ttype == _USER_DEFINED and token in vocab
        ]
        if user_defined:
            tk.add_tokens(user_defined)

        add_bos = (
            bool(self._meta.get("tokenizer.ggml.add_bos_token", self._add_bos_default()))
            and named["bos_token"] is not None
        )
        add_eos = (
            bool(self._meta.get("tokenizer.ggml.add_eos_token", False))
            and named["eos_token"] is not None
        )
        bos, eos = named["bos_token"], named["eos_token"]
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        special_ids = []
        if add_bos:
            special_ids.append((bos, self._meta["tokenizer.ggml.bos_token_id"]))
        if add_eos:
            special_ids.append((eos, self._meta["tokenizer.ggml.eos_token_id"]))
        tk.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special_ids
        )
        return tk

    def _build_capabilities(self) -> dict[str, bytes]:
        if self._meta.get("tokenizer.ggml.model") is None:
            return {}
        tk = self.build_tokenizer()
        tokens = self._array("tokenizer.ggml.tokens")
        special = {}
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        ):
            token = self._special_token(key, tokens)
            if token is not None:
                special[name] = token
        tok_config: dict[str, Any] = {"tokenizer_class": "TokenizersBackend"}
        for key in ("add_bos_token", "add_eos_token"):
            if f"tokenizer.ggml.{key}" in self._meta:
                tok_config[key] = bool(self._meta[f"tokenizer.ggml.{key}"])
        if "add_bos_token" not in tok_config and self._add_bos_default():
            tok_config["add_bos_token"] = True
        tok_config.update(special)
        template = self._meta.get("tokenizer.chat_template")
        if template is not None:
            tok_config["chat_template"] = template

        files = {
            "tokenizer.json": tk.to_str().encode("utf-8"),
            "tokenizer_config.json": (jsonio.dumps(tok_config) + "\n").encode("utf-8"),
            "special_tokens_map.json": (jsonio.dumps(special) + "\n").encode("utf-8"),
        }
        # What transformers derives for a model loaded from this file: the token ids the file
        # states, nothing about sampling (GGUF does not say).
        gen = {
            k: self.config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if k in self.config
        }
        if gen:
            files["generation_config.json"] = (jsonio.dumps(gen) + "\n").encode("utf-8")
        return files


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies (its file lists none): every split of a
    token into two tokens of the vocabulary, ordered by the token's score (highest first), then by
    the longer left piece, then the longer right piece; splits of one token in the order of their
    pieces' ids; ties keep the vocabulary's order (the rule transformers and tokenizers apply)."""
    found = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        found.extend(local)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Within each head the converter interleaves the two rotary
    halves (rows 0, h/2, 1, h/2+1, ...); Hugging Face keeps the halves contiguous. A pure copy."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
