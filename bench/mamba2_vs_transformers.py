"""Mamba2 speed, side by side with transformers' own CPU path (its torch fallback: no
mamba_ssm / causal_conv1d kernels on CPU), in one process with the same thread count: prefill
of 512 tokens and 64 decode steps on a 4-layer, hidden-256 Mamba2 built from a config with
re-randomised weights, fp32. The two arms alternate repeat by repeat so that a change in
machine load hits both; the best of the repeats counts.

    python bench/mamba2_vs_transformers.py [--threads 1 2] [--repeats 5]

Each thread count runs in its own subprocess (the BLAS pools are sized at import). Results,
ratios and machine facts go to bench/results/mamba2_vs_transformers.json.
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

CONFIG = {"vocab_size": 2048, "hidden_size": 256, "expand": 2, "num_heads": 8, "head_dim": 64, "state_size": 64, "n_groups": 2,
              "conv_kernel": 4, "chunk_size": 256, "num_hidden_layers": 4, "use_bias": False, "use_conv_bias": True,
              "layer_norm_epsilon": 1e-5, "tie_word_embeddings": False}
PREFILL = 512
DECODE = 64


def build(tmp: Path):
    """The fixture checkpoint (transformers) and its container (vindex3)."""
    import torch
    import transformers as T

    import vindex3

    torch.manual_seed(0)
    model = T.Mamba2ForCausalLM(T.Mamba2Config(**CONFIG)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "mixer" not in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
        for layer in model.backbone.layers:
            mx = layer.mixer
            h = mx.A_log.shape[0]
            mx.A_log.copy_(torch.empty(h).uniform_(math.log(0.3), math.log(4.0), generator=gen))
            mx.dt_bias.copy_(torch.empty(h).uniform_(-3.0, 0.5, generator=gen))
            mx.D.copy_(torch.randn(h, generator=gen))
            mx.norm.weight.copy_(1.0 + 0.5 * torch.randn(mx.norm.weight.shape, generator=gen))
            mx.conv1d.bias.copy_(0.2 * torch.randn(mx.conv1d.bias.shape, generator=gen))
    ck = tmp / "ckpt"
    model.save_pretrained(ck)
    return model, vindex3.open(vindex3.encode(ck, tmp / "mamba2.vindex3"))


def run(threads: int, repeats: int) -> dict:
    import numpy as np
    import torch

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
            logits = st.prefill(ids[:16], last_only=True)[-1]
            toks = []
            t = time.perf_counter()
            for _ in range(DECODE):
                toks.append(int(np.argmax(logits)))
                logits = st.step(toks[-1])
            return time.perf_counter() - t, toks

        def theirs_decode():
            o = model(t_ids[:, :16], use_cache=True, logits_to_keep=1)
            cache, nxt = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            toks = []
            t = time.perf_counter()
            for _ in range(DECODE):
                toks.append(int(nxt))
                o = model(nxt, cache=cache, use_cache=True)
                cache, nxt = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - t, toks

        with torch.inference_mode():
            # warm-up: numba kernels load, torch allocators settle; also the parity of the two
            ours_logits = ex.forward(ids[:64])
            theirs_logits = model(t_ids[:, :64]).logits[0].numpy()
            ours_prefill(), theirs_prefill()
            best = {"ours_prefill": 1e9, "theirs_prefill": 1e9, "ours_decode": 1e9, "theirs_decode": 1e9}
            same_tokens = True
            for _ in range(repeats):
                best["ours_prefill"] = min(best["ours_prefill"], ours_prefill())
                best["theirs_prefill"] = min(best["theirs_prefill"], theirs_prefill())
                (so, to), (st_, tt) = ours_decode(), theirs_decode()
                same_tokens &= to == tt
                best["ours_decode"] = min(best["ours_decode"], so)
                best["theirs_decode"] = min(best["theirs_decode"], st_)
    ours = {"prefill_tok_s": PREFILL / best["ours_prefill"], "decode_tok_s": DECODE / best["ours_decode"]}
    theirs = {"prefill_tok_s": PREFILL / best["theirs_prefill"], "decode_tok_s": DECODE / best["theirs_decode"]}
    return {
        "threads": threads,
        "machine": facts(threads),
        "ours": ours,
        "transformers": theirs,
        "ratios": {k: ours[k] / theirs[k] for k in ours},
        "max_abs_logit_diff_64_tokens": float(np.abs(ours_logits - theirs_logits).max()),
        "same_greedy_tokens": bool(same_tokens),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single thread count, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "mamba2_vs_transformers.json"))
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
        "benchmark": "mamba2_vs_transformers",
        "model": {"family": "mamba2", **CONFIG},
        "workload": {"prefill_tokens": PREFILL, "decode_steps": DECODE, "decode_after_prompt_tokens": 16,
                     "repeats": a.repeats, "statistic": "best of repeats, arms interleaved"},
        "reference_path": "transformers Mamba2Mixer torch fallback (no mamba_ssm / causal_conv1d), fp32, inference_mode",
        "targets": {"prefill": ">= 2.0", "decode": ">= 1.5"},
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'threads':<9}{'':<16}{'ours':>10}{'transformers':>14}{'ratio':>8}")
    for r in runs:
        for k in ("prefill_tok_s", "decode_tok_s"):
            print(f"{r['threads']:<9}{k:<16}{r['ours'][k]:>10.1f}{r['transformers'][k]:>14.1f}{r['ratios'][k]:>8.2f}")
        print(f"{'':<9}max |Δlogit| over 64 tokens {r['max_abs_logit_diff_64_tokens']:.2e}, "
              f"same greedy tokens: {r['same_greedy_tokens']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
