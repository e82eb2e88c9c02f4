"""What a server user expects day to day: log-probabilities equal to INFER's own TOP
probabilities (through the official `openai` client on a loopback server), echo, and the
service endpoints (/tokenize, /detokenize, /health, /v1/embeddings, /metrics)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from server_fixtures import chat_container, config, live_server, sse_events
from starlette.testclient import TestClient

import lql
from lql.server.app import create_app
from lql.statements.infer import top_candidates

# Both sides compute softmax in float64 from float32 logits; a generated position's logits are
# the server's one-token step against a reference prefill over the whole sequence, whose spread
# on this fixture measured max |dp| 5.8e-10 (two prompts, 8 tokens, top 5). The bound is 1e-5.
TOL = 1e-5


def _keyed(cands) -> dict[str, float]:
    """Candidates as the completions shape keys them: by text, the more probable of a pair kept."""
    out: dict[str, float] = {}
    for c in cands:
        out.setdefault(c.token, c.probability)
    return out


def _close(got: dict[str, float], cands) -> bool:
    want = _keyed(cands)
    return list(got) == list(want) and max(abs(np.exp(v) - want[t]) for t, v in got.items()) <= TOL


def _reference(container, ids: list[int], k: int):
    """INFER's top-k at every position of ``ids``: prefill over the whole sequence."""
    c = lql.connect(container)
    st = c.container.executor().start()
    logits = np.asarray(st.prefill(list(ids)))
    return [top_candidates(row, k, c.catalog.token_text) for row in logits]


@pytest.mark.numeric
def test_logprobs_equal_infer_top_through_the_openai_client(tiny_llama_container, tmp_path):
    openai = pytest.importorskip("openai", reason="SKIPPED LOUDLY: the openai client is a dev dependency")
    path = chat_container(tiny_llama_container, tmp_path)
    s = lql.connect(path)
    local = s.execute_one("INFER 'Water boils' TOP 5")
    with live_server(config(path, model_id="tiny")) as (url, _app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        r = client.completions.create(model="tiny", prompt="Water boils", max_tokens=6, temperature=0, logprobs=5)
        lp = r.choices[0].logprobs
        # the first generated position is INFER 'Water boils' TOP 5, candidate for candidate
        first = lp.top_logprobs[0]
        assert _close(first, local.top)
        assert lp.tokens[0] == local.top[0].token  # greedy picks the most probable
        assert lp.token_logprobs[0] == next(iter(first.values()))

        # chat: logprobs + top_logprobs in the chat shape, equal to INFER ... CHAT TOP 3
        local_chat = s.execute_one("INFER 'Say hi' CHAT TOP 3")
        rc = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                            max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
        content = rc.choices[0].logprobs.content
        assert len(content) >= 1
        alts = content[0].top_logprobs  # the chat shape is a list: every alternative, duplicates of text included
        assert [a.token for a in alts] == [c.token for c in local_chat.top]
        assert max(abs(np.exp(a.logprob) - c.probability) for a, c in zip(alts, local_chat.top)) <= TOL
        assert content[0].bytes == list(content[0].token.encode("utf-8"))

        stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi"}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True)
        streamed_chat = [e for ch in stream if ch.choices and ch.choices[0].logprobs
                         for e in ch.choices[0].logprobs.content]
        assert [(e.token, e.logprob) for e in streamed_chat] == [(e.token, e.logprob) for e in content]

        # a stream carries the same entries, token by token
        chunks = list(client.completions.create(model="tiny", prompt="Water boils", max_tokens=6, temperature=0,
                                                logprobs=5, stream=True))
        streamed = [t for ch in chunks if ch.choices[0].logprobs for t in ch.choices[0].logprobs.token_logprobs]
        assert streamed == lp.token_logprobs


@pytest.mark.numeric
def test_logprobs_at_every_position_and_echo(tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    prompt_ids = list(s.execute_one("INFER 'The capital of France is' TOP 1").prompt.ids)
    with TestClient(create_app(config(tiny_llama_container))) as c:
        body = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0,
                "logprobs": 3, "echo": True}
        r = c.post("/v1/completions", json=body).json()
        choice = r["choices"][0]
        plain = c.post("/v1/completions", json={**body, "echo": False, "logprobs": None}).json()["choices"][0]
    assert choice["text"] == "The capital of France is" + plain["text"]
    lp = choice["logprobs"]
    n = len(prompt_ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    gen_count = r["usage"]["completion_tokens"]
    assert len(lp["tokens"]) in (n + gen_count, n + gen_count - 1)  # an end-of-sequence token has no entry
    # greedy: each generated token is its position's most probable one
    gen_ids = []
    ref_prompt = _reference(tiny_llama_container, prompt_ids, 3)
    seq = list(prompt_ids)
    for i in range(n, len(lp["tokens"])):
        ref = _reference(tiny_llama_container, seq, 3)[-1]
        gen_ids.append(ref[0].id)
        seq.append(ref[0].id)
        assert _close(lp["top_logprobs"][i], ref)
        assert lp["tokens"][i] == ref[0].token
    # the prompt's own positions: the entry of token i is the distribution after tokens < i
    for i in range(1, n):
        ref = ref_prompt[i - 1]
        assert _close(lp["top_logprobs"][i], ref)
        assert lp["tokens"][i] == s.catalog.token_text(prompt_ids[i])
        full = _reference(tiny_llama_container, prompt_ids[:i], s.catalog.vocab)[-1]
        p_tok = next(cand.probability for cand in full if cand.id == prompt_ids[i])
        assert abs(np.exp(lp["token_logprobs"][i]) - p_tok) <= TOL
    assert s.catalog.decode(gen_ids) == plain["text"] or plain["finish_reason"] == "stop"
    offs = lp["text_offset"]
    assert offs[0] == 0 and all(b - a == len(t) for a, b, t in zip(offs, offs[1:], lp["tokens"]))


def test_echo_scores_the_prompt_with_no_tokens_and_refusals(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container))) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Water boils", "max_tokens": 0, "echo": True,
                                             "logprobs": 0})
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        assert ch["text"] == "Water boils" and ch["finish_reason"] == "length"
        assert ch["logprobs"]["top_logprobs"][1] == {}
        assert r.json()["usage"]["completion_tokens"] == 0
        for body, word in (({"max_tokens": 0}, "echo"), ({"logprobs": 21}, "logprobs"),
                           ({"logprobs": 2, "temperature": 0, "speculate": {"depth": 1}}, "speculate")):
            r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x", **body})
            assert r.status_code == 400 and word in r.json()["error"]["message"], (body, r.text)
        # streamed echo: the prompt text first
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "Water boils", "max_tokens": 3,
                                             "temperature": 0, "echo": True, "stream": True})
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        assert chunks[0]["choices"][0]["text"] == "Water boils"


