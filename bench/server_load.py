"""Load on `lql serve`, loopback only, bounded in count and time: N concurrent streaming chat
clients (default 16) for a fixed time (default 60 s) against the default model
(SmolLM2-135M-Instruct), each request greedy (temperature 0) on one of a few prompts.

Before the load, the greedy answer to every prompt is computed in this process through LQL
(``INFER 'p' CHAT GENERATE n``); during it, every stream's text is checked against that answer.
Reports throughput (generated tokens and requests per second), time to first token and
per-token latency (p50, p99), failures (any non-200, error event or exception) and mismatches,
and writes bench/results/server_load.json with the machine facts.

The server is `python -m lql serve` in a child process on a free 127.0.0.1 port; no request
starts after the duration, every request has a client timeout, the whole run has a deadline,
and the server is stopped at the end whatever happened.

    python bench/server_load.py [--clients 16] [--seconds 60] [--max-tokens 32] [--container DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give a synonym for happy.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish.",
    "List two kinds of trees.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def greedy_answers(container: Path, max_tokens: int) -> tuple[dict[str, str], float]:
    """The oracle: LQL's own greedy generation of each prompt, end-of-sequence cut; and the
    in-process decode rate of one stream (tokens/s, BLAS held at one thread as the server holds
    it), the peer the server's figures are read against."""
    from threadpoolctl import threadpool_limits

    import lql

    s = lql.connect(container)
    eos = set(s.catalog.eos_ids())
    out = {}
    n = secs = 0.0
    with threadpool_limits(limits=int(os.environ.get("VINDEX3_DECODE_THREADS", "1")), user_api="blas"):
        for p in PROMPTS:
            r = s.execute_one(f"INFER {p!r} CHAT GENERATE {max_tokens}")
            ids = list(r.generated_ids)
            n += len(ids)
            secs += r.timing.decode_seconds or 0.0
            cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
            out[p] = s.catalog.decode(ids[:cut])
    return out, n / secs if secs > 0 else 0.0


