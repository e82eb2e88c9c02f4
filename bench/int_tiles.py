"""Register tile shapes of the prefill integer kernels (vindex3/codecs/inttiles.py, TILE and
TILE_BY_PATH): each (rows x positions) tile on SmolLM2's four layer shapes at T = 512, one
thread, hot weights, arms interleaved within each round; each figure is the best round's CPU
time for the four products (the calling thread's CPU time). The bytes of every tile are checked
equal to the first's as they run.

    python bench/int_tiles.py --kind i8 --tiles 4x4,2x4,1x4,1x8 [--path avx2] [--rounds 3]

``--in-l1`` times the i8 tile's loop alone instead: one tile called over and over on the same
16 rows and positions (weights, activation codes and scales all in L1), CPU time, and reports
cycles per chunk of 64 codes at the clock measured by a chain of dependent shift-and-xor steps
(two single-cycle steps an iteration), so the loop's own rate can be set against the whole kernel's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts, pin_threads

SMOL = [(576, 576), (192, 576), (1536, 576), (576, 1536)]


def _weight(kind: str, O: int, K: int, rng):
    import numpy as np

    from vindex3.codecs.kernels import F16_TABLE

    if kind == "i8":
        return (rng.integers(-127, 128, (O, K), dtype=np.int8), rng.random((O, K // 32), np.float32))
    f16 = lambda: rng.random((O, K // 32)).astype(np.float16).view(np.uint16)
    return (rng.integers(0, 256, (O, K // 2), dtype=np.uint8), f16(), f16(), F16_TABLE)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=["i8", "q4"], default="i8")
    ap.add_argument("--tiles", default="4x4,2x8,2x4,1x4,1x8")
    ap.add_argument("--path", default=None, help="integer dot path (default: the target's best)")
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "int_tiles.json"))
    ap.add_argument("--in-l1", action="store_true", help="time the i8 tile's loop alone on operands held in L1")
    a = ap.parse_args()
    pin_threads(1)
    import numpy as np

    from vindex3.codecs import intrinsics as I
    from vindex3.codecs import inttiles as IT

    path = a.path or I.chosen()
    try:
        tiles = [(int(r), int(p)) for r, p in (s.split("x") for s in a.tiles.split(","))]
    except ValueError:
        ap.error(f"--tiles takes rows x positions pairs such as 4x4,1x8, got {a.tiles!r}")
    if a.rounds < 1 or a.T < 1:
        ap.error(f"--rounds and --T must be at least 1, got {a.rounds} and {a.T}")
    if any(not (1 <= p <= I.MAX_T and 1 <= r <= 16) for r, p in tiles):
        ap.error(f"--tiles: rows must be 1..16 and positions 1..{I.MAX_T}, got {a.tiles!r}")
    if a.in_l1:
        if a.kind != "i8" or path == "plain":
            ap.error("--in-l1 times the i8 tile of a vector path")
        return in_l1(a, path, tiles)
    rng = np.random.default_rng(0)
    ws = {s: _weight(a.kind, *s, rng) for s in SMOL}
    xs = {s: rng.standard_normal((a.T, s[1])).astype(np.float32) for s in SMOL}
    times: dict[str, list[float]] = {f"{r}x{p}": [] for r, p in tiles}
    first: dict = {}
    for rnd in range(a.rounds):
        for tile in tiles:
            k = IT.tiles_kernel(a.kind, path, False, tile)
            total = 0.0
            for s in SMOL:
                y = np.empty((a.T, s[0]), np.float32)
                k(*ws[s], xs[s], y, I.ROWS_PER_TASK)  # compile and warm
                c0 = time.thread_time()
                for _ in range(3):
                    k(*ws[s], xs[s], y, I.ROWS_PER_TASK)
                total += (time.thread_time() - c0) / 3
                if s in first and not np.array_equal(first[s], y):
                    raise SystemExit(f"tile {tile} changed the bytes of {s}")
                first.setdefault(s, y.copy())
            times[f"{tile[0]}x{tile[1]}"].append(total)
    macs = sum(O * K for O, K in SMOL) * a.T
    rows = {t: {"best_ms": min(v) * 1e3, "g_mac_per_cpu_s": macs / min(v) / 1e9, "rounds_ms": [x * 1e3 for x in v]}
            for t, v in times.items()}
    for t, r in rows.items():
        print(f"{a.kind} {path} tile {t:>4}: {r['best_ms']:.2f} ms  {r['g_mac_per_cpu_s']:.1f} G mac/cpu-s")
    out = {"benchmark": "int_tiles", "kind": a.kind, "path": path, "T": a.T, "shapes": SMOL,
           "default_tile": list(IT.default_tile(a.kind, path)), "clock": "thread_time",
           "machine": facts(1), "tiles": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("wrote", a.out)
    return 0


def clock_ghz() -> float:
    """The core's clock, from a chain of dependent shift-and-xor steps (2 cycles an iteration)."""
    from numba import njit

    @njit
    def chain(n, x):
        for _ in range(n):
            x = x ^ (x >> 1)
        return x

    chain(10, 5)
    n = 100_000_000
    c0 = time.thread_time()
    chain(n, 12345)
    return 2 * n / (time.thread_time() - c0) / 1e9


def in_l1(a, path: str, tiles: list[tuple[int, int]]) -> int:
    """The i8 tile's loop alone: each tile called on the same 16 rows and its P positions."""
    import numpy as np
    from numba import njit

    from vindex3.codecs import inttiles as IT

    rng = np.random.default_rng(0)
    ghz = clock_ghz()
    rows = {}
    for R, P in tiles:
        tile = IT._make_i8_tile(path, R, P)

        @njit
        def run(Q, S, XQ, XD, XC, Y, n, nrows, tile=tile, R=R):
            for _ in range(n):
                for o in range(0, nrows, R):
                    tile(Q, S, o, XQ, XD, XC, 0, Y)

        for K in (576, 1536):
            nrows = 16 // R * R
            Q = rng.integers(-127, 128, (nrows, K), dtype=np.int8)
            S = rng.random((nrows, K // 32), np.float32)
            XQ = rng.integers(-127, 128, (P, K), dtype=np.int8)
            XD = rng.random((P, K // 32), np.float32)
            XC = np.zeros((P, K // 4), np.int32)
            Y = np.empty((P, nrows), np.float32)
            n = 2000
            run(Q, S, XQ, XD, XC, Y, 1, nrows)
            best = float("inf")
            for _ in range(a.rounds):
                c0 = time.thread_time()
                run(Q, S, XQ, XD, XC, Y, n, nrows)
                best = min(best, time.thread_time() - c0)
            chunks = n * (nrows // R) * (K // 64)  # tile calls x chunks each
            r = {"g_mac_per_cpu_s": n * nrows * P * K / best / 1e9, "cycles_per_chunk": best / chunks * ghz * 1e9}
            rows[f"{R}x{P} K={K}"] = r
            print(f"i8 {path} tile {R}x{P} K={K}: {r['g_mac_per_cpu_s']:.1f} G mac/cpu-s, "
                  f"{r['cycles_per_chunk']:.1f} cycles a chunk of 64 codes at {ghz:.2f} GHz")
    out = {"benchmark": "int_tiles --in-l1", "kind": "i8", "path": path, "clock_ghz": ghz, "clock": "thread_time",
           "machine": facts(1), "tiles": rows}
    Path(a.out).write_text(json.dumps(out, indent=1))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
