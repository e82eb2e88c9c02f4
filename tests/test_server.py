"""lql serve, in-process (the ASGI app through Starlette's TestClient): keys, profiles, path
confinement, limits, sessions, the one error shape, the error boundary, completions against
`INFER ... GENERATE`, sampling, stop strings and SSE framing."""

from __future__ import annotations

import json
import logging
import os

import pytest
from server_fixtures import chat_container, config, sse_events
from starlette.testclient import TestClient

import lql
import lql.cli
from lql.server.app import create_app

KEY = "test-key-0123"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def client(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container, api_key=KEY))) as c:
        yield c


def query(c, text, *, model="tiny", headers=None, status=200):
    r = c.post("/v1/query", json={"lql": text, "model": model}, headers={**AUTH, **(headers or {})})
    assert r.status_code == status, r.text
    return r.json()["results"]


def greedy(container, prompt: str, n: int) -> tuple[list[int], str]:
    """The oracle: what `INFER 'prompt' GENERATE n` produces, without its end-of-sequence token."""
    s = lql.connect(container)
    r = s.execute_one(f"INFER {prompt!r} GENERATE {n}")
    ids = list(r.generated_ids)
    if r.stopped_at is not None:
        ids = ids[:-1]
    return ids, s.catalog.decode(ids)


# ---- keys -------------------------------------------------------------------------------


def test_key_required_everywhere_but_health(client):
    assert client.get("/v1/health").json() == {"status": "ok"}
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/tiny/stats"), ("POST", "/v1/query"),
                         ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Basic x"}):
            r = client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (path, headers)
            assert r.headers["WWW-Authenticate"] == "Bearer"
            err = r.json()["error"]
            assert err["type"] == "Unauthorized" and "key" in err["message"]
            assert set(err) == {"type", "message", "hint", "line", "column", "expected"}
    assert client.get("/v1/models", headers=AUTH).status_code == 200


def test_no_key_configured_means_open(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container))) as c:
        assert c.get("/v1/models").status_code == 200


# ---- models, stats ----------------------------------------------------------------------


