"""Executor speed on SmolLM2-135M-Instruct, side by side with transformers (same weights from
the same GGUF, fp32, same thread count): prefill tokens/s at 128 and 512 tokens, decode
tokens/s over 64 steps, peak RSS. Ours runs with ``VINDEX3_DECODE_THREADS`` at the thread count
(before this was set, ours ran its prompts and decode at one thread whatever ``--threads`` said). Each arm runs in its own subprocess so its peak RSS is its
own; this script runs both and writes the ratios.

    python bench/executor_vs_transformers.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import facts, pin_threads

PROMPT_WORDS = ["The", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while", "the", "model", "keeps", "counting", "tokens", "and", "the", "benchmark", "keeps", "time."]


def prompt_ids(tok_encode, n: int) -> list[int]:
    text = " ".join(PROMPT_WORDS * 40)
    ids = tok_encode(text)
    assert len(ids) >= n
    return ids[:n]


def arm_ours(threads: int, repeats: int) -> dict:
    import numpy as np

    import vindex3
    from vindex3 import default_model

    c = vindex3.open(default_model.ensure())
    t = time.perf_counter()
    ex = c.executor()
    prepare = time.perf_counter() - t
    out = {"prepare_seconds": prepare, "weight_bytes": c.weight_bytes}
    for n in (128, 512):
        ids = prompt_ids(c.tokenizer.encode, n)
        best = 1e9
        for _ in range(repeats):
            st = ex.start()
            t = time.perf_counter()
            st.prefill(ids, last_only=True)
            best = min(best, time.perf_counter() - t)
        out[f"prefill_{n}_tok_s"] = n / best
    ids = prompt_ids(c.tokenizer.encode, 16)
    best = 1e9
    for _ in range(repeats):
        st = ex.start()
        logits = st.prefill(ids, last_only=True)[-1]
        t = time.perf_counter()
        for _ in range(64):
            logits = st.step(int(np.argmax(logits)))
        best = min(best, time.perf_counter() - t)
    out["decode_tok_s"] = 64 / best
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def arm_transformers(threads: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vindex3 import default_model

    torch.set_num_threads(threads)
    g = default_model.gguf_path()
    tok = AutoTokenizer.from_pretrained(g.parent, gguf_file=g.name)
    m = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    out = {"attn_implementation": m.config._attn_implementation}
    enc = lambda s: tok(s).input_ids
    with torch.inference_mode():
        for n in (128, 512):
            ids = torch.tensor([prompt_ids(enc, n)])
            best = 1e9
            for _ in range(repeats):
                t = time.perf_counter()
                m(ids, use_cache=True, logits_to_keep=1)
                best = min(best, time.perf_counter() - t)
            out[f"prefill_{n}_tok_s"] = n / best
        ids = torch.tensor([prompt_ids(enc, 16)])
        best = 1e9
        for _ in range(repeats):
            o = m(ids, use_cache=True, logits_to_keep=1)
            cache, nxt = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            t = time.perf_counter()
            for _ in range(64):
                o = m(nxt, cache=cache, use_cache=True)
                cache, nxt = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)
            best = min(best, time.perf_counter() - t)
        out["decode_tok_s"] = 64 / best
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--arm", choices=["ours", "transformers"])
    ap.add_argument("--out", default=str(HERE / "results" / "executor_vs_transformers.json"))
    a = ap.parse_args()
    if a.arm:
        pin_threads(a.threads)
        fn = arm_ours if a.arm == "ours" else arm_transformers
        print(json.dumps(fn(a.threads, a.repeats)))
        return 0
    res = {}
    for arm in ("ours", "transformers"):
        # ours at the same count: decode-sized passes (prompts up to 512 tokens included) use
        # VINDEX3_DECODE_THREADS threads, not BLAS's own (vindex3.exec.engine.pass_threads)
        env = dict(os.environ, VINDEX3_DECODE_THREADS=str(a.threads))
        p = subprocess.run([sys.executable, __file__, "--arm", arm, "--threads", str(a.threads), "--repeats", str(a.repeats)],
                           capture_output=True, text=True, env=env, check=False)
        if p.returncode:
            print(p.stderr, file=sys.stderr)
            return p.returncode
        res[arm] = json.loads(p.stdout.strip().splitlines()[-1])
    o, t = res["ours"], res["transformers"]
    ratios = {k: o[k] / t[k] for k in ("prefill_128_tok_s", "prefill_512_tok_s", "decode_tok_s")}
    ratios["peak_rss_over_weight_bytes"] = o["peak_rss_bytes"] / o["weight_bytes"]
    report = {"benchmark": "executor_vs_transformers", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to f32)",
              "machine": facts(a.threads), "ours": o, "transformers": t, "ratios": ratios,
              "targets": {"decode": ">= 1.5", "prefill": ">= 0.9", "peak_rss_over_weight_bytes": "<= 1.3"}}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'':<22}{'ours':>12}{'transformers':>14}{'ratio':>8}")
    for k in ("prefill_128_tok_s", "prefill_512_tok_s", "decode_tok_s"):
        print(f"{k:<22}{o[k]:>12.1f}{t[k]:>14.1f}{ratios[k]:>8.2f}")
    print(f"{'peak RSS (MiB)':<22}{o['peak_rss_bytes'] / 2**20:>12.0f}{t['peak_rss_bytes'] / 2**20:>14.0f}")
    print(f"peak RSS / weight bytes (ours): {ratios['peak_rss_over_weight_bytes']:.2f}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
