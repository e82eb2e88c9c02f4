"""PATCH SWEEP on SmolLM2, two arms interleaved in one process: each cell running from its layer
on (what the statement does) against each cell a whole patched prefill (what it did before).
Same cells, same bytes (asserted); the ratio of their wall times is the figure.

Writes bench/results/patch_sweep_arms.json with machine facts and the load average.

    python bench/patch_sweep_arms.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vindex3
from vindex3 import default_model, jsonio
from vindex3.draft.machine import machine_facts
from vindex3.internals import patching

CLEAN = "The Eiffel Tower is in the city of"
CORRUPT = "The Colosseum is in the city of"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    c = vindex3.open(str(default_model.container_path()))
    tok = c.tokenizer
    clean, corrupt = tok.encode(CLEAN), tok.encode(CORRUPT)
    target = int(tok.pieces(" Paris")[0])
    ex = c.executor()
    ex.forward(clean)  # warm
    shared = patching._from_layer
    arms = {"from_layer": shared, "whole_prefill": lambda ex, layer: None}
    times: dict[str, list[float]] = {k: [] for k in arms}
    cells = {}
    loads = [os.getloadavg()]
    for _ in range(args.rounds):
        for name, fn in arms.items():
            patching._from_layer = fn
            t0 = time.perf_counter()
            r = patching.patch_sweep(ex, clean, corrupt, target, "residual")
            times[name].append(time.perf_counter() - t0)
            cells[name] = [x.logit for x in r.cells]
            loads.append(os.getloadavg())
    patching._from_layer = shared
    assert cells["from_layer"] == cells["whole_prefill"]  # the same bytes
    best = {k: min(v) for k, v in times.items()}
    res = {"bench": "patch_sweep_arms", "cells": len(cells["from_layer"]), "seconds": times, "best": best,
           "ratio_whole_over_from_layer": best["whole_prefill"] / best["from_layer"], "loadavg": loads,
           "machine": machine_facts()}
    jsonio.write_atomic(ROOT / "bench" / "results" / "patch_sweep_arms.json", res)
    print(f"{res['cells']} cells: from its layer on {best['from_layer']:.1f} s, whole prefill "
          f"{best['whole_prefill']:.1f} s, ratio {res['ratio_whole_over_from_layer']:.2f}x, "
          f"load {loads[0][0]:.1f}..{loads[-1][0]:.1f}")


if __name__ == "__main__":
    main()
