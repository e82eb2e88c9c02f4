"""Which cache level the dots kernels' software prefetch should fill, on the weights of a real
container: the products of every SmolLM2 layer (as the fused layers hold them: the container's
own arrays, file-mapped) for one kind, each arm's dots kernel built with its prefetch locality
and distance, all arms compiled in ONE process and alternated pass by pass (the order reversed
every round), so the machine's drift is shared. A pass runs every layer's products in order at
T positions, one thread, or ``--threads 2`` (one parallel region a pass, each thread half the
rows of every product, no barrier between products: the streaming, not the hand-off). Reported
per arm: the median ms a pass and the paired median ratio to the first arm (each round's time
over the first arm's time in that round). Writes JSON with the machine facts and the load
average before and after.

    python bench/prefetch_locality.py [--kind i8] [--ts 1,2,4,8] [--threads 1,2] [--rounds 30]
        [--arms "3:8192,2:8192,2:16384,1:8192,0:8192"]

An arm is ``locality:distance`` (bytes; 0: no software prefetch). ``--kind``: i8 (the int8
container, q8 activations) or q4. The containers are the ones bench/make_peer_ggufs.py and
bench/intdot_vs_llamacpp.py represent (``--path`` to name another).
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
from machine import facts

GROUPS = ("qkv", "o", "gu", "down")


def layer_weights(path: str) -> list[tuple]:
    """Every fused layer's product arrays, in execution order (q, k, v, o, gate, up, down)."""
    import vindex3
    from vindex3.exec.ops import fused_layer as FL

    c = vindex3.open(path)
    ex = c.executor(activations="q8")
    ws, seen = [], set()
    real = FL.FusedLayer.run

    def run(self, h, kv, p0, cos, sin):
        if self.index not in seen:
            seen.add(self.index)
            for g in GROUPS:
                a = self.args[g]
                # int8: (codes, scales) per weight; q4: (codes, d, m) per weight, then the f16 table
                cols, extra = (a[:3], (a[3],)) if len(a) == 4 else (a[:2], ())
                ws.extend(tuple(w) + extra for w in zip(*cols))
        return real(self, h, kv, p0, cos, sin)

    FL.FusedLayer.run = run
    try:
        ex.start().prefill([1, 2, 3], last_only=True)
    finally:
        FL.FusedLayer.run = real
    if not ws:
        raise SystemExit(f"{path}: no fused layers ran (nothing to measure)")
    return ws


def build(kind: str, locality: int, pf: int):
    """pass(Ws, acts, Ys, nth): every weight's rows at every position, ``nth`` threads."""
    from numba import njit, prange

    from vindex3.codecs import intrinsics as I

    if kind == "i8":
        d = I._make_i8_dots(I.chosen(), pf=pf, locality=locality)

        @njit
        def one(w, a, Y, o0, o1):
            for k in range(o0, o1, 16):
                for t0 in range(0, a[0].shape[0], I.MAX_T):
                    d(w[0], w[1], k, min(o1, k + 16), a[0], a[1], a[2], t0, Y)
    else:
        d = I._make_q4_dots(I.chosen(), pf=pf, locality=locality)

        @njit
        def one(w, a, Y, o0, o1):
            for k in range(o0, o1, 16):
                for t0 in range(0, a[0].shape[0], I.MAX_T):
                    d(w[0], w[1], w[2], w[3], k, min(o1, k + 16), a[0], a[1], a[3], t0, Y)

    @njit(parallel=True)
    def run(Ws, narrow, wide, Ys, nth):
        for part in prange(nth):
            for i in range(len(Ws)):
                w = Ws[i]
                Y = Ys[i]
                O = Y.shape[1]
                o0 = (O * part // nth) // 16 * 16
                o1 = O if part == nth - 1 else (O * (part + 1) // nth) // 16 * 16
                if w[0].shape[1] * (2 if kind == "q4" else 1) == narrow[0].shape[1]:
                    one(w, narrow, Y, o0, o1)
                else:
                    one(w, wide, Y, o0, o1)

    return run


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", default="i8", choices=("i8", "q4"))
    ap.add_argument("--path", default=None)
    ap.add_argument("--ts", default="1,2,4,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--arms", default="3:8192,2:8192,2:16384,1:8192,0:8192")
    ap.add_argument("--out", default=str(HERE / "results" / "prefetch_locality.json"))
    a = ap.parse_args()
    from vindex3.default_model import cache_dir

    enc = {"i8": "int8", "q4": "q4"}[a.kind]
    path = a.path or str(cache_dir() / "peer-ggufs" / f"smollm2-135m-instruct.{enc}.vindex3")
    if not Path(path).exists():
        raise SystemExit(f"no container at {path} (bench/intdot_vs_llamacpp.py represents it)")
    import numba
    import numpy as np
    from numba.typed import List

    from vindex3.codecs import intrinsics as I

    load0 = os.getloadavg()
    ws = layer_weights(path)
    arms = [tuple(int(v) for v in s.split(":")) for s in a.arms.split(",")]
    runs = {(loc, pf): build(a.kind, loc, pf) for loc, pf in arms}
    WL = List(ws)
    results = []
    rng = np.random.default_rng(0)
    for T in (int(t) for t in a.ts.split(",")):
        X = rng.standard_normal((T, 1536), dtype=np.float32)
        narrow = I.quantized(np.ascontiguousarray(X[:, :576]))
        wide = I.quantized(X)
        YL = List([np.empty((T, (w[1].shape[0])), np.float32) for w in ws])
        for nth in (int(n) for n in a.threads.split(",")):
            numba.set_num_threads(nth)
            times = {arm: [] for arm in arms}
            for f in runs.values():
                f(WL, narrow, wide, YL, nth)
            for r in range(a.rounds):
                for arm in (arms if r % 2 else arms[::-1]):
                    t0 = time.perf_counter()
                    runs[arm](WL, narrow, wide, YL, nth)
                    times[arm].append(time.perf_counter() - t0)
            base = np.array(times[arms[0]])
            for arm in arms:
                v = np.array(times[arm])
                row = {"T": T, "threads": nth, "locality": arm[0], "prefetch_bytes": arm[1],
                       "ms_median": round(float(np.median(v)) * 1e3, 3),
                       "ratio_to_first_paired_median": round(float(np.median(v / base)), 3)}
                results.append(row)
                print(f"T={T} threads={nth} locality {arm[0]} distance {arm[1]:6d}: {row['ms_median']:8.3f} ms"
                      f"  x{row['ratio_to_first_paired_median']:.3f} of locality {arms[0][0]}:{arms[0][1]}",
                      flush=True)
    nbytes = sum(sum(x.nbytes for x in w[:3]) for w in ws)
    out = {"bench": "prefetch_locality", "kind": a.kind, "container": Path(path).name, "weights": len(ws),
           "weight_bytes": nbytes, "rounds": a.rounds, "target_cpu": I.target_cpu(), "intdot_path": I.chosen(),
           "results": results, "loadavg_before": load0, "loadavg_after": os.getloadavg(), "machine": facts()}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
