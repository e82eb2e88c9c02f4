"""One decode step's matrix products on the shipped SmolLM2-135M Q4_1 GGUF (q4_1 layers, q8_0
tied head), three arms side by side in one process: ``f32`` (the weights widened to float32),
``decode_dot`` (the native blocks through the kernel GgmlWeight used before this change: decode
each row to a scratch row, then dot; ``ggml_kernels.rows_blocks``) and ``fused`` (the native
blocks through ``GgmlWeight.mm``: ``ggml_kernels.rows_fused``). One sweep multiplies one token
(T = 1) by every matrix a decode step reads (30 layers x q, k, v, o, gate, up, down, and the
head), as bench/gguf_native.py does. Rounds interleave the arms; medians, bests and their ratios
are written with the machine facts and the load average before and after.

    python bench/ggml_decode.py [--rounds 9] [--out bench/results/ggml_decode.json]
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
from gguf_native import weights
from machine import facts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=str(HERE / "results" / "ggml_decode.json"))
    a = ap.parse_args()
    import numpy as np

    from vindex3.codecs import ggml_kernels as K
    from vindex3.codecs.kernels import ROWS_PER_TASK

    load_before = list(os.getloadavg())
    mats = weights()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((1, w.shape[1])).astype(np.float32) for _, w, _ in mats]

    def decode_dot(w, x):
        y = np.empty((1, w.rows), np.float32)
        K.rows_blocks(w.kind, w.b, x, y, ROWS_PER_TASK, K.F16, K.KVALUES, w.be, w.bb)
        return y

    arms = {
        "f32": lambda i: mats[i][1].mm(xs[i]),
        "decode_dot": lambda i: decode_dot(mats[i][2], xs[i]),
        "fused": lambda i: mats[i][2].mm(xs[i]),
    }
    outs = {k: [f(i) for i in range(len(mats))] for k, f in arms.items()}  # compile and warm
    times: dict[str, list[float]] = {k: [] for k in arms}
    for _ in range(a.rounds):
        for k, f in arms.items():
            t0 = time.perf_counter()
            for i in range(len(mats)):
                f(i)
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    res = {
        "bench": "ggml_decode",
        "machine": facts(threads=1),
        "loadavg_before": load_before,
        "loadavg_after": list(os.getloadavg()),
        "encodings": sorted({n.encoding for _, _, n in mats}),
        "rounds": a.rounds,
        "arms": {k: {"median_s": med[k], "best_s": best[k]} for k in arms},
        "fused_over_f32": {"median": med["fused"] / med["f32"], "best": best["fused"] / best["f32"]},
        "decode_dot_over_f32": {"median": med["decode_dot"] / med["f32"], "best": best["decode_dot"] / best["f32"]},
        "fused_speedup_over_decode_dot": {"median": med["decode_dot"] / med["fused"], "best": best["decode_dot"] / best["fused"]},
        # how far each native arm's products are from the f32 arm's (largest over all matrices)
        "max_abs_diff_vs_f32": {k: max(float(np.abs(o - f).max()) for o, f in zip(outs[k], outs["f32"]))
                                for k in ("decode_dot", "fused")},
    }
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
