"""Batched decoding on `lql serve`: aggregate generated tokens per second with 1, 4 and 8
concurrent streaming completion clients, on a server that batches concurrent decode steps
(vindex3.exec.batch) beside the same server with batching switched off (each generation steps
alone, interleaved token by token: what the server did before). Loopback only, bounded.

Both servers are `lql serve` child processes on free 127.0.0.1 ports, started once, warmed up
by two uncounted concurrent requests and kept for the run; the peer's worker has its batched
prefetch replaced by a no-op at start-up (nothing else differs). Arms are interleaved: for each repeat, for each server, for each client count.
Each client sends ``--requests`` greedy requests one after another (``max_tokens`` fixed, no
stop strings); every text is checked against the lone greedy answer computed through LQL in
this process before the load (a mismatch fails the bench). Writes
bench/results/server_batch.json with the machine facts and the load average around each arm.

    python bench/server_batch.py [--clients 1,4,8] [--requests 2] [--max-tokens 32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.serving import COMPLETION_PROMPTS as PROMPTS
from bench.serving import free_port, greedy_answers, start, stop, stream_completion, wait_up

# the peer: the same server, its worker's batched prefetch a no-op (each generation steps alone)
UNBATCHED = ("import sys; import lql.server.worker as w; w.ModelWorker._prefetch = lambda self: None; "
             "from lql.server.cli import main; sys.exit(main(sys.argv[1:]))")
BATCHED = "import sys; from lql.server.cli import main; sys.exit(main(sys.argv[1:]))"


def start_server(code: str, container: Path, clients: int, root: Path = ROOT) -> tuple[subprocess.Popen, str]:
    """``lql serve`` on a free loopback port, running the code under ``root`` (this checkout, or
    another one's copy for a before/after comparison)."""
    port = free_port()
    cmd = [sys.executable, "-c", code, str(container), "--host", "127.0.0.1", "--port", str(port),
           "--max-concurrent", str(clients), "--max-queue", str(clients), "--time-limit", "600", "--log-level", "warning"]
    proc = start(cmd, {**os.environ, "PYTHONPATH": str(root)})
    url = f"http://127.0.0.1:{port}"
    wait_up(proc, url + "/health", what="lql serve")
    return proc, url


async def one_client(k: int, url: str, model: str, requests: int, max_tokens: int, answers: dict[str, str],
                     records: list[dict], c=None) -> None:
    """Client k's requests, one after another, over ``c`` (an httpx.AsyncClient; a new one,
    closed at the end, when None)."""
    import httpx

    if c is None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as own:
            await one_client(k, url, model, requests, max_tokens, answers, records, own)
        return
    for r_i in range(requests):
        prompt = PROMPTS[(k + r_i * 3) % len(PROMPTS)]
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        got = await stream_completion(c, url, body)
        records.append({"client": k, "prompt": prompt, "status": got["status"], "matches": got["text"] == answers[prompt],
                        "tokens": (got["usage"] or {}).get("completion_tokens", 0)})


def warm_up(url: str, model: str) -> None:
    """Two concurrent short requests, not counted: the first arm must not pay for loading the
    numba kernels (a single step's and a batched pass's) into the fresh server process."""
    import httpx

    async def two() -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as c:
            body = {"model": model, "max_tokens": 4, "temperature": 0, "stream": True}
            got = await asyncio.gather(*(stream_completion(c, url, {**body, "prompt": p}) for p in PROMPTS[:2]))
            if any(g["status"] != 200 for g in got):
                raise SystemExit(f"the warm-up requests failed: {[g.get('error') for g in got]}")

    asyncio.run(two())


def run_arm(url: str, model: str, clients: int, requests: int, max_tokens: int, answers: dict[str, str]) -> dict:
    import httpx

    before = httpx.get(url + "/metrics", timeout=10).text
    records: list[dict] = []
    load0 = os.getloadavg()[0]
    clock: dict[str, float] = {}

    async def all_clients() -> None:
        # the clients are made before the clock starts: an httpx client loads its TLS context
        # when made (~20 ms each here), which is the client library's cost, not the server's, and
        # would weigh 8 times as much on the 8-client arm as on the 1-client arm
        clock["made"] = time.monotonic()
        cs = [httpx.AsyncClient(timeout=httpx.Timeout(300.0)) for _ in range(clients)]
        try:
            clock["t0"] = time.monotonic()
            await asyncio.wait_for(asyncio.gather(*(one_client(k, url, model, requests, max_tokens, answers, records, c)
                                                    for k, c in enumerate(cs))), timeout=900)
            clock["t1"] = time.monotonic()
        finally:
            for c in cs:
                await c.aclose()

    asyncio.run(all_clients())
    wall = clock["t1"] - clock["t0"]
    after = httpx.get(url + "/metrics", timeout=10).text
    tokens = sum(r["tokens"] for r in records)
    return {"clients": clients, "requests": len(records), "failed": sum(r["status"] != 200 for r in records),
            "mismatched": sum(not r["matches"] for r in records), "tokens": tokens, "wall_seconds": wall,
            "tokens_per_second": tokens / wall,
            # the clock as it was before (the clients made inside it): what making them cost
            "client_setup_seconds": clock["t0"] - clock["made"],
            "tokens_per_second_with_client_setup": tokens / (clock["t1"] - clock["made"]), "loadavg_before": load0, "loadavg_after": os.getloadavg()[0],
            "batched_passes": _batches(after, before), "worker_seconds": _busy(after, before)}


def _batches(after: str, before: str) -> dict[str, int]:
    """Batched passes by rows during an arm (the difference of two /metrics texts)."""

    def table(text: str) -> dict[str, int]:
        out = {}
        for line in text.splitlines():
            if line.startswith("lql_batched_steps_total{"):
                rows = line.split('rows="', 1)[1].split('"', 1)[0]
                out[rows] = int(float(line.rsplit(" ", 1)[1]))
        return out

    a, b = table(after), table(before)
    return {k: a[k] - b.get(k, 0) for k in sorted(a, key=int) if a[k] - b.get(k, 0)}


def _busy(after: str, before: str) -> dict[str, float]:
    """Seconds the worker spent during an arm by work (batched passes; generation steps run
    alone, prefills included; calls), from two /metrics texts."""

    def table(text: str) -> dict[str, float]:
        out = {}
        for line in text.splitlines():
            if line.startswith("lql_worker_seconds_total{"):
                work = line.split('work="', 1)[1].split('"', 1)[0]
                out[work] = float(line.rsplit(" ", 1)[1])
        return out

    a, b = table(after), table(before)
    return {k: round(a[k] - b.get(k, 0.0), 3) for k in sorted(a)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--container", help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "server_batch.json"))
    ap.add_argument("--server-code", help="the checkout whose code the servers run (default: this one); e.g. a copy "
                    "of a base commit, to compare before and after under the same clients")
    ap.add_argument("--no-unbatched", action="store_true", help="run the batched server only")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    if any(c < 1 or c > 16 for c in counts) or not 1 <= args.requests <= 8 or not 1 <= args.repeats <= 4:
        ap.error("--clients 1..16, --requests 1..8, --repeats 1..4: the load is bounded")
    if args.container:
        container = Path(args.container)
    else:
        from vindex3 import default_model

        container = Path(default_model.ensure())
    from lql.server.config import model_id_for

    model = model_id_for(container)
    print(f"greedy answers for {len(PROMPTS)} prompts ...", file=sys.stderr)
    answers = greedy_answers(container, PROMPTS, args.max_tokens)
    servers = {}
    arms: list[dict] = []
    try:
        root = Path(args.server_code).resolve() if args.server_code else ROOT
        for name, code in (("batched", BATCHED), ("unbatched", UNBATCHED))[:1 if args.no_unbatched else 2]:
            servers[name] = start_server(code, container, max(counts), root)
            warm_up(servers[name][1], model)
        for rep in range(args.repeats):
            for name, (_proc, url) in servers.items():
                for c in counts:
                    print(f"repeat {rep + 1}: {name} server, {c} client(s) ...", file=sys.stderr)
                    arm = run_arm(url, model, c, args.requests, args.max_tokens, answers)
                    arm.update(server=name, repeat=rep)
                    arms.append(arm)
                    print(f"  {arm['tokens']} tokens in {arm['wall_seconds']:.1f} s: {arm['tokens_per_second']:.1f} tok/s "
                          f"(load {arm['loadavg_before']:.1f} -> {arm['loadavg_after']:.1f}), passes {arm['batched_passes']}, "
                          f"worker seconds {arm['worker_seconds']}",
                          file=sys.stderr)
    finally:
        for proc, _url in servers.values():
            stop(proc)

    from bench.machine import facts

    def rate(server: str, c: int, key: str = "tokens_per_second") -> float:
        xs = [a[key] for a in arms if a["server"] == server and a["clients"] == c]
        return sum(xs) / len(xs)

    summary: dict = {}
    for name in servers:
        one = rate(name, counts[0])
        old = rate(name, counts[0], "tokens_per_second_with_client_setup")
        summary[name] = {str(c): {"tokens_per_second": rate(name, c), "over_one_client": rate(name, c) / one,
                                  "over_one_client_with_client_setup":
                                      rate(name, c, "tokens_per_second_with_client_setup") / old}
                         for c in counts}
    if "unbatched" in servers:
        summary["batched_over_unbatched"] = {str(c): rate("batched", c) / rate("unbatched", c) for c in counts}
    report = {"bench": "server_batch", "model": model, "clients": counts, "requests_per_client": args.requests,
              "max_tokens": args.max_tokens, "repeats": args.repeats,
              "server_code": "this checkout" if not args.server_code else "another checkout (--server-code)",
              "clock": "from the clients' first request to their last answer (clients made before)",
              "summary": summary, "arms": arms,
              "failed": sum(a["failed"] for a in arms), "mismatched": sum(a["mismatched"] for a in arms),
              "machine": facts(threads=int(os.environ.get("VINDEX3_DECODE_THREADS", "1")))}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for name in servers:
        print(f"{name}: " + ", ".join(f"{c} clients {summary[name][str(c)]['tokens_per_second']:.1f} tok/s "
                                      f"({summary[name][str(c)]['over_one_client']:.2f}x one; with the clients' setup "
                                      f"{summary[name][str(c)]['over_one_client_with_client_setup']:.2f}x)"
                                      for c in counts))
    if "unbatched" in servers:
        print("batched / unbatched: " + ", ".join(f"{c} clients {v:.2f}x" for c, v in summary["batched_over_unbatched"].items()))
    print(f"failed {report['failed']}, mismatched {report['mismatched']}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores; wrote {args.out}")
    return 0 if report["failed"] == 0 and report["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
