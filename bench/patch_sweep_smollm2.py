"""A causal-tracing sweep on SmolLM2-135M-Instruct: PATCH SWEEP of the residual over every layer
(30) and every position of a clean / corrupted prompt pair, as the LQL statement runs it (one
pass per cell, from the cell's layer on: the layers before it are the corrupted run's, shared),
with the recovered fraction of ' Paris' per cell.

Writes bench/results/patch_sweep_smollm2.json with machine facts, the load average, the timing
and the grid (layer x position recovered fractions, rounded to 2 decimals), and the heatmap
docs/images/patch_sweep_smollm2.png (PLOT INTO), which docs/internals.md shows.

    python bench/patch_sweep_smollm2.py [--container DIR]
    python bench/patch_sweep_smollm2.py --clean TEXT --corrupted TEXT --name NAME   # another pair of
        equal length (e.g. 12 positions); writes bench/results/NAME.json and no image
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lql
from vindex3 import default_model, jsonio
from vindex3.draft.machine import machine_facts

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--container", default=None)
    ap.add_argument("--clean", default=CLEAN)
    ap.add_argument("--corrupted", default=CORRUPT)
    ap.add_argument("--name", default="patch_sweep_smollm2", help="the results file's stem")
    args = ap.parse_args()
    default_pair = (args.clean, args.corrupted) == (CLEAN, CORRUPT)
    path = args.container or str(default_model.container_path())
    s = lql.Session()
    list(s.run(f"OPEN '{path}';"))
    tok = s.container.tokenizer
    clean, corrupt = tok.encode(args.clean), tok.encode(args.corrupted)
    if len(clean) != len(corrupt):
        sys.exit(f"the prompts tokenize to {len(clean)} and {len(corrupt)} tokens; choose a pair of equal length")
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    png = ROOT / "docs" / "images" / "patch_sweep_smollm2.png"
    plot = f" PLOT INTO '{png}' OVERWRITE" if default_pair else ""
    (out,) = list(s.run(f"PATCH SWEEP '{args.corrupted}' FROM '{args.clean}' FOR ' Paris' SITE RESIDUAL{plot};"))
    wall = time.perf_counter() - t0
    if out.error is not None:
        sys.exit(str(out.error))
    r = out.result
    grid = {}
    for c in r.cells:
        grid.setdefault(str(c.layer), []).append(None if c.recovered is None else round(c.recovered, 2))
    res = {"bench": "patch_sweep_smollm2", "clean": args.clean, "corrupted": args.corrupted, "target": " Paris",
           "layers": len(r.layers), "positions": r.positions, "cells": len(r.cells), "prefills": r.passes, "layer_runs": r.layer_runs,
           "layer_runs_without_sharing": len(r.cells) * len(r.layers),
           "seconds": wall, "ms_per_prefill": 1000 * wall / r.passes, "clean_logit": r.clean_logit,
           "corrupted_logit": r.corrupted_logit, "grid_recovered": grid, "loadavg_before": load0,
           "loadavg_after": os.getloadavg(), "machine": machine_facts()}
    dest = ROOT / "bench" / "results" / f"{args.name}.json"
    jsonio.write_atomic(dest, res)
    print(f"{len(r.layers)} layers x {r.positions} positions = {len(r.cells)} cells, {r.passes} prefills, "
          f"{r.layer_runs} layer runs (not shared: {len(r.cells) * len(r.layers)}): "
          f"{wall:.1f} s ({1000 * wall / r.passes:.1f} ms per prefill), load {load0[0]:.1f}")
    print(out.result.to_text(timing=True).splitlines()[0])


if __name__ == "__main__":
    main()
