"""A small Qwen3.5-text-like model, side by side with transformers' own CPU path (its torch
fallback: no flash-linear-attention / causal_conv1d kernels on CPU), in one process with the
same thread count: prefill of 512 tokens and 64 decode steps after a 16-token prompt, fp32.
The model is a ``qwen3_5_text`` built from a config (hidden 512, 8 layers, three Gated DeltaNet
layers to one gated-attention layer, 4 key heads and 8 value heads of 64, 4 query heads over 2
KV heads of 128 with a quarter rotary, FFN 1536, vocab 4096) with re-randomised weights. The two
arms alternate repeat by repeat so that a change in machine load hits both; the best of the
repeats counts, as wall time and as this process's CPU time (on a shared machine the CPU time of
a one-thread run is the steadier figure).

    python bench/gated_delta_vs_transformers.py [--threads 1 2] [--repeats 5]

Each thread count runs in its own subprocess (the BLAS pools are sized at import). Results,
ratios and machine facts go to bench/results/gated_delta_vs_transformers.json.
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

LIN, FULL = "linear_attention", "full_attention"
CONFIG = {
    "vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 8, "layer_types": [LIN, LIN, LIN, FULL] * 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 1536,
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
PREFILL = 512
DECODE = 64
PROMPT = 16


def build(tmp: Path):
    """The fixture checkpoint (transformers) and its container (vindex3)."""
    import torch
    import transformers as T

    import vindex3

    torch.manual_seed(0)
    model = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(**CONFIG)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(math.log(0.3), math.log(8.0), generator=gen))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty(p.shape).uniform_(-2.0, 1.0, generator=gen))
            elif "linear_attn.norm" in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            elif p.dim() == 1:  # zero-centred (1 + w) norms
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                gain = 3.0 if name.startswith("lm_head") else 0.7
                p.copy_(torch.randn(p.shape, generator=gen) * (gain / math.sqrt(p.shape[-1])))
    ck = tmp / "ckpt"
    model.save_pretrained(ck)
    return model, vindex3.open(vindex3.encode(ck, tmp / "qwen3_5_text.vindex3"))


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


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
            return _timed(lambda: st.prefill(ids, last_only=True))

        def theirs_prefill():
            return _timed(lambda: model(t_ids, use_cache=True, logits_to_keep=1))

        def ours_decode():
            st = ex.start()
            logits = st.prefill(ids[:PROMPT], last_only=True)[-1]
            toks = []

            def loop():
                nonlocal logits
                for _ in range(DECODE):
                    toks.append(int(np.argmax(logits)))
                    logits = st.step(toks[-1])

            w, cpu, _ = _timed(loop)
            return w, cpu, toks

        def theirs_decode():
            o = model(t_ids[:, :PROMPT], use_cache=True, logits_to_keep=1)
            state = {"cache": o.cache, "nxt": o.logits[:, -1].argmax(-1, keepdim=True)}
            toks = []

            def loop():
                for _ in range(DECODE):
                    toks.append(int(state["nxt"]))
                    o = model(state["nxt"], cache=state["cache"], use_cache=True)
                    state["cache"], state["nxt"] = o.cache, o.logits[:, -1].argmax(-1, keepdim=True)

            w, cpu, _ = _timed(loop)
            return w, cpu, toks

        with torch.inference_mode():
            # warm-up (numba kernels load, torch allocators settle) and the parity of the two arms
            ours_logits = ex.forward(ids[:160])
            theirs_logits = model(t_ids[:, :160]).logits[0].numpy()
            ours_prefill(), theirs_prefill()
            keys = ("ours_prefill", "theirs_prefill", "ours_decode", "theirs_decode")
            wall = dict.fromkeys(keys, 1e9)
            cpu = dict.fromkeys(keys, 1e9)
            same_tokens = True
            for _ in range(repeats):
                for k, fn in (("ours_prefill", ours_prefill), ("theirs_prefill", theirs_prefill)):
                    w, cp, _ = fn()
                    wall[k], cpu[k] = min(wall[k], w), min(cpu[k], cp)
                (wo, co, to), (wt, ct, tt) = ours_decode(), theirs_decode()
                same_tokens &= to == tt
                wall["ours_decode"], cpu["ours_decode"] = min(wall["ours_decode"], wo), min(cpu["ours_decode"], co)
                wall["theirs_decode"], cpu["theirs_decode"] = min(wall["theirs_decode"], wt), min(cpu["theirs_decode"], ct)

        gemm = _gemm_split(ex, model, ids, t_ids)

    def rates(t: dict, who: str) -> dict:
        return {"prefill_tok_s": PREFILL / t[f"{who}_prefill"], "decode_tok_s": DECODE / t[f"{who}_decode"]}

    out = {"threads": threads, "machine": facts(threads), "reference_attention": model.config._attn_implementation}
    for label, t in (("wall", wall), ("cpu", cpu)):
        ours, theirs = rates(t, "ours"), rates(t, "theirs")
        out[label] = {"ours": ours, "transformers": theirs, "ratios": {k: ours[k] / theirs[k] for k in ours}}
    out["max_abs_logit_diff_160_tokens"] = float(np.abs(ours_logits - theirs_logits).max())
    out["max_abs_logit_160_tokens"] = float(np.abs(theirs_logits).max())
    out["same_greedy_tokens"] = bool(same_tokens)
    out["prefill_split_seconds"] = gemm
    return out


def _gemm_split(ex, model, ids, t_ids) -> dict:
    """Where one 512-token prefill spends its CPU time: in the projection GEMMs (the same BLAS
    work in both arms) or elsewhere (the mixers, attention, norms). One instrumented pass each,
    outside the timed runs, summing the projections' matmul calls (our weight objects' ``mm``,
    transformers' ``nn.Linear`` modules); the mixers' own products count as "elsewhere"."""
    import torch

    from vindex3.codecs.f32 import DenseF32

    spent = [0.0]
    mm = DenseF32.mm

    def timed_mm(self, x):
        t = time.process_time()
        y = mm(self, x)
        spent[0] += time.process_time() - t
        return y

    DenseF32.mm = timed_mm
    try:
        st = ex.start()
        t0 = time.process_time()
        st.prefill(ids, last_only=True)
        ours_total = time.process_time() - t0
    finally:
        DenseF32.mm = mm
    lin = torch.nn.Linear.forward
    theirs_spent = [0.0]

    def timed_linear(self, x):
        t = time.process_time()
        y = lin(self, x)
        theirs_spent[0] += time.process_time() - t
        return y

    torch.nn.Linear.forward = timed_linear
    try:
        with torch.inference_mode():
            t0 = time.process_time()
            model(t_ids, use_cache=True, logits_to_keep=1)
            theirs_total = time.process_time() - t0
    finally:
        torch.nn.Linear.forward = lin
    return {"ours_total": ours_total, "ours_gemm": spent[0], "transformers_total": theirs_total,
            "transformers_gemm": theirs_spent[0]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single thread count, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "gated_delta_vs_transformers.json"))
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
        "benchmark": "gated_delta_vs_transformers",
        "model": {"family": "qwen3_5_text", **CONFIG},
        "workload": {"prefill_tokens": PREFILL, "decode_steps": DECODE, "decode_after_prompt_tokens": PROMPT,
                     "repeats": a.repeats, "statistic": "best of repeats, arms interleaved; wall and process CPU time"},
        "reference_path": "transformers Qwen3_5ForCausalLM, torch fallback (no flash-linear-attention / causal_conv1d), "
                          "fp32, its default attention implementation (see reference_attention per run), inference_mode",
        "targets": {"prefill": ">= 2.0", "decode": ">= 1.5"},
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'threads':<9}{'time':<6}{'':<16}{'ours':>10}{'transformers':>14}{'ratio':>8}")
    for r in runs:
        for label in ("wall", "cpu"):
            for k in ("prefill_tok_s", "decode_tok_s"):
                x = r[label]
                print(f"{r['threads']:<9}{label:<6}{k:<16}{x['ours'][k]:>10.1f}{x['transformers'][k]:>14.1f}"
                      f"{x['ratios'][k]:>8.2f}")
        g = r["prefill_split_seconds"]
        print(f"{'':<9}prefill CPU seconds: ours {g['ours_total']:.3f} of which GEMM {g['ours_gemm']:.3f}; "
              f"transformers {g['transformers_total']:.3f} of which GEMM {g['transformers_gemm']:.3f}")
        print(f"{'':<9}max |Δlogit| over 160 tokens {r['max_abs_logit_diff_160_tokens']:.2e} "
              f"(max |logit| {r['max_abs_logit_160_tokens']:.1f}), same greedy tokens: {r['same_greedy_tokens']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
