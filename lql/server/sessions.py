"""Server-side LQL sessions. A request with ``X-Session-Id: ID`` runs in the session kept under
(model, ID), created on first use and forgotten after ``--session-ttl`` seconds without a
request; its state (draft depth, settings, an OPENed container) carries from one request to
the next. A request without the header runs in a fresh session that ends with it.

A session's statements run on its model's worker thread, one request at a time (a second
request in the same session waits for the first)."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass, field

from ..errors import LqlError

SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class SessionRefusal(LqlError):
    """The X-Session-Id header is malformed."""


class TooManySessions(SessionRefusal):
    """--max-sessions sessions are live; a new one cannot be opened (429)."""


@dataclass
class ServerSession:
    session: object  # lql.Session
    model: str
    id: str | None
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class SessionStore:
    def __init__(self, ttl: float, max_sessions: int):
        self.ttl, self.max_sessions = ttl, max_sessions
        self._sessions: dict[tuple[str, str], ServerSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def sweep(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if now - s.last_used > self.ttl and not s.lock.locked()]:
            del self._sessions[key]

    def get(self, host, session_id: str | None) -> ServerSession:
        """The session for (model, id), new if there is none; a fresh one without an id."""
        self.sweep()
        if session_id is None:
            return ServerSession(_new_session(host), host.id, None)
        if not SESSION_ID.fullmatch(session_id):
            raise SessionRefusal("X-Session-Id must be 1-128 characters of letters, digits, '_', '.' or '-'")
        key = (host.id, session_id)
        s = self._sessions.get(key)
        if s is None:
            if len(self._sessions) >= self.max_sessions:
                raise TooManySessions(f"this server keeps at most {self.max_sessions} sessions, and all are in use",
                                     hint="retry later, or send requests without X-Session-Id")
            s = self._sessions[key] = ServerSession(_new_session(host), host.id, session_id)
        s.last_used = time.monotonic()
        return s


def _new_session(host):
    from ..session import Session

    s = Session()
    s.bind(host.container)
    # Prepared executors are shared by every session on the model: all of them run on its one
    # worker thread, so sharing is safe, and a session does not prepare the model again.
    s._executors = host.executors
    # and so is the model's Internals: feature metadata a read-only server builds (in memory, it
    # writes nothing) is kept for the next request instead of rebuilt by every one
    s.shared_internals = host.internals  # made on first use, on the worker thread
    return s
