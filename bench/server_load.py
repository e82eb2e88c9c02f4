"""Aggregate generated tokens per second of `lql serve` at 1, 4 and 8 concurrent streaming
completion clients, beside llama.cpp's server (llama-cpp-python's ``[server]`` extra) on the same
weights when one is given, otherwise beside our own single-client rate. Loopback only, bounded.

Both servers are child processes on free 127.0.0.1 ports, started once, kept for the run and
stopped (terminated, then killed) at the end whatever happened; each must answer within 120 s of
starting, and the whole load has a deadline. Both are held at one thread: `lql serve` with
OMP/OpenBLAS/MKL/numba threads and VINDEX3_DECODE_THREADS at 1; the peer with ``--n_threads 1
--n_threads_batch 1`` and the same environment. Same requests on both: the raw prompts of
bench/serving.py through /v1/completions (no chat template), greedy (temperature 0; the peer also
``repeat_penalty`` 1.0, since its server's default is 1.1), the same ``max_tokens``, streamed.
Arms are interleaved: for each repeat, for each client count, each server in turn (the order
alternates between repeats). Each client sends ``--requests`` requests one after another.

Before the arms, each server answers every prompt once without streaming (also its warm-up):
the text and token counts it gives there are what a streamed answer must repeat (a streamed
request is counted with that completion_tokens; a different text is a mismatch). `lql serve`'s
answers must equal LQL's own greedy continuation computed in this process (a mismatch fails the
bench); whether the peer's equal them too is reported, not required (llama.cpp sums in another
order, so a near-tie may go the other way). The peer's server runs one request at a time (a
lock around its one model): its aggregate rate does not grow with clients; it also reuses the
KV of a prompt prefix shared with the previous request, which ours does not.

Writes bench/results/server_load.json: per arm tokens, seconds, tok/s, time to first token and
the load average before and after; per server and client count the mean rate and its ratio to
one client; lql over the peer per client count; the machine facts. If the peer cannot run, the
JSON says why (``peer.ran`` false, ``peer.why``) and only our own arms are measured.

The peer lives in its own virtual environment, never in the project's (its fastapi would change
the starlette under lql's server):

    python3.11 -m venv PEERVENV
    PEERVENV/bin/pip install numpy jinja2 fastapi sse-starlette starlette-context pydantic-settings uvicorn
    PEERVENV/bin/pip install 'llama-cpp-python[server]'   # or a local build: --peer-pythonpath BUILD
    python bench/make_peer_ggufs.py                        # F32 GGUF of the default model's weights

    python bench/server_load.py [--clients 1,4,8] [--requests 2] [--max-tokens 32] [--repeats 1]
        [--container DIR] [--peer-python PEERVENV/bin/python] [--peer-pythonpath BUILD] [--peer-gguf FILE]

``--peer-gguf`` defaults to the F32 GGUF bench/make_peer_ggufs.py writes into
$VINDEX3_CACHE/peer-ggufs (the same float32 values as the default container, which is f32).
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

ONE_THREAD = {v: "1" for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS",
                                "VINDEX3_DECODE_THREADS")}
PEER_EXTRA = {"repeat_penalty": 1.0}  # llama-cpp-python's server defaults to 1.1, which is not greedy
# Whether a server's usage.completion_tokens counts the end-of-sequence token it generated: lql's
# does, llama-cpp-python's does not (measured: same text, 30 against 29 tokens); both computed
# that step, so the bench counts it on both sides (the peer's finish_reason "stop", with no stop
# strings asked, is that token).
START_SECONDS = 120.0


def start_lql(container: Path, clients: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "lql", "serve", str(container), "--host", "127.0.0.1", "--port", str(port),
           "--max-concurrent", str(clients), "--max-queue", str(clients), "--time-limit", "600",
           "--log-level", "warning"]
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": str(ROOT)}
    proc = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_up(proc, url + "/health", what="lql serve", seconds=START_SECONDS)
    return proc, url


def start_peer(python: str, pythonpath: str | None, gguf: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [python, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "peer", "--host", "127.0.0.1",
           "--port", str(port), "--n_threads", "1", "--n_threads_batch", "1", "--n_ctx", "2048",
           "--interrupt_requests", "False", "--use_mlock", "False", "--verbose", "False"]
    env = {**os.environ, **ONE_THREAD}
    env.pop("PYTHONPATH", None)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    proc = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_up(proc, url + "/v1/models", what="llama-cpp-python's server", seconds=START_SECONDS)
    return proc, url


def body(side: dict, prompt: str, max_tokens: int, stream: bool) -> dict:
    b = {"model": side["model"], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if stream:
        b["stream_options"] = {"include_usage": True}
    return {**b, **side["extra"]}


def reference_answers(side: dict, max_tokens: int) -> dict[str, dict]:
    """Each prompt answered once without streaming (the warm-up): text, prompt and completion
    tokens, and the tokens it generated (completion tokens with the end-of-sequence one)."""
    import httpx

    out = {}
    with httpx.Client(timeout=httpx.Timeout(600.0)) as c:
        for p in PROMPTS:
            r = c.post(side["url"] + "/v1/completions", json=body(side, p, max_tokens, stream=False))
            r.raise_for_status()
            obj = r.json()
            out[p] = {"text": obj["choices"][0]["text"], "finish_reason": obj["choices"][0].get("finish_reason"),
                      "prompt_tokens": obj["usage"]["prompt_tokens"],
                      "completion_tokens": obj["usage"]["completion_tokens"]}
            eos_left_out = not side["counts_eos"] and out[p]["finish_reason"] == "stop"
            out[p]["generated"] = out[p]["completion_tokens"] + eos_left_out
    return out


async def one_client(k: int, side: dict, requests: int, max_tokens: int, records: list[dict]) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as c:
        for i in range(requests):
            prompt = PROMPTS[(k + i * 3) % len(PROMPTS)]
            ref = side["reference"][prompt]
            r = await stream_completion(c, side["url"], body(side, prompt, max_tokens, stream=True))
            ok = r["status"] == 200 and "error" not in r
            records.append({"client": k, "prompt": prompt, "ok": ok, "status": r["status"], "error": r.get("error"),
                            "matches": r["text"] == ref["text"], "tokens": ref["generated"] if ok else 0,
                            "streamed_usage": (r["usage"] or {}).get("completion_tokens"),
                            "ttft": r["times"][0] - r["t0"] if r["times"] else None})


def run_arm(side: dict, clients: int, requests: int, max_tokens: int) -> dict:
    records: list[dict] = []
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()

    async def all_clients() -> None:
        await asyncio.wait_for(asyncio.gather(*(one_client(k, side, requests, max_tokens, records)
                                                for k in range(clients))), timeout=1200)

    asyncio.run(all_clients())
    wall = time.monotonic() - t0
    tokens = sum(r["tokens"] for r in records)
    ttft = sorted(r["ttft"] for r in records if r["ttft"] is not None)
    return {"server": side["name"], "clients": clients, "requests": len(records),
            "failed": sum(not r["ok"] for r in records), "mismatched": sum(r["ok"] and not r["matches"] for r in records),
            "tokens": tokens, "wall_seconds": wall, "tokens_per_second": tokens / wall,
            "ttft_p50_s": ttft[len(ttft) // 2] if ttft else None,
            "streamed_usage_differs": sum(r["streamed_usage"] is not None and r["streamed_usage"] != r["tokens"]
                                          for r in records if r["ok"]),  # lql's stream against its warm-up
            "loadavg_before": load0, "loadavg_after": os.getloadavg()[0],
            "failures": [{k: r[k] for k in ("client", "prompt", "status", "error")} for r in records if not r["ok"]][:5]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--container", help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--peer-python", help="a Python with llama-cpp-python's server importable (its own venv)")
    ap.add_argument("--peer-pythonpath", help="PYTHONPATH for the peer (a local llama-cpp-python build)")
    ap.add_argument("--peer-gguf", help="the peer's weights (default: the F32 GGUF of bench/make_peer_ggufs.py)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "server_load.json"))
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.clients.split(",")]
    if any(c < 1 or c > 16 for c in counts) or not 1 <= args.requests <= 8 or not 1 <= args.repeats <= 4 \
            or not 1 <= args.max_tokens <= 256:
        ap.error("--clients 1..16, --requests 1..8, --repeats 1..4, --max-tokens 1..256: the load is bounded")
    from vindex3 import default_model

    container = Path(args.container) if args.container else Path(default_model.ensure())
    gguf = Path(args.peer_gguf) if args.peer_gguf else \
        default_model.cache_dir() / "peer-ggufs" / "SmolLM2-135M-Instruct.F32.gguf"
    from lql.server.config import model_id_for

    print(f"LQL's greedy answers for {len(PROMPTS)} prompts ...", file=sys.stderr)
    answers = greedy_answers(container, PROMPTS, args.max_tokens)

    sides: list[dict] = []
    procs: list[subprocess.Popen] = []
    peer: dict = {"ran": False, "gguf": gguf.name, "threads": "--n_threads 1 --n_threads_batch 1"}
    arms: list[dict] = []
    try:
        proc, url = start_lql(container, max(counts))
        procs.append(proc)
        sides.append({"name": "lql", "url": url, "model": model_id_for(container), "extra": {}, "counts_eos": True})
        if not args.peer_python:
            peer["why"] = "not asked for: --peer-python was not given"
        elif not gguf.is_file():
            peer["why"] = f"the peer's GGUF {gguf.name} is not there (python bench/make_peer_ggufs.py writes it)"
        else:
            try:
                proc, url = start_peer(args.peer_python, args.peer_pythonpath, gguf)
                procs.append(proc)
                sides.append({"name": "llama.cpp", "url": url, "model": "peer", "extra": dict(PEER_EXTRA),
                              "counts_eos": False})
                peer["ran"] = True
            except (SystemExit, OSError) as e:
                peer["why"] = f"its server did not start: {e}"
        if not peer["ran"]:
            print(f"no peer server: {peer['why']}", file=sys.stderr)
        for side in sides:
            print(f"{side['name']}: warm-up and reference answers ...", file=sys.stderr)
            side["reference"] = reference_answers(side, args.max_tokens)
        lql_ref = sides[0]["reference"]
        bad = {p: (r["text"], answers[p]) for p, r in lql_ref.items() if r["text"] != answers[p]}
        if bad:
            raise SystemExit(f"lql serve's greedy answers differ from LQL's own: {bad}")
        if peer["ran"]:
            pref = sides[1]["reference"]
            peer["answers_equal_lql"] = sum(pref[p]["text"] == answers[p] for p in PROMPTS)
            peer["prompts"] = len(PROMPTS)
            peer["prompt_tokens_equal"] = all(pref[p]["prompt_tokens"] == lql_ref[p]["prompt_tokens"] for p in PROMPTS)
            peer["differing_answers"] = {p: {"peer": pref[p]["text"], "lql": answers[p]}
                                         for p in PROMPTS if pref[p]["text"] != answers[p]}
        for rep in range(args.repeats):
            for c in counts:
                for side in (sides if rep % 2 == 0 else sides[::-1]):
                    print(f"repeat {rep + 1}: {side['name']}, {c} client(s) ...", file=sys.stderr)
                    arm = run_arm(side, c, args.requests, args.max_tokens)
                    arm["repeat"] = rep
                    arms.append(arm)
                    print(f"  {arm['tokens']} tokens in {arm['wall_seconds']:.1f} s: {arm['tokens_per_second']:.2f} "
                          f"tok/s (load {arm['loadavg_before']:.1f} -> {arm['loadavg_after']:.1f})", file=sys.stderr)
    finally:
        for proc in procs:
            stop(proc)

    from bench.machine import facts

    def rate(server: str, c: int) -> float:
        xs = [a["tokens_per_second"] for a in arms if a["server"] == server and a["clients"] == c]
        return sum(xs) / len(xs)

    summary: dict = {}
    for side in sides:
        one = rate(side["name"], counts[0])
        summary[side["name"]] = {str(c): {"tokens_per_second": rate(side["name"], c),
                                          f"over_{counts[0]}_client": rate(side["name"], c) / one} for c in counts}
    if peer["ran"]:
        summary["lql_over_llama.cpp"] = {str(c): rate("lql", c) / rate("llama.cpp", c) for c in counts}
    else:  # the fallback: beside our own single-client rate
        summary["lql_over_lql_one_client"] = {str(c): rate("lql", c) / rate("lql", counts[0]) for c in counts}
    report = {"bench": "server_load", "model": sides[0]["model"], "clients": counts, "requests_per_client": args.requests,
              "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": PROMPTS, "peer": peer,
              "threads": "one per server (OMP/OpenBLAS/MKL/numba/VINDEX3_DECODE_THREADS=1; peer --n_threads 1 "
                         "--n_threads_batch 1)",
              "summary": summary, "arms": arms,
              "reference_answers": {side["name"]: {p: {k: v for k, v in r.items() if k != "text"}
                                                   for p, r in side["reference"].items()} for side in sides}, "failed": sum(a["failed"] for a in arms),
              "mismatched": sum(a["mismatched"] for a in arms), "machine": facts(threads=1)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    for side in sides:
        s = summary[side["name"]]
        print(f"{side['name']}: " + ", ".join(f"{c} clients {s[str(c)]['tokens_per_second']:.2f} tok/s "
                                              f"({s[str(c)][f'over_{counts[0]}_client']:.2f}x)" for c in counts))
    if peer["ran"]:
        print("lql / llama.cpp: " + ", ".join(f"{c} clients {v:.2f}x" for c, v in summary["lql_over_llama.cpp"].items()))
        print(f"peer answers equal to LQL's greedy: {peer['answers_equal_lql']} of {peer['prompts']}")
    print(f"failed {report['failed']}, mismatched {report['mismatched']}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} cores; wrote {args.out}")
    return 0 if report["failed"] == 0 and report["mismatched"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
