"""A small Kimi-Linear model end to end, side by side with transformers 5.24.0's
``KimiLinearForCausalLM`` (its torch fallback for KDA: fla / causal_conv1d are not installed;
eager attention for MLA), fp32, one process, the same thread count: prefill of 512 tokens and
64 greedy decode steps. The two arms alternate repeat by repeat so that a change in machine
load hits both; the best of the repeats counts.

The fixture: hidden 512, 4 layers (KDA, KDA, KDA, MLA: Kimi's 3:1 pattern), KDA 4 heads of 128
with conv 4, MLA 4 heads with kv_lora_rank 256, qk_rope 64, qk_nope 128, v 128, no q_lora, every
FFN dense (1024 wide; routed experts have no operator in this build yet), vocab 4096, weights
re-randomised at realistic scales. Also reported: the bytes our state holds per position
(latent rows) and fixed (KDA buffers), what transformers' own cache holds after the same
tokens, and what a per-head K/V cache of the same attention would hold.

    python bench/kda_mla_vs_transformers.py [--threads 1 2] [--repeats 5]

Each thread count runs in its own subprocess (the BLAS pools are sized at import). Results,
ratios, parity and machine facts go to bench/results/kda_mla_vs_transformers.json.
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
from machine import facts, pin_threads

L = 4
CONFIG = {
    "vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": None, "kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "intermediate_size": 1024, "moe_intermediate_size": 256, "first_k_dense_replace": L, "num_experts": 8,
    "num_experts_per_token": 2, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "linear_attn_config": {"head_dim": 128, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 3],
                           "full_attn_layers": [4]},
}
PREFILL = 512
DECODE = 64


def build(tmp: Path):
    """The fixture model (transformers) and its container (vindex3)."""
    import torch
    import transformers as T

    import vindex3

    cfg = T.KimiLinearConfig(**CONFIG)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                gain = 1.0 if "embed_tokens" in name else (2.0 if name.startswith("lm_head") else 1.0) / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * gain)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for mod in model.modules():
            if hasattr(mod, "forget_gate"):
                h, kd = mod.num_heads, mod.qkv_dim
                mod.forget_gate.A_log.copy_(torch.empty(1, 1, h, 1).uniform_(math.log(1.0), math.log(16.0), generator=gen))
                mod.forget_gate.dt_bias.copy_(torch.empty(kd).uniform_(-5.0, 0.5, generator=gen))
                mod.conv1d.weight.copy_(0.5 * torch.randn(mod.conv1d.weight.shape, generator=gen))
    model.eval()
    ck = tmp / "ckpt"
    model.save_pretrained(ck)
    return model, vindex3.open(vindex3.encode(ck, tmp / "kimi.vindex3"))


def _cache_bytes(cache) -> int:
    """Bytes of every tensor transformers' cache holds (its layers' attributes)."""
    import torch

    seen, total = set(), 0
    for layer in getattr(cache, "layers", []):
        for v in vars(layer).values():
            for t in (v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else [v]):
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    total += t.numel() * t.element_size()
    return total


def run(threads: int, repeats: int) -> dict:
    import numpy as np
    import torch

    from vindex3.continuation import LATENT, RECURRENT

    torch.set_num_threads(threads)
    ids = [int(x) for x in np.random.default_rng(0).integers(3, CONFIG["vocab_size"], PREFILL)]
    with tempfile.TemporaryDirectory() as td:
        model, c = build(Path(td))
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
            logits = st.prefill(ids, last_only=True)[-1]
            toks = []
            t = time.perf_counter()
            for _ in range(DECODE):
                toks.append(int(np.argmax(logits)))
                logits = st.step(toks[-1])
            return time.perf_counter() - t, toks, st

        def theirs_decode():
            o = model(t_ids, use_cache=True, logits_to_keep=1)
            cache, nxt = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            toks = []
            t = time.perf_counter()
            for _ in range(DECODE):
                toks.append(int(nxt))
                o = model(nxt, cache=cache, use_cache=True)
                cache, nxt = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t, toks, cache

        with torch.inference_mode():
            # warm-up (numba kernels load, torch allocators settle) and parity over the prompt
            ours_logits = ex.forward(ids)
            theirs_logits = model(t_ids).logits[0].numpy()
            ours_prefill(), theirs_prefill()
            best = {"ours_prefill": 1e9, "theirs_prefill": 1e9, "ours_decode": 1e9, "theirs_decode": 1e9}
            same_tokens = True
            for _ in range(repeats):
                best["ours_prefill"] = min(best["ours_prefill"], ours_prefill())
                best["theirs_prefill"] = min(best["theirs_prefill"], theirs_prefill())
                (so, to, our_state), (st_, tt, their_cache) = ours_decode(), theirs_decode()
                same_tokens &= to == tt
                best["ours_decode"] = min(best["ours_decode"], so)
                best["theirs_decode"] = min(best["theirs_decode"], st_)
        positions = PREFILL + DECODE
        geoms = c.continuation()
        latent_pp = sum(p.row_bytes for g in geoms for p in g.of(LATENT))
        fixed = sum(p.fixed_bytes for g in geoms for p in g.of(RECURRENT))
        mla = c.graph.surface["operators"]["mla"]
        mla_layers = sum(g.has(LATENT) for g in geoms)
        kv_pp = 4 * mla["num_heads"] * (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"] + mla["v_head_dim"]) * mla_layers
        state = {
            "positions": positions,
            "ours_bytes": int(our_state.state.nbytes),
            "ours_from_geometry": latent_pp * positions + fixed,
            "latent_bytes_per_position": latent_pp,
            "kda_fixed_bytes": fixed,
            "transformers_cache_bytes": _cache_bytes(their_cache),
            "per_head_kv_cache_bytes_per_position": kv_pp,
            "kv_over_latent": kv_pp / latent_pp,
        }
    ours = {"prefill_tok_s": PREFILL / best["ours_prefill"], "decode_tok_s": DECODE / best["ours_decode"]}
    theirs = {"prefill_tok_s": PREFILL / best["theirs_prefill"], "decode_tok_s": DECODE / best["theirs_decode"]}
    return {
        "threads": threads,
        "machine": facts(threads),
        "ours": ours,
        "transformers": theirs,
        "ratios": {k: ours[k] / theirs[k] for k in ours},
        "max_abs_logit_diff_512_tokens": float(np.abs(ours_logits - theirs_logits).max()),
        "max_abs_logit": float(np.abs(theirs_logits).max()),
        "same_greedy_tokens": bool(same_tokens),
        "state": state,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single thread count, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "kda_mla_vs_transformers.json"))
    a = ap.parse_args()
    if a.one is not None:
        pin_threads(a.one)
        os.environ.setdefault("VINDEX3_DECODE_THREADS", str(a.one))
        print(json.dumps(run(a.one, a.repeats)))
        return 0
    runs = []
    for n in a.threads:
        p = subprocess.run([sys.executable, __file__, "--one", str(n), "--repeats", str(a.repeats)],
                           capture_output=True, text=True, check=False)
        if p.returncode:
            print(p.stderr, file=sys.stderr)
            return p.returncode
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    report = {
        "benchmark": "kda_mla_vs_transformers",
        "model": {"family": "kimi_linear", "layers": ["kda", "kda", "kda", "mla"], **CONFIG},
        "workload": {"prefill_tokens": PREFILL, "decode_steps": DECODE, "decode_after_prompt_tokens": PREFILL,
                     "repeats": a.repeats, "statistic": "best of repeats, arms interleaved"},
        "reference_path": "transformers KimiLinearForCausalLM: KDA on its torch fallback (no fla / causal_conv1d), "
                          "MLA eager; fp32, inference_mode",
        "targets": {"prefill": ">= 1.5", "decode": ">= 1.5"},
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'threads':<9}{'':<16}{'ours':>10}{'transformers':>14}{'ratio':>8}")
    for r in runs:
        for k in ("prefill_tok_s", "decode_tok_s"):
            print(f"{r['threads']:<9}{k:<16}{r['ours'][k]:>10.1f}{r['transformers'][k]:>14.1f}{r['ratios'][k]:>8.2f}")
        s = r["state"]
        print(f"{'':<9}max |Δlogit| over 512 tokens {r['max_abs_logit_diff_512_tokens']:.2e} (|logit| up to "
              f"{r['max_abs_logit']:.1f}), same greedy tokens: {r['same_greedy_tokens']}")
        print(f"{'':<9}state at {s['positions']} positions: ours {s['ours_bytes']:,} B (latent {s['latent_bytes_per_position']:,} "
              f"B/position + KDA {s['kda_fixed_bytes']:,} B fixed), transformers' cache {s['transformers_cache_bytes']:,} B; "
              f"a per-head K/V cache would need {s['per_head_kv_cache_bytes_per_position']:,} B/position "
              f"({s['kv_over_latent']:.1f}x the latent rows)")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
