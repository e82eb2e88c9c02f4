"""The HTTP transport: uvicorn with bounds on what a connection may hold before its request is
read. uvicorn times out idle keep-alive connections (``timeout_keep_alive``) and caps a
header's size (``h11_max_incomplete_event_size``), but waits for a request's headers forever; a
client that opens connections and sends nothing, or a byte a minute, would hold them. Here:

* ``header_timeout`` (default 10 s): a connection that has not sent a whole request head within
  it is closed (checked on uvicorn's own 0.1 s tick);
* ``timeout_keep_alive`` 5 s, ``h11_max_incomplete_event_size`` 16 KiB, ``limit_concurrency``
  (default 256 connections and tasks; beyond it uvicorn answers 503 at once);
* a request body must arrive within ``--time-limit`` (`lql.server.app.read_json`)."""

from __future__ import annotations

import time
import weakref

HEADER_TIMEOUT = 10.0
KEEP_ALIVE = 5
MAX_HEAD_BYTES = 16 * 1024
MAX_CONNECTIONS = 256


def server(app, host: str, port: int, *, log_level: str = "warning", header_timeout: float = HEADER_TIMEOUT,
           max_connections: int = MAX_CONNECTIONS, graceful: float = 5):
    """A uvicorn Server for ``app`` on ``host:port`` with the bounds above."""
    import uvicorn

    class BoundedServer(uvicorn.Server):
        def __init__(self, config):
            super().__init__(config)
            self._first_seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        async def on_tick(self, counter: int) -> bool:
            self.close_slow_heads()
            return await super().on_tick(counter)

        def close_slow_heads(self) -> int:
            """Close every connection that has held no whole request head for ``header_timeout``."""
            now, closed = time.monotonic(), 0
            for proto in list(self.server_state.connections):
                if getattr(proto, "cycle", None) is not None:  # a request was read (keep-alive is uvicorn's)
                    self._first_seen.pop(proto, None)
                    continue
                first = self._first_seen.setdefault(proto, now)
                transport = getattr(proto, "transport", None)
                if now - first > header_timeout and transport is not None and not transport.is_closing():
                    transport.close()
                    closed += 1
            return closed

    return BoundedServer(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_keep_alive=KEEP_ALIVE, h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                                        limit_concurrency=max_connections, timeout_graceful_shutdown=graceful))
