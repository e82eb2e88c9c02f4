"""What the server benches share: a free loopback port, a child server process waited for and
stopped within a time bound, LQL's own greedy answers as the oracle, and one streaming
OpenAI-style completion request read to its end with the time of each chunk."""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
from pathlib import Path

# raw completion prompts (no chat template: both servers see the same text)
COMPLETION_PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "Once upon a time, there was",
    "def add(a, b):",
    "The three primary colors are",
    "In the morning I like to",
    "The largest planet in the solar system is",
    "A good name for a cat is",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    """``cmd`` as a child process, its output into an unnamed temporary file (``proc.log``): a
    pipe nobody reads would stop a chatty server once it fills."""
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed with the process, in stop()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def log_tail(proc: subprocess.Popen, chars: int = 2000) -> str:
    log = getattr(proc, "log", None)
    if log is None:
        return ""
    log.flush()
    log.seek(0)
    return log.read()[-chars:]


def wait_up(proc: subprocess.Popen, url: str, *, what: str, seconds: float = 120.0) -> None:
    """Until ``url`` answers 200, the child exits (SystemExit with its output's tail) or
    ``seconds`` pass (the child is killed, SystemExit)."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with status {proc.returncode}: {log_tail(proc)}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"{what} did not come up in {seconds:g} s")
        time.sleep(0.2)


def stop(proc: subprocess.Popen) -> None:
    """Terminate the child, kill it if it has not exited in 20 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
    log = getattr(proc, "log", None)
    if log is not None:
        log.close()


def greedy_answers(container: Path, prompts: list[str], max_tokens: int) -> dict[str, str]:
    """The oracle: LQL's own greedy continuation of each prompt (INFER 'p' GENERATE n), cut at
    the first end-of-sequence token."""
    import lql

    s = lql.connect(container)
    eos = set(s.catalog.eos_ids())
    out = {}
    for p in prompts:
        ids = list(s.execute_one(f"INFER {p!r} GENERATE {max_tokens}").generated_ids)
        cut = next((i for i, t in enumerate(ids) if t in eos), len(ids))
        out[p] = s.catalog.decode(ids[:cut])
    return out


async def stream_completion(client, url: str, body: dict) -> dict:
    """POST ``body`` (with ``stream`` true) to ``url``/v1/completions and read the events to the
    end: status, text, usage (when the server sends it), finish reason, and the monotonic time
    of the request and of each chunk that carried text."""
    out: dict = {"status": None, "text": "", "usage": None, "finish_reason": None, "t0": time.monotonic(), "times": []}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["error"] = (await r.aread()).decode(errors="replace")[:300]
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                out["error"] = obj["error"]
                break
            if obj.get("usage"):
                out["usage"] = obj["usage"]
            for ch in obj.get("choices", []):
                piece = ch.get("text") or ""
                if piece:
                    out["times"].append(time.monotonic())
                    out["text"] += piece
                if ch.get("finish_reason"):
                    out["finish_reason"] = ch["finish_reason"]
    return out
