"""Time of a decode step with the decode-sized kernels (vindex3.exec.ops.decode) on and off, and
with fused layers (vindex3.exec.ops.fused_layer: one compiled call a layer) on top of them, in
one process, arms interleaved (round r runs every arm, the order alternating), 1 thread by
default. The fused arm's logits must equal the kernels arm's byte for byte (checked, recorded).

Per arm: the median over rounds of the best-of-``--repeats`` ms per token (a 16-token prefill,
then ``--steps`` greedy steps, only the steps timed), kernel launches per token (every numba
call that enters vindex3.codecs.threads.launch: the rows kernels and the decode kernels), C-level
calls per token (numpy functions and other builtins) and Python calls, counted with
sys.setprofile in one untimed step), and how far the arms' logits are apart after the steps. The machine facts and load average
before and after go into the JSON.

    python bench/decode_step.py [--encoding int8] [--activations q8] [--rounds 7] [--steps 32]

``--first-pass``: what a FRESH process pays before its first token, fused layers off and on,
the fused layer functions' disk cache (vindex3.exec.ops.fused_source) cold (an empty directory)
and warm (the directory the cold arm filled). Each arm is its own process: open, a 16-token
prefill, one unfused step (its kernels compiled or loaded as always), then the first step with
fused layers on (or still off) and a second one; per arm the seconds of that first step and the
open-to-second-step wall time, the rounds interleaved (cold, warm, off, each round a new cache).
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
from machine import facts, pin_threads

TEXT = " ".join(["The quick brown fox jumps over the lazy dog while the model keeps counting tokens."] * 8)


def counts_of_a_step(st, tok: int) -> tuple[int, int, int]:
    """(kernel launches, Python calls, C calls) of one step. Operators (``a + b`` on arrays) are
    neither: only calls of functions and methods count."""
    from vindex3.codecs import threads

    launches = [0]
    real = threads._LAUNCH

    class Counting(type(real)):
        def __enter__(self):
            launches[0] += 1
            return real.__enter__()

    ccalls, pycalls = [0], [0]

    def prof(frame, event, arg):
        if event == "c_call":
            ccalls[0] += 1
        elif event == "call":
            pycalls[0] += 1

    threads._LAUNCH = Counting()
    sys.setprofile(prof)
    try:
        st.step(tok)
    finally:
        sys.setprofile(None)
        threads._LAUNCH = real
    return launches[0], pycalls[0], ccalls[0]


_FIRST = """
import json, sys, time
t0 = time.perf_counter()
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import vindex3
from vindex3.exec.ops import fused_layer as FL, fused_source as S
if sys.argv[4]:
    S.cache_dir = lambda: Path(sys.argv[4])  # this arm's fused cache, empty (cold) or filled (warm)
c = vindex3.open(sys.argv[2])
ex = c.executor(activations=sys.argv[3])
st = ex.start()
FL.set_enabled(False)
logits = st.prefill(c.tokenizer.encode(sys.argv[6])[:16], last_only=True)[-1]
tok = int(logits.argmax())
logits = st.step(tok)
FL.set_enabled(sys.argv[5] == "1")
t1 = time.perf_counter()
logits = st.step(int(logits.argmax()))
t2 = time.perf_counter()
st.step(int(logits.argmax()))
t3 = time.perf_counter()
fns = list(FL._LAYERS.values())
print(json.dumps({"first_step_s": t2 - t1, "second_step_s": t3 - t2, "process_to_second_step_s": t3 - t0,
                  "cache_hits": sum(sum(f.stats.cache_hits.values()) for f in fns),
                  "cache_misses": sum(sum(f.stats.cache_misses.values()) for f in fns), "how": list(S.how.values())}))
