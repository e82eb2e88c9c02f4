"""Gated DeltaNet mixer speed, side by side with transformers' own CPU path (its torch fallback:
no fla / causal_conv1d kernels on CPU), in one process with the same thread count: prefill of
512 positions and 64 decode steps (after a 16-position prefill) through one mixer, in both
projection layouts (Qwen3-Next's grouped qkvz/ba and Qwen3.5's split qkv/z/b/a), fp32, weights
re-randomised. The arms alternate repeat by repeat so that a change in machine load hits both;
the best of the repeats counts. This measures the mixer alone (no embedding, norms, FFN, head).

    python bench/gated_delta_kernels.py [--threads 1 2] [--repeats 5]

Each thread count runs in its own subprocess (the BLAS pools are sized at import). Results,
ratios and machine facts go to bench/results/gated_delta_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import facts, pin_threads

# A small but realistic geometry: Qwen3-Next / Qwen3.5 keep d_k = d_v = 128 and twice as many
# value heads as key heads; hidden 512 keeps the projections in proportion.
CONFIG = {"hidden_size": 512, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
          "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
          "rms_norm_eps": 1e-6, "hidden_act": "silu"}
PREFILL = 512
DECODE = 64
DECODE_AFTER = 16
LAYOUTS = ("qkvz_ba_grouped", "qkv_z_b_a")


def build(layout: str):
    import torch
    import transformers as T
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from vindex3.codecs.f32 import DenseF32
    from vindex3.exec.ops.gated_delta import GatedDeltaGeometry, GatedDeltaWeights

    if layout == "qkvz_ba_grouped":
        cfg = T.Qwen3NextConfig(vocab_size=32, num_hidden_layers=1, layer_types=["linear_attention"], **CONFIG)
        cls = Qwen3NextGatedDeltaNet
    else:
        cfg = T.Qwen3_5TextConfig(vocab_size=32, num_hidden_layers=1, layer_types=["linear_attention"], **CONFIG)
        cls = Qwen3_5GatedDeltaNet
    torch.manual_seed(0)
    m = cls(cfg, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for lin in (mm for mm in m.modules() if isinstance(mm, torch.nn.Linear)):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / math.sqrt(lin.weight.shape[1]))
        m.conv1d.weight.copy_(0.5 * torch.randn(m.conv1d.weight.shape, generator=gen))
        h = m.num_v_heads
        m.A_log.copy_(torch.empty(h).uniform_(math.log(0.05), math.log(3.0), generator=gen))
        m.dt_bias.copy_(torch.empty(h).uniform_(-3.0, 0.5, generator=gen))
        m.norm.weight.copy_(1.0 + 0.5 * torch.randn(m.norm.weight.shape, generator=gen))

    def arr(t):
        return t.detach().numpy().copy()

    kw = {"conv_weight": arr(m.conv1d.weight), "A_log": arr(m.A_log), "dt_bias": arr(m.dt_bias),
          "norm_weight": arr(m.norm.weight), "out_proj": DenseF32(arr(m.out_proj.weight))}
    for n in ("in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"):
        if hasattr(m, n):
            kw[n] = DenseF32(arr(getattr(m, n).weight))
    g = GatedDeltaGeometry(
        hidden_size=cfg.hidden_size, num_key_heads=cfg.linear_num_key_heads,
        num_value_heads=cfg.linear_num_value_heads, key_head_dim=cfg.linear_key_head_dim,
        value_head_dim=cfg.linear_value_head_dim, conv_kernel=cfg.linear_conv_kernel_dim,
        chunk_size=64, norm_eps=cfg.rms_norm_eps, qk_l2norm_eps=1e-6, projection_layout=layout,
        conv_activation=cfg.hidden_act)
    return cfg, m, GatedDeltaWeights(**kw), g


def run_layout(layout: str, repeats: int) -> dict:
    import numpy as np
    import torch
    from transformers import DynamicCache

    from vindex3.exec.ops.gated_delta import GatedDeltaState, gated_delta_prefill, gated_delta_step

    cfg, m, w, g = build(layout)
    x = np.random.default_rng(0).standard_normal((PREFILL, cfg.hidden_size)).astype(np.float32)
    xt = torch.from_numpy(x)[None]

    def ours_prefill():
        st = GatedDeltaState.zeros(g)
        t = time.perf_counter()
        y = gated_delta_prefill(x, w, g, st)
        return time.perf_counter() - t, y

    def theirs_prefill():
        cache = DynamicCache(config=cfg)
        t = time.perf_counter()
        y = m(xt, cache=cache)
        return time.perf_counter() - t, y[0].numpy()

    def ours_decode():
        st = GatedDeltaState.zeros(g)
        gated_delta_prefill(x[:DECODE_AFTER], w, g, st)
        ys = []
        t = time.perf_counter()
        for i in range(DECODE_AFTER, DECODE_AFTER + DECODE):
            ys.append(gated_delta_step(x[i], w, g, st))
        return time.perf_counter() - t, np.stack(ys)

    def theirs_decode():
        cache = DynamicCache(config=cfg)
        m(xt[:, :DECODE_AFTER], cache=cache)
        ys = []
        t = time.perf_counter()
        for i in range(DECODE_AFTER, DECODE_AFTER + DECODE):
            ys.append(m(xt[:, i : i + 1], cache=cache))
        dt = time.perf_counter() - t
        return dt, torch.cat(ys, 1)[0].numpy()

    with torch.inference_mode():
        _, yo = ours_prefill()
        _, yt = theirs_prefill()
        _, do = ours_decode()
        _, dtt = theirs_decode()
        best = {"ours_prefill": 1e9, "theirs_prefill": 1e9, "ours_decode": 1e9, "theirs_decode": 1e9}
        for _ in range(repeats):
            best["ours_prefill"] = min(best["ours_prefill"], ours_prefill()[0])
            best["theirs_prefill"] = min(best["theirs_prefill"], theirs_prefill()[0])
            best["ours_decode"] = min(best["ours_decode"], ours_decode()[0])
            best["theirs_decode"] = min(best["theirs_decode"], theirs_decode()[0])
    ours = {"prefill_tok_s": PREFILL / best["ours_prefill"], "decode_tok_s": DECODE / best["ours_decode"]}
    theirs = {"prefill_tok_s": PREFILL / best["theirs_prefill"], "decode_tok_s": DECODE / best["theirs_decode"]}
    return {
        "layout": layout,
        "ours": ours,
        "transformers": theirs,
        "ratios": {k: ours[k] / theirs[k] for k in ours},
        "best_seconds": best,
        "max_abs_diff_prefill": float(np.abs(yo - yt).max()),
        "max_abs_diff_decode": float(np.abs(do - dtt).max()),
        "max_abs_output": float(np.abs(yt).max()),
    }


def run(threads: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    return {"threads": threads, "machine": facts(threads),
            "layouts": [run_layout(lay, repeats) for lay in LAYOUTS]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single thread count, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "gated_delta_kernels.json"))
    a = ap.parse_args()
    if a.one is not None:
        pin_threads(a.one)
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
        "benchmark": "gated_delta_kernels",
        "model": {"mixer": "gated_delta", **CONFIG, "chunk_size": 64},
        "workload": {"prefill_tokens": PREFILL, "decode_steps": DECODE, "decode_after_prompt_tokens": DECODE_AFTER,
                     "repeats": a.repeats, "statistic": "best of repeats, arms interleaved", "scope": "one mixer"},
        "reference_path": "transformers 5.24.0 Qwen3NextGatedDeltaNet / Qwen3_5GatedDeltaNet torch fallback "
                          "(no fla, no causal_conv1d), fp32, inference_mode, DynamicCache",
        "targets_whole_model": {"prefill": ">= 2.0", "decode": ">= 1.5"},
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'threads':<9}{'layout':<17}{'':<15}{'ours':>10}{'transformers':>14}{'ratio':>8}")
    for r in runs:
        for lay in r["layouts"]:
            for k in ("prefill_tok_s", "decode_tok_s"):
                print(f"{r['threads']:<9}{lay['layout']:<17}{k:<15}{lay['ours'][k]:>10.1f}"
                      f"{lay['transformers'][k]:>14.1f}{lay['ratios'][k]:>8.2f}")
            print(f"{'':<26}max |Δ| prefill {lay['max_abs_diff_prefill']:.2e}, decode "
                  f"{lay['max_abs_diff_decode']:.2e} (outputs up to {lay['max_abs_output']:.1f})")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
