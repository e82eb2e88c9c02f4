"""Memory of sessions that OPEN one container, and what the first-use checks cost.

Part 1, sessions: N LQL sessions in one process open the default model (SmolLM2-135M) and each
runs one INFER. Arm ``shared``: OPEN as it is (lql.prepared: one opened container for all).
Arm ``separate``: each session binds its own `vindex3.open` (what every OPEN did before). Each
arm runs in a fresh subprocess, arms interleaved; RSS, PSS and anonymous memory after each
session, and the seconds of each session's first INFER (its executor's first use included).

Part 2, first-use scan: on each SmolLM2 container found (f32 default; bf16, int8, q4 when
bench/make_peer_ggufs.py made them), the whole model's tensors scanned by the old NaN/inf count
(`Weight.nonfinite`) and by the magnitude scan (`vindex3.scan.scan`) side by side, interleaved,
min of 3; and the container's own record of a first use (hash and scan seconds).

    python bench/shared_open.py [--sessions 4] [--rounds 2]

Writes bench/results/shared_open.json with the machine facts."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _mem() -> dict[str, int]:
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("Rss", "Pss", "Anonymous"):
                out[k.lower() + "_mib"] = int(v.split()[0]) // 1024
    return out


def child(arm: str, sessions: int) -> dict:
    import vindex3
    from lql import Session
    from vindex3 import default_model

    path = default_model.container_path()
    rows = [{"session": 0, **_mem()}]
    held = []
    for i in range(sessions):
        s = Session()
        if arm == "shared":
            s.execute(f"OPEN '{path}'")
        else:
            s.bind(vindex3.open(path))
        t0 = time.perf_counter()
        s.execute("INFER TOKENS (1, 2, 3) TOP 1")
        rows.append({"session": i + 1, "first_infer_s": round(time.perf_counter() - t0, 4), **_mem()})
        held.append(s)
    return {"arm": arm, "rows": rows}


def sessions_part(n: int, rounds: int) -> list[dict]:
    out = []
    for r in range(rounds):
        for arm in ("shared", "separate") if r % 2 == 0 else ("separate", "shared"):
            p = subprocess.run([sys.executable, __file__, "--child", arm, "--sessions", str(n)], cwd=ROOT,
                               capture_output=True, text=True, timeout=600, check=True)
            res = json.loads(p.stdout.strip().splitlines()[-1])
            res["round"] = r
            out.append(res)
            last = res["rows"][-1]
            print(f"round {r} {arm:8s}: after {n} sessions rss {last['rss_mib']} MiB, pss {last['pss_mib']} MiB, "
                  f"anon {last['anonymous_mib']} MiB; first INFER per session "
                  f"{[row['first_infer_s'] for row in res['rows'][1:]]}")
    return out


def scan_part() -> list[dict]:
    import vindex3
    from vindex3 import default_model
    from vindex3.scan import scan

    cache = default_model.cache_dir()
    paths = [default_model.container_path()] + sorted((cache / "peer-ggufs").glob("smollm2-135m-instruct.*.vindex3"))
    out = []
    for p in paths:
        if not (p / "index.json").exists():
            continue
        c = vindex3.open(p)
        t0 = time.perf_counter()
        c.executor()
        first_use = time.perf_counter() - t0
        cost = c.first_use_cost()
        ws = [seg.weight(n) for seg in c.segments.values() for n in seg.entries]
        for w in ws:  # pages in, kernels compiled: both arms then measure the pass itself
            w.nonfinite()
            scan(w)
        old, new = [], []
        for _ in range(3):
            t = time.perf_counter()
            for w in ws:
                w.nonfinite()
            old.append(time.perf_counter() - t)
            t = time.perf_counter()
            for w in ws:
                scan(w)
            new.append(time.perf_counter() - t)
        row = {"container": p.name, "weight_bytes": c.weight_bytes, "executor_first_use_s": round(first_use, 4),
               "first_use_cost": cost, "nonfinite_s": round(min(old), 4), "scan_s": round(min(new), 4),
               "ratio_scan_over_nonfinite": round(min(new) / min(old), 2)}
        out.append(row)
        hs = sum(r["hash_seconds"] for r in cost)
        print(f"{p.name}: executor first use {first_use:.3f} s (hash {hs:.3f} s); whole-model pass: nonfinite "
              f"{min(old):.3f} s, magnitude scan {min(new):.3f} s ({row['ratio_scan_over_nonfinite']}x)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=("shared", "separate"))
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child:
        print(json.dumps(child(args.child, args.sessions)))
        return
    sys.path.insert(0, str(HERE))
    from machine import facts

    result = {"machine_before": facts(), "sessions": sessions_part(args.sessions, args.rounds), "scan": scan_part(),
              "machine_after": facts()}
    out = HERE / "results" / "shared_open.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
