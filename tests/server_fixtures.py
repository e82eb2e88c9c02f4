"""Helpers for the server tests: a configuration over test containers, the ASGI app in-process
(Starlette's TestClient), a real uvicorn server on a free loopback port (started and stopped
by the test, bounded in time), a tiny container that carries a chat template, and a way to
slow the model down so that a test can act while a generation runs."""

from __future__ import annotations

import contextlib
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("starlette", reason="SKIPPED LOUDLY: the server extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("uvicorn", reason="SKIPPED LOUDLY: the server extra is not installed (pip install -e '.[dev]')")
pytest.importorskip("httpx", reason="SKIPPED LOUDLY: httpx (Starlette's test client) is a dev dependency")

from lql.server.app import create_app
from lql.server.config import Limits, ModelSpec, ServerConfig

# A ChatML template in the subset lql.chat renders (the shape SmolLM2's own template has).
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def config(path: Path, *, model_id: str = "tiny", **kw) -> ServerConfig:
    limits = {k: kw.pop(k) for k in list(kw) if k in Limits.__dataclass_fields__}
    return ServerConfig(models=(ModelSpec(model_id, Path(path)),), limits=Limits(**limits), **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def live_server(cfg: ServerConfig, *, timeout: float = 20.0) -> Iterator[tuple[str, object]]:
    """A real uvicorn server on 127.0.0.1 in a thread of this process: (base URL, the app).
    Stopped when the block ends, within ``timeout`` seconds."""
    import uvicorn

    app = create_app(cfg)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    t = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        if not t.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        t.join(timeout)
        assert not t.is_alive(), "the test server did not stop"


def chat_container(src: Path, dest: Path) -> Path:
    """A copy of a container with a chat template beside its tokenizer."""
    out = dest / (Path(src).name.replace(".vindex3", "") + "-chat.vindex3")
    if not out.exists():
        shutil.copytree(src, out, symlinks=True)
        (out / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    return out


@contextlib.contextmanager
def slow_steps(monkeypatch, seconds: float) -> Iterator[dict]:
    """Every single-token step of every executor sleeps ``seconds`` first, and so does every
    batched pass of several streams' steps; counts the steps (a batched pass counts its rows)
    and the batched passes."""
    from vindex3.exec import batch, engine

    seen = {"steps": 0, "batched": 0}
    real = engine.Stream.step
    real_many = batch.step_many

    def step(self, token_id):
        seen["steps"] += 1
        time.sleep(seconds)
        return real(self, token_id)

    def step_many(streams, tokens):
        seen["steps"] += len(streams)
        seen["batched"] += 1
        time.sleep(seconds)
        return real_many(streams, tokens)

    monkeypatch.setattr(engine.Stream, "step", step)
    monkeypatch.setattr(batch, "step_many", step_many)
    yield seen


def sse_events(text: str) -> list[str]:
    """The data fields of a server-sent event stream, checking its framing: every event is one
    ``data: ...`` line followed by a blank line."""
    assert text.endswith("\n\n"), "an event stream ends with a blank line"
    events = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 1 and lines[0].startswith("data: "), f"not one data line: {block!r}"
        events.append(lines[0][len("data: "):])
    return events
