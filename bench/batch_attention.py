"""Batched decode steps with softmax attention's projections shared vs per stream, and its
attention proper in one call for all streams vs one call per stream, in-process.

Four arms on one executor of the default model (or ``--container``), interleaved per repeat:
``lone`` (each of the streams steps alone, ``stream.step``), ``per-stream`` (``step_many`` with
attention run whole once per stream, as before its stages were split), ``shared`` (the q/k/v
and output projections once over all rows, the attention proper one call per stream) and
``one-call`` (``step_many`` as it is: the attention proper of all streams in one compiled call,
vindex3.exec.ops.decode_many). The other arms are the same code with `split_ops` reporting no
stages, or stages whose attend offers no ``rows``.
Every arm's logits are checked equal to the lone arm's (a mismatch fails the bench). Reports
the median wall time of a step of all streams per arm and the ratios; writes
bench/results/batch_attention.json with the machine facts and the load average around each arm.

    python bench/batch_attention.py [--streams 8] [--steps 6] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6, help="decode steps per arm and repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--container", help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "batch_attention.json"))
    args = ap.parse_args(argv)

    import numpy as np

    import vindex3
    from bench.machine import facts
    from vindex3 import default_model
    from vindex3.exec.batch import split_ops, step_many

    container = Path(args.container) if args.container else Path(default_model.ensure())
    ex = vindex3.open(container).executor()
    one_call = split_ops(ex)
    no_stages = {i: [None] * len(ops) for i, ops in one_call.items()}

    def per_stream_attend(st):
        project, attend, output = st[2]
        return (st[0], st[1], (project, lambda *a: attend(*a), output))  # a stage without ``rows``

    shared = {i: [None if st is None else per_stream_attend(st) for st in ops] for i, ops in one_call.items()}
    tables = {"per-stream": no_stages, "shared": shared, "one-call": one_call}
    prompts = [[1, 2, 3 + i, 40 + i] for i in range(args.streams)]

    def run(arm: str) -> tuple[list[float], list[list[np.ndarray]]]:
        streams = [ex.start() for _ in prompts]
        toks = [int(np.argmax(s.prefill(p)[-1])) for s, p in zip(streams, prompts)]
        ex._split_ops = tables.get(arm, one_call)
        walls, rows = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            if arm == "lone":
                out = [s.step(t) for s, t in zip(streams, toks)]
            else:
                out = step_many(streams, toks)
            walls.append(time.perf_counter() - t0)
            rows.append(out)
            toks = [int(np.argmax(r)) for r in out]
        ex._split_ops = one_call
        return walls, rows

    arms = ("lone", "per-stream", "shared", "one-call")
    for a in arms[1:]:
        run(a)  # warm-up: numba kernels compiled, pages mapped
    seconds: dict[str, list[float]] = {a: [] for a in arms}
    loads = []
    mismatched = 0
    for _ in range(args.repeats):
        got = {}
        for a in arms:
            l0 = os.getloadavg()[0]
            walls, rows = run(a)
            loads.append({"arm": a, "loadavg_before": l0, "loadavg_after": os.getloadavg()[0]})
            seconds[a] += walls
            got[a] = rows
        mismatched += sum(not np.array_equal(x, y) for a in arms[1:] for rx, ry in zip(got["lone"], got[a])
                          for x, y in zip(rx, ry))
    med = {a: statistics.median(seconds[a]) for a in arms}
    report = {
        "bench": "batch_attention",
        "container": container.name,
        "streams": args.streams, "steps": args.steps, "repeats": args.repeats,
        "median_step_seconds": med,
        "lone_over_one_call": med["lone"] / med["one-call"],
        "lone_over_shared": med["lone"] / med["shared"],
        "lone_over_per_stream": med["lone"] / med["per-stream"],
        "per_stream_over_shared": med["per-stream"] / med["shared"],
        "shared_over_one_call": med["shared"] / med["one-call"],
        "mismatched": mismatched,
        "loads": loads,
        "machine": facts(threads=1),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"{args.streams} streams, median ms per step of all: " + ", ".join(f"{a} {1e3 * med[a]:.1f}" for a in arms))
    print(f"speed-up over lone (tokens/s of the streams stepped together over stepped alone): per-stream "
          f"{report['lone_over_per_stream']:.2f}x, shared {report['lone_over_shared']:.2f}x, one-call "
          f"{report['lone_over_one_call']:.2f}x; shared over per-stream {report['per_stream_over_shared']:.2f}x, "
          f"one-call over shared {report['shared_over_one_call']:.2f}x; "
          f"mismatched {mismatched}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; wrote {args.out}")
    return 1 if mismatched else 0


if __name__ == "__main__":
    raise SystemExit(main())
