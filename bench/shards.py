"""A 2-shard Ray pipeline against one process, side by side in one script, on the real model
(SmolLM2-135M-Instruct, 30 layers split 0-14 / 15-29).

Both arms prefill the same prompt and decode the same greedy tokens (checked identical), in
lockstep: one decode step of each in turn, alternating which goes first, so that both see the
same machine load. Per-token figures are medians over all steps of all runs; the overhead is the
median of the per-step differences; prefill is the best of the runs. Also measured: one actor round trip with no work (the per-hop floor on this host's
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
import vindex3.shards
from vindex3 import jsonio
from vindex3.draft.machine import machine_facts

PROMPT = "The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is"


def lockstep(one, sh, ids: list[int], n: int) -> dict:
    """Both arms prefill the prompt (in alternating order), then decode greedily in lockstep,
    one step of each in turn (alternating which goes first), so that both see the same machine
    load. Returns per-step seconds of each arm and the sharded stream."""
    a, b = one.start(), sh.start()
    pre = {}
    for name, st in ((("one", a), ("sh", b)) if n % 2 else (("sh", b), ("one", a))):
        t0 = time.perf_counter()
        last = st.prefill(ids, last_only=True)[-1]
        pre[name] = time.perf_counter() - t0
        if name == "one":
            tok_a = int(np.argmax(last))
        else:
            tok_b = int(np.argmax(last))
    toks = {"one": [tok_a], "sh": [tok_b]}
    steps = {"one": [], "sh": []}
    compute = []  # in-actor seconds of each sharded step, summed over the shards
    for i in range(n - 1):
        pair = [("one", a), ("sh", b)] if i % 2 == 0 else [("sh", b), ("one", a)]
        for name, st in pair:
            c0 = sum(b.trace.shard_seconds.values())
            t0 = time.perf_counter()
            row = st.step(toks[name][-1])
            steps[name].append(time.perf_counter() - t0)
            toks[name].append(int(np.argmax(row)))
            if name == "sh":
                compute.append(sum(b.trace.shard_seconds.values()) - c0)
    if toks["one"] != toks["sh"]:
        raise SystemExit("the sharded pipeline's greedy tokens differ from one process")
    return {"prefill": pre, "steps": steps, "tokens": toks["one"], "stream": b, "actor_compute": compute}


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
    lockstep(one, sh, ids, 4)  # warm both arms (numba caches, first BLAS calls, actor imports)
    runs = [lockstep(one, sh, ids, a.n) for _ in range(a.repeats)]
    if any(r["tokens"] != runs[0]["tokens"] for r in runs):
        raise SystemExit("greedy tokens changed between runs")

    # One actor round trip that does no work: the transport floor of one hop on this host.
    actor = model.shards[0].actor
    ray.get(actor.stats.remote())
    rtts = []
    for _ in range(200):
        t0 = time.perf_counter()
        ray.get(actor.stats.remote())
        rtts.append(time.perf_counter() - t0)

    one_steps = [t for r in runs for t in r["steps"]["one"]]
    sh_steps = [t for r in runs for t in r["steps"]["sh"]]
    diffs = [y - x for r in runs for x, y in zip(r["steps"]["one"], r["steps"]["sh"])]
    pre_one = min(r["prefill"]["one"] for r in runs)
    pre_sh = min(r["prefill"]["sh"] for r in runs)
    st = runs[-1]["stream"]
    tr = st.trace
    compute = statistics.median(t for r in runs for t in r["actor_compute"])
    # What the pipeline adds around the layers' own compute: step wall time minus the shards'
    # in-actor seconds minus the driver's ends (embedding row, final norm, head), per step.
    ends = model.ends
    ends_s = []
    for _ in range(50):
        t0 = time.perf_counter()
        ends.logits(ends._embed([ids[0]]), 1, False)
        ends_s.append(time.perf_counter() - t0)
    ends_med = statistics.median(ends_s)
    transport = statistics.median(w - k for r in runs for w, k in zip(r["steps"]["sh"], r["actor_compute"])) - ends_med
    placement = sh.placement(positions=len(ids) + a.n)
    hop = placement.bytes_per_hop_per_position
    med1, meds = statistics.median(one_steps), statistics.median(sh_steps)
    result = {
        "model": c.name,
        "ranges": a.ranges,
        "prompt_tokens": len(ids),
        "generated": a.n,
        "repeats": a.repeats,
        "tokens_identical": True,
        "per_token_ms": {"one_process": 1e3 * med1, "sharded": 1e3 * meds},
        "per_token_overhead_ms": 1e3 * statistics.median(diffs),
        "per_token_ratio_sharded_over_one": meds / med1,
        "prefill_ms": {"one_process": 1e3 * pre_one, "sharded": 1e3 * pre_sh},
        "prefill_ratio_sharded_over_one": pre_sh / pre_one,
        "in_actor_compute_ms_per_step": 1e3 * compute,
        "driver_ends_ms_per_step": 1e3 * ends_med,
        "pipeline_transport_ms_per_step": 1e3 * transport,
        "actor_round_trip_ms": {"median": 1e3 * statistics.median(rtts), "p90": 1e3 * sorted(rtts)[int(0.9 * len(rtts))]},
        "hidden_bytes_per_hop_per_token": hop,
        "hops_per_token": placement.hops_per_position,
        "bytes_between_shards_per_token": placement.bytes_between_shards_per_position,
        "bytes_moved_per_token": placement.bytes_moved_per_position,
        "bytes_moved_measured_per_position": tr.transfer_bytes / tr.positions,
        "placement": placement.model_dump(),
        "machine": {**facts(), "build": machine_facts()},
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(jsonio.dumps(result) + "\n")
    print(f"{c.name}, {a.ranges}, {a.n} tokens after a {len(ids)}-token prompt, {a.repeats} lockstep runs (medians)")
    print(f"  per token: one process {result['per_token_ms']['one_process']:.2f} ms, "
          f"2 shards {result['per_token_ms']['sharded']:.2f} ms "
          f"(+{result['per_token_overhead_ms']:.2f} ms, x{result['per_token_ratio_sharded_over_one']:.2f})")
    print(f"  prefill:   one process {result['prefill_ms']['one_process']:.1f} ms, "
          f"2 shards {result['prefill_ms']['sharded']:.1f} ms (x{result['prefill_ratio_sharded_over_one']:.2f})")
    print(f"  actor round trip (no work) median {result['actor_round_trip_ms']['median']:.3f} ms; "
          f"in-actor compute {result['in_actor_compute_ms_per_step']:.2f} ms per step (both shards)")
    print(f"  per step: driver ends {result['driver_ends_ms_per_step']:.2f} ms; what the pipeline adds around the "
          f"compute (transport, scheduling) {result['pipeline_transport_ms_per_step']:.2f} ms")
    print(f"  hidden state moved per token: {hop} B per hop x {placement.hops_per_position} hops = "
          f"{placement.bytes_moved_per_position} B ({placement.bytes_between_shards_per_position} B between shards)")
    print(f"  wrote {a.out}")
    model.close()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
