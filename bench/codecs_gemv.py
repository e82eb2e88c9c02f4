"""Weight-streaming speed of each encoding on SmolLM2-135M's matrices, side by side in one
process: one "sweep" multiplies one token (T=1) by every matrix a decode step reads (30 layers
x q, k, v, o, gate, up, down, and the tied 49152 x 576 head), so sweep time is the floor of a
decode step for that encoding and bytes / time is the bandwidth the kernel streams at.

Arms, at 1 and 2 threads (BLAS threads for numpy, numba threads for the kernels):
  f32-numpy (x @ W.T, BLAS GEMV), f32-numba (kernels.rows_plain, what DenseF32.mm runs for
  small T), bf16, f16, int8 (per-block scales), int8_row (the per-row alternative), q4.
Also, per encoding, mm at T in SMALL_TS (rows kernel vs BLAS or decoded tiles) on the FFN
matrices, which is how the small-T thresholds were chosen.

The weights are the shipped GGUF's, dequantized exactly to float32, then encoded. Rounds are
interleaved (every arm once per round); the median and best sweep per arm are reported.

    python bench/codecs_gemv.py [--rounds 7] [--out bench/results/codecs_gemv.json]
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

SMALL_TS = (1, 2, 4, 8, 16, 32)


def load_matrices() -> list:
    """Every matrix a decode step multiplies, float32, in [out, in] order, from the shipped GGUF."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from vindex3.default_model import gguf_path

    r = gguf.GGUFReader(gguf_path(), "r")
    by = {t.name: t for t in r.tensors}
    names = []
    nl = 1 + max(int(n.split(".")[1]) for n in by if n.startswith("blk."))
    for i in range(nl):
        for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            names.append(f"blk.{i}.{k}.weight")
    names.append("output.weight" if "output.weight" in by else "token_embd.weight")
    out = []
    for n in names:
        t = by[n]
        w = dequantize(t.data, t.tensor_type)
        out.append((n, np.ascontiguousarray(w, dtype=np.float32)))
    return out


