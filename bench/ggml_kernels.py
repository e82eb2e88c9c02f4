"""Decode-sized products (T = 1) of every GGML block encoding, three arms side by side in one
process: ``f32`` (the same matrix widened to float32, through the f32 codec's ``mm``: what a
widened container runs), ``decode_dot`` (the kernel GgmlWeight used before: decode each row to an
L1 scratch row, then dot; ``ggml_kernels.rows_blocks``) and ``fused`` (what GgmlWeight.mm runs
now: ``ggml_kernels.rows_fused``, codes dotted straight from the blocks, the block scale applied
to the partial sum). Random blocks with small finite scales (the values do not change the work),
matrices of SmolLM2-135M's FFN size ([1536, 576]; [1536, 768] for the 256-element K-quants).
Rounds interleave the arms; medians, bests, their ratios and the machine's load average before
and after are written.

    python bench/ggml_kernels.py [--rounds 15] [--out bench/results/ggml_kernels.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts

F16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q4_k": (0, 2),
              "q5_k": (0, 2), "q6_k": (208,), "mxfp4": ()}


def matrix(name: str, rng):
    import numpy as np

    from vindex3.codecs.ggml import KINDS

    _, be, bb = KINDS[name]
    rows, cols = 1536, (576 if be == 32 else 768)
    raw = rng.integers(0, 256, size=(rows, cols // be, bb), dtype=np.uint8)
    if name == "mxfp4":
        raw[:, :, 0] = 120
    for off in F16_FIELDS[name]:
        vals = rng.uniform(0.5, 1.0, raw.shape[:2]).astype(np.float16) * np.float16(2.0**-10)
        raw[:, :, off:off + 2] = vals.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1), (rows, cols)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=str(HERE / "results" / "ggml_kernels.json"))
    a = ap.parse_args()
    import numpy as np

    from vindex3 import codecs
    from vindex3.codecs import ggml_kernels as K
    from vindex3.codecs.ggml import KINDS
    from vindex3.codecs.kernels import ROWS_PER_TASK

    load_before = list(os.getloadavg())
    rng = np.random.default_rng(0)
    results = {}
    for name in KINDS:
        raw, shape = matrix(name, rng)
        kind, be, bb = KINDS[name]
        w = codecs.get(name).weight(raw.reshape(-1), shape)
        f32 = codecs.get("f32").weight(np.ascontiguousarray(w.dense()).reshape(-1).view(np.uint8), shape)
        x = rng.standard_normal((1, shape[1])).astype(np.float32)
        y = np.empty((1, shape[0]), np.float32)

        def decode_dot(raw=raw, x=x, y=y, kind=kind, be=be, bb=bb):
            K.rows_blocks(kind, raw, x, y, ROWS_PER_TASK, K.F16, K.KVALUES, be, bb)
            return y

        arms = {"f32": lambda f32=f32, x=x: f32.mm(x), "decode_dot": decode_dot, "fused": lambda w=w, x=x: w.mm(x)}
        outs = {k: np.array(f()) for k, f in arms.items()}  # compile, warm, and keep for the check below
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(a.rounds):
            for k, f in arms.items():
                t0 = time.perf_counter()
                for _ in range(10):
                    f()
                times[k].append((time.perf_counter() - t0) / 10)
        med = {k: statistics.median(v) for k, v in times.items()}
        best = {k: min(v) for k, v in times.items()}
        scale = float(np.abs(outs["f32"]).max())
        results[name] = {
            "shape": list(shape),
            "median_us": {k: v * 1e6 for k, v in med.items()},
            "best_us": {k: v * 1e6 for k, v in best.items()},
            # on a loaded machine the best round is the one least disturbed by other processes
            "fused_over_decode_dot": {"median": med["fused"] / med["decode_dot"], "best": best["fused"] / best["decode_dot"]},
            "fused_over_f32": {"median": med["fused"] / med["f32"], "best": best["fused"] / best["f32"]},
            "max_abs_diff_vs_f32": {k: float(np.abs(outs[k].reshape(-1) - outs["f32"].reshape(-1)).max())
                                    for k in ("decode_dot", "fused")},
            "max_abs_output": scale,
        }
        print(name, json.dumps(results[name]))
    res = {"bench": "ggml_kernels", "machine": facts(threads=1), "loadavg_before": load_before,
           "loadavg_after": list(os.getloadavg()),
           "rounds": a.rounds, "T": 1, "encodings": results}
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