# ---- tokenizer, embeddings, health, metrics ---------------------------------------------


def test_tokenize_detokenize_and_health_at_the_top(tiny_llama_container):
    s = lql.connect(tiny_llama_container)
    want = list(s.execute_one("INFER 'Water boils' TOP 1").prompt.ids)
    with TestClient(create_app(config(tiny_llama_container, api_key="k"))) as c:
        assert c.get("/health").json() == {"status": "ok"}  # no key needed, as /v1/health
        assert c.post("/tokenize", json={"prompt": "Water boils"}).status_code == 401
        auth = {"Authorization": "Bearer k"}
        r = c.post("/tokenize", headers=auth, json={"model": "tiny", "prompt": "Water boils"}).json()
        assert r == {"model": "tiny", "tokens": want, "count": len(want)}
        bare = c.post("/tokenize", headers=auth, json={"prompt": "Water boils", "add_special": False}).json()
        assert bare["tokens"] == s.catalog.tokenize("Water boils", special=False)
        r = c.post("/detokenize", headers=auth, json={"tokens": bare["tokens"]}).json()
        assert r == {"model": "tiny", "prompt": s.catalog.decode(bare["tokens"])}
        for path, body, word in (("/detokenize", {"tokens": [10**9]}, "outside the vocabulary"),
                                 ("/tokenize", {"prompt": "x", "special": True}, "'special'"),
                                 ("/tokenize", {"prompt": 3}, "'prompt'"),
                                 ("/tokenize", {"prompt": "x", "model": "nope"}, "nope")):
            r = c.post(path, headers=auth, json=body)
            assert r.status_code in (400, 404) and word in r.json()["error"]["message"], r.text