def _paths(a, T, xs, ffn, mats, encs, f32w):
    """The rows kernel and the large-T path (BLAS for f32, decoded tiles + BLAS otherwise)."""
    import numpy as np

    from vindex3.codecs import kernels as K

    def rows_path():
        for i in ffn:
            if a == "f32":
                w = mats[i][1]
                K.rows_plain(w, xs[i], np.empty((T, w.shape[0]), np.float32), K.ROWS_PER_TASK)
            else:
                wt = encs[a][i]
                wt._rows(xs[i], np.empty((T, wt.rows), np.float32))

    def big_path():
        for i in ffn:
            if a == "f32":
                xs[i] @ f32w[i].aT
            else:
                wt = encs[a][i]
                wt._tiles(xs[i], np.empty((T, wt.rows), np.float32))

    return rows_path, big_path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=str(HERE / "results" / "codecs_gemv.json"))
    args = ap.parse_args()

    import numba
    import numpy as np
    from threadpoolctl import threadpool_limits

    from vindex3 import codecs
    from vindex3.codecs import f32 as f32mod
    from vindex3.codecs import kernels as K
    from vindex3.codecs.int8 import Int8RowCodec

    mats = load_matrices()
    rng = np.random.default_rng(0)
    x_by_in = {}
    for _, w in mats:
        x_by_in.setdefault(w.shape[1], rng.standard_normal((1, w.shape[1])).astype(np.float32))

    encs = {}
    t0 = time.perf_counter()
    for name in ("bf16", "f16", "int8", "q4"):
        c = codecs.get(name)
        encs[name] = [c.weight(c.encode(w), w.shape) for _, w in mats]
    cb = Int8RowCodec()
    encs["int8_row"] = [cb.weight(cb.encode(w), w.shape) for _, w in mats]
    encode_s = time.perf_counter() - t0
    f32w = [codecs.get("f32").weight(w.reshape(-1).view(np.uint8), w.shape) for _, w in mats]

    def sweep_numpy():
        for (_, w), wt in zip(mats, f32w):
            x_by_in[w.shape[1]] @ wt.aT

    def sweep_numba_f32():
        for (_, w) in mats:
            x = x_by_in[w.shape[1]]
            y = np.empty((1, w.shape[0]), np.float32)
            K.rows_plain(w, x, y, K.ROWS_PER_TASK)

    def sweep_enc(ws):
        def run():
            for wt in ws:
                wt.mm(x_by_in[wt.cols])

        return run

    arms = {
        "f32-numpy": (sweep_numpy, sum(w.nbytes for _, w in mats)),
        "f32-numba": (sweep_numba_f32, sum(w.nbytes for _, w in mats)),
    }
    for name, ws in encs.items():
        arms[name] = (sweep_enc(ws), sum(wt.nbytes for wt in ws))

    results: dict = {}
    for threads in (1, 2):
        numba.set_num_threads(threads)
        with threadpool_limits(limits=threads, user_api="blas"):
            for fn, _ in arms.values():  # compile and warm
                fn()
            times = {a: [] for a in arms}
            cpu = {a: [] for a in arms}
            for _ in range(args.rounds):
                for a, (fn, _) in arms.items():
                    c = time.process_time()
                    t = time.perf_counter()
                    fn()
                    times[a].append(time.perf_counter() - t)
                    cpu[a].append(time.process_time() - c)
        for a, (_, nbytes) in arms.items():
            med = statistics.median(times[a])
            best = min(times[a])
            results.setdefault(a, {})[f"threads_{threads}"] = {
                "sweep_ms_median": med * 1e3,
                "sweep_ms_best": best * 1e3,
                "gb_s_median": nbytes / med / 1e9,
                "gb_s_best": nbytes / best / 1e9,
                "upper_bound_tok_s": 1.0 / med,
                # CPU seconds of the process per sweep (all threads): on a machine whose cores
                # are shared, wall time includes waiting to be scheduled and CPU time does not
                "sweep_cpu_ms_best": min(cpu[a]) * 1e3,
                "gb_per_cpu_s_best": nbytes / min(cpu[a]) / 1e9,
                "loadavg": os.getloadavg()[0],
            }
    for a, (_, nbytes) in arms.items():
        results[a]["bytes_per_sweep"] = nbytes

    # small-T: rows kernel vs the large-T path, on the FFN matrices of layer 0 (gate, up, down)
    ffn = [i for i, (n, _) in enumerate(mats) if n.startswith("blk.0.ffn_")]
    small_t: dict = {}
    numba.set_num_threads(2)
    with threadpool_limits(limits=2, user_api="blas"):
        for a in ("f32", *encs):
            rows_t, big_t = [], []
            for T in SMALL_TS:
                xs = {i: rng.standard_normal((T, mats[i][1].shape[1])).astype(np.float32) for i in ffn}

                rows_path, big_path = _paths(a, T, xs, ffn, mats, encs, f32w)
                for f, acc in ((rows_path, rows_t), (big_path, big_t)):
                    f()
                    ts = []
                    for _ in range(args.rounds):
                        t = time.perf_counter()
                        f()
                        ts.append(time.perf_counter() - t)
                    acc.append(statistics.median(ts) * 1e3)
            small_t[a] = {"T": list(SMALL_TS), "rows_kernel_ms": rows_t, "large_t_path_ms": big_t}

    # prefill-sized: T=512 through every matrix of layer 0 (BLAS for f32, decoded tiles + BLAS
    # for the others), 2 BLAS threads: what a prefill pays per layer for its weights' encoding
    prefill: dict = {}
    l0 = [i for i, (n, _) in enumerate(mats) if n.startswith("blk.0.")]
    xp = {i: rng.standard_normal((512, mats[i][1].shape[1])).astype(np.float32) for i in l0}
    with threadpool_limits(limits=2, user_api="blas"):
        for a in ("f32", *encs):
            def run(a=a):
                for i in l0:
                    if a == "f32":
                        xp[i] @ f32w[i].aT
                    else:
                        encs[a][i].mm(xp[i])

            run()
            ts = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                run()
                ts.append(time.perf_counter() - t)
            prefill[a] = {"best_ms": min(ts) * 1e3, "median_ms": statistics.median(ts) * 1e3}

    doc = {
        "what": "T=1 sweep over every SmolLM2-135M matrix a decode step reads; GB/s = encoded bytes / sweep time",
        "machine": facts(threads=None) | {"numba": numba.__version__, "numba_threading_layer": numba.threading_layer()},
        "matrices": len(mats),
        "weights_per_sweep": int(sum(w.size for _, w in mats)),
        "encode_seconds_all_codecs": encode_s,
        "rounds": args.rounds,
        "arms": results,
        "small_t_ffn_layer0_ms": small_t,
        "prefill_512_layer0_ms": prefill,
        "thresholds_in_code": {"f32.SMALL_T": f32mod.SMALL_T, "RowWeight.small_t": {k: encs[k][0].small_t for k in encs}},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    w = max(len(a) for a in results)
    print(f"{'arm':<{w}}  {'bytes':>10}  {'1t best ms':>10} {'GB/s':>6} {'cpu GB/s':>8}  {'2t best ms':>10} {'GB/s':>6}")
    for a, r in results.items():
        r1, r2 = r["threads_1"], r["threads_2"]
        print(f"{a:<{w}}  {r['bytes_per_sweep'] / 1e6:>8.1f}MB  {r1['sweep_ms_best']:>10.2f} {r1['gb_s_best']:>6.1f} "
              f"{r1['gb_per_cpu_s_best']:>8.1f}  {r2['sweep_ms_best']:>10.2f} {r2['gb_s_best']:>6.1f}")
    for a, s in small_t.items():
        print(a, "rows", [f"{v:.2f}" for v in s["rows_kernel_ms"]], "large", [f"{v:.2f}" for v in s["large_t_path_ms"]])
    for a, r in prefill.items():
        print(f"prefill T=512 layer 0 {a}: best {r['best_ms']:.2f} ms, median {r['median_ms']:.2f} ms")
    print("wrote", args.out, "loadavg", os.getloadavg())


if __name__ == "__main__":
    main()
