"""Tiny random checkpoints, built with transformers from configs, for every family.

Norm weights are re-randomised after init so that layout and offset bugs cannot hide behind
ones and zeros. Everything is deterministic (fixed seeds)."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 320
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, there was a small model that wanted to know everything.",
    "1 + 1 = 2, 2 + 2 = 4, 3 + 3 = 6.",
    "Water boils at a temperature of 100 degrees Celsius.",
]

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)

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


def build_checkpoint(family: str, out: Path, seed: int = 0, tokenizer: bool = True, **overrides) -> Path:
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
    model.eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    if tokenizer:
        build_tokenizer(out)
    return out


def load_reference(path: Path):
    import torch
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
