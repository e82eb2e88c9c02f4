"""How numba's OpenMP workers wait between parallel regions decides whether two decode threads
beat one: SmolLM2 decode (bench/intdot_vs_llamacpp.py's arm: 16 prompt tokens, 32 greedy steps,
fused layers) at 1 thread and at 2 threads with the workers sleeping (``OMP_WAIT_POLICY=PASSIVE``,
vindex3's default), spinning (``ACTIVE``) or spinning a bounded while (``GOMP_SPINCOUNT``), each
arm in its own process, arms interleaved round by round; then the same with ``--busy N`` busy
loops running beside them (a shared machine). Writes bench/results/thread_wait_policy.json with
the machine facts and the load average beside every arm.

    python bench/thread_wait_policy.py [--rounds 2] [--busy 2] [--encodings f32,int8] [--spins 3000]
        [--skip ACTIVE,SPINCOUNT]

The 2-thread arms run teams (vindex3.codecs.threads: one region a fused layer) unless the arm
says ``VINDEX3_TEAMS=0`` (a region per product).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from machine import child_json, facts

# name -> (decode threads, environment); PASSIVE at one thread too (no parallel region runs)
VARIANTS = {
    "1 thread": (1, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, sleeping (PASSIVE)": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
    "2 threads, sleeping, a region per product (VINDEX3_TEAMS=0)": (2, {"OMP_WAIT_POLICY": "PASSIVE",
                                                                              "VINDEX3_TEAMS": "0"}),
    "2 threads, spinning (ACTIVE)": (2, {"OMP_WAIT_POLICY": "ACTIVE"}),
    "2 threads, bounded spin (GOMP_SPINCOUNT=20000)": (2, {"GOMP_SPINCOUNT": "20000"}),
}


def spin_variant(n: int) -> tuple[str, tuple[int, dict]]:
    return f"2 threads, bounded spin (GOMP_SPINCOUNT={n})", (2, {"GOMP_SPINCOUNT": str(n)})
ACTS = {"f32": "exact", "bf16": "exact", "int8": "q8", "q4": "q8"}


def run_arm(path: str, activations: str, threads: int, extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "VINDEX3_TEAMS")}
    env.update(extra, VINDEX3_DECODE_THREADS=str(threads), VINDEX3_FUSED_LAYERS="1",
               PYTHONPATH=str(HERE.parent) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else ""))
    spec = {"kind": "ours", "path": path, "activations": activations}
    cmd = [sys.executable, str(HERE / "intdot_vs_llamacpp.py"), "--arm", json.dumps(spec), "--arm-threads",
           str(threads), "--steps", "32", "--repeats", "2"]
    return child_json(cmd, env, f"{spec} t={threads}", timeout=900)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the arms in the second part (0: none)")
    ap.add_argument("--encodings", default="f32,int8")
    ap.add_argument("--spins", default="", help="more bounded-spin variants, comma-separated GOMP_SPINCOUNT values")
    ap.add_argument("--skip", default="", help="variants to leave out, comma-separated substrings of their names")
    ap.add_argument("--out", default=str(HERE / "results" / "thread_wait_policy.json"))
    a = ap.parse_args()
    from llamacpp_peer import our_containers
    from make_peer_ggufs import peer_dir

    for n in (int(v) for v in a.spins.split(",") if v.strip()):
        VARIANTS.update([spin_variant(n)])
    for sub in (v.strip() for v in a.skip.split(",") if v.strip()):
        for name in [n for n in VARIANTS if sub in n]:
            del VARIANTS[name]
    encs = [e.strip() for e in a.encodings.split(",") if e.strip()]
    bad = [e for e in encs if e not in ACTS]
    if bad:
        raise SystemExit(f"unknown encodings {bad} (known: {', '.join(ACTS)})")
    paths = our_containers(encs, peer_dir(None))
    runs: dict = {}
    parts = [("quiet", 0)] + ([(f"{a.busy} busy loops", a.busy)] if a.busy else [])
    for part, nbusy in parts:
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(nbusy)]
        try:
            if nbusy:
                time.sleep(5)
            for r in range(a.rounds):
                for enc in encs:
                    for name, (th, env) in VARIANTS.items():
                        res = run_arm(paths[enc], ACTS[enc], th, env)
                        res["loadavg"] = os.getloadavg()[0]
                        runs.setdefault(part, {}).setdefault(f"{enc} {ACTS[enc]}", {}).setdefault(name, []).append(res)
                        print(f"{part} round {r} {enc} {name}: {res['decode_tok_s']:.1f} tok/s "
                              f"(load {res['loadavg']:.1f})", flush=True)
        finally:
            for p in busy:
                p.kill()
                p.wait()
    summary = {part: {arm: {v: [round(x["decode_tok_s"], 1) for x in lst] for v, lst in by.items()}
                      for arm, by in arms.items()} for part, arms in runs.items()}
    doc = {"benchmark": "thread_wait_policy", "model": "SmolLM2-135M-Instruct", "variants": {
        k: {"threads": t, "env": e} for k, (t, e) in VARIANTS.items()}, "rounds": a.rounds,
        "summary_decode_tok_s": summary, "machine": facts(None) | {"loadavg_end": os.getloadavg()}, "runs": runs}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
