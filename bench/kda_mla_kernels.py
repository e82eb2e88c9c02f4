"""KDA mixer and MLA attention kernels, side by side with the transformers 5.24.0 modules they
mirror (``KimiLinearDeltaAttention`` on its torch fallback — fla is not installed —,
``DeepseekV3Attention`` and ``KimiLinearAttention``, eager), fp32, one process, same thread
count, at a small realistic size:

* KDA: hidden 1024, 8 heads of 128, conv kernel 4, gate ranks 128, chunk 64;
* MLA: hidden 1024, 8 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v 128 — DeepSeek-style
  (q_lora_rank 384, yarn, interleaved rope) and Kimi-style (q_proj, no rope).

Workload per kernel: prefill of 512 positions from an empty state, then 64 single-token steps
continuing that state (context 512 → 576). The arms alternate repeat by repeat so that a change
in machine load hits both; the best of the repeats counts. For MLA both attention forms run
(reconstruct K/V from the latent rows, or kv_b absorbed into q and o), which is how the
module's defaults were chosen. transformers' rotary tables and causal masks are built outside
its timed region (in a model they are shared by all layers).

    python bench/kda_mla_kernels.py [--threads 1 2] [--repeats 3]

Each thread count runs in its own subprocess (BLAS pools are sized at import). Results, ratios,
parity, latent-vs-KV bytes and machine facts go to bench/results/kda_mla_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import facts, pin_threads

PREFILL = 512
DECODE = 64
KDA = {"hidden": 1024, "heads": 8, "head_dim": 128, "kernel": 4, "forget_rank": 128, "gate_rank": 128, "chunk": 64}
MLA = {"hidden_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 8, "kv_lora_rank": 512,
       "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
DS_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
           "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
# real sizes, for the bytes-per-position table only
REAL = {
    "deepseek_v3 (671B)": {"num_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                           "v_head_dim": 128, "hidden_size": 7168, "q_lora_rank": 1536},
    "kimi_linear (48B-A3B)": {"num_heads": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                              "v_head_dim": 128, "hidden_size": 2304, "q_lora_rank": None},
}


def _tests():
    sys.path.insert(0, str(HERE.parent / "tests"))
    import test_kda_mla_kernels as tk  # the one mapping from transformers modules to our operands

    return tk


def build_kda():
    import torch
    import transformers as T
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    from vindex3.exec.ops.kda import KdaState

    tk = _tests()
    c = KDA
    cfg = T.KimiLinearConfig(
        vocab_size=32, hidden_size=c["hidden"], num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4, layer_types=["linear_attention"],
        linear_attn_config={"head_dim": c["head_dim"], "num_heads": c["heads"], "short_conv_kernel_size": c["kernel"]},
        rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts=2, num_experts_per_token=1,
    )
    torch.manual_seed(0)
    m = KimiLinearDeltaAttention(cfg, 0).float().eval()
    gen = torch.Generator().manual_seed(1)
    H, D = c["heads"], c["head_dim"]
    with torch.no_grad():
        m.forget_gate.A_log.copy_(torch.empty(1, 1, H, 1).uniform_(math.log(0.3), math.log(6.0), generator=gen))
        m.forget_gate.dt_bias.copy_(torch.empty(H * D).uniform_(-5.0, 0.5, generator=gen))
        m.o_norm.weight.copy_(1.0 + 0.5 * torch.randn(D, generator=gen))
    w, g = tk.kda_operands(m, cfg, chunk_size=c["chunk"])
    return cfg, m, w, g, KdaState.zeros


def build_mla(kind: str):
    import torch
    import transformers as T
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    tk = _tests()
    torch.manual_seed(0)
    if kind == "deepseek":
        cfg = T.DeepseekV3Config(vocab_size=32, num_hidden_layers=1, q_lora_rank=384, rope_interleave=True,
                                 rope_parameters=dict(DS_ROPE), max_position_embeddings=163840, **MLA)
        cfg._attn_implementation = "eager"
        m, rot = DeepseekV3Attention(cfg, 0).float().eval(), DeepseekV3RotaryEmbedding(cfg)
    else:
        cfg = T.KimiLinearConfig(vocab_size=32, num_hidden_layers=1, layer_types=["full_attention"], q_lora_rank=None,
                                 pad_token_id=0, bos_token_id=1, eos_token_id=2, num_experts=2, num_experts_per_token=1,
                                 linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 3}, **MLA)
        cfg._attn_implementation = "eager"
        m, rot = KimiLinearAttention(cfg, 0).float().eval(), None
    tk._scale_mla(m, torch.Generator().manual_seed(1))
    w, g = tk.mla_operands(m, cfg, rope=kind == "deepseek")
    return cfg, m, rot, w, g


def run(threads: int, repeats: int) -> dict:
    import numpy as np
    import torch
    from transformers import DynamicCache

    from vindex3.exec.ops.kda import kda_prefill, kda_step

    tk = _tests()
    torch.set_num_threads(threads)
    results: dict = {"threads": threads, "machine": facts(threads)}

    def best_of(fns: dict) -> dict:
        best = dict.fromkeys(fns, 1e9)
        for _ in range(repeats):
            for k, f in fns.items():  # arms interleaved
                best[k] = min(best[k], f())
        return best

    def timed(f):
        t = time.perf_counter()
        f()
        return time.perf_counter() - t

    # ------------------------------------------------------------------ KDA
    cfg, m, w, g, zeros = build_kda()
    x = torch.randn(1, PREFILL + DECODE, g.hidden_size, generator=torch.Generator().manual_seed(2))
    xn = x[0].numpy()

    def ours_kda_prefill():
        st = zeros(g)
        return timed(lambda: kda_prefill(xn[:PREFILL], w, g, st))

    def theirs_kda_prefill():
        cache = DynamicCache(config=cfg)
        return timed(lambda: m(x[:, :PREFILL], cache=cache))

    def ours_kda_decode():
        st = zeros(g)
        kda_prefill(xn[:PREFILL], w, g, st)
        return timed(lambda: [kda_step(xn[t], w, g, st) for t in range(PREFILL, PREFILL + DECODE)])

    def theirs_kda_decode():
        cache = DynamicCache(config=cfg)
        m(x[:, :PREFILL], cache=cache)
        return timed(lambda: [m(x[:, t : t + 1], cache=cache) for t in range(PREFILL, PREFILL + DECODE)])

    with torch.inference_mode():
        # parity at this size, and warm-up (numba kernels load)
        (rp,), rs, _ = tk.kda_reference(m, cfg, x, [PREFILL], DECODE)
        st = zeros(g)
        op = kda_prefill(xn[:PREFILL], w, g, st)
        os_ = np.stack([kda_step(xn[t], w, g, st) for t in range(PREFILL, PREFILL + DECODE)])
        b = best_of({"ours_prefill": ours_kda_prefill, "theirs_prefill": theirs_kda_prefill,
                     "ours_decode": ours_kda_decode, "theirs_decode": theirs_kda_decode})
    results["kda"] = {
        "ours": {"prefill_tok_s": PREFILL / b["ours_prefill"], "decode_tok_s": DECODE / b["ours_decode"]},
        "transformers": {"prefill_tok_s": PREFILL / b["theirs_prefill"], "decode_tok_s": DECODE / b["theirs_decode"]},
        "ratios": {"prefill": b["theirs_prefill"] / b["ours_prefill"], "decode": b["theirs_decode"] / b["ours_decode"]},
        "max_abs_diff": {"prefill": float(np.abs(op - rp).max()), "decode": float(np.abs(os_ - np.stack(rs)).max()),
                         "output_max_abs": float(np.abs(rp).max())},
        "state_bytes": g.state_nbytes(),
    }

    for kind in ("deepseek", "kimi"):
        results[f"mla_{kind}"] = bench_mla(kind, best_of, timed)
    return results


def bench_mla(kind: str, best_of, timed) -> dict:
    import copy

    import numpy as np
    import torch
    from transformers import DynamicCache

    from vindex3.exec.ops.mla import (
        DECODE_MODE,
        MODES,
        PREFILL_MODE,
        LatentRows,
        mla_prefill,
        mla_step,
    )

    tk = _tests()
    _, m, rot, w, g = build_mla(kind)
    x = torch.randn(1, PREFILL + DECODE, g.hidden_size, generator=torch.Generator().manual_seed(3))
    xn = x[0].numpy()
    mask = tk._causal_mask(PREFILL, 0)
    pe_pre = rot(x, torch.arange(PREFILL)[None]) if rot is not None else None
    pe_dec = [rot(x, torch.tensor([[t]])) if rot is not None else None for t in range(PREFILL, PREFILL + DECODE)]

    def theirs_call(a, b, cache, pe, mask_):
        kw = {"attention_mask": mask_, "cache": cache}
        if pe is not None:
            kw["position_embeddings"] = pe
        return m(x[:, a:b], **kw)

    def theirs_prefill():
        cache = DynamicCache(config=m.config)
        return timed(lambda: theirs_call(0, PREFILL, cache, pe_pre, mask))

    def theirs_decode():
        cache = DynamicCache(config=m.config)
        theirs_call(0, PREFILL, cache, pe_pre, mask)
        steps = range(PREFILL, PREFILL + DECODE)
        return timed(lambda: [theirs_call(t, t + 1, cache, pe, None) for t, pe in zip(steps, pe_dec)])

    def ours_prefill(mode):
        def f():
            rows = LatentRows.for_geometry(g)
            return timed(lambda: mla_prefill(xn[:PREFILL], w, g, rows, mode=mode))

        return f

    def ours_decode(mode):
        def f():
            rows = LatentRows.for_geometry(g)
            mla_prefill(xn[:PREFILL], w, g, rows)
            return timed(lambda: [mla_step(xn[t], w, g, rows, mode=mode) for t in range(PREFILL, PREFILL + DECODE)])

        return f

    with torch.inference_mode():
        (rp,), rs, _ = tk.mla_reference(m, rot, x, [PREFILL], DECODE)
        # a float64 run of the same module: how far each float32 arm is from the exact function
        m64 = copy.deepcopy(m).double()
        kw = {"attention_mask": mask.double(), "cache": None}
        if rot is not None:
            kw["position_embeddings"] = copy.deepcopy(rot).double()(x.double(), torch.arange(PREFILL)[None])
        r64 = m64(x[:, :PREFILL].double(), **kw)[0][0].numpy()
        parity = {"output_max_abs": float(np.abs(rp).max()), "prefill_transformers_vs_float64": float(np.abs(rp - r64).max())}
        for mode in MODES:
            rows = LatentRows.for_geometry(g)
            op = mla_prefill(xn[:PREFILL], w, g, rows, mode=mode)
            od = np.stack([mla_step(xn[t], w, g, rows, mode=mode) for t in range(PREFILL, PREFILL + DECODE)])
            parity[f"prefill_{mode}"] = float(np.abs(op - rp).max())
            parity[f"prefill_{mode}_vs_float64"] = float(np.abs(op - r64).max())
            parity[f"decode_{mode}"] = float(np.abs(od - np.stack(rs)).max())
        arms = {"theirs_prefill": theirs_prefill, "theirs_decode": theirs_decode}
        for mode in MODES:
            arms[f"prefill_{mode}"] = ours_prefill(mode)
            arms[f"decode_{mode}"] = ours_decode(mode)
        b = best_of(arms)
    ours = {f"prefill_{md}_tok_s": PREFILL / b[f"prefill_{md}"] for md in MODES}
    ours.update({f"decode_{md}_tok_s": DECODE / b[f"decode_{md}"] for md in MODES})
    ratios = {"prefill_default": b["theirs_prefill"] / b[f"prefill_{PREFILL_MODE}"],
              "decode_default": b["theirs_decode"] / b[f"decode_{DECODE_MODE}"]}
    for md in MODES:
        ratios[f"prefill_{md}"] = b["theirs_prefill"] / b[f"prefill_{md}"]
        ratios[f"decode_{md}"] = b["theirs_decode"] / b[f"decode_{md}"]
    return {
        "ours": ours,
        "transformers": {"prefill_tok_s": PREFILL / b["theirs_prefill"], "decode_tok_s": DECODE / b["theirs_decode"]},
        "ratios": ratios,
        "max_abs_diff": parity,
        "bytes_per_position": {"latent": g.latent_nbytes_per_position, "kv_cache": g.kv_nbytes_per_position,
                               "kv_over_latent": g.kv_nbytes_per_position / g.latent_nbytes_per_position},
    }


def bytes_table() -> dict:
    from vindex3.exec.ops.mla import MlaGeometry

    out = {}
    for name, d in REAL.items():
        g = MlaGeometry(hidden_size=d["hidden_size"], num_heads=d["num_heads"], q_lora_rank=d["q_lora_rank"],
                        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope_head_dim"],
                        qk_rope_head_dim=d["qk_rope_head_dim"], v_head_dim=d["v_head_dim"],
                        q_a_norm_eps=1e-6 if d["q_lora_rank"] else None, kv_a_norm_eps=1e-6, rope=None,
                        attention_bias=False)
        out[name] = {"latent_bytes_per_position_f32": g.latent_nbytes_per_position,
                     "kv_bytes_per_position_f32": g.kv_nbytes_per_position,
                     "kv_over_latent": g.kv_nbytes_per_position / g.latent_nbytes_per_position}
    return out


def worst(parity: dict) -> float:
    return max(v for n, v in parity.items() if n.startswith(("prefill_", "decode_")) and "float64" not in n)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single thread count, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "kda_mla_kernels.json"))
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
    from vindex3.exec.ops.mla import DECODE_MODE, PREFILL_MODE

    report = {
        "benchmark": "kda_mla_kernels",
        "kernels": {"kda": KDA, "mla": MLA, "mla_deepseek": {"q_lora_rank": 384, "rope": DS_ROPE, "rope_interleave": True},
                    "mla_kimi": {"q_lora_rank": None, "rope": None}},
        "workload": {"prefill_tokens": PREFILL, "decode_steps": DECODE, "decode_after_prompt_tokens": PREFILL,
                     "repeats": a.repeats, "statistic": "best of repeats, arms interleaved"},
        "reference_path": "transformers 5.24.0 modules, torch fallback (no fla / causal_conv1d), eager attention, fp32, "
                          "inference_mode; rotary tables and masks built outside the timed region",
        "mla_defaults": {"prefill": PREFILL_MODE, "decode": DECODE_MODE},
        "bytes_per_position_real_sizes": bytes_table(),
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in runs:
        k = r["kda"]
        print(f"threads {r['threads']}  KDA  prefill x{k['ratios']['prefill']:.2f}  decode x{k['ratios']['decode']:.2f}  "
              f"|Δ| prefill {k['max_abs_diff']['prefill']:.1e} decode {k['max_abs_diff']['decode']:.1e}")
        for kind in ("deepseek", "kimi"):
            q = r[f"mla_{kind}"]
            rt = q["ratios"]
            print(f"threads {r['threads']}  MLA {kind:<8} prefill x{rt['prefill_reconstruct']:.2f} (reconstruct) "
                  f"x{rt['prefill_absorbed']:.2f} (absorbed)  decode x{rt['decode_reconstruct']:.2f} (reconstruct) "
                  f"x{rt['decode_absorbed']:.2f} (absorbed)  |Δ| vs transformers {worst(q['max_abs_diff']):.1e}  "
                  f"bytes/pos latent {q['bytes_per_position']['latent']} vs kv {q['bytes_per_position']['kv_cache']}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    sys.exit(main())
