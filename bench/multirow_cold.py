"""Several-position rows kernels (T = 1..8) on cold weights: shapes of the dots kernels of
vindex3/codecs/intrinsics.py built with each arm's options (prefetch distance and locality,
weight rows walked side by side, positions per walk), serial, one thread. Every weight is cold
as in a decode step: the kernel walks through file-mapped copies totalling more than the
last-level cache, one call per copy. Arms are interleaved within each round; each figure is the
best round's CPU milliseconds per call (the calling thread's CPU time).

    python bench/multirow_cold.py [--kinds f32,i8,q4] [--arms base,r2g4] [--ts 1,2,4,8]

An arm names its options (`arm_options`) of `_make_float_dots`, `_make_i8_dots`, `_make_q4_dots`).
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
from prefetch_distance import COLD_BYTES, _mapped, _nbytes, _weight

SHAPES = {"smol": [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)], "1b": [(5632, 2048)]}


def arm_options(name: str) -> dict:
    """An arm's kernel options from its name: ``module`` (the kernel as the module builds it),
    else tokens joined by ``_``: ``pf<n>k`` prefetch distance n KB (``pf0``: none), ``loc<n>``
    prefetch locality, ``nolead`` one stream's distance for every row of a walk (no
    `_lead`), ``r<n>`` weight rows side by side, ``g<n>`` positions per walk."""
    opts: dict = {}
    if name == "module":
        return opts
    for tok in name.split("_"):
        if tok.startswith("pf"):
            opts["pf"] = int(tok[2:].rstrip("k")) * (1024 if tok.endswith("k") else 1)
        elif tok == "nolead":
            opts["pair_lead"] = False
        elif tok.startswith("loc"):
            opts["locality"] = int(tok[3:])
        elif tok[0] == "r":
            opts["rows"] = int(tok[1:])
        elif tok[0] == "g":
            opts["group"] = int(tok[1:])
        else:
            raise SystemExit(f"unknown arm token {tok!r} in {name!r} (pf<n>k, loc<n>, r<n>, g<n>)")
    return opts


def _kernel(kind: str, path: str, opts: dict, rpt: int):
    from vindex3.codecs import intrinsics as I
    from vindex3.codecs.kernels import F16_TABLE

    if kind in ("f32", "bf16"):
        L, PT = I.FLOAT_GEOMETRY[kind]
        k = I._make_rows_float(I._make_float_dots(kind, L, PT, **opts), PT, False)
        return lambda w, x, y: k(w[0], x, y, rpt)
    if kind == "i8":
        k = I._make_rows_i8(I._make_i8_dots(path, **opts), False)
        return lambda w, x, y: k(w[0], w[1], x, y, rpt)
    k = I._make_rows_q4(I._make_q4_dots(path, **opts), False)
    return lambda w, x, y: k(w[0], w[1], w[2], F16_TABLE, x, y, rpt)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="f32,i8,q4")
    ap.add_argument("--arms", default="module,r2g4")
    ap.add_argument("--rpt", default="16", help="rows per task, one arm each when several (a,b)")
    ap.add_argument("--path", default=None, help="integer dot path (default: the target's best)")
    ap.add_argument("--shapes", default="smol,1b")
    ap.add_argument("--ts", default="1,2,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--memory", choices=["cold", "hot"], default="cold",
                    help="hot: one weight in a numpy array used again and again (cache-resident when it fits)")
    ap.add_argument("--out", default=str(HERE / "results" / "multirow_cold.json"))
    a = ap.parse_args()
    pin_threads(1)
    import numpy as np

    from vindex3.codecs import intrinsics as I

    path = a.path or I.best()
    shapes = [s for name in a.shapes.split(",") for s in SHAPES[name]]
    ts = [int(t) for t in a.ts.split(",")]
    rpts = [int(r) for r in a.rpt.split(",")]
    rng = np.random.default_rng(38)
    out = {"machine": facts(1), "clock": "thread_time", "path": path, "cold_bytes": COLD_BYTES, "memory": a.memory,
           "arms": {n: arm_options(n) for n in a.arms.split(",")}, "rows": []}
    print(f"path {path} load {os.getloadavg()}")
    for kind in a.kinds.split(","):
        arms = {}
        for n in a.arms.split(","):
            for r in rpts:
                arms[n if len(rpts) == 1 else f"{n}/rpt{r}"] = _kernel(kind, path, arm_options(n), r)
        for O, K in shapes:
            w0 = _weight(kind, O, K, rng)
            n = max(1, math.ceil(COLD_BYTES / _nbytes(w0)))
            tmp = tempfile.TemporaryDirectory()
            copies = [w0] if a.memory == "hot" else [_mapped(w0, Path(tmp.name), i) for i in range(n)]
            for T in ts:
                x = rng.standard_normal((T, K), np.float32)
                y = np.empty((T, O), np.float32)
                best = {arm: math.inf for arm in arms}
                want = None
                for f in arms.values():  # compile, warm, and every arm gives the same bytes
                    f(copies[0], x, y)
                    if want is None:
                        want = y.copy()
                    assert np.array_equal(y, want, equal_nan=True), "an arm changed the bytes"
                reps = max(1, math.ceil(20e6 / (len(copies) * _nbytes(w0))))
                load0 = os.getloadavg()[0]
                for _ in range(a.rounds):
                    for arm, f in arms.items():
                        t0 = time.thread_time()
                        for _ in range(reps):
                            for w in copies:
                                f(w, x, y)
                        best[arm] = min(best[arm], (time.thread_time() - t0) / (reps * len(copies)))
                row = {"kind": kind, "O": O, "K": K, "T": T, "bytes": _nbytes(w0), "load1": load0,
                       "ms": {arm: round(v * 1e3, 4) for arm, v in best.items()}}
                out["rows"].append(row)
                first = next(iter(best.values()))
                cells = "  ".join(f"{k}:{v:.3f}({first / best[k]:.2f}x)" for k, v in row["ms"].items())
                print(f"{kind} {O}x{K} T={T} load {load0:.2f} | {cells}", flush=True)
            del copies, w0
            tmp.cleanup()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