async def client_loop(k: int, url: str, model: str, answers: dict[str, str], stop_at: float, max_tokens: int,
                      records: list[dict]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0)) as c:
        i = k
        while time.monotonic() < stop_at:
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            rec: dict = {"client": k, "prompt": prompt, "ok": False}
            t0 = time.monotonic()
            times: list[float] = []
            text = ""
            try:
                async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    rec["status"] = r.status_code
                    if r.status_code != 200:
                        rec["error"] = (await r.aread()).decode()[:300]
                    else:
                        async for line in r.aiter_lines():
                            if not line.startswith("data: "):
                                continue
                            data = line[6:]
                            if data == "[DONE]":
                                rec["ok"] = True
                                break
                            obj = json.loads(data)
                            if "error" in obj:
                                rec["error"] = obj["error"]
                                break
                            if obj.get("usage"):
                                rec["usage"] = obj["usage"]
                            for ch in obj.get("choices", []):
                                piece = ch["delta"].get("content")
                                if piece:
                                    times.append(time.monotonic())
                                    text += piece
            except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
                rec["error"] = f"{type(e).__name__}: {e}"
                rec["ok"] = False
            t1 = time.monotonic()
            rec.update(text=text, seconds=t1 - t0, ttft=(times[0] - t0) if times else None,
                       matches=text == answers[prompt])
            n = (rec.get("usage") or {}).get("completion_tokens")
            if times and n and n > 1:
                rec["per_token"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
            rec["gaps"] = [b - a for a, b in itertools.pairwise(times)]
            records.append(rec)


async def load(url: str, model: str, answers: dict[str, str], clients: int, seconds: float, max_tokens: int) -> tuple[list[dict], float]:
    records: list[dict] = []
    t0 = time.monotonic()
    stop_at = t0 + seconds
    await asyncio.gather(*(client_loop(k, url, model, answers, stop_at, max_tokens, records) for k in range(clients)))
    return records, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--container", help="a container with a chat template (default: the default model)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "server_load.json"))
    args = ap.parse_args(argv)
    if args.clients < 1 or args.clients > 64 or args.seconds <= 0 or args.seconds > 600:
        ap.error("--clients 1..64 and --seconds up to 600: the load is bounded")

    if args.container:
        container = Path(args.container)
    else:
        from vindex3 import default_model

        container = Path(default_model.ensure())
    from lql.server.config import model_id_for

    model = model_id_for(container)
    print(f"greedy answers for {len(PROMPTS)} prompts ...", file=sys.stderr)
    answers, before = greedy_answers(container, args.max_tokens)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "lql", "serve", str(container), "--host", "127.0.0.1", "--port", str(port),
           "--max-concurrent", str(args.clients), "--max-queue", str(args.clients), "--time-limit", "300",
           "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"lql serve exited: {proc.stderr.read()}")
            try:
                if httpx.get(url + "/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("lql serve did not come up in 120 s")
            time.sleep(0.2)
        print(f"{args.clients} streaming clients for {args.seconds:g} s on {model} ...", file=sys.stderr)
        records, wall = asyncio.run(asyncio.wait_for(
            load(url, model, answers, args.clients, args.seconds, args.max_tokens), timeout=args.seconds + 400))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    print("in-process decode rate again, after the load ...", file=sys.stderr)
    answers_after, after = greedy_answers(container, args.max_tokens)
    assert answers_after == answers, "the in-process greedy answers changed between two runs"

    from bench.machine import facts

    ok = [r for r in records if r["ok"]]
    tokens = sum((r.get("usage") or {}).get("completion_tokens", 0) for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    per_token = [r["per_token"] for r in ok if r.get("per_token") is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    summary = {
        "requests": len(records),
        "failed": len(records) - len(ok),
        "mismatched": sum(1 for r in ok if not r["matches"]),
        "wall_seconds": wall,
        "generated_tokens": tokens,
        "tokens_per_second": tokens / wall if wall > 0 else None,
        "requests_per_second": len(ok) / wall if wall > 0 else None,
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "per_token_p50_s": pct(per_token, 50), "per_token_p99_s": pct(per_token, 99),
        "inter_chunk_p50_s": pct(gaps, 50), "inter_chunk_p99_s": pct(gaps, 99),
        "request_seconds_mean": statistics.fmean(r["seconds"] for r in ok) if ok else None,
        # the peer: one stream decoding in this process, before and after the load
        "in_process_tokens_per_second_before": before,
        "in_process_tokens_per_second_after": after,
        "server_over_in_process": (tokens / wall) / ((before + after) / 2) if wall > 0 and before + after > 0 else None,
    }
    report = {
        "bench": "server_load",
        "model": model,
        "clients": args.clients,
        "seconds": args.seconds,
        "max_tokens": args.max_tokens,
        "prompts": PROMPTS,
        "summary": summary,
        "failures": [{k: r.get(k) for k in ("client", "prompt", "status", "error")} for r in records if not r["ok"]][:20],
        "mismatches": [{"prompt": r["prompt"], "got": r["text"], "want": answers[r["prompt"]]}
                       for r in ok if not r["matches"]][:20],
        "machine": facts(threads=int(os.environ.get("VINDEX3_DECODE_THREADS", "1"))),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    s = summary
    print(f"requests {s['requests']} (failed {s['failed']}, mismatched {s['mismatched']}) in {wall:.1f} s; "
          f"{tokens} tokens, {s['tokens_per_second']:.1f} tok/s, {s['requests_per_second']:.2f} req/s")
    if ttft:
        print(f"time to first token p50 {s['ttft_p50_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s; "
              f"per token p50 {s['per_token_p50_s']:.3f} s, p99 {s['per_token_p99_s']:.3f} s")
    print(f"one stream in-process: {before:.1f} tok/s before, {after:.1f} after; server aggregate / in-process "
          f"{s['server_over_in_process']:.2f}x; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"wrote {args.out}")
    return 0 if s["failed"] == 0 and s["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