def test_embeddings_are_the_final_hidden_state(tiny_llama_container):
    openai = pytest.importorskip("openai", reason="SKIPPED LOUDLY: the openai client is a dev dependency")
    s = lql.connect(tiny_llama_container)
    texts = ["Water boils", "The capital of France is"]

    def hidden(text):
        st = s.container.executor().start()
        st.prefill(s.catalog.tokenize(text))
        return np.asarray(st.last_hidden)

    with live_server(config(tiny_llama_container)) as (url, _app):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
        r = client.embeddings.create(model="tiny", input=texts)  # the client asks for base64 and decodes it
        assert [d.index for d in r.data] == [0, 1]
        assert r.model_extra["pooling"] == "mean" and "before the final norm" in r.model_extra["hidden"]
        for d, t in zip(r.data, texts):
            h = hidden(t)
            # the same prefill on the same executor code: bit-identical
            assert np.array_equal(np.asarray(d.embedding, dtype=np.float32), h.mean(axis=0, dtype=np.float32))
        assert r.usage.prompt_tokens == sum(len(s.catalog.tokenize(t)) for t in texts)
        last = client.embeddings.create(model="tiny", input=texts[0], encoding_format="float",
                                        extra_body={"pooling": "last"})
        assert np.array_equal(np.asarray(last.data[0].embedding, dtype=np.float32), hidden(texts[0])[-1])
        with pytest.raises(openai.BadRequestError, match="dimensions"):
            client.embeddings.create(model="tiny", input="x", dimensions=8)


def test_metrics_count_a_known_request_sequence(tiny_llama_container):
    with TestClient(create_app(config(tiny_llama_container))) as c:
        for _ in range(2):
            assert c.post("/v1/completions", json={"prompt": "Water boils", "max_tokens": 3, "temperature": 0}).status_code == 200
        streamed = c.post("/v1/completions", json={"prompt": "Water boils", "max_tokens": 3, "temperature": 0,
                                                    "stream": True})
        assert streamed.status_code == 200
        assert c.post("/v1/completions", json={"prompt": "x", "n": 17}).status_code == 400
        c.post("/tokenize", json={"prompt": "Water boils"})
        c.post("/v1/embeddings", json={"input": "Water boils"})
        c.get("/v1/models/tiny")
        c.get("/v1/models/no/such/thing/at/all")
        r = c.get("/metrics")
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
    assert sse_events(streamed.text)[-1] == "[DONE]"
    lines = dict(ln.rsplit(" ", 1) for ln in text.splitlines() if ln and not ln.startswith("#"))
    assert lines['lql_requests_total{route="/v1/completions",method="POST",status="200"}'] == "3"
    assert lines['lql_requests_total{route="/v1/completions",method="POST",status="400"}'] == "1"
    assert lines['lql_requests_total{route="/tokenize",method="POST",status="200"}'] == "1"
    assert lines['lql_requests_total{route="/v1/models/{id}",method="GET",status="200"}'] == "1"
    assert lines['lql_requests_total{route="/v1/models/{id}",method="GET",status="404"}'] == "1"
    assert lines['lql_request_duration_seconds_count{route="/v1/completions"}'] == "4"
    assert lines['lql_request_duration_seconds_bucket{route="/v1/completions",le="+Inf"}'] == "4"
    s = lql.connect(tiny_llama_container)
    n_prompt = len(s.catalog.tokenize("Water boils"))
    assert lines['lql_prompt_tokens_total{model="tiny"}'] == str(3 * n_prompt)
    assert lines['lql_completion_tokens_total{model="tiny"}'] == "9"
    assert lines['lql_embedding_tokens_total{model="tiny"}'] == str(n_prompt)
    assert lines["lql_requests_running"] == "0" and lines["lql_requests_waiting"] == "0"
    assert lines['lql_generations_active{model="tiny"}'] == "0"
    # buckets are cumulative
    buckets = [int(v) for k, v in lines.items() if k.startswith('lql_request_duration_seconds_bucket{route="/v1/completions"')]
    assert buckets == sorted(buckets)
