"""A long hostile run against `lql serve` (issue 32's acceptance): N request cases against a real
uvicorn server on a loopback port (both profiles, a tiny container, an API key), each body
generated from the server's own pydantic request models (completions, chat, embeddings,
tokenize) or from LQL statements generated from the grammar (/v1/query), half of them mutated
(wrong types, huge and negative numbers, deep nesting, unknown fields, truncation, bytes that
are not UTF-8), plus raw-socket cases (heads that never end, bodies shorter than their
Content-Length, garbage). Every request is bounded in time. Counts statuses, and writes
bench/results/fuzz_http.json with the machine facts, the server process's RSS at the start, the
middle and the end, and the load average. Exit status 1 if any response was a 500 (an internal
error), any request ran past its limit, or the RSS grew past the bound.

    .venv/bin/python bench/fuzz_http.py --cases 10000 --seed 0

Traffic goes to 127.0.0.1 only, to a server this script starts and stops."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import lql_fuzz as F
from machine import facts as machine_facts

KEY = "fuzz-key"
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize", "/v1/query")


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def body_for(endpoint: str, rng: random.Random, grammar: F.Grammar, ch: F.RandomChooser) -> Any:
    """A well-formed body for ``endpoint``, with values drawn from what the models accept."""
    text = rng.choice(["Hi", "The capital of France is", "", "x" * rng.randint(1, 300), "\u00e9\u4e2d\U0001f600"])
    if endpoint == "/v1/completions":
        b: dict[str, Any] = {"prompt": text or "Hi", "max_tokens": rng.randint(1, 8)}
        if rng.random() < 0.5:
            b["temperature"] = rng.choice([0, 0.7, 1.0, 2.0])
            b["seed"] = rng.randint(0, 10)
        if rng.random() < 0.3:
            b["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            b["stream"] = True
        if rng.random() < 0.2:
            b["temperature"] = 0
            b["speculate"] = {"depth": rng.randint(1, 3), "lookahead": rng.randint(1, 8)}
        return b
    if endpoint == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text or "Hi"}], "max_tokens": rng.randint(1, 8)}
    if endpoint == "/v1/embeddings":
        return {"input": text or "Hi", "pooling": rng.choice(["mean", "last"])}
    if endpoint == "/tokenize":
        return {"prompt": text}
    if endpoint == "/detokenize":
        return {"tokens": [rng.randint(0, 300) for _ in range(rng.randint(0, 6))]}
    return {"lql": grammar.statement(ch) + ";"}


def mutate(b: Any, rng: random.Random) -> Any:
    """One hostile change to a body."""
    if not isinstance(b, dict) or not b:
        return b
    key = rng.choice(sorted(b))
    choice = rng.randrange(9)
    out = dict(b)
    if choice == 0:
        out[key] = rng.choice([True, None, "1", [], {}, -1, 10**30, 1e308, float("nan") if rng.random() < 0.1 else -1e-320])
    elif choice == 1:
        out["unknown_field_" + str(rng.randint(0, 9))] = 1
    elif choice == 2:
        out[key] = [[[[[[1]]]]]]
    elif choice == 3:
        out.pop(key)
    elif choice == 4:
        out[key] = "\ud800" if rng.random() < 0.5 else "\x00" * 100
    elif choice == 5:
        out["max_tokens"] = rng.choice([0, -5, 10**9, "many"])
    elif choice == 6:
        out["speculate"] = {"depth": rng.choice([0, 1, 10**6]), "lookahead": rng.choice([1, 10**9, -1])}
    elif choice == 7:
        out["seed"] = rng.choice([-1, 2**64, "s"])
    else:
        out["temperature"] = rng.choice([1e-320, -1, 3, "hot"])
    return out


def raw_case(port: int, rng: random.Random, limit: float) -> str:
    """A raw-socket case; returns what happened ('closed', 'answered', 'timeout')."""
    kind = rng.randrange(4)
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as s:
        try:
            if kind == 0:  # a head that never ends
                s.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\n")
            elif kind == 1:  # a body shorter than its Content-Length, then gone
                s.sendall(b"POST /v1/query HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{\"lql\":")
                return "closed"
            elif kind == 2:  # garbage
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randint(1, 400))) + b"\r\n\r\n")
            else:  # a nested body
                body = b"[" * 100_000
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            data = s.recv(4096)
            if b" 500 " in data.split(b"\r\n", 1)[0]:
                return "internal"
            return "answered" if data else "closed"
        except TimeoutError:
            return "timeout"
        except OSError:
            return "closed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--limit", type=float, default=20.0, help="seconds one request may take")
    p.add_argument("--rss-growth", type=float, default=1.5, help="allowed end/middle RSS ratio")
    p.add_argument("--out", type=Path, default=HERE / "results" / "fuzz_http.json")
    args = p.parse_args(argv)

    import httpx
    from fixtures import build_checkpoint
    from server_fixtures import config, free_port

    import vindex3
    from lql.server.app import create_app
    from lql.server.transport import server

    rng = random.Random(args.seed)
    ch = F.RandomChooser(rng)
    grammar = F.Grammar()
    statuses: dict[str, int] = {}
    bad: list[str] = []
    rss: dict[str, int] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fuzz-http-") as tmp:
        c = vindex3.encode(build_checkpoint("llama", Path(tmp) / "ckpt"), Path(tmp) / "tiny.vindex3")
        data = Path(tmp) / "data"
        data.mkdir()
        for profile in ("read-only", "full"):
            port = free_port()
            srv = server(create_app(config(c, api_key=KEY, profile=profile, data_dir=data)), "127.0.0.1", port,
                         header_timeout=2.0, graceful=2)
            th = threading.Thread(target=srv.run, daemon=True)
            th.start()
            while not srv.started:
                if not th.is_alive():
                    raise SystemExit("the server did not start")
                time.sleep(0.02)
            rss[f"{profile}_start"] = rss_bytes()
            n = args.cases // 2
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=args.limit,
                              headers={"Authorization": f"Bearer {KEY}"}) as client:
                for i in range(n):
                    if i == n // 2:
                        rss[f"{profile}_middle"] = rss_bytes()
                    if rng.random() < 0.05:
                        what = raw_case(port, rng, args.limit)
                        statuses[f"raw:{what}"] = statuses.get(f"raw:{what}", 0) + 1
                        if what in ("internal", "timeout"):
                            bad.append(f"{profile} raw case {i}: {what}")
                        continue
                    ep = rng.choice(ENDPOINTS)
                    b = body_for(ep, rng, grammar, ch)
                    if rng.random() < 0.5:
                        b = mutate(b, rng)
                    try:
                        content = json.dumps(b, allow_nan=True).encode("utf-8", "surrogatepass")
                        if rng.random() < 0.03:
                            content = content[: rng.randint(0, len(content))]
                        r = client.post(ep, content=content, headers={"Content-Type": "application/json"})
                        code = r.status_code
                    except httpx.TimeoutException:
                        bad.append(f"{profile} {ep} case {i}: past {args.limit} s")
                        continue
                    except httpx.HTTPError as e:
                        statuses[f"transport:{type(e).__name__}"] = statuses.get(f"transport:{type(e).__name__}", 0) + 1
                        continue
                    statuses[str(code)] = statuses.get(str(code), 0) + 1
                    if code >= 500 and code != 503:
                        bad.append(f"{profile} {ep} case {i}: {code} {r.text[:200]}")
            rss[f"{profile}_end"] = rss_bytes()
            srv.should_exit = True
            th.join(10)
            if rss[f"{profile}_end"] > args.rss_growth * rss[f"{profile}_middle"]:
                bad.append(f"{profile}: RSS grew from {rss[f'{profile}_middle']:,} to {rss[f'{profile}_end']:,} bytes")
    seconds = time.perf_counter() - t0
    report = {"cases": args.cases, "seed": args.seed, "seconds": round(seconds, 1), "statuses": statuses,
              "bad": bad[:50], "bad_count": len(bad), "rss_bytes": rss, "loadavg": os.getloadavg(),
              "machine": machine_facts()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: report[k] for k in ("cases", "seconds", "statuses", "bad_count", "rss_bytes")}, indent=1))
    for line in bad[:20]:
        print("BAD", line)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
