"""lql serve on the default model (SmolLM2-135M-Instruct): with no path the server serves it,
and a chat completion through its own chat template is what transformers generates greedily
from the same GGUF (the independent oracle), streamed or not."""

from __future__ import annotations

import json

import pytest
from server_fixtures import sse_events
from starlette.testclient import TestClient

from lql.server.app import create_app
from lql.server.cli import arg_parser, config_from_args


@pytest.mark.slow
def test_default_model_chat_equals_transformers_greedy(smollm2_container, smollm2_reference):
    import torch

    config, host, port = config_from_args(arg_parser().parse_args([]))  # no path: the default model
    (spec,) = config.models
    assert spec.default_model and spec.path == smollm2_container and spec.id == "smollm2-135m-instruct"
    assert (host, port) == ("127.0.0.1", 8088)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    with TestClient(create_app(config)) as c:
        info = c.get("/v1/models").json()["data"][0]
        assert info["layers"] == 30 and info["chat_template"] is True and info["default_model"] is True
        body = {"model": spec.id, "messages": messages, "max_tokens": 12, "temperature": 0}
        r = c.post("/v1/chat/completions", json=body).json()
        streamed = c.post("/v1/chat/completions", json={**body, "stream": True}).text
        host_ = c.app.state.server.hosts[spec.id]
        # the prompt ids the server used: its chat template through the container's tokenizer
        from lql import chat

        rendered = chat.render(host_.catalog.chat_template(), messages, add_generation_prompt=True,
                               **host_.catalog.special_tokens())
        ids = host_.catalog.tokenize(rendered, special=False)
        assert r["usage"]["prompt_tokens"] == len(ids)
        with torch.no_grad():
            out = smollm2_reference.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                                             eos_token_id=list(host_.catalog.eos_ids()), pad_token_id=0)
        new = [int(t) for t in out[0, len(ids):]]
        eos = set(host_.catalog.eos_ids())
        cut = next((i for i, t in enumerate(new) if t in eos), len(new))
        want = host_.catalog.decode(new[:cut])
        assert r["choices"][0]["message"]["content"] == want
        assert "Paris" in want
        chunks = [json.loads(e) for e in sse_events(streamed)[:-1]]
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks) == want
