"""OpenBLAS's idle-worker spin (``OPENBLAS_THREAD_TIMEOUT``, read once when OpenBLAS loads: its
workers spin ``2 ** value`` CPU cycles after a product before they sleep) against prefill time: SmolLM2 prefills of several lengths at a decode thread count, one process per
arm (the variable is read when OpenBLAS loads), arms interleaved over rounds, each arm's best of
``--repeats`` per length and round; reports the median over rounds and each arm's ratio to the
first.

    python bench/blas_idle.py [--timeouts 28,4,20] [--lengths 17,64,128,512] [--threads 2]
        [--rounds 3] [--repeats 3] [--out bench/results/blas_idle.json]

28 is OpenBLAS's build default. Why it is measured: at two threads the compiled kernels that run
between a long prefill's products (attention, SiLU) share the cores with a spinning worker
(bench/prefill_profile.py). What it found is in docs/container.md ("OpenBLAS's spinning
workers"): no value helps every length, so the project sets none.
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
from machine import child_json, facts, pin_threads


def arm(lengths: list[int], repeats: int) -> dict:
    import vindex3
    from vindex3 import default_model

    ex = vindex3.open(default_model.ensure()).executor()
    out = {}
    for T in lengths:
        ids = [100 + (i * 37) % 40000 for i in range(T)]
        ex.start().prefill(ids)  # warm: compile and touch the weights
        best = float("inf")
        for _ in range(repeats):
            st = ex.start()
            t0 = time.perf_counter()
            st.prefill(ids)
            best = min(best, time.perf_counter() - t0)
        out[str(T)] = best * 1000.0
    return {"ms": out, "timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timeouts", default="28,4,20")
    ap.add_argument("--lengths", default="17,64,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "blas_idle.json"))
    ap.add_argument("--arm", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    if a.arm:
        print(json.dumps(arm(lengths, a.repeats)))
        return 0
    pin_threads(a.threads)
    timeouts = a.timeouts.split(",")
    runs: dict[str, list[dict]] = {t: [] for t in timeouts}
    load0 = os.getloadavg()
    for r in range(a.rounds):
        for t in timeouts if r % 2 == 0 else timeouts[::-1]:
            env = dict(os.environ, OPENBLAS_THREAD_TIMEOUT=t, VINDEX3_DECODE_THREADS=str(a.threads))
            got = child_json([sys.executable, __file__, "--arm", "--lengths", a.lengths, "--repeats", str(a.repeats)],
                             env, f"timeout {t}")
            assert got["timeout"] == t, got
            runs[t].append(got["ms"])
            print(f"round {r} timeout {t}: " + ", ".join(f"{k}: {v:.1f}" for k, v in got["ms"].items())
                  + f" ms (load {os.getloadavg()[0]:.1f})", flush=True)
    med = {t: {str(T): statistics.median(x[str(T)] for x in runs[t]) for T in lengths} for t in timeouts}
    base = timeouts[0]
    ratio = {t: {k: med[base][k] / v for k, v in med[t].items()} for t in timeouts}
    for t in timeouts:
        print(f"timeout {t}: " + ", ".join(f"T={k} {v:.1f} ms ({ratio[t][k]:.2f}x)" for k, v in med[t].items()))
    doc = {"bench": "blas_idle", "threads": a.threads, "lengths": lengths, "rounds": a.rounds,
           "repeats": a.repeats, "median_ms": med, f"speedup_over_{base}": ratio, "runs": runs,
           "loadavg_before": list(load0), "loadavg_after": list(os.getloadavg()), "machine": facts(a.threads)}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