def test_models_lists_facts(client, tiny_llama_container):
    data = client.get("/v1/models", headers=AUTH).json()
    assert data["object"] == "list"
    (m,) = data["data"]
    c = lql.connect(tiny_llama_container).container
    assert m["id"] == "tiny" and m["object"] == "model"
    assert m["layers"] == c.graph.num_layers == 4
    assert m["operator_mix"] == [{"label": label, "count": n} for label, n in c.graph.operator_mix()]
    assert m["encodings"] == ["f32"] and m["digest"] == c.digest
    assert client.get("/v1/models/tiny", headers=AUTH).json() == m
    r = client.get("/v1/models/nope/stats", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "ModelNotFound" and "tiny" in r.json()["error"]["hint"]


def test_stats_endpoint_is_lql_json_stats(client, tiny_llama_container):
    got = client.get("/v1/models/tiny/stats", headers=AUTH).json()
    want = lql.connect(tiny_llama_container).execute_one("STATS").to_dict()
    assert got["kind"] == "stats" and got["ok"] is True
    # lql --json's STATS, the container named by its served model id instead of its path here
    assert got["result"] == {**want["result"], "path": "tiny"}


# ---- /v1/query ----------------------------------------------------------------------------


def test_query_returns_what_lql_json_prints(client, tiny_llama_container, tmp_path):
    text = "STATS; SHOW LAYERS RANGE 1-2; INFER 'Water' TOP 3; DRAFT DEPTH 9; STATS"
    got = query(client, text)
    p = tmp_path / "q.lql"
    p.write_text(text)
    import io

    out, err = io.StringIO(), io.StringIO()
    rc = lql.cli.main(["--json", "--no-timing", "--container", str(tiny_llama_container), str(p)], stdout=out, stderr=err)
    assert rc == 1
    want = [json.loads(line) for line in out.getvalue().splitlines()][1:]  # after the -c OPEN
    assert len(got) == len(want) == 4  # the failing statement stops the rest, as in lql

    def strip(o):
        o = json.loads(json.dumps(o))
        (o.get("result") or {}).pop("timing", None)
        if o.get("kind") == "stats":  # the server names the container by its model id, not its path
            o["result"]["path"] = "tiny" if o["result"]["path"] == str(tiny_llama_container) else o["result"]["path"]
        return o

    assert [strip(o) for o in got] == [strip(o) for o in want]
    assert got[3]["error"]["type"] == "SliceError" and got[3]["statement"]["column"] == text.index("DRAFT DEPTH 9") + 1


def test_query_syntax_error_same_shape(client):
    (o,) = query(client, "STATS; OPEN model.vindex3")[1:]
    assert o["ok"] is False and o["kind"] is None and o["statement"]["kind"] is None
    assert o["error"]["type"] == "LqlSyntaxError" and o["error"]["expected"] and o["error"]["column"] == 13


def test_sessions_keep_state_for_their_ttl(tiny_llama_container):
    import time

    with TestClient(create_app(config(tiny_llama_container, session_ttl=0.5))) as c:
        q = lambda text, h=None: c.post("/v1/query", json={"lql": text}, headers=h or {}).json()["results"]
        sid = {"X-Session-Id": "abc-1"}
        q("DRAFT DEPTH 2", sid)
        assert q("INFER 'x' TOP 1", sid)[0]["result"]["depth"] == 2
        assert q("INFER 'x' TOP 1", {"X-Session-Id": "other"})[0]["result"]["depth"] is None
        assert q("INFER 'x' TOP 1")[0]["result"]["depth"] is None  # no header: a fresh session
        q("DRAFT DEPTH 2")
        assert q("INFER 'x' TOP 1")[0]["result"]["depth"] is None
        time.sleep(0.8)
        # forgotten after its TTL: the next request is told so, by name, once
        r = c.post("/v1/query", json={"lql": "INFER 'x' TOP 1"}, headers=sid)
        assert r.status_code == 410 and r.json()["error"]["type"] == "SessionEvicted"
        assert "'abc-1'" in r.json()["error"]["message"] and "--session-ttl" in r.json()["error"]["message"]
        assert q("INFER 'x' TOP 1", sid)[0]["result"]["depth"] is None  # then it starts afresh
        r = c.post("/v1/query", json={"lql": "STATS"}, headers={"X-Session-Id": "no spaces"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "SessionRefusal"


def test_query_refuses_malformed_bodies(client):
    for body, word in (([1], "object"), ({"lql": 3}, "lql"), ({"lql": "STATS", "x": 1}, "'x'"),
                       ({"lql": "STATS", "model": "nope"}, "nope")):
        r = client.post("/v1/query", json=body, headers=AUTH)
        assert r.status_code in (400, 404) and word in r.json()["error"]["message"], r.text
    r = client.post("/v1/query", content=b"{not json", headers=AUTH)
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


# ---- the error boundary ---------------------------------------------------------------------


def test_unexpected_exception_is_an_internal_error_naming_the_statement(client, monkeypatch, caplog):
    from lql import registry
    from lql.statements.facts import ShowComponentsPlan

    def broken(session, node):
        raise RuntimeError("boom inside a command")

    monkeypatch.setitem(registry.RUNNERS, ShowComponentsPlan, (broken, "test"))
    with caplog.at_level(logging.ERROR, logger="lql.server"):
        r = client.post("/v1/query", json={"lql": "STATS; SHOW COMPONENTS; STATS"}, headers=AUTH)
    assert r.status_code == 500
    results = r.json()["results"]
    assert [o["ok"] for o in results] == [True, False]
    err = results[1]["error"]
    assert err["type"] == "InternalError"
    assert err["message"].startswith("internal error: RuntimeError: boom inside a command")
    assert results[1]["statement"]["text"] == "SHOW COMPONENTS" and err["column"] == 8
    assert "Traceback" not in r.text
    assert any("Traceback" in (rec.exc_text or "") or rec.exc_info for rec in caplog.records)  # logged


def test_unknown_endpoint_and_method_are_json(client):
    r = client.get("/v2/nothing", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFound"
    r = client.get("/v1/query", headers=AUTH)
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


# ---- profiles and paths -------------------------------------------------------------------


def test_read_only_profile_refuses_by_name(tiny_llama_container, tiny_llama_dir, tmp_path):
    cfg = config(tiny_llama_container, profile="read-only", data_dir=tmp_path, read_only_generate=8)
    with TestClient(create_app(cfg)) as c:
        q = lambda text: c.post("/v1/query", json={"lql": text}).json()["results"][-1]
        for text, word in (("ENCODE 'ckpt' INTO 'out'", "ENCODE"), ("PLAN 'ckpt'", "PLAN"),
                           ("DUMP LOGITS 'x' INTO 'x.f32'", "DUMP LOGITS"), ("OPEN 'x.vindex3'", "OPEN"),
                           ("OPEN DEFAULT", "OPEN"), ("SCORE DRAFT 'a' AGAINST 'b'", "SCORE DRAFT"),
                           ("DRAFT LADDER DEPTHS (1) ON 'p.jsonl'", "DRAFT LADDER"), ("VERIFY", "VERIFY")):
            o = q(text)
            assert o["ok"] is False and o["error"]["type"] == "ProfileRefusal", text
            assert f"read-only profile refuses {word}" in o["error"]["message"], o
        assert not list(tmp_path.iterdir())  # nothing was written
        for text in ("STATS", "EXPLAIN", "SHOW LAYERS", "SHOW OPERANDS LAYER 0", "INFER 'x' TOP 2", "TRACE 'x'",
                     "DRAFT DEPTH 2", "SET top = 2", "HELP", "INFER 'x' GENERATE 8"):
            assert q(text)["ok"] is True, text
        o = q("INFER 'x' GENERATE 9")
        assert o["error"]["type"] == "LimitRefusal" and "--read-only-generate" in o["error"]["message"]
        o = q("EXPLAIN INFER 'x' GENERATE 9")
        assert o["error"]["type"] == "LimitRefusal"


def test_use_remote_is_refused_on_a_server(client):
    o = query(client, "USE REMOTE 'http://127.0.0.1:1'")[0]
    assert o["error"]["type"] == "ProfileRefusal" and "USE REMOTE" in o["error"]["message"]


def test_paths_stay_inside_the_data_dir(tiny_llama_container, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (data / "out-link").symlink_to(outside)
    with TestClient(create_app(config(tiny_llama_container, data_dir=data))) as c:
        q = lambda text: c.post("/v1/query", json={"lql": text}).json()["results"][-1]
        o = q("DUMP LOGITS 'Water' INTO 'full.f32'")
        assert o["ok"] is True, o
        assert (data / "full.f32").exists() and (data / "full.meta.json").exists()
        for target, word in (("../escape.f32", "'..'"), (str(outside / "abs.f32"), "absolute"),
                             ("out-link/x.f32", "symbolic link"), ("", "not a file name"), ("~/x.f32", "absolute")):
            o = q(f"DUMP LOGITS 'Water' INTO {target!r}")
            assert o["error"]["type"] == "PathRefusal" and word in o["error"]["message"], (target, o)
        assert list(outside.iterdir()) == [] and not (tmp_path / "escape.f32").exists()
        o = q("SCORE DRAFT 'full.f32' AGAINST '../x'")
        assert o["error"]["type"] == "PathRefusal"
        o = q("OPEN '../data'")
        assert o["error"]["type"] == "PathRefusal"
    with TestClient(create_app(config(tiny_llama_container))) as c:  # no --data-dir: no paths at all
        o = c.post("/v1/query", json={"lql": "DUMP LOGITS 'x' INTO 'a.f32'"}).json()["results"][0]
        assert o["error"]["type"] == "PathRefusal" and "--data-dir" in o["error"]["hint"]


# ---- limits -----------------------------------------------------------------------------------


def test_limits_refuse_by_name(tiny_llama_container):
    cfg = config(tiny_llama_container, max_body_bytes=2000, max_statements=3, max_tokens=10, max_prompt_tokens=12)
    with TestClient(create_app(cfg)) as c:
        r = c.post("/v1/query", json={"lql": "STATS;" * 500})
        assert r.status_code == 413 and r.json()["error"]["type"] == "BodyTooLarge"
        r = c.post("/v1/query", json={"lql": "STATS; STATS; STATS; STATS"})
        assert r.status_code == 400 and "--max-statements" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 11})
        assert r.status_code == 400 and "--max-tokens" in r.json()["error"]["message"]
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Water boils at a temperature of 100 degrees"})
        assert r.status_code == 400 and "--max-prompt-tokens" in r.json()["error"]["message"]
        o = c.post("/v1/query", json={"lql": "INFER 'Water boils at a temperature of 100 degrees' TOP 1"}).json()
        assert o["results"][0]["error"]["type"] == "LimitRefusal"
        o = c.post("/v1/query", json={"lql": "INFER 'x' GENERATE 11"}).json()
        assert "--max-tokens" in o["results"][0]["error"]["message"]


def test_time_limit_stops_a_statement_and_a_completion(tiny_llama_container, monkeypatch):
    from server_fixtures import slow_steps

    with slow_steps(monkeypatch, 0.05), TestClient(create_app(config(tiny_llama_container, time_limit=0.4))) as c:
        o = c.post("/v1/query", json={"lql": "INFER 'x' GENERATE 100 EXACTLY; STATS"}).json()["results"]
        assert len(o) == 1 and o[0]["error"]["type"] == "TimeLimit" and "0.4 s" in o[0]["error"]["message"]
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 100, "temperature": 0})
        assert r.status_code == 504 and r.json()["error"]["type"] == "TimeLimit"


# ---- completions --------------------------------------------------------------------------------


def test_greedy_completion_is_infer_generate(client, tiny_llama_container):
    for prompt in ("Water boils", "The capital of France is", "def add(a, b):"):
        ids, text = greedy(tiny_llama_container, prompt, 12)
        r = client.post("/v1/completions", headers=AUTH,
                        json={"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0}).json()
        (choice,) = r["choices"]
        assert choice["text"] == text
        assert choice["finish_reason"] == ("length" if len(ids) == 12 else "stop")
        n_prompt = len(lql.connect(tiny_llama_container).execute_one(f"INFER {prompt!r} TOP 1").prompt.ids)
        assert r["usage"]["prompt_tokens"] == n_prompt
        assert r["usage"]["total_tokens"] == n_prompt + r["usage"]["completion_tokens"]


def test_token_prompt_and_draft_depth(client, tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    want = s.execute_one("INFER TOKENS (1, 40, 50) GENERATE 6 EXACTLY DRAFT DEPTH 2").generated_ids
    r = client.post("/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": [1, 40, 50], "max_tokens": 6,
                                                             "temperature": 0, "draft_depth": 2}).json()
    stop = set(s.catalog.eos_ids())
    cut = next((i for i, t in enumerate(want) if t in stop), len(want))
    assert r["choices"][0]["text"] == s.catalog.decode(want[:cut])
    r = client.post("/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "x", "draft_depth": 9})
    assert r.status_code == 400 and r.json()["error"]["type"] == "SliceError"


def test_speculate_equals_greedy(client):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0}
    plain = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]
    for depth, k in ((1, 4), (2, 3), (3, 1)):
        spec = client.post("/v1/completions", headers=AUTH,
                           json={**body, "speculate": {"depth": depth, "lookahead": k}}).json()["choices"][0]
        assert spec == plain
    r = client.post("/v1/completions", headers=AUTH, json={**body, "temperature": 0.7, "speculate": {"depth": 1}})
    assert r.status_code == 400 and "temperature 0" in r.json()["error"]["message"]


def test_sampling_with_a_seed_is_reproducible_and_top_p_narrows_to_greedy(client):
    body = {"model": "tiny", "prompt": "Water", "max_tokens": 12, "temperature": 1.5, "seed": 7}
    a = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    b = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    assert a == b
    others = {client.post("/v1/completions", headers=AUTH, json={**body, "seed": s}).json()["choices"][0]["text"]
              for s in range(8)}
    assert len(others) > 1  # a near-uniform random model: eight seeds do not all agree
    greedy_text = client.post("/v1/completions", headers=AUTH,
                              json={**body, "temperature": 0}).json()["choices"][0]["text"]
    nucleus = client.post("/v1/completions", headers=AUTH, json={**body, "top_p": 1e-9}).json()["choices"][0]["text"]
    assert nucleus == greedy_text  # the nucleus of the smallest p is the argmax alone


def test_sampling_follows_the_softmax():
    """pick() against a numpy rendering of the distribution: frequencies over many draws."""
    import numpy as np

    from lql.server.completions import pick

    logits = np.array([2.0, 1.0, 0.5, -1.0, 0.0], dtype=np.float32)
    rng = np.random.default_rng(0)
    draws = np.array([pick(logits, 0.8, 1.0, rng) for _ in range(20000)])
    p = np.exp(logits.astype(np.float64) / 0.8)
    p /= p.sum()
    freq = np.bincount(draws, minlength=5) / draws.size
    assert np.abs(freq - p).max() < 0.015
    draws = np.array([pick(logits, 1.0, 0.7, rng) for _ in range(5000)])
    q = np.exp(logits.astype(np.float64))
    q /= q.sum()  # 0.56 + 0.21 >= 0.7: the nucleus is tokens 0 and 1
    assert set(draws.tolist()) == {0, 1}
    assert abs((draws == 0).mean() - q[0] / (q[0] + q[1])) < 0.03


def test_stop_strings_cut_the_text(client):
    body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 24, "temperature": 0}
    full = client.post("/v1/completions", headers=AUTH, json=body).json()["choices"][0]["text"]
    assert len(full) > 6
    stop = full[3:5]
    cut = full[: full.index(stop)]
    for stream in (False, True):
        r = client.post("/v1/completions", headers=AUTH, json={**body, "stop": [stop, "\x00never"], "stream": stream})
        if stream:
            chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
            text = "".join(ch["choices"][0]["text"] for ch in chunks)
            finish = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == cut and finish == "stop"


def test_unsupported_fields_are_refused_by_name(client):
    for extra, word in (({"n": 17}, "'n'"), ({"n": 0}, "'n'"), ({"best_of": 3}, "'best_of'"), ({"suffix": "z"}, "'suffix'"),
                        ({"frobnicate": 1}, "'frobnicate'"), ({"temperature": 3}, "temperature"),
                        ({"prompt": ["a", "b"]}, "2 strings")):
        r = client.post("/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": "x", **extra})
        assert r.status_code == 400 and word in r.json()["error"]["message"], (extra, r.text)


