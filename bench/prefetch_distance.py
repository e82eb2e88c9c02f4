"""Software prefetch distance of the dots kernels (vindex3/codecs/intrinsics.py, PREFETCH):
the serial rows kernel of each weight kind built with each distance, on SmolLM2's and the 1.1B
shape's matrices, at T=1 and T=8 activation rows, one thread. Every weight is cold as in a
decode step (the kernel walks through copies totalling more than the last-level cache, one
call per copy), so the figure is what a decode pays. Arms (distances) are interleaved within
each round; each figure is the best round's CPU milliseconds per call (the calling thread's CPU
time: a round in which the process was descheduled does not count the time away).

    python bench/prefetch_distance.py [--kinds f32,bf16,i8,q4] [--dists 0,1024,2048,4096,8192]

With ``--threads 2`` the arms are instead the serial kernel and the parallel one on numba's
pool of two threads (both with the module's distances), timed by the wall clock (CPU time would
count both threads): where a decode-sized product gains from a second core at the load of the
moment (vindex3/codecs/threads.py, PARALLEL_MIN_BYTES).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts, pin_threads

SMOL = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]
ONE_B = [(2048, 2048), (5632, 2048), (2048, 5632), (32000, 2048)]
COLD_BYTES = 96 << 20  # more than the 32 MB last-level cache


def _weight(kind: str, O: int, K: int, rng):
    import numpy as np

    if kind == "f32":
        return (rng.standard_normal((O, K), np.float32),)
    if kind == "bf16":
        return (rng.integers(0x3C00, 0x3F80, (O, K), dtype=np.uint16),)
    if kind == "i8":
        return (rng.integers(-127, 128, (O, K), dtype=np.int8), rng.random((O, K // 32), np.float32))
    f16 = lambda: rng.random((O, K // 32)).astype(np.float16).view(np.uint16)
    return (rng.integers(0, 256, (O, K // 2), dtype=np.uint8), f16(), f16())


def _mapped(w, where: Path, n: int):
    """``w`` written to files and mapped read-only, as a container's segments are (page-cache
    pages of 4 KB, not the huge pages numpy may give a large array)."""
    import numpy as np

    out = []
    for i, a in enumerate(w):
        f = where / f"w{n}.{i}.bin"
        a.tofile(f)
        out.append(np.memmap(f, dtype=a.dtype, mode="r", shape=a.shape))
    return tuple(out)


def _nbytes(w) -> int:
    return sum(a.nbytes for a in w)


def _kernel(kind: str, path: str, pf: int | None, parallel: bool = False):
    from vindex3.codecs import intrinsics as I
    from vindex3.codecs.kernels import F16_TABLE

    if kind in ("f32", "bf16"):
        L, PT = I.FLOAT_GEOMETRY[kind]
        k = I._make_rows_float(I._make_float_dots(kind, L, PT, pf), PT, parallel)
        return lambda w, x, y: k(w[0], x, y, I.ROWS_PER_TASK)
    if kind == "i8":
        k = I._make_rows_i8(I._make_i8_dots(path, pf), parallel)
        return lambda w, x, y: k(w[0], w[1], x, y, I.ROWS_PER_TASK)
    k = I._make_rows_q4(I._make_q4_dots(path, pf), parallel)
    return lambda w, x, y: k(w[0], w[1], w[2], F16_TABLE, x, y, I.ROWS_PER_TASK)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="f32,bf16,i8,q4")
    ap.add_argument("--dists", default="0,1024,2048,4096,8192", help="weight prefetch distances, bytes")
    ap.add_argument("--path", default=None, help="integer dot path (default: the target's best)")
    ap.add_argument("--shapes", default="all", choices=["all", "smol", "1b"])
    ap.add_argument("--ts", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", choices=["mapped", "arrays", "hot"], default="mapped",
                    help="weights in mapped files (as a container's), in numpy arrays, or one array "
                         "used again and again (cache-resident when it fits)")
    ap.add_argument("--threads", type=int, default=1, choices=[1, 2], help="2: serial against parallel arms")
    ap.add_argument("--out", default=str(HERE / "results" / "prefetch_distance.json"))
    a = ap.parse_args()
    pin_threads(a.threads)
    import numpy as np

    from vindex3.codecs import intrinsics as I

    path = a.path or I.best()
    shapes = {"all": SMOL + ONE_B, "smol": SMOL, "1b": ONE_B}[a.shapes]
    dists = [int(d) for d in a.dists.split(",")]
    ts = [int(t) for t in a.ts.split(",")]
    rng = np.random.default_rng(38)
    clock = time.thread_time if a.threads == 1 else time.perf_counter
    out = {"machine": facts(a.threads), "clock": clock.__name__, "path": path, "cold_bytes": COLD_BYTES, "memory": a.memory, "rows": []}
    print(f"path {path} load {os.getloadavg()}")
    for kind in a.kinds.split(","):
        if a.threads == 1:
            arms = {pf: _kernel(kind, path, pf) for pf in dists}
        else:
            arms = {"1 thread": _kernel(kind, path, None), "2 threads": _kernel(kind, path, None, True)}
        for O, K in shapes:
            w0 = _weight(kind, O, K, rng)
            n = 1 if a.memory == "hot" else max(1, math.ceil(COLD_BYTES / _nbytes(w0)))
            tmp = tempfile.TemporaryDirectory()
            if a.memory == "mapped":
                copies = [_mapped(w0, Path(tmp.name), i) for i in range(n)]
            else:
                copies = [w0] + [tuple(x.copy() for x in w0) for _ in range(n - 1)]
            for T in ts:
                x = rng.standard_normal((T, K), np.float32)
                y = np.empty((T, O), np.float32)
                best = {arm: math.inf for arm in arms}
                for f in arms.values():  # compile, warm
                    f(copies[0], x, y)
                reps = max(1, math.ceil(20e6 / (len(copies) * _nbytes(w0))))
                load0 = os.getloadavg()[0]
                for _ in range(a.rounds):
                    for arm, f in arms.items():
                        t0 = clock()
                        for _ in range(reps):
                            for w in copies:
                                f(w, x, y)
                        best[arm] = min(best[arm], (clock() - t0) / (reps * len(copies)))
                row = {"kind": kind, "O": O, "K": K, "T": T, "bytes": _nbytes(w0), "load1": load0,
                       "ms": {str(pf): round(best[pf] * 1e3, 4) for pf in arms}}
                base = best.get(0, best.get("1 thread"))
                out["rows"].append(row)
                cells = "  ".join(f"{k}:{v:.3f}" for k, v in row["ms"].items())
                gbs = _nbytes(w0) / min(best.values()) / 1e9
                print(f"{kind} {O}x{K} T={T} load {load0:.2f} | {cells} | best {gbs:.1f} GB/s"
                      + (f" x{base / min(best.values()):.2f}" if base else ""), flush=True)
            del copies, w0
            tmp.cleanup()
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
