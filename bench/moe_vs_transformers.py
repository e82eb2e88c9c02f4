"""A routed-expert model end to end, side by side with transformers, in one process with the same
thread count: a Qwen3-MoE built from a config (hidden 512, 8 layers, 16 experts, top-2, expert
intermediate 1024, softmax router with renormalisation, 8 query heads of 64 over 4 KV heads,
vocab 2048), weights re-drawn at unit gain with a sharper router, saved in the released layout
(one tensor per expert) and encoded (the banks stacked). Prefill of 512 tokens, then 64 decode
steps fed a fixed token sequence (both arms do the same work whatever their argmax says).

transformers runs as a user gets it (its default attention and experts implementations) and,
as a second arm, with eager attention and the eager experts loop. The arms alternate repeat by
repeat so that a change in machine load hits all of them; prefill takes the best repeat, decode
the best of each step over the repeats (from the same state, so the same experts) summed over
the steps. Wall (perf_counter) and CPU (process_time) seconds are both kept: on a shared machine
a 1-thread arm's CPU time is the stable figure.

Reads: each decode step's trace says which bytes it touched; the mean is compared with always
read (everything but the expert banks and the embedding) + one embedding row + k/E of the
banks, computed here from the container's tensor table.

    python bench/moe_vs_transformers.py [--threads 1 2] [--repeats 5]

Each thread count runs in its own subprocess (BLAS pools are sized at import). Results, ratios
and machine facts go to bench/results/moe_vs_transformers.json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import facts, pin_threads

CONFIG = {"vocab_size": 2048, "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
          "num_key_value_heads": 4, "head_dim": 64, "num_experts": 16, "num_experts_per_tok": 2,
          "moe_intermediate_size": 1024, "intermediate_size": 1024, "norm_topk_prob": True, "hidden_act": "silu",
          "rms_norm_eps": 1e-6, "max_position_embeddings": 1024, "tie_word_embeddings": False,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
PREFILL = 512
DECODE = 64


def build(tmp: Path):
    import torch
    import transformers as T

    import vindex3

    torch.manual_seed(0)
    model = T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**CONFIG)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
                continue
            gain = 3.0 if name.endswith("mlp.gate.weight") else 1.0
            fan_in = 1 if "embed_tokens" in name else p.shape[-1]
            p.copy_(gain / math.sqrt(fan_in) * torch.randn(p.shape, generator=gen))
    ck = tmp / "ckpt"
    model.save_pretrained(ck)
    del model
    return ck, vindex3.open(vindex3.encode(ck, tmp / "moe.vindex3"))


def expected_reads(c) -> dict:
    """Bytes a decode step should touch, from the container's tensor table alone."""
    E, k = CONFIG["num_experts"], CONFIG["num_experts_per_tok"]
    bank = always = 0
    for obj, seg in c.segments.items():
        for name, e in seg.entries.items():
            if obj == "embedding":
                continue
            if ".experts." in name:
                bank += e.nbytes
            else:
                always += e.nbytes
    emb = c.segments["embedding"].entries["weight"]
    row = emb.nbytes // emb.shape[0]
    return {"always_read": always, "embedding_row": row, "expert_banks": bank,
            "always_plus_k_of_E_experts": always + row + k * bank / E, "everything": always + emb.nbytes + bank}