def test_chat_needs_a_template(client):
    r = client.post("/v1/chat/completions", headers=AUTH,
                    json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]


def test_chat_completion_is_infer_chat(tiny_llama_container, tmp_path):
    path = chat_container(tiny_llama_container, tmp_path)
    s = lql.connect(path)
    r_local = s.execute_one("INFER 'Hello there' CHAT GENERATE 10")
    ids = list(r_local.generated_ids)
    if r_local.stopped_at is not None:
        ids = ids[:-1]
    with TestClient(create_app(config(path, model_id="chat"))) as c:
        r = c.post("/v1/chat/completions", json={"model": "chat", "max_tokens": 10, "temperature": 0,
                                                  "messages": [{"role": "user", "content": "Hello there"}]}).json()
    assert r["object"] == "chat.completion"
    assert r["choices"][0]["message"] == {"role": "assistant", "content": s.catalog.decode(ids)}
    assert r["usage"]["prompt_tokens"] == len(r_local.prompt.ids)


def test_sse_framing_and_stream_equals_non_stream(tiny_llama_container, tmp_path):
    path = chat_container(tiny_llama_container, tmp_path)
    with TestClient(create_app(config(path, model_id="chat"))) as c:
        body = {"model": "chat", "prompt": "Water boils at", "max_tokens": 12, "temperature": 0}
        whole = c.post("/v1/completions", json=body).json()
        r = c.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
        text = "".join(ch["choices"][0]["text"] for ch in chunks[:-1])
        assert text == whole["choices"][0]["text"]
        assert [ch["choices"][0]["finish_reason"] for ch in chunks[:-1]][-1] == whole["choices"][0]["finish_reason"]
        assert all(ch["choices"][0]["finish_reason"] is None for ch in chunks[:-2])

        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        whole = c.post("/v1/chat/completions", json={"model": "chat", "messages": msgs, "max_tokens": 8,
                                                      "temperature": 0}).json()
        r = c.post("/v1/chat/completions", json={"model": "chat", "messages": msgs, "max_tokens": 8, "temperature": 0,
                                                  "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
        text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
        assert text == whole["choices"][0]["message"]["content"]
        assert chunks[-1]["choices"][0]["delta"] == {} and chunks[-1]["choices"][0]["finish_reason"] is not None


def test_a_stream_that_fails_ends_with_an_error_event(tiny_llama_container, monkeypatch):
    from server_fixtures import slow_steps

    with slow_steps(monkeypatch, 0.05), TestClient(create_app(config(tiny_llama_container, time_limit=0.3))) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 100, "temperature": 0,
                                             "stream": True})
        events = sse_events(r.text)
        last = json.loads(events[-1])
        assert last["error"]["type"] == "TimeLimit" and "[DONE]" not in events


