"""Kernel-level rates on SmolLM2's matrix shapes, one thread, per CPU-second: the float-lane int8
and q4 rows kernels (activations 'exact', vindex3/codecs/kernels.py) against the integer dots of
every path the target runs (activations 'q8', vindex3/codecs/intrinsics.py), and the bf16 rows
kernel that widens a row into L1 scratch against the one that widens in registers, with f32 as
the yardstick. Arms are interleaved within each round; each figure is the best round.

    python bench/intdot_kernels.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts, pin_threads

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def _arms(w: dict, x, y, paths: list[str]) -> dict:
    from vindex3.codecs import intrinsics as I
    from vindex3.codecs import kernels as K

    bf16 = I.rows_bf16("vector")
    arms = {
        "f32": lambda: K.rows_plain(w["f32"].a, x, y, 16),
        "bf16 scratch (today)": lambda: K.rows_bf16(w["bf16"].h, x, y, 16),
        "bf16 registers": lambda: bf16(w["bf16"].h, x, y, 16),
        "int8 float lanes (exact)": lambda: K.rows_i8_block_scale(w["int8"].q, w["int8"].s, x, y, 16),
        "q4 float lanes (exact)": lambda: K.rows_q4(w["q4"].qs, w["q4"].d, w["q4"].m, K.F16_TABLE,
                                                     *K.q4_split_x(x), y, 16),
    }

    def i8(k):
        return lambda: k(w["int8"].q, w["int8"].s, x, y, 16)

    def q4(k):
        return lambda: k(w["q4"].qs, w["q4"].d, w["q4"].m, K.F16_TABLE, x, y, 16)

    for p in paths:
        arms[f"int8 q8 {p}"] = i8(I.rows_kernel("i8", p))
        arms[f"q4 q8 {p}"] = q4(I.rows_kernel("q4", p))
    return arms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out", default=str(HERE / "results" / "intdot_kernels.json"))
    a = ap.parse_args()
    pin_threads(1)
    import numpy as np

    from vindex3 import codecs
    from vindex3.codecs import intrinsics as I

    rng = np.random.default_rng(0)
    paths = [p for p in I.PATHS if I.available(p) and p != "plain"]
    rows: dict = {}
    for O, Kd in SHAPES:
        W = rng.standard_normal((O, Kd)).astype(np.float32)
        x = rng.standard_normal((1, Kd)).astype(np.float32)
        y = np.empty((1, O), np.float32)
        w = {e: codecs.get(e).weight(codecs.get(e).encode(W), W.shape) for e in ("f32", "bf16", "int8", "q4")}
        arms = _arms(w, x, y, paths)
        for f in arms.values():
            f()  # compile
        best = dict.fromkeys(arms, 1e9)
        for _ in range(a.rounds):
            for name, f in arms.items():
                t = time.process_time()
                for _ in range(a.calls):
                    f()
                best[name] = min(best[name], (time.process_time() - t) / a.calls)
        rows[f"{O}x{Kd}"] = {n: {"us_per_call": v * 1e6, "g_elements_per_cpu_s": O * Kd / v / 1e9} for n, v in best.items()}
        print(f"{O}x{Kd}: " + ", ".join(f"{n} {O * Kd / v / 1e9:.1f}" for n, v in best.items()), flush=True)
    doc = {"benchmark": "intdot_kernels", "unit": "G weight elements per CPU-second, one thread, one token",
           "paths": paths, "chosen": I.chosen(), "rounds": a.rounds, "calls": a.calls,
           "machine": facts(1) | {"loadavg_end": os.getloadavg()}, "shapes": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
