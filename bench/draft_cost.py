"""What a draft costs, for every depth 1..L of the real model (SmolLM2-135M-Instruct).

Per depth: operand reads and bytes as planned (`Container.plan_slice`) and as measured by the
prepared executor, split into the fixed ends (embedding, final norm, head) and the per-layer
part; prepare seconds; ms per position on the decode path (best of rounds that sweep all depths). Fits reads = a + b·depth and
requires the fit to be exact (integer a, b, zero residual) and planned reads to equal measured
reads. Writes bench/results/draft_cost.json with machine facts.

    python bench/draft_cost.py [--container DIR] [--positions 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vindex3
from vindex3 import jsonio
from vindex3.draft.bank import default_bank, load_prompts
from vindex3.draft.dumps import decode_logits
from vindex3.draft.machine import machine_facts
from vindex3.draft.slices import make_executor


def container_path(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from vindex3 import default_model

    return Path(default_model.ensure())


def exact_affine(xs: list[int], ys: list[int]) -> dict:
    """Fit y = a + b·x. Exact means integer a and b reproduce every y with zero residual."""
    x = np.asarray(xs, dtype=np.float64)
    y = np.asarray(ys, dtype=np.float64)
    b_ls, a_ls = np.polyfit(x, y, 1)
    if len(xs) >= 2:
        b = (ys[1] - ys[0]) // (xs[1] - xs[0])
        a = ys[0] - b * xs[0]
        residual = [yy - (a + b * xx) for xx, yy in zip(xs, ys)]
    else:
        a, b, residual = ys[0], 0, [0]
    return {"a": int(a), "b": int(b), "exact": all(r == 0 for r in residual),
            "max_abs_residual": int(max(abs(r) for r in residual)),
            "least_squares": {"a": float(a_ls), "b": float(b_ls)}}


def linear_fit(xs: list[float], ys: list[float]) -> dict:
    x, y = np.asarray(xs), np.asarray(ys)
    b, a = np.polyfit(x, y, 1)
    pred = a + b * x
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    return {"a": float(a), "b": float(b), "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def time_decode(ex, ids: list[int], repeats: int) -> float:
    """Best-of-``repeats`` ms per position through the decode path (1-token prefill, then steps)."""
    best = float("inf")
    for _ in range(repeats):
        st = ex.start()
        t0 = time.perf_counter()
        decode_logits(st, ids)
        best = min(best, (time.perf_counter() - t0) * 1000.0 / len(ids))
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container")
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "draft_cost.json"))
    args = ap.parse_args()

    c = vindex3.open(container_path(args.container))
    L = c.graph.num_layers
    # A fixed token sequence: the bank's prompts concatenated, cut to the requested length.
    ids: list[int] = []
    for p in load_prompts(default_bank(ROOT)):
        ids += c.tokenizer.encode(p.text)
        if len(ids) >= args.positions:
            break
    ids = ids[: args.positions]

    # Prepare every slice first (reads and bytes are counted at preparation), then time the
    # decode path in rounds over all depths, so that a burst of load from other processes
    # touches every depth a little instead of a few depths a lot; keep the best round.
    slices = list(range(1, L + 1)) + ["full"]
    prepared = {}
    rows = []
    for d in slices:
        sl = vindex3.Full() if d == "full" else vindex3.Draft(d)
        plan = c.plan_slice(sl)
        gc.collect()
        ex, prep = make_executor(c, sl)
        tr = ex.trace
        prepared[d] = ex
        rows.append({
            "depth": d, "executed_layers": len(plan.executed_layers),
            "planned_reads": plan.total_reads, "ends_reads": plan.ends_reads,
            "layer_reads": plan.layer_reads, "planned_bytes": plan.total_bytes,
            "ends_bytes": plan.ends_bytes, "layer_bytes": plan.layer_bytes,
            "measured_reads": int(tr.operand_reads), "measured_bytes": int(tr.bytes_read),
            "prepare_seconds": prep, "ms_per_position": float("inf"), "ms_per_position_runs": [],
        })
    for r in range(args.repeats):
        order = slices if r % 2 == 0 else slices[::-1]
        for d in order:
            row = rows[slices.index(d)]
            ms = time_decode(prepared[d], ids, 1)
            row["ms_per_position_runs"].append(ms)
            row["ms_per_position"] = min(row["ms_per_position"], ms)
        print(f"round {r + 1}/{args.repeats} done", file=sys.stderr)
    del prepared

    print(f"{'depth':>5} {'reads':>6} {'measured':>8} {'ends':>5} {'layer':>6} {'MB':>8} "
          f"{'prep s':>7} {'ms/pos':>7}")
    for row in rows:
        print(f"{row['depth']:>5} {row['planned_reads']:>6} {row['measured_reads']:>8} {row['ends_reads']:>5} "
              f"{row['layer_reads']:>6} {row['planned_bytes'] / 1e6:>8.2f} {row['prepare_seconds']:>7.3f} "
              f"{row['ms_per_position']:>7.2f}")

    drafts = [r for r in rows if r["depth"] != "full"]
    full = rows[-1]
    depths = [r["depth"] for r in drafts]
    fits = {
        "planned_reads": exact_affine(depths, [r["planned_reads"] for r in drafts]),
        "measured_reads": exact_affine(depths, [r["measured_reads"] for r in drafts]),
        "planned_bytes": exact_affine(depths, [r["planned_bytes"] for r in drafts]),
        "measured_bytes": exact_affine(depths, [r["measured_bytes"] for r in drafts]),
        "prepare_seconds": linear_fit(depths, [r["prepare_seconds"] for r in drafts]),
        "ms_per_position": linear_fit(depths, [r["ms_per_position"] for r in drafts]),
    }
    plan_eq_measured = all(r["planned_reads"] == r["measured_reads"] for r in rows)
    draft_L = drafts[-1]
    same_as_full = all(draft_L[k] == full[k] for k in ("planned_reads", "planned_bytes", "measured_reads"))
    fr, fb = fits["measured_reads"], fits["planned_bytes"]
    print()
    print(f"reads  = {fr['a']} + {fr['b']}·depth   exact: {fr['exact']} (max residual {fr['max_abs_residual']})")
    print(f"bytes  = {fb['a']} + {fb['b']}·depth   exact: {fb['exact']}")
    mp = fits["ms_per_position"]
    print(f"ms/pos ≈ {mp['a']:.3f} + {mp['b']:.3f}·depth   r² {mp['r2']:.4f}")
    print(f"planned reads == measured reads at every depth: {plan_eq_measured}")
    print(f"Draft({L}) costs what Full costs: {same_as_full}")
    for d in (1, 4, 8, 16):
        if d <= L:
            r = drafts[d - 1]
            print(f"depth {d:>2}: {r['planned_bytes'] / full['planned_bytes']:.3f} of full bytes, "
                  f"{r['ms_per_position'] / full['ms_per_position']:.3f} of full ms/position")

    out = {
        "benchmark": "draft_cost", "container": c.name, "container_digest": c.digest,
        "model_layers": L, "positions": len(ids), "repeats": args.repeats, "rows": rows,
        "fits": fits, "planned_equals_measured": plan_eq_measured,
        "draft_L_equals_full": same_as_full, "machine": machine_facts(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    jsonio.write_atomic(args.out, out)
    ok = fr["exact"] and fits["planned_reads"]["exact"] and plan_eq_measured
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