def test_server_environment_key_file_and_bind_refusals(tmp_path, tiny_llama_container):
    from lql.server.cli import UsageError, arg_parser, config_from_args

    def cfg(*argv):
        return config_from_args(arg_parser().parse_args([str(tiny_llama_container), *argv]))

    with pytest.raises(UsageError, match="without an API key"):
        cfg("--host", "0.0.0.0")
    assert cfg("--host", "0.0.0.0", "--insecure-no-key")[0].api_key is None
    assert cfg("--host", "::1")[0].api_key is None
    kf = tmp_path / "key"
    kf.write_text("s3cret\n")
    c, host, port = cfg("--host", "0.0.0.0", "--api-key-file", str(kf), "--port", "9")
    assert c.api_key == "s3cret" and (host, port) == ("0.0.0.0", 9)
    kf.write_text("\n")
    with pytest.raises(UsageError, match="empty"):
        cfg("--api-key-file", str(kf))
    with pytest.raises(UsageError, match="not a directory"):
        cfg("--data-dir", str(tmp_path / "nope"))
    c = cfg("--max-concurrent", "3", "--max-queue", "5", "--time-limit", "7", "--profile", "read-only")[0]
    assert (c.limits.max_concurrent, c.limits.max_queue, c.limits.time_limit, c.profile) == (3, 5, 7.0, "read-only")
    assert c.models[0].id == os.path.basename(str(tiny_llama_container)).replace(".vindex3", "")


