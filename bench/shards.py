"""A 2-shard Ray pipeline against one process, side by side in one script, on the real model
(SmolLM2-135M-Instruct, 30 layers split 0-14 / 15-29).

Both arms prefill the same prompt and decode the same greedy tokens (checked identical); the arms
alternate run by run, and the per-token figure of each arm is the median step time of its best
run. Also measured: one actor round trip with no work (the per-hop floor on this host's
loopback), the in-actor compute seconds (so that the pipeline's overhead is split into compute
and transport), and the hidden-state bytes moved per token. Writes bench/results/shards.json with
machine facts.

    python bench/shards.py [--container DIR] [--n 32] [--repeats 3] [--ranges 0-14,15-29]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np
from machine import facts

import vindex3
from vindex3 import jsonio
from vindex3.draft.machine import machine_facts

PROMPT = "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is"


def decode(ex, ids: list[int], n: int) -> tuple[list[int], list[float], float, object]:
    """Greedy: prefill, then n-1 steps; returns tokens, step seconds, prefill seconds, stream."""
    st = ex.start()
    t0 = time.perf_counter()
    logits = st.prefill(ids, last_only=True)[-1]
    pre = time.perf_counter() - t0
    toks, steps = [int(np.argmax(logits))], []
    for _ in range(n - 1):
        t0 = time.perf_counter()
        logits = st.step(toks[-1])
        steps.append(time.perf_counter() - t0)
        toks.append(int(np.argmax(logits)))
    return toks, steps, pre, st


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--container")
    ap.add_argument("--n", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranges", default="0-14,15-29")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "shards.json"))
    a = ap.parse_args()
    from vindex3 import default_model

    path = Path(a.container) if a.container else Path(default_model.ensure())
    c = vindex3.open(path)
    ids = c.tokenizer.encode(PROMPT)
    vindex3.shards.ensure_ray(num_cpus=2)
    import ray

    model = vindex3.shards.shard(c, a.ranges)
    one, sh = c.executor(), model.executor()
    decode(one, ids, 4)  # warm both arms (numba caches, first BLAS calls, actor imports)
    decode(sh, ids, 4)

    runs: dict[str, list] = {"one_process": [], "sharded": []}
    tokens: dict[str, list[int]] = {}
    last_stream = None
    for r in range(a.repeats):
        order = [("one_process", one), ("sharded", sh)]
        if r % 2:
            order.reverse()
        for name, ex in order:
            toks, steps, pre, st = decode(ex, ids, a.n)
            tokens.setdefault(name, toks)
            if tokens[name] != toks:
                raise SystemExit(f"{name}: greedy tokens changed between runs")
            runs[name].append({"prefill_s": pre, "step_median_s": statistics.median(steps), "steps": steps})
            if name == "sharded":
                last_stream = st
    if tokens["one_process"] != tokens["sharded"]:
        raise SystemExit("the sharded pipeline's greedy tokens differ from one process")

    # One actor round trip that does no work: the transport floor of one hop on this host.
    actor = model.shards[0].actor
    ray.get(actor.stats.remote())
    rtts = []
    for _ in range(200):
        t0 = time.perf_counter()
        ray.get(actor.stats.remote())
        rtts.append(time.perf_counter() - t0)

    def best(name):
        return min(runs[name], key=lambda d: d["step_median_s"])

    b1, bs = best("one_process"), best("sharded")
    tr = last_stream.trace
    positions = tr.positions
    actor_compute = sum(tr.shard_seconds.values()) / len(tr.step_seconds)
    placement = sh.placement(positions=len(ids) + a.n)
    hop = placement.bytes_per_hop_per_position
    result = {
        "model": c.name,
        "ranges": a.ranges,
        "prompt_tokens": len(ids),
        "generated": a.n,
        "repeats": a.repeats,
        "tokens_identical": True,
        "per_token_ms": {"one_process": 1e3 * b1["step_median_s"], "sharded": 1e3 * bs["step_median_s"]},
        "per_token_overhead_ms": 1e3 * (bs["step_median_s"] - b1["step_median_s"]),
        "per_token_ratio_sharded_over_one": bs["step_median_s"] / b1["step_median_s"],
        "prefill_ms": {"one_process": 1e3 * b1["prefill_s"], "sharded": 1e3 * bs["prefill_s"]},
        "prefill_ratio_sharded_over_one": bs["prefill_s"] / b1["prefill_s"],
        "in_actor_compute_ms_per_call": 1e3 * actor_compute,
        "actor_round_trip_ms": {"median": 1e3 * statistics.median(rtts), "p90": 1e3 * sorted(rtts)[int(0.9 * len(rtts))]},
        "hidden_bytes_per_hop_per_token": hop,
        "hops_per_token": placement.hops_per_position,
        "bytes_between_shards_per_token": placement.bytes_between_shards_per_position,
        "bytes_moved_per_token": placement.bytes_moved_per_position,
        "bytes_moved_measured_per_position": tr.transfer_bytes / positions,
        "placement": placement.model_dump(),
        "machine": {**facts(), "build": machine_facts()},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(jsonio.dumps(result) + "\n")
    print(f"{c.name}, {a.ranges}, {a.n} tokens after a {len(ids)}-token prompt (best of {a.repeats})")
    print(f"  per token: one process {result['per_token_ms']['one_process']:.2f} ms, "
          f"2 shards {result['per_token_ms']['sharded']:.2f} ms "
          f"(+{result['per_token_overhead_ms']:.2f} ms, x{result['per_token_ratio_sharded_over_one']:.2f})")
    print(f"  prefill:   one process {result['prefill_ms']['one_process']:.1f} ms, "
          f"2 shards {result['prefill_ms']['sharded']:.1f} ms (x{result['prefill_ratio_sharded_over_one']:.2f})")
    print(f"  actor round trip (no work) median {result['actor_round_trip_ms']['median']:.3f} ms; "
          f"in-actor compute {result['in_actor_compute_ms_per_call']:.2f} ms per pass")
    print(f"  hidden state moved per token: {hop} B per hop x {placement.hops_per_position} hops = "
          f"{placement.bytes_moved_per_position} B ({placement.bytes_between_shards_per_position} B between shards)")
    print(f"  wrote {a.out}")
    model.close()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
