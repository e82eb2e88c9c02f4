"""Tiny random checkpoints, built with transformers from configs, for every family.

Norm weights are re-randomised after init so that layout and offset bugs cannot hide behind
ones and zeros. Everything is deterministic (fixed seeds)."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path

import numpy as np

VOCAB = 320
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, there was a small model that wanted to know everything.",
    "1 + 1 = 2, 2 + 2 = 4, 3 + 3 = 6.",
    "Water boils at a temperature of 100 degrees Celsius.",
]

BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2}

FAMILIES: dict[str, dict] = {
    "llama": dict(BASE, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama_tied": dict(BASE, tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh",
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "mistral": dict(BASE, sliding_window=5, head_dim=24, hidden_act="gelu"),
    "qwen2": dict(BASE, layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
                  sliding_window=6, use_sliding_window=True, max_window_layers=1),
    "qwen3": dict(BASE, head_dim=20, attention_bias=True),
    "granite": dict(BASE, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.07, logits_scaling=4.0,
                    tie_word_embeddings=True),
}
MODEL_TYPE = {"llama_tied": "llama"}


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 16, special_tokens=["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))


def build_checkpoint(family: str, out: Path, seed: int = 0, tokenizer: bool = True, runtime_layout: bool = False,
                     **overrides) -> Path:
    """``runtime_layout``: save as transformers holds the weights in memory (fused expert banks)
    instead of the released layout (one tensor per expert, where the family has one)."""
    import torch
    import transformers as T

    model_type = MODEL_TYPE.get(family, family)
    cfg_cls = T.AutoConfig.for_model(model_type).__class__
    cfg = cfg_cls(**{**FAMILIES[family], **overrides})
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases: re-randomise away from ones and zeros
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
        REFINE.get(family, lambda m: None)(model)
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, **({"save_original_format": False} if runtime_layout else {}))
    if tokenizer:
        build_tokenizer(out)
    return out


def load_reference(path: Path, **kwargs):
    import torch
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager", **kwargs).eval()


# ---- state-space and hybrid families ---------------------------------------------------------
# Odd widths everywhere the configs allow, n_groups > 1, and a chunk size (8) that the test
# prompts exceed and do not divide.

FAMILIES["mamba2"] = {
    "vocab_size": VOCAB, "hidden_size": 45, "expand": 2, "num_heads": 6, "head_dim": 15, "state_size": 13, "n_groups": 3, "conv_kernel": 3,
    "chunk_size": 8, "num_hidden_layers": 3, "use_bias": True, "use_conv_bias": True, "layer_norm_epsilon": 1e-5,
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
FAMILIES["granitemoehybrid"] = {
    "vocab_size": VOCAB, "hidden_size": 45, "num_hidden_layers": 4, "num_attention_heads": 3, "num_key_value_heads": 1,
    "shared_intermediate_size": 70, "num_local_experts": 0, "layer_types": ["attention", "mamba", "mamba", "attention"],
    "mamba_n_heads": 6, "mamba_d_head": 15, "mamba_n_groups": 3, "mamba_d_state": 13, "mamba_d_conv": 3, "mamba_expand": 2,
    "mamba_chunk_size": 8, "embedding_multiplier": 2.0, "residual_multiplier": 0.6, "attention_multiplier": 0.09,
    "logits_scaling": 0.5, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "position_embedding_type": None, "initializer_range": 0.1,
    "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
}


def _rerandomise_ssm(model) -> None:
    """A_log, dt_bias and D away from their arange/ones initialisation, the gated-norm weights
    and conv biases away from ones, so layout and offset bugs cannot hide."""
    import math

    import torch

    gen = torch.Generator().manual_seed(1234)
    for _, mod in sorted(model.named_modules(), key=lambda nm: nm[0]):
        if not hasattr(mod, "A_log"):
            continue
        h = mod.A_log.shape[0]
        mod.A_log.copy_(torch.empty(h).uniform_(math.log(0.3), math.log(4.0), generator=gen))
        mod.dt_bias.copy_(torch.empty(h).uniform_(-3.0, 0.5, generator=gen))
        mod.D.copy_(torch.randn(h, generator=gen))
        mod.norm.weight.copy_(1.0 + 0.5 * torch.randn(mod.norm.weight.shape, generator=gen))
        if mod.conv1d.bias is not None:
            mod.conv1d.bias.copy_(0.2 * torch.randn(mod.conv1d.bias.shape, generator=gen))
        for lin in (mod.in_proj, mod.out_proj):
            if lin.bias is not None:
                lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=gen))


# ---- routed-expert families -------------------------------------------------------------------
# E >= 8, k >= 2, odd widths wherever the reference allows (rotary needs an even head width;
# OLMoE's QK norms need heads * head_dim = hidden), a dense layer among the routed ones
# (qwen3_moe), sliding windows the prompts exceed (mixtral, gpt_oss), yarn rope (gpt_oss).

MOE_BASE = {"vocab_size": VOCAB, "num_hidden_layers": 3, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
            "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
FAMILIES["qwen3_moe"] = dict(
    MOE_BASE, hidden_size=45, num_attention_heads=3, num_key_value_heads=1, head_dim=16, intermediate_size=53,
    moe_intermediate_size=23, num_experts=10, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1],
    rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, tie_word_embeddings=False,
)
FAMILIES["olmoe"] = dict(
    MOE_BASE, hidden_size=42, num_attention_heads=3, num_key_value_heads=1, intermediate_size=23, num_experts=9,
    num_experts_per_tok=2, clip_qkv=3.0, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)
FAMILIES["mixtral"] = dict(
    MOE_BASE, hidden_size=45, num_attention_heads=3, num_key_value_heads=1, head_dim=16, intermediate_size=23,
    num_local_experts=8, num_experts_per_tok=2, sliding_window=7, rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
)
FAMILIES["gpt_oss"] = dict(
    MOE_BASE, num_hidden_layers=4, hidden_size=45, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=23, num_local_experts=8, num_experts_per_tok=3, sliding_window=6,
    rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64},
)
FAMILIES["granitemoehybrid_moe"] = dict(
    FAMILIES["granitemoehybrid"], num_local_experts=8, num_experts_per_tok=2, intermediate_size=23,
    shared_intermediate_size=31, layer_types=["attention", "mamba", "attention"], num_hidden_layers=3, logits_scaling=16.0,
)
MODEL_TYPE["granitemoehybrid_moe"] = "granitemoehybrid"
MOE_FAMILIES = ["qwen3_moe", "olmoe", "mixtral", "granitemoehybrid_moe", "gpt_oss"]


def _scale_moe(model) -> None:
    """Every matrix drawn at unit gain (std c / sqrt(fan_in)), routers sharper, biases and sinks
    O(0.5): default init gives logits of ~0.5, which makes a 1e-4 tolerance meaningless. Norm
    weights keep the 1 + 0.3·N(0, 1) of build_checkpoint; SSM parameters are re-randomised too."""
    import math

    import torch

    gen = torch.Generator().manual_seed(4321)
    for name, p in sorted(model.named_parameters()):
        if "norm" in name or "A_log" in name or name.endswith((".D", "dt_bias")):
            continue
        if p.dim() == 1 or name.endswith("_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            continue
        in_out = name.endswith(("experts.gate_up_proj", "experts.down_proj")) and model.config.model_type == "gpt_oss"
        fan_in = p.shape[-2] if in_out else p.shape[-1]
        gain = 3.0 if ("router" in name or name.endswith("gate.weight")) else 1.0
        if "embed_tokens" in name:
            gain, fan_in = 1.0, 1
        p.copy_(gain / math.sqrt(fan_in) * torch.randn(p.shape, generator=gen))
    if any(hasattr(m, "A_log") for m in model.modules()):
        _rerandomise_ssm(model)


REFINE = {"mamba2": _rerandomise_ssm, "granitemoehybrid": _rerandomise_ssm,
          **{f: _scale_moe for f in MOE_FAMILIES}}


# -- running both sides -------------------------------------------------------------------

def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def hf_logits64(model, ids):
    """The reference's logits from a float64 copy of it (same weights; the float32 casts it keeps
    inside, such as rope frequencies and eager softmax, stay float32). Its distance from
    ``hf_logits`` is the reference's own float32 rounding on ``ids``, the spread a parity tolerance
    is a stated multiple of."""
    import copy

    return hf_logits(copy.deepcopy(model).double(), ids)


def hf_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
        cache, nxt, toks = out.cache, int(out.logits[0, -1].argmax()), []
        for _ in range(n):
            toks.append(nxt)
            out = model(torch.tensor([[nxt]]), cache=cache, use_cache=True)
            cache, nxt = out.cache, int(out.logits[0, -1].argmax())
    return toks


def our_greedy(ex, ids, n):
    st = ex.start()
    logits = st.prefill(ids, last_only=True)[-1]
    toks = []
    for _ in range(n):
        toks.append(int(logits.argmax()))
        logits = st.step(toks[-1])
    return toks


def token_by_token(ex, ids):
    st = ex.start()
    return np.stack([st.prefill(ids[:1])[0]] + [st.step(t) for t in ids[1:]])


@contextlib.contextmanager
def bounded(seconds: float, what: str, exc: type[BaseException] = TimeoutError):
    """Fail (never hang) when ``what`` takes longer than ``seconds``: ``exc`` is raised (the fuzz
    harness passes a BaseException, so no ``except Exception`` in the code under test swallows
    it)."""

    def on_alarm(signum, frame):
        raise exc(f"{what} took longer than {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# -- hand-written containers ------------------------------------------------------------------

def reseal(container: Path) -> None:
    """Record the current hashes of a container's graph, segments and capability files in its
    index, as a tool that writes a container by hand would. Tests use it to build containers
    whose hashes agree with deliberately unusual content (an unknown encoding, a described
    operator, NaN weights...), so that what they test is the check after the hash check."""
    import hashlib
    import struct

    container = Path(container)
    idx = json.loads((container / "index.json").read_text())
    idx["graph"]["sha256"] = hashlib.sha256((container / "system_graph.json").read_bytes()).hexdigest()
    for rep in idx["representations"].values():
        raw = (container / rep["segment"]).read_bytes()
        hlen = struct.unpack("<Q", raw[:8])[0]
        start = 8 + hlen
        rep.update(segment_sha256=hashlib.sha256(raw).hexdigest(), segment_bytes=len(raw),
                   payload_sha256=hashlib.sha256(raw[start:]).hexdigest(), payload_bytes=len(raw) - start,
                   header_sha256=hashlib.sha256(raw[:start]).hexdigest())
        try:  # best effort: a header too damaged to read keeps the hashes it had
            tensors = json.loads(raw[8:start])["tensors"]
            rep.update(tensors=len(tensors),
                       tensor_sha256={t["name"]: hashlib.sha256(raw[start + t["offset"]:start + t["offset"] + t["len"]]).hexdigest()
                                      for t in tensors})
        except (ValueError, KeyError, TypeError, IndexError):
            pass
    idx["segments"] = [{"path": r["segment"], "bytes": r["segment_bytes"], "sha256": r["segment_sha256"]}
                       for r in idx["representations"].values()]
    for name, cap in idx["capabilities"].items():
        data = (container / name).read_bytes()
        cap.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))
    from vindex3.manifest import seal

    (container / "index.json").write_text(json.dumps(seal(idx), indent=2))


@contextlib.contextmanager
def blas_products():
    """float32 products through BLAS at every T (`vindex3.codecs.f32.SMALL_T` at 0) while inside:
    another summation order of the same products than the rows kernel's, which every decode step
    and every pass of up to SMALL_T positions takes. Parity tests measure a codec's or a twin's
    difference against the spread between these two orders of the same float32 weights."""
    from vindex3.codecs import f32

    old = f32.SMALL_T
    f32.SMALL_T = 0
    try:
        yield
    finally:
        f32.SMALL_T = old