def test_sessions_are_bounded_and_the_least_recently_used_is_evicted(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container, max_sessions=2))) as c:
        store = c.app.state.server.sessions

        def q(text, sid):
            return c.post("/v1/query", json={"lql": text}, headers={"X-Session-Id": sid})

        assert q("DRAFT DEPTH 2", "a").status_code == 200
        assert q("DRAFT DEPTH 3", "b").status_code == 200
        assert q("STATS", "a").status_code == 200  # a is now more recently used than b
        assert q("STATS", "c").status_code == 200  # a third: b, the least recently used, is evicted
        assert len(store) == 2 and store.evicted == 1
        assert q("INFER 'x' TOP 1", "a").json()["results"][0]["result"]["depth"] == 2  # a kept its state
        r = q("INFER 'x' TOP 1", "b")
        assert r.status_code == 410 and r.json()["error"]["type"] == "SessionEvicted"
        msg = r.json()["error"]["message"]
        assert "'b'" in msg and "least recently used" in msg and "--max-sessions" in msg
        r = q("INFER 'x' TOP 1", "b")  # told once; then a new, empty session (evicting c)
        assert r.status_code == 200 and r.json()["results"][0]["result"]["depth"] is None
        assert c.post("/v1/query", json={"lql": "STATS"}).status_code == 200  # no header: no kept session


