"""Where a 512-token prefill of SmolLM2-135M-Instruct spends its time, per kind of op:
projections (every weight product but the head), the attention core (scores, masks, softmax,
weighted sum of V, the K/V write; rope apart when it runs apart), rope, norms, SiLU/gating,
the head (final norm and head product) and the rest of the layer loop (residual adds,
finiteness checks, Python). Each arm runs in its own process at its thread count
(``VINDEX3_DECODE_THREADS``, BLAS held there too: a 512-token prefill is a small pass,
vindex3.exec.engine.SMALL_PASS); arms are interleaved over rounds, each reports its best
prefill over ``--repeats`` after a warm-up, with the per-kind split of that best run.

Times are exclusive (a product inside the attention stage counts as a projection) and come
from wrappers around the ops, which add a few microseconds per call (~1.5k calls a prefill).

    python bench/prefill_profile.py [--rounds 2] [--repeats 2] [--threads 1 2]
        [--arms "f32 exact,int8 q8"] [--out bench/results/prefill_profile.json]

An arm named "<encoding> <activations> numpy" runs with the prefill kernels off
(``VINDEX3_PREFILL_KERNELS=0``: vindex3.exec.ops.prefill_attend), the numpy path they replace.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import child_json, facts, pin_threads

PREFILL_T = 512
KINDS = ("projections", "attention", "rope", "norms", "silu_gating", "lm_head", "rest_of_layers", "embed_other")


class Timer:
    """Exclusive wall and CPU seconds (every thread of the process) per kind; a call inside the
    head counts as the head's. CPU seconds are the figure to read on a busy machine, where a
    descheduled process's wall clock says little."""

    def __init__(self):
        self.reset()
        self.stack: list[list] = []  # [kind, child wall seconds, child cpu seconds]

    def reset(self):
        self.sec = dict.fromkeys(KINDS, 0.0)
        self.cpu = dict.fromkeys(KINDS, 0.0)

    def wrap(self, kind: str, f):
        def g(*a, **k):
            outer = self.stack[-1][0] if self.stack else None
            k_eff = "lm_head" if outer == "lm_head" else kind
            self.stack.append([k_eff, 0.0, 0.0])
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                return f(*a, **k)
            finally:
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                _, child, child_cpu = self.stack.pop()
                self.sec[k_eff] += dt - child
                self.cpu[k_eff] += dc - child_cpu
                if self.stack:
                    self.stack[-1][1] += dt
                    self.stack[-1][2] += dc

        g.__wrapped__ = f
        for attr in ("stages", "rows"):
            if hasattr(f, attr):
                setattr(g, attr, getattr(f, attr))
        return g


def instrument(t: Timer) -> None:
    from vindex3.codecs import base
    from vindex3.exec import engine
    from vindex3.exec.ops import norm, rope
    from vindex3.exec.ops import softmax as sm
    from vindex3.operators import gated_ffn

    seen, todo = [], [base.Weight]
    while todo:
        k = todo.pop()
        seen.append(k)
        todo.extend(k.__subclasses__())
    for cls in seen:
        if "mm" in cls.__dict__:
            cls.mm = t.wrap("projections", cls.__dict__["mm"])
    real_products = base.products
    sm.products = lambda ws: t.wrap("projections", real_products(ws))
    gated_ffn.products = sm.products
    engine.rms_norm = t.wrap("norms", engine.rms_norm)
    norm.rms_norm = t.wrap("norms", norm.rms_norm)
    rope.apply = t.wrap("rope", rope.apply)
    real_make = sm.make_attention

    def make_attention(p, w, tap=None):
        run = real_make(p, w, tap=tap)
        project, attend, output = run.stages
        attend_t = t.wrap("attention", attend)

        def run2(x, kv, p0):
            return output(attend_t(*project(x), kv, p0))

        run2.stages = (project, attend_t, output)
        return run2

    sm.make_attention = make_attention
    gated_ffn._Bound._activations = t.wrap("silu_gating", gated_ffn._Bound._activations)
    engine.Readout.__call__ = t.wrap("lm_head", engine.Readout.__call__)
    engine.Executor._layers = t.wrap("rest_of_layers", engine.Executor._layers)