def run(threads: int, repeats: int) -> dict:
    import numpy as np
    import torch
    import transformers as T

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as d:
        ck, c = build(Path(d))
        ex = c.executor()
        default = T.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32).eval()
        eager = T.AutoModelForCausalLM.from_pretrained(ck, dtype=torch.float32, attn_implementation="eager",
                                                       experts_implementation="eager").eval()
        impl = {"default": {"attention": default.config._attn_implementation,
                            "experts": default.config._experts_implementation},
                "eager": {"attention": eager.config._attn_implementation, "experts": eager.config._experts_implementation}}
        rng = np.random.default_rng(2)
        prompt = rng.integers(3, CONFIG["vocab_size"], PREFILL).tolist()
        feed = rng.integers(3, CONFIG["vocab_size"], DECODE).tolist()

        def timed(f):
            w0, c0 = time.perf_counter(), time.process_time()
            r = f()
            return np.array([time.perf_counter() - w0, time.process_time() - c0]), r

        # -- arms: prefill(), start() -> state, step(state, i)
        def ours_prefill():
            return ex.start().prefill(prompt, last_only=True)

        def ours_start():
            st = ex.start()
            st.prefill(prompt, last_only=True)
            return st

        def ours_step(st, i):
            st.step(feed[i])

        def hf(model):
            tp = torch.tensor([prompt])

            def prefill():
                return model(tp, use_cache=True, logits_to_keep=1).logits[0, -1].numpy()

            def start():
                return [model(tp, use_cache=True, logits_to_keep=1).cache]

            def step(state, i):
                state[0] = model(torch.tensor([[feed[i]]]), cache=state[0], use_cache=True).cache

            return prefill, start, step

        arms = {"ours": (ours_prefill, ours_start, ours_step), "transformers": hf(default), "transformers_eager": hf(eager)}
        best_p = {a: np.full(2, np.inf) for a in arms}
        best_d = {a: np.full((DECODE, 2), np.inf) for a in arms}
        with torch.inference_mode():
            lasts = {a: f[0]() for a, f in arms.items()}  # warm-up, and the arms' agreement
            diffs = {a: float(np.abs(lasts["ours"] - lasts[a]).max()) for a in arms if a != "ours"}
            for _ in range(repeats):
                for a, (prefill, start, step) in arms.items():
                    best_p[a] = np.minimum(best_p[a], timed(prefill)[0])
                    s = start()
                    for i in range(DECODE):
                        best_d[a][i] = np.minimum(best_d[a][i], timed(lambda s=s, i=i, step=step: step(s, i))[0])
            st = ours_start()
            for i in range(DECODE):
                st.step(feed[i])
            step_bytes = st.trace.step_bytes[1:]
            calls = st.trace.calls("moe_ffn")[CONFIG["num_hidden_layers"]:]
            experts_per_step = float(np.mean([len(cl.detail.ran) for cl in calls]))
        want = expected_reads(c)
        prof = c.op_plan().read_profile()

    def rates(a):
        pw, pc = best_p[a]
        dw, dc = best_d[a].sum(axis=0)
        return {"prefill_tok_s": PREFILL / pw, "decode_tok_s": DECODE / dw,
                "prefill_tok_cpu_s": PREFILL / pc, "decode_tok_cpu_s": DECODE / dc}

    res = {a: rates(a) for a in arms}
    return {
        "threads": threads,
        "machine": facts(threads),
        "transformers_implementations": impl,
        "ours": res["ours"],
        "transformers": res["transformers"],
        "transformers_eager": res["transformers_eager"],
        "ratios": {a: {m: res["ours"][m] / res[a][m] for m in res["ours"]} for a in ("transformers", "transformers_eager")},
        "max_abs_diff_last_logits": diffs,
        "decode_reads": {
            "mean_bytes_per_step": float(np.mean(step_bytes)),
            "min_bytes_per_step": int(np.min(step_bytes)), "max_bytes_per_step": int(np.max(step_bytes)),
            "experts_run_per_layer_per_step": experts_per_step,
            **want,
            "measured_over_expected": float(np.mean(step_bytes)) / want["always_plus_k_of_E_experts"],
            "plan_per_position_bytes": prof.per_position_bytes,
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a single thread count, in this process
    ap.add_argument("--out", default=str(HERE / "results" / "moe_vs_transformers.json"))
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
        "benchmark": "moe_vs_transformers",
        "model": {"family": "qwen3_moe", "config": CONFIG},
        "workload": {"prefill_positions": PREFILL, "decode_steps": DECODE, "repeats": a.repeats,
                     "statistic": "prefill: best of repeats; decode: per step best of repeats, summed; arms "
                                  "interleaved; wall (perf_counter) and cpu (process_time) seconds"},
        "targets": {"prefill": ">= 1.5x transformers", "decode": ">= 1.5x transformers",
                    "decode_bytes_per_token": "within 10% of always-read + k/E of expert bytes"},
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2) + "\n")
    for r in runs:
        print(f"threads {r['threads']}  (transformers default: {r['transformers_implementations']['default']})")
        print(f"  {'':<20}{'ours':>10}{'hf':>10}{'hf eager':>10}{'ratio':>8}{'ratio eager':>12}")
        for m in ("prefill_tok_s", "prefill_tok_cpu_s", "decode_tok_s", "decode_tok_cpu_s"):
            print(f"  {m:<20}{r['ours'][m]:>10.1f}{r['transformers'][m]:>10.1f}{r['transformers_eager'][m]:>10.1f}"
                  f"{r['ratios']['transformers'][m]:>8.2f}{r['ratios']['transformers_eager'][m]:>12.2f}")
        dr = r["decode_reads"]
        print(f"  decode bytes/step {dr['mean_bytes_per_step']:,.0f}, expected {dr['always_plus_k_of_E_experts']:,.0f} "
              f"({dr['measured_over_expected']:.3f}), all weights {dr['everything']:,}")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