def test_a_session_running_a_request_is_never_evicted():
    import asyncio
    from types import SimpleNamespace

    from lql.server import sessions as S

    S_new = S._new_session
    S._new_session = lambda host: object()
    try:
        store = S.SessionStore(ttl=60, max_sessions=1)
        host = SimpleNamespace(id="m")

        async def busy():
            a = store.get(host, "a")
            async with a.lock:  # a request runs in a: no room for b
                with pytest.raises(S.TooManySessions, match="every one is running a request"):
                    store.get(host, "b")
            assert store.get(host, "b") is not a  # idle again: a is evicted for b

        asyncio.run(busy())
        with pytest.raises(S.SessionEvicted):
            store.get(host, "a")
        # notes are bounded
        for i in range(20):
            store.get(host, f"s{i}")
        assert len(store._gone) <= 4 * store.max_sessions
    finally:
        S._new_session = S_new


def test_dir_serves_every_container_under_its_own_id(tiny_llama_container, containers, tmp_path):
    from lql.server.cli import arg_parser, config_from_args

    d = tmp_path / "models"
    d.mkdir()
    (d / "a.vindex3").symlink_to(tiny_llama_container)
    (d / "b.vindex3").symlink_to(containers("qwen3"))
    (d / "notes").mkdir()  # not a container: no index.json
    cfg = config_from_args(arg_parser().parse_args(["--dir", str(d)]))[0]
    assert [m.id for m in cfg.models] == ["a", "b"]
    with TestClient(create_app(cfg)) as c:
        data = c.get("/v1/models").json()["data"]
        assert [(m["id"], m["layers"]) for m in data] == [("a", 4), ("b", 4)]
        assert data[0]["digest"] != data[1]["digest"]
        r = c.post("/v1/query", json={"lql": "STATS"})
        assert r.status_code == 404 and "a, b" in r.json()["error"]["hint"]
        for mid in ("a", "b"):
            o = c.post("/v1/query", json={"lql": "STATS", "model": mid}).json()["results"][0]
            assert o["result"]["digest"] == next(m["digest"] for m in data if m["id"] == mid)
    with pytest.raises(Exception, match="holds no container"):
        config_from_args(arg_parser().parse_args(["--dir", str(d / "notes")]))


def test_the_server_holds_blas_at_one_thread_whatever_the_decode_count(tiny_llama_container, monkeypatch):
    """Large products split over VINDEX3_DECODE_THREADS themselves (vindex3.exec.engine.pass_threads)
    with BLAS at one thread; the server holds that count for its life so that workers entering and
    leaving the executor's limit at once never leave BLAS at another count mid-product."""
    from threadpoolctl import threadpool_info

    from vindex3.codecs import threads

    def blas_counts():
        return {i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"}

    monkeypatch.setenv("VINDEX3_DECODE_THREADS", "2")
    threads.set_count(None)
    try:
        with TestClient(create_app(config(tiny_llama_container))) as c:
            assert blas_counts() <= {1}
            r = c.post("/v1/query", json={"lql": "INFER 'The capital of France is' GENERATE 3", "model": "tiny"})
            assert r.status_code == 200, r.text
            assert blas_counts() <= {1}
    finally:
        monkeypatch.delenv("VINDEX3_DECODE_THREADS")
        threads.set_count(None)
