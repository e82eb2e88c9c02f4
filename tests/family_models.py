"""Tiny random checkpoints of the dense families (GPT-2, GPT-NeoX, Gemma, Phi, OLMo 2, SmolLM3)
built from configs, their containers, and the transformers 5.24.0 oracle (fp32, eager) beside
them; shared by tests/test_families_*.py.

Weights: every matrix at ``gain / sqrt(fan_in)``, embeddings at unit scale (times ``emb``),
biases at 0.3·N(0, 1), norm weights at 1 + 0.3·N(0, 1) (or 0.3·N(0, 1) for (1 + w) norms), so
that a layout, bias or offset bug cannot hide behind ones and zeros and logits are of order 1-10
(each parity test asserts it)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
from fixtures import build_tokenizer, hf_logits

TOL = 1e-4


def rerandomise(model, *, gain: float = 1.0, emb: float = 1.0, head_gain: float | None = None,
                zero_centred: bool = False, seed: int = 7) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    conv1d = model.config.model_type == "gpt2"  # Conv1D weights are [in, out]
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                is_norm = "norm" in name or ".ln_" in name or "ln_f" in name or "layernorm" in name
                if is_norm and name.endswith("weight"):
                    p.copy_((0.0 if zero_centred else 1.0) + 0.3 * torch.randn(p.shape, generator=gen))
                else:
                    p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif any(k in name for k in ("wte", "wpe", "embed_tokens", "embed_in")):
                p.copy_(emb * torch.randn(p.shape, generator=gen))
            else:
                fan_in = p.shape[0] if conv1d and "transformer.h." in name else p.shape[-1]
                g = head_gain if head_gain is not None and name.startswith(("lm_head", "embed_out")) else gain
                p.copy_(torch.randn(p.shape, generator=gen) * (g / math.sqrt(fan_in)))


def build(model_type: str, cfg: dict, out: Path, *, vision: bool = False, runtime_layout: bool = False, **scale) -> Path:
    """``runtime_layout``: save the tensor names transformers holds in memory instead of the
    released checkpoints' (they differ for the vision-language models)."""
    import torch
    import transformers as T

    config = T.AutoConfig.for_model(model_type, **cfg)
    torch.manual_seed(0)
    auto = T.AutoModelForImageTextToText if vision else T.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    rerandomise(model, **scale)
    model.eval()
    model.save_pretrained(out, **({"save_original_format": False} if runtime_layout else {}))
    build_tokenizer(out)
    return out


def reference(path: Path, vision: bool = False):
    import torch
    import transformers as T

    auto = T.AutoModelForImageTextToText if vision else T.AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_decode(model, ids):
    """Token by token through the reference's own cache."""
    import torch

    rows, cache = [], None
    with torch.no_grad():
        for t in ids:
            out = model(torch.tensor([[t]]), cache=cache, use_cache=True)
            cache = out.cache
            rows.append(out.logits[0, -1].numpy())
    return np.stack(rows)


def spreads(ref, ex, ids) -> dict:
    """Every figure the parity tests assert and docs/operators.md reports: the reference's own
    float32-vs-float64 spread (the floor) and prefill-vs-decode spread, and ours against each."""
    from fixtures import token_by_token

    theirs = hf_logits(ref, ids)
    truth = hf_logits(copy.deepcopy(ref).double(), ids)
    their_dec = hf_decode(ref, ids)
    ours = ex.forward(ids)
    dec = token_by_token(ex, ids)
    return {
        "max_logit": float(np.abs(theirs).max()),
        "hf32_vs_hf64": float(np.abs(theirs - truth).max()),
        "hf_decode_vs_prefill": float(np.abs(their_dec - theirs).max()),
        "prefill_vs_hf": float(np.abs(ours - theirs).max()),
        "decode_vs_hf": float(np.abs(dec - theirs).max()),
        "decode_vs_hf_decode": float(np.abs(dec - their_dec).max()),
        "ours_vs_hf64": float(max(np.abs(ours - truth).max(), np.abs(dec - truth).max())),
        "dtype": (ours.dtype, dec.dtype, ex.last_hidden.dtype),
    }


# -- the checks every family's test file runs ------------------------------------------------------

def check_parity(ck: Path, container: Path, ids: list[int], vision: bool = False, floor: float = TOL / 2) -> dict:
    """Prefill and token-by-token decode against the reference's prefill, its own decode and its
    float64 run, within TOL; identical 16-token greedy continuations. ``floor``: the bar the
    reference's own float32-vs-float64 spread must stay under for TOL to mean something."""
    from fixtures import hf_greedy, our_greedy

    import vindex3

    ref = reference(ck, vision)
    ex = vindex3.open(container).executor()
    s = spreads(ref, ex, ids)
    assert 1.0 < s["max_logit"] < 30.0, s  # logits of order 1-10: a 1e-4 bar means something
    assert s["hf32_vs_hf64"] <= floor, s
    assert s["dtype"] == (np.float32,) * 3
    assert s["prefill_vs_hf"] <= TOL and s["decode_vs_hf"] <= TOL and s["decode_vs_hf_decode"] <= TOL, s
    assert s["ours_vs_hf64"] <= TOL, s
    assert our_greedy(ex, ids[:8], 16) == hf_greedy(ref, ids[:8], 16)
    return s


def check_draft_bit_identical(container: Path, ids: list[int]) -> None:
    from fixtures import token_by_token

    import vindex3

    c = vindex3.open(container)
    L = c.graph.num_layers
    full, draft = c.executor(slice=vindex3.Full()), c.executor(slice=vindex3.Draft(L))
    assert np.array_equal(full.forward(ids), draft.forward(ids))
    assert np.array_equal(full.last_hidden, draft.last_hidden)
    assert full.trace.executed_layers == draft.trace.executed_layers == list(range(L))
    assert np.array_equal(token_by_token(full, ids[:30]), token_by_token(draft, ids[:30]))


def check_speculation(container: Path, ids: list[int]) -> None:
    import vindex3
    from vindex3.draft import greedy_generate, speculative_generate

    c = vindex3.open(container)
    want = greedy_generate(c, ids[:6], 12).tokens
    for depth, lookahead in [(1, 3), (c.graph.num_layers - 1, 4)]:
        r = speculative_generate(c, ids[:6], 12, depth, lookahead)
        assert r.tokens == want and r.rollback == "truncate"


def check_every_key_graded(ck: Path) -> None:
    import json

    import vindex3

    plan = vindex3.admit(ck)
    assert plan.admissible, [f.text() for f in plan.blocking()]
    cfg = json.loads((ck / "config.json").read_text())
    keys = {f.key for f in plan.findings}
    assert set(cfg) <= keys
    for sub in ("text_config",):
        if isinstance(cfg.get(sub), dict):
            assert {f"{sub}.{k}" for k in cfg[sub]} <= keys
    assert not [f for f in plan.findings if f.category == "unknown"]


def copy_with_config(src: Path, dst: Path, text: bool = False, **changes) -> Path:
    """A copy of a checkpoint with config keys changed (``text``: inside text_config); ``...``
    removes a key."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    target = cfg["text_config"] if text else cfg
    for k, v in changes.items():
        if v is ...:
            target.pop(k, None)
        else:
            target[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def blocking(ck: Path) -> dict:
    import vindex3

    plan = vindex3.admit(ck)
    assert not plan.admissible
    return {f.key: f.message for f in plan.blocking()}
