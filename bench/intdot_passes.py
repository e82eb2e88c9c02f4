"""What several activation rows per pass over a weight buy a decode step, in process, on
SmolLM2-135M-Instruct: (a) one batched pass of 8 streams (vindex3.exec.batch.step_many) against
one stream's step, and (b) a verify call (a live stream's prefill of k positions, what
speculation's full-model check runs) against one step, per extra position.

Arms: encodings f32 (exact) and int8 (q8), each in its own process, interleaved over rounds;
``--baseline DIR`` adds the same arms run on another checkout's code (e.g. the tree before the
several-positions kernels), so the ratios sit side by side. Every arm checks that the batched
logits equal each stream's lone step (np.array_equal) and that a verify's last-position logits
equal the steps' (the invariant the kernels keep). Times are the best of ``--repeats`` inside a
process; figures are medians over rounds. Writes bench/results/intdot_passes.json with the
machine facts and the load average around each arm.

    python bench/intdot_passes.py [--rounds 3] [--threads 1] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import facts, pin_threads

PROMPTS = ["The capital of France is", "Water boils at a temperature of", "Once upon a time, there was",
           "def add(a, b):", "The three primary colors are", "In the morning I like to",
           "The largest planet in the solar system is", "A good name for a cat is"]


def arm(container: str, activations: str, repeats: int, ks: list[int]) -> dict:
    import numpy as np

    import vindex3
    from vindex3.exec.batch import step_many

    c = vindex3.open(container)
    ex = c.executor(activations=activations)
    prompts = [c.tokenizer.encode(p) for p in PROMPTS]

    def fresh(n):
        sts, nxt = [], []
        for p in prompts[:n]:
            st = ex.start()
            nxt.append(int(np.argmax(st.prefill(p, last_only=True)[-1])))
            sts.append(st)
        return sts, nxt

    out: dict = {"activations": activations}
    # (a) one pass of 8 streams vs one stream's step, 4 steps each, best over repeats
    one = eight = 1e9
    same = True
    for _ in range(repeats + 1):  # the first compiles
        sts, nxt = fresh(8)
        lone = [sts[0].step(nxt[0])]
        t = time.perf_counter()
        for _ in range(4):
            lone.append(sts[0].step(int(np.argmax(lone[-1]))))
        one = min(one, (time.perf_counter() - t) / 4)
        sts, nxt = fresh(8)
        rows = step_many(sts, nxt)
        t = time.perf_counter()
        for _ in range(4):
            rows = step_many(sts, [int(np.argmax(r)) for r in rows])
        eight = min(eight, (time.perf_counter() - t) / 4)
        alone, nx = fresh(8)
        for st, tok, r in zip(alone, nx, step_many(*fresh(8))):
            same = same and np.array_equal(st.step(tok), r)
    out["step_ms"] = one * 1e3
    out["pass_of_8_ms"] = eight * 1e3
    out["pass_of_8_over_step"] = eight / one
    out["batched_equals_lone"] = bool(same)
    # (b) a verify call of k positions on a live stream vs one step
    ids = prompts[0]
    cost = {}
    equal = True
    for k in ks:
        best = 1e9
        for _ in range(repeats + 1):
            st = ex.start()
            st.prefill(ids, last_only=True)
            toks = [int(x) for x in c.tokenizer.encode(" Paris and the river Seine flow")][:k]
            toks += [toks[-1]] * (k - len(toks))
            t = time.perf_counter()
            lg = st.prefill(toks)
            best = min(best, time.perf_counter() - t)
        cost[k] = best * 1e3
        if k > 1:  # the verify's positions equal the steps
            st = ex.start()
            st.prefill(ids, last_only=True)
            steps = [st.step(x) for x in toks]
            equal = equal and all(np.array_equal(lg[i], steps[i]) for i in range(k))
    out["verify_ms"] = cost
    out["extra_position_over_step"] = {k: (cost[k] - cost[1]) / (k - 1) / cost[1] for k in ks if k > 1}
    out["verify_equals_steps"] = bool(equal)
    return out


def run_arm(code: str, spec: dict, threads: int, repeats: int, ks: list[int]) -> dict:
    cmd = [sys.executable, __file__, "--arm", json.dumps(spec), "--arm-threads", str(threads),
           "--repeats", str(repeats), "--ks", *map(str, ks)]
    env = dict(os.environ, VINDEX3_DECODE_THREADS=str(threads), PYTHONPATH=code)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800, env=env)
    if p.returncode:
        raise SystemExit(f"arm {spec} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--baseline", help="another checkout whose code runs the same arms")
    ap.add_argument("--out", default=str(HERE / "results" / "intdot_passes.json"))
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-threads", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        pin_threads(a.arm_threads)
        spec = json.loads(a.arm)
        print(json.dumps(arm(spec["path"], spec["activations"], a.repeats, a.ks)))
        return 0

    sys.path.insert(0, str(HERE.parent))
    from llamacpp_peer import our_containers
    from make_peer_ggufs import peer_dir

    ours = our_containers(["f32", "int8"], peer_dir(None))
    codes = {"this tree": str(HERE.parent)}
    if a.baseline:
        codes["baseline"] = str(Path(a.baseline).resolve())
    arms = [(f"{enc} {act}", {"path": ours[enc], "activations": act}) for enc, act in (("f32", "exact"), ("int8", "q8"))]
    runs: dict = {}
    for r in range(a.rounds):
        for code_name, code in codes.items():
            for name, spec in arms:
                before = os.getloadavg()[0]
                res = run_arm(code, spec, a.threads, a.repeats, a.ks)
                res["loadavg"] = [before, os.getloadavg()[0]]
                runs.setdefault(code_name, {}).setdefault(name, []).append(res)
                print(f"round {r} {code_name} {name}: step {res['step_ms']:.1f} ms, pass of 8 {res['pass_of_8_ms']:.1f} ms "
                      f"({res['pass_of_8_over_step']:.2f}x), extra position "
                      f"{ {k: round(v, 2) for k, v in res['extra_position_over_step'].items()} } of a step, "
                      f"equal {res['batched_equals_lone']}/{res['verify_equals_steps']} (load {before:.1f})", flush=True)
    summary: dict = {}
    for code_name, by in runs.items():
        for name, lst in by.items():
            s = {k: statistics.median(x[k] for x in lst) for k in ("step_ms", "pass_of_8_ms", "pass_of_8_over_step")}
            s["aggregate_speedup_8_streams"] = 8 / s["pass_of_8_over_step"]
            s["extra_position_over_step"] = {k: statistics.median(x["extra_position_over_step"][k] for x in lst)
                                             for k in lst[0]["extra_position_over_step"]}
            s["verify_ms"] = {k: statistics.median(x["verify_ms"][k] for x in lst) for k in lst[0]["verify_ms"]}
            s["batched_equals_lone"] = all(x["batched_equals_lone"] for x in lst)
            s["verify_equals_steps"] = all(x["verify_equals_steps"] for x in lst)
            summary.setdefault(code_name, {})[name] = s
    doc = {"benchmark": "intdot_passes", "model": "SmolLM2-135M-Instruct", "threads": a.threads,
           "rounds": a.rounds, "repeats": a.repeats, "machine": facts(None) | {"loadavg_end": os.getloadavg()},
           "summary": summary, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    for code_name, by in summary.items():
        for name, s in by.items():
            print(f"{code_name:<10} {name:<10} step {s['step_ms']:6.1f} ms  pass of 8 {s['pass_of_8_over_step']:.2f}x a step "
                  f"(8 streams {s['aggregate_speedup_8_streams']:.2f}x one)  extra verified position "
                  + ", ".join(f"k={k}: {v:.2f}" for k, v in s["extra_position_over_step"].items()))
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
