"""Concurrent streaming clients that each send several requests one after another (the shape
of bench/server_batch.py) on a real server: every stream's greedy text is the lone request's,
the streams shared batched passes, and the worker is left with nothing running -- on tiny
models in f32 and int8 and, when it is present, on the default model (SmolLM2 f32)."""

from __future__ import annotations

import json
import threading
import time

import pytest


def _wait(cond, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, "the worker did not get there in time"
        time.sleep(0.005)


def _no_eos(catalog, ids):
    stop = set(catalog.eos_ids())
    cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return catalog.decode(list(ids[:cut]))


def _clients(url: str, model: str, prompts: list[str], per_client: int, max_tokens: int) -> dict[tuple[int, int], str]:
    """len(prompts) streaming clients at once, each sending ``per_client`` greedy requests one
    after another (client k's request r asks for prompt (k + 3 r) mod len): their texts."""
    import httpx

    got: dict[tuple[int, int], str] = {}
    start = threading.Barrier(len(prompts))

    def client(k):
        start.wait(30)
        with httpx.Client(timeout=120) as c:
            for r in range(per_client):
                body = {"model": model, "prompt": prompts[(k + 3 * r) % len(prompts)], "max_tokens": max_tokens,
                        "temperature": 0, "stream": True}
                text = ""
                with c.stream("POST", url + "/v1/completions", json=body) as resp:
                    assert resp.status_code == 200
                    for line in resp.iter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                got[(k, r)] = text

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a client did not finish in time"
    return got


def _serve_and_check(path, model_id: str, prompts: list[str], per_client: int, max_tokens: int) -> None:
    pytest.importorskip("httpx", reason="SKIPPED LOUDLY: httpx is a dev dependency")
    from server_fixtures import config, live_server

    import lql

    s = lql.connect(path)
    want = {p: _no_eos(s.catalog, s.execute_one(f"INFER {p!r} GENERATE {max_tokens}").generated_ids) for p in prompts}
    cfg = config(path, model_id=model_id, max_concurrent=len(prompts), max_queue=len(prompts), time_limit=300)
    with live_server(cfg, timeout=60) as (url, app):
        worker = app.state.server.hosts[model_id].worker
        got = _clients(url, model_id, prompts, per_client, max_tokens)
        _wait(lambda: worker.active_generations == 0)
        assert got == {(k, r): want[prompts[(k + 3 * r) % len(prompts)]]
                       for k in range(len(prompts)) for r in range(per_client)}
        assert max(worker.batches) > 1  # streams shared passes
        _wait(lambda: app.state.server.gate.running == 0)  # every slot given back (as each stream closes)


@pytest.mark.parametrize("encoding", ["f32", "int8"])
def test_eight_clients_two_requests_each_equal_lone_greedy(tiny_llama_container, tmp_path,
                                                                            encoding):
    path = tiny_llama_container
    if encoding != "f32":
        from vindex3.represent import represent

        path = tmp_path / f"llama-{encoding}.vindex3"
        represent(tiny_llama_container, path, encoding)
    prompts = ["Water", "The capital", "def add", "Once upon", "1 + 1", "Paris", "boils at", "small model"]
    _serve_and_check(path, "tiny", prompts, per_client=2, max_tokens=20)


@pytest.mark.slow
def test_default_model_eight_clients_equal_lone_greedy(smollm2_container):
    prompts = ["The capital of France is", "Water boils at a temperature of", "Once upon a time, there was",
               "def add(a, b):", "The three primary colors are", "In the morning I like to",
               "The largest planet in the solar system is", "A good name for a cat is"]
    _serve_and_check(smollm2_container, "smollm2", prompts, per_client=2, max_tokens=16)
