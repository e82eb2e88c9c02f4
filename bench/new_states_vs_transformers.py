"""Speed of the operators with new kinds of state (mamba1, short_conv, parallel softmax +
mamba2_mup, rg_lru), each family side by side with transformers' own CPU path (its torch
fallbacks: no mamba_ssm / causal_conv1d kernels on CPU), in one process at one thread: prefill of
512 tokens and 64 greedy decode steps after a 16-token prompt, on 4-layer, hidden-256 models built
from configs with re-randomised weights, fp32. The arms alternate repeat by repeat so that a
change in machine load hits both; the best of the repeats counts.

    python bench/new_states_vs_transformers.py [--families mamba lfm2 ...] [--repeats 3]

Each family runs in its own subprocess. Results, ratios, the load average and machine facts go
to bench/results/new_states_vs_transformers.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # this checkout's vindex3, not an installed one
from machine import facts, pin_threads

V = 2048
CONFIGS = {
    "mamba": {"vocab_size": V, "hidden_size": 256, "state_size": 16, "num_hidden_layers": 4, "expand": 2, "conv_kernel": 4,
              "tie_word_embeddings": False},
    "falcon_mamba": {"vocab_size": V, "hidden_size": 256, "state_size": 16, "num_hidden_layers": 4, "expand": 2,
                     "conv_kernel": 4, "mixer_rms_eps": 1e-6, "tie_word_embeddings": False},
    "lfm2": {"vocab_size": V, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 768, "full_attn_idxs": [1], "conv_L_cache": 3, "max_position_embeddings": 4096,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": False},
    "falcon_h1": {"vocab_size": V, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "intermediate_size": 512, "mamba_d_ssm": 512, "mamba_n_heads": 8,
                  "mamba_d_state": 64, "mamba_n_groups": 1, "mamba_chunk_size": 256, "max_position_embeddings": 4096,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "mlp_multipliers": [1.0, 1.0],
                  "ssm_multipliers": [0.9, 1.1, 0.7, 1.3, 0.6], "key_multiplier": 0.8, "tie_word_embeddings": False},
    "recurrent_gemma": {"vocab_size": V, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                        "num_key_value_heads": 1, "lru_width": 256, "attention_window_size": 128, "intermediate_size": 768,
                        "block_types": ["recurrent", "recurrent", "attention"],
                        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
}
PREFILL = 512
DECODE = 64
PROMPT = 16


def build(family: str, tmp: Path):
    """The fixture checkpoint (transformers) and its container (vindex3)."""
    import torch
    import transformers as T

    import vindex3

    cfg = T.AutoConfig.for_model(family, **CONFIGS[family])
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.3), math.log(4.0), generator=gen))
            elif p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:]) if p.dim() > 2 and p.shape[1] == 1 else p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(1 if "embed" in name else fan_in))
    ck = tmp / "ckpt"
    model.save_pretrained(ck)
    return model, vindex3.open(vindex3.encode(ck, tmp / f"{family}.vindex3"))


def hf_decode(model, ids, n):
    """Greedy: the prompt in one pass, then n one-token passes through the reference's cache;
    returns (seconds of the n steps, tokens)."""
    import torch
    from transformers import DynamicCache

    griffin = model.config.model_type == "recurrent_gemma"
    kw, cache = {}, None
    if griffin:  # keeps its recurrent state in its modules and returns no cache
        model.model._setup_cache(model.config, 1, "cpu", torch.float32)
        cache = DynamicCache(config=model.config)
        kw = {"position_ids": torch.arange(len(ids))[None]}
    o = model(torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1, **kw)
    cache = cache if griffin else o.cache
    nxt = o.logits[:, -1].argmax(-1, keepdim=True)
    toks = []
    t = time.perf_counter()
    for i in range(n):
        toks.append(int(nxt))
        if griffin:
            kw = {"position_ids": torch.tensor([[len(ids) + i]])}
        o = model(nxt, cache=cache, use_cache=True, **kw)
        cache = cache if griffin else o.cache
        nxt = o.logits[:, -1].argmax(-1, keepdim=True)
    return time.perf_counter() - t, toks


def run(family: str, threads: int, repeats: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(threads)
    ids = [int(x) for x in np.random.default_rng(0).integers(3, V, PREFILL)]
    with tempfile.TemporaryDirectory() as td:
        model, c = build(family, Path(td))
        ex = c.executor()
        t_ids = torch.tensor([ids])

        def ours_prefill():
            st = ex.start()
            t = time.perf_counter()
            st.prefill(ids, last_only=True)
            return time.perf_counter() - t

        def theirs_prefill():
            t = time.perf_counter()
            model(t_ids, use_cache=True, logits_to_keep=1)
            return time.perf_counter() - t

        def ours_decode():
            st = ex.start()
            logits = st.prefill(ids[:PROMPT], last_only=True)[-1]
            toks = []
            t = time.perf_counter()
            for _ in range(DECODE):
                toks.append(int(np.argmax(logits)))
                logits = st.step(toks[-1])
            return time.perf_counter() - t, toks

        with torch.inference_mode():
            ours_logits = ex.forward(ids[:64])
            theirs_logits = model(t_ids[:, :64]).logits[0].numpy()
            ours_prefill(), theirs_prefill(), ours_decode(), hf_decode(model, ids[:PROMPT], 4)  # warm-up
            best = {"ours_prefill": 1e9, "theirs_prefill": 1e9, "ours_decode": 1e9, "theirs_decode": 1e9}
            same_tokens = True
            for _ in range(repeats):
                best["ours_prefill"] = min(best["ours_prefill"], ours_prefill())
                best["theirs_prefill"] = min(best["theirs_prefill"], theirs_prefill())
                (so, to), (st_, tt) = ours_decode(), hf_decode(model, ids[:PROMPT], DECODE)
                same_tokens &= to == tt
                best["ours_decode"] = min(best["ours_decode"], so)
                best["theirs_decode"] = min(best["theirs_decode"], st_)
    ours = {"prefill_tok_s": PREFILL / best["ours_prefill"], "decode_tok_s": DECODE / best["ours_decode"]}
    theirs = {"prefill_tok_s": PREFILL / best["theirs_prefill"], "decode_tok_s": DECODE / best["theirs_decode"]}
    return {
        "family": family,
        "model": CONFIGS[family],
        "threads": threads,
        "machine": facts(threads),
        "load_average": os.getloadavg(),
        "ours": ours,
        "transformers": theirs,
        "ratios": {k: ours[k] / theirs[k] for k in ours},
        "max_abs_logit_diff_64_tokens": float(np.abs(ours_logits - theirs_logits).max()),
        "max_abs_logit_64_tokens": float(np.abs(theirs_logits).max()),
        "same_greedy_tokens": bool(same_tokens),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="+", default=list(CONFIGS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a single family, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "new_states_vs_transformers.json"))
    a = ap.parse_args()
    if a.one is not None:
        pin_threads(a.threads)
        os.environ.setdefault("VINDEX3_DECODE_THREADS", str(a.threads))
        print(json.dumps(run(a.one, a.threads, a.repeats)))
        return 0
    runs = []
    for fam in a.families:
        p = subprocess.run([sys.executable, __file__, "--one", fam, "--threads", str(a.threads), "--repeats", str(a.repeats)],
                           capture_output=True, text=True, check=False)
        if p.returncode:
            print(p.stderr, file=sys.stderr)
            return p.returncode
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    report = {
        "benchmark": "new_states_vs_transformers",
        "workload": {"prefill_tokens": PREFILL, "decode_steps": DECODE, "decode_after_prompt_tokens": PROMPT,
                     "repeats": a.repeats, "statistic": "best of repeats, arms interleaved", "threads": a.threads},
        "reference_path": "transformers 5.24.0 torch fallbacks (no mamba_ssm / causal_conv1d), fp32, inference_mode",
        "targets": {"decode": ">= 2.0"},
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'family':<17}{'':<15}{'ours':>10}{'transformers':>14}{'ratio':>8}")
    for r in runs:
        for k in ("prefill_tok_s", "decode_tok_s"):
            print(f"{r['family']:<17}{k:<15}{r['ours'][k]:>10.1f}{r['transformers'][k]:>14.1f}{r['ratios'][k]:>8.2f}")
        print(f"{'':<17}max |Δlogit| over 64 tokens {r['max_abs_logit_diff_64_tokens']:.1e} (logits up to "
              f"{r['max_abs_logit_64_tokens']:.1f}), same greedy tokens: {r['same_greedy_tokens']}, "
              f"load average {r['load_average'][0]:.1f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