"""


def first_pass(a, path: Path) -> None:
    """The ``--first-pass`` measurement (see the module docstring)."""
    import subprocess
    import tempfile

    load_before = os.getloadavg()
    env = dict(os.environ, VINDEX3_DECODE_THREADS=str(a.threads), OMP_NUM_THREADS=str(a.threads))
    rows: dict = {"fused_cold": [], "fused_warm": [], "unfused": []}
    for r in range(a.rounds):
        with tempfile.TemporaryDirectory() as cache:
            for arm in ("fused_cold", "fused_warm", "unfused"):
                cmd = [sys.executable, "-c", _FIRST, str(HERE.parent), str(path), a.activations,
                       cache if arm != "unfused" else "", "0" if arm == "unfused" else "1", TEXT]
                p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
                if p.returncode:
                    raise SystemExit(p.stderr[-3000:])
                rows[arm].append(json.loads(p.stdout.strip().splitlines()[-1]))
    load_after = os.getloadavg()
    summary = {arm: {k: round(statistics.median(x[k] for x in xs), 4) for k in ("first_step_s", "second_step_s",
                                                                                 "process_to_second_step_s")}
               for arm, xs in rows.items()}
    res = {"bench": "decode_step_first_pass", "model": "SmolLM2-135M-Instruct", "encoding": a.encoding,
           "activations": a.activations, "rounds": a.rounds, "median": summary, "runs": rows,
           "loadavg_before": load_before, "loadavg_after": load_after, "machine": facts(a.threads)}
    out = Path(a.out) if a.out else HERE / "results" / f"decode_step_first_pass_{a.encoding}_{a.activations}_{a.threads}t.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    for arm, m in summary.items():
        print(f"{arm:<11} first step {m['first_step_s']:7.3f} s  second {m['second_step_s']:.4f} s  "
              f"process to second step {m['process_to_second_step_s']:6.2f} s")
    print(f"load {load_before[0]:.2f} -> {load_after[0]:.2f}  ({out})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--encoding", default="int8", help="f32 | bf16 | int8 | q4 (represented once beside the peer GGUFs)")
    ap.add_argument("--activations", default="q8")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--first-pass", action="store_true", help="a fresh process's first step: fused off / on with a cold and a warm cache")
    a = ap.parse_args()
    pin_threads(a.threads)
    os.environ["VINDEX3_DECODE_THREADS"] = str(a.threads)
    import numpy as np
    from llamacpp_peer import our_containers
    from make_peer_ggufs import peer_dir

    import vindex3
    from vindex3.exec.ops import decode, fused_layer

    path = our_containers([a.encoding], peer_dir(None))[a.encoding]
    if a.first_pass:
        return first_pass(a, path)
    load_before = os.getloadavg()
    c = vindex3.open(path)
    ex = c.executor(activations=a.activations)
    ids = c.tokenizer.encode(TEXT)[:16]
    # arm -> (decode kernels on, fused layers on)
    arms = {"numpy": (False, False), "kernels": (True, False), "fused": (True, True)}

    def switch(on: tuple[bool, bool]) -> None:
        decode.set_enabled(on[0])
        fused_layer.set_enabled(on[1])

    def decode_run(on: tuple[bool, bool]) -> tuple[float, np.ndarray, list[int]]:
        switch(on)
        best, last, toks = 1e9, None, []
        for _ in range(a.repeats):
            st = ex.start()
            logits = st.prefill(ids, last_only=True)[-1]
            toks = []
            t0 = time.perf_counter()
            for _ in range(a.steps):
                toks.append(int(np.argmax(logits)))
                logits = st.step(toks[-1])
            best = min(best, time.perf_counter() - t0)
            last = logits
        return 1000 * best / a.steps, last, toks

    info: dict = {}
    for name, on in arms.items():  # warm-up (compiles) and the counts
        decode_run(on)
        switch(on)
        st = ex.start()
        logits = st.prefill(ids, last_only=True)[-1]
        launches, pycalls, ccalls = counts_of_a_step(st, int(np.argmax(logits)))
        info[name] = {"launches_per_token": launches, "python_calls_per_token": pycalls, "c_calls_per_token": ccalls}
    ms: dict = {n: [] for n in arms}
    final: dict = {}
    for r in range(a.rounds):
        order = list(arms)[r % len(arms):] + list(arms)[:r % len(arms)]
        order = order if r % 2 == 0 else order[::-1]
        for name in order:
            t, last, toks = decode_run(arms[name])
            ms[name].append(t)
            final[name] = (last, toks)
    switch((None, None))
    load_after = os.getloadavg()
    for name in arms:
        info[name]["ms_per_token_rounds"] = [round(x, 3) for x in ms[name]]
        info[name]["ms_per_token_median"] = round(statistics.median(ms[name]), 3)
    # the same tokens through both arms (the numpy arm's greedy ones): how far the logits of
    # every step are apart, and at how many steps the argmax differs
    toks = final["numpy"][1]
    per_arm = {}
    for name, on in arms.items():
        switch(on)
        st = ex.start()
        rows = [st.prefill(ids, last_only=True)[-1]]
        rows += [st.step(t) for t in toks[:-1]]
        per_arm[name] = np.stack(rows)
    switch((None, None))
    d = float(np.abs(per_arm["kernels"] - per_arm["numpy"]).max())
    flips = int((per_arm["kernels"].argmax(-1) != per_arm["numpy"].argmax(-1)).sum())
    res = {
        "bench": "decode_step",
        "model": "SmolLM2-135M-Instruct",
        "encoding": a.encoding,
        "activations": a.activations,
        "steps": a.steps,
        "rounds": a.rounds,
        "repeats": a.repeats,
        "arms": info,
        "speedup_kernels_over_numpy": round(info["numpy"]["ms_per_token_median"] / info["kernels"]["ms_per_token_median"], 3),
        "speedup_fused_over_kernels": round(info["kernels"]["ms_per_token_median"] / info["fused"]["ms_per_token_median"], 3),
        "fused_logits_equal_kernels": bool(np.array_equal(per_arm["fused"], per_arm["kernels"])),
        "fused_layers": sum(w is None for w in ex.fused.why.values()),
        "layers": len(ex.fused.why),
        "logits_max_abs_diff_same_tokens": d,
        "argmax_differs_at_steps": flips,
        "same_greedy_tokens": final["kernels"][1] == final["numpy"][1],
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "machine": facts(a.threads),
    }
    out = Path(a.out) if a.out else HERE / "results" / f"decode_step_smollm2_{a.encoding}_{a.activations}_{a.threads}t.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    for name in arms:
        i = info[name]
        print(f"{name:<8} {i['ms_per_token_median']:7.2f} ms/token  {i['launches_per_token']:4d} launches/token  "
              f"{i['python_calls_per_token']:5d} Python calls/token  {i['c_calls_per_token']:5d} C calls/token")
    print(f"fused over kernels {res['speedup_fused_over_kernels']}x ({res['fused_layers']}/{res['layers']} layers fused), "
          f"fused logits == kernels logits: {res['fused_logits_equal_kernels']}")
    print(f"speed-up {res['speedup_kernels_over_numpy']}x, logits max|d| {d:.3g} (same tokens), argmax differs at "
          f"{flips}/{len(toks)} steps, same greedy text {res['same_greedy_tokens']}, "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f}  ({out})")


if __name__ == "__main__":
    main()