def arm(path: str, activations: str, repeats: int) -> dict:
    import vindex3
    from vindex3.codecs import threads

    t = Timer()
    instrument(t)
    c = vindex3.open(path)
    ex = c.executor(activations=activations)
    from llamacpp_peer import TEXT as LONG

    ids = list(c.tokenizer.encode(LONG))[:PREFILL_T]
    assert len(ids) == PREFILL_T
    best, split, best_cpu, split_cpu = 1e9, None, 1e9, None
    for i in range(repeats + 1):  # the first is a warm-up (compiles)
        t.reset()
        t0, c0 = time.perf_counter(), time.process_time()
        ex.start().prefill(ids, last_only=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        if i and wall < best:
            best, split = wall, dict(t.sec)
            split["embed_other"] = wall - sum(v for k, v in split.items() if k != "embed_other")
        if i and cpu < best_cpu:
            best_cpu, split_cpu = cpu, dict(t.cpu)
            split_cpu["embed_other"] = cpu - sum(v for k, v in split_cpu.items() if k != "embed_other")
    return {"wall_s": best, "tok_s": PREFILL_T / best, "split_s": split, "cpu_s": best_cpu,
            "split_cpu_s": split_cpu, "threads": threads.count()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--arms", default="f32 exact,int8 q8")
    ap.add_argument("--out", default=str(HERE / "results" / "prefill_profile.json"))
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-threads", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        pin_threads(a.arm_threads)
        spec = json.loads(a.arm)
        print(json.dumps(arm(spec["path"], spec["activations"], a.repeats)))
        return 0
    from llamacpp_peer import our_containers
    from make_peer_ggufs import peer_dir

    names = [s.strip() for s in a.arms.split(",") if s.strip()]
    encs = sorted({n.split()[0] for n in names})
    paths = our_containers(encs, peer_dir(None))
    runs: dict = {}
    for r in range(a.rounds):
        for th in a.threads:
            for name in names:
                enc, act, *rest = name.split()
                spec = {"path": paths[enc], "activations": act}
                env = dict(os.environ, VINDEX3_DECODE_THREADS=str(th), PYTHONPATH=str(HERE.parent),
                           VINDEX3_PREFILL_KERNELS="0" if rest == ["numpy"] else "1")
                res = child_json([sys.executable, __file__, "--arm", json.dumps(spec), "--arm-threads", str(th),
                                  "--repeats", str(a.repeats)], env, f"{name} t={th}")
                res["loadavg"] = os.getloadavg()[0]
                runs.setdefault(name, {}).setdefault(f"threads_{th}", []).append(res)
                sp = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in res["split_s"].items())
                sc = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in res["split_cpu_s"].items())
                print(f"round {r} t={th} {name}: {res['wall_s'] * 1e3:.0f} ms wall ({res['tok_s']:.0f} tok/s; ms: {sp}); "
                      f"{res['cpu_s'] * 1e3:.0f} ms cpu ({sc}) load {res['loadavg']:.1f}", flush=True)
    summary: dict = {}
    for name, by_t in runs.items():
        for tk, lst in by_t.items():
            b = min(lst, key=lambda x: x["wall_s"])
            bc = min(lst, key=lambda x: x["cpu_s"])
            summary.setdefault(name, {})[tk] = {"best_wall_s": b["wall_s"], "split_s": b["split_s"],
                                                "best_cpu_s": bc["cpu_s"], "split_cpu_s": bc["split_cpu_s"],
                                                "loadavg_range": [min(x["loadavg"] for x in lst),
                                                                  max(x["loadavg"] for x in lst)]}
    doc = {"benchmark": "prefill_profile", "model": "SmolLM2-135M-Instruct", "prefill_tokens": PREFILL_T,
           "rounds": a.rounds, "repeats": a.repeats, "machine": facts(None) | {"loadavg_end": os.getloadavg()},
           "summary": summary, "runs": runs}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
