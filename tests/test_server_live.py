"""lql serve on a real uvicorn server (a free loopback port, started and stopped by each test):
the official `openai` client unchanged, USE REMOTE round trips equal to local runs, a client
that disconnects mid-stream, the bounded queue and 429, and the `lql serve` command itself."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_fixtures import chat_container, config, free_port, live_server, slow_steps

import lql
import lql.cli

httpx = pytest.importorskip("httpx", reason="SKIPPED LOUDLY: httpx is a dev dependency (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parents[1]


def _no_eos(catalog, ids):
    stop = set(catalog.eos_ids())
    cut = next((i for i, t in enumerate(ids) if t in stop), len(ids))
    return catalog.decode(list(ids[:cut]))


# ---- the official client ---------------------------------------------------------------


def test_openai_client_unchanged(tiny_llama_container, tmp_path):
    openai = pytest.importorskip("openai", reason="SKIPPED LOUDLY: the openai client is a dev dependency")
    path = chat_container(tiny_llama_container, tmp_path)
    s = lql.connect(path)
    with live_server(config(path, model_id="tiny-chat", api_key="sk-test")) as (url, _app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == ["tiny-chat"]

        local = s.execute_one("INFER 'Water boils' GENERATE 10")
        want = _no_eos(s.catalog, local.generated_ids)
        r = client.completions.create(model="tiny-chat", prompt="Water boils", max_tokens=10, temperature=0)
        assert r.choices[0].text == want
        # generated tokens, an end-of-sequence token that stopped them included
        assert r.usage.completion_tokens == len(local.generated_ids)
        assert r.usage.prompt_tokens == len(local.prompt.ids)
        streamed = "".join(ch.choices[0].text for ch in client.completions.create(
            model="tiny-chat", prompt="Water boils", max_tokens=10, temperature=0, stream=True))
        assert streamed == want

        want = _no_eos(s.catalog, s.execute_one("INFER 'Say hi' CHAT GENERATE 10").generated_ids)
        msgs = [{"role": "user", "content": "Say hi"}]
        r = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0)
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
        assert r.usage.prompt_tokens == len(s.execute_one("INFER 'Say hi' CHAT TOP 1").prompt.ids)
        stream = client.chat.completions.create(model="tiny-chat", messages=msgs, max_tokens=10, temperature=0,
                                                stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert chunks[-1].usage.total_tokens == r.usage.total_tokens

        # extension fields pass through the client's extra_body
        r = client.completions.create(model="tiny-chat", prompt="Water boils", max_tokens=10, temperature=0,
                                      extra_body={"speculate": {"depth": 2, "lookahead": 3}})
        assert r.choices[0].text == _no_eos(s.catalog, s.execute_one("INFER 'Water boils' GENERATE 10").generated_ids)

        bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.BadRequestError, match="'n'"):
            client.completions.create(model="tiny-chat", prompt="x", n=17)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x")


# ---- USE REMOTE --------------------------------------------------------------------------

ROUND_TRIP = [
    "STATS AT 100 POSITIONS", "EXPLAIN", "EXPLAIN INFER 'Water boils' DRAFT DEPTH 1", "SHOW LAYERS RANGE 1-2",
    "SHOW COMPONENTS", "SHOW REPRESENTATIONS '*norm*'", "SHOW PROVENANCE", "SHOW OPERANDS LAYER 0",
    "INFER 'Water' TOP 3", "INFER 'Water boils' GENERATE 6", "DRAFT DEPTH 2", "INFER 'Water' TOP 3",
    "TRACE 'Hi there'", "DRAFT OFF", "INFER 'Once upon' GENERATE 8 SPECULATE DEPTH 2 LOOKAHEAD 3",
    "SET top = 2", "INFER TOKENS (1, 40, 50)", "SHOW SETTINGS", "VERIFY", "HELP TRACE",
]
REFUSED = ["DRAFT DEPTH 9", "INFER 'x' TOP 0", "SHOW LAYERS RANGE 3-1", "INFER TOKENS (99999)", "SET nope = 1"]


def _comparable(r) -> dict:
    d = r.to_dict()
    res = d["result"]
    for k in ("timing", "speedup", "plain_tokens_per_second"):
        res.pop(k, None)
    return d


def test_use_remote_round_trips_equal_local_results(tiny_llama_container):
    with live_server(config(tiny_llama_container)) as (url, _app):
        local, remote = lql.connect(tiny_llama_container), lql.Session()
        r = remote.execute_one(f"USE REMOTE '{url}'")
        assert r.url == url and r.model == "tiny" and r.layers == 4 and r.digest == local.container.digest
        here = str(tiny_llama_container)

        def served(x):  # the server names its container by the model id, never by its path here
            return json.loads(json.dumps(x).replace(json.dumps(here)[1:-1], "tiny"))

        for text in ROUND_TRIP:
            a, b = local.execute_one(text), remote.execute_one(text)
            assert type(a) is type(b), text
            assert a.to_text(timing=False).replace(here, "tiny") == b.to_text(timing=False), text
            assert here not in b.to_text(timing=False), text
            assert served(_comparable(a)) == _comparable(b), text
            assert served(a.to_records()) == b.to_records() or "timing" in json.dumps(a.to_records()), text
        for text in REFUSED:
            errs = []
            for s in (local, remote):
                with pytest.raises(lql.LqlError) as e:
                    s.execute(f"STATS;\n  {text}")
                errs.append(e.value)
            a, b = errs
            assert (type(a), a.kind, a.message, a.hint, a.line, a.column) == \
                   (type(b), b.kind, b.message, b.hint, b.line, b.column), text
        # a syntax error is found here, before anything is sent
        with pytest.raises(lql.LqlSyntaxError):
            remote.execute("OPEN model.vindex3")
        # OPEN leaves the server
        remote.execute(f"OPEN '{tiny_llama_container}'")
        assert remote.remote is None and remote.container is not None


def test_use_remote_from_the_lql_command_prints_what_local_prints(tiny_llama_container):
    with live_server(config(tiny_llama_container)) as (url, _app):
        def run(*argv):
            out, err = io.StringIO(), io.StringIO()
            rc = lql.cli.main(["--no-timing", *argv], stdout=out, stderr=err)
            return rc, out.getvalue(), err.getvalue()

        text = "SHOW LAYERS; INFER 'Water' TOP 3; DRAFT DEPTH 7"
        rc_l, out_l, err_l = run("--container", str(tiny_llama_container), "-e", text)
        rc_r, out_r, err_r = run("-e", f"USE REMOTE '{url}'; " + text)
        assert rc_l == rc_r == 1
        assert out_r.split("\n\n", 1)[1] == out_l.split("\n\n", 1)[1]  # after OPEN / USE REMOTE
        assert err_l.split(": error: ")[1] == err_r.split(": error: ")[1]


def test_use_remote_keys_models_and_toolbar(tiny_llama_container, tmp_path, monkeypatch):
    from prompt_toolkit.output import DummyOutput

    from lql import repl

    with live_server(config(tiny_llama_container, api_key="k-123")) as (url, _app):
        s = lql.Session()
        monkeypatch.delenv("LQL_API_KEY", raising=False)
        with pytest.raises(lql.LqlError) as e:
            s.execute(f"USE REMOTE '{url}'")
        assert e.value.kind == "Unauthorized" and "LQL_API_KEY" not in e.value.message
        monkeypatch.setenv("LQL_API_KEY", "k-123")
        with pytest.raises(lql.LqlError, match="does not serve a model 'other'") as e:
            s.execute(f"USE REMOTE '{url}' MODEL 'other'")
        assert "tiny" in e.value.hint
        s.execute(f"USE REMOTE '{url}' MODEL 'tiny'")
        sh = repl.Shell(output=DummyOutput(), history_path=tmp_path / "h", stdout=io.StringIO(), stderr=io.StringIO())
        sh.session = s
        sh.run_text("DRAFT DEPTH 2;")
        bar = "".join(t for _, t in sh.toolbar())
        assert f"remote {url}" in bar and "model tiny" in bar and "draft depth 2" in bar
    with pytest.raises(lql.LqlError) as e:
        s.execute("STATS")  # the server is gone
    assert e.value.kind == "RemoteUnavailable" and url in e.value.message


# ---- load: disconnects and the queue ---------------------------------------------------------


def test_client_disconnecting_mid_stream_stops_its_generation(tiny_llama_container, monkeypatch):
    with slow_steps(monkeypatch, 0.03) as seen, live_server(config(tiny_llama_container)) as (url, app):
        worker = app.state.server.hosts["tiny"].worker
        body = {"model": "tiny", "prompt": "Water", "max_tokens": 500, "temperature": 0, "stream": True}
        with httpx.Client(timeout=10) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            it = r.iter_raw()
            next(it)
            next(it)
            # the model computes on its worker thread: the event loop still answers at once
            t0 = time.monotonic()
            assert httpx.get(url + "/v1/health", timeout=5).status_code == 200
            assert time.monotonic() - t0 < 1.0
            assert worker.active_generations == 1
        # the connection is closed: the generation must stop within a few steps
        deadline = time.monotonic() + 5
        while worker.active_generations and time.monotonic() < deadline:
            time.sleep(0.02)
        assert worker.active_generations == 0
        steps = seen["steps"]
        time.sleep(0.3)
        assert seen["steps"] == steps < 100  # nothing runs after the stop, far short of 500
        assert app.state.server.gate.running == 0  # its slot was given back


def test_past_max_concurrent_requests_queue_then_get_429(tiny_llama_container, monkeypatch):
    cfg = config(tiny_llama_container, max_concurrent=1, max_queue=1, retry_after=3)
    with slow_steps(monkeypatch, 0.02), live_server(cfg) as (url, app):
        gate = app.state.server.gate
        body = {"model": "tiny", "prompt": "Water", "max_tokens": 60, "temperature": 0}
        results: dict[str, httpx.Response] = {}

        def post(name):
            results[name] = httpx.post(url + "/v1/completions", json=body, timeout=30)

        first = threading.Thread(target=post, args=("first",))
        first.start()
        while gate.running < 1:
            time.sleep(0.01)
        second = threading.Thread(target=post, args=("second",))
        second.start()
        while gate.waiting < 1:
            time.sleep(0.01)
        r = httpx.post(url + "/v1/query", json={"lql": "INFER 'x' GENERATE 2"}, timeout=30)
        assert r.status_code == 429 and r.headers["Retry-After"] == "3"
        assert r.json()["error"]["type"] == "Busy" and "--max-concurrent 1" in r.json()["error"]["message"]
        first.join(30)
        second.join(30)
        assert results["first"].status_code == results["second"].status_code == 200
        assert results["first"].json()["choices"][0]["text"] == results["second"].json()["choices"][0]["text"]
        assert gate.running == 0 and gate.waiting == 0


def test_concurrent_streams_interleave_and_each_equals_greedy(tiny_llama_container, monkeypatch):
    s = lql.connect(tiny_llama_container)
    prompts = ["Water", "The capital", "def add", "Once upon"]
    want = {p: _no_eos(s.catalog, s.execute_one(f"INFER {p!r} GENERATE 20").generated_ids) for p in prompts}
    with slow_steps(monkeypatch, 0.005), live_server(config(tiny_llama_container)) as (url, _app):
        got: dict[str, list[tuple[float, str]]] = {}

        def stream(p):
            body = {"model": "tiny", "prompt": p, "max_tokens": 20, "temperature": 0, "stream": True}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        events.append((time.monotonic(), json.loads(line[6:])["choices"][0]["text"]))
            got[p] = events

        threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert {p: "".join(t for _, t in ev) for p, ev in got.items()} == want
        # interleaved: every stream had produced something before any stream finished
        first_done = min(ev[-1][0] for ev in got.values())
        assert all(ev[0][0] < first_done for ev in got.values())


# ---- the command ---------------------------------------------------------------------------------


def test_lql_serve_command_starts_serves_and_refuses_an_open_bind(tiny_llama_container, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "lql", "serve", str(tiny_llama_container), "--host", "0.0.0.0"],
                       capture_output=True, text=True, timeout=60, env=env, check=False)
    assert p.returncode == 2 and "without an API key" in p.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lql", "serve", str(tiny_llama_container), "--port", str(port),
                             "--api-key", "k", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "lql serve did not come up"
            time.sleep(0.1)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/query", json={"lql": "SHOW LAYERS"},
                       headers={"Authorization": "Bearer k"}, timeout=30)
        assert r.status_code == 200 and r.json()["model"] == "tiny" or r.json()["model"] == Path(
            tiny_llama_container).name.replace(".vindex3", "")
        assert r.json()["results"][0]["kind"] == "show_layers"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
