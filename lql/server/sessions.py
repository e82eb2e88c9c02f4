"""Server-side LQL sessions. A request with ``X-Session-Id: ID`` runs in the session kept under
(model, ID), created on first use and forgotten after ``--session-ttl`` seconds without a
request; its state (draft depth, settings, an OPENed container) carries from one request to
the next. A request without the header runs in a fresh session that ends with it.

At most ``--max-sessions`` are kept: a new session beyond it evicts the least recently used
one that no request is running in (when every one is busy, the new one is refused, 429). A
session forgotten for either reason leaves a note, so that its client's next request is told
by name (`SessionEvicted`, 410: the session's state is gone) instead of silently running in a
new, empty session; that request consumes the note, and the one after it starts afresh. Notes
are bounded (the most recent ``4 * --max-sessions``).

A session's statements run on its model's worker thread, one request at a time (a second
request in the same session waits for the first)."""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..errors import LqlError

SESSION_ID = re.compile(r"[A-Za-z0-9_.-]{1,128}")


class SessionRefusal(LqlError):
    """The X-Session-Id header is malformed."""


class TooManySessions(SessionRefusal):
    """--max-sessions sessions are live and every one is running a request; a new one cannot
    be opened (429)."""


class SessionEvicted(SessionRefusal):
    """The session this request names was forgotten (idle past --session-ttl, or evicted as
    the least recently used when --max-sessions was reached): its state is gone (410)."""


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
        # least recently used first
        self._sessions: OrderedDict[tuple[str, str], ServerSession] = OrderedDict()
        self._gone: OrderedDict[tuple[str, str], str] = OrderedDict()  # key -> why it was forgotten
        self.evicted = 0  # sessions evicted to make room (for /metrics and tests)
        self.expired = 0  # sessions forgotten after their idle time

    def __len__(self) -> int:
        return len(self._sessions)

    def _forget(self, key: tuple[str, str], why: str) -> None:
        del self._sessions[key]
        self._gone[key] = why
        self._gone.move_to_end(key)
        while len(self._gone) > 4 * self.max_sessions:
            self._gone.popitem(last=False)

    def sweep(self) -> None:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if now - s.last_used > self.ttl and not s.lock.locked()]:
            self._forget(key, f"it was idle for more than {self.ttl:g} s (--session-ttl)")
            self.expired += 1

    def get(self, host, session_id: str | None) -> ServerSession:
        """The session for (model, id), new if there is none; a fresh one without an id. A
        request naming a session that was forgotten is refused once, by name."""
        self.sweep()
        if session_id is None:
            return ServerSession(_new_session(host), host.id, None)
        if not SESSION_ID.fullmatch(session_id):
            raise SessionRefusal("X-Session-Id must be 1-128 characters of letters, digits, '_', '.' or '-'")
        key = (host.id, session_id)
        s = self._sessions.get(key)
        if s is None:
            why = self._gone.pop(key, None)
            if why is not None:
                raise SessionEvicted(f"session {session_id!r} was forgotten: {why}; its state (draft depth, settings, "
                                     "an OPENed container) is gone",
                                     hint="send the request again to start the session afresh, and set its state again")
            if len(self._sessions) >= self.max_sessions:
                idle = next((k for k, v in self._sessions.items() if not v.lock.locked()), None)
                if idle is None:
                    raise TooManySessions(f"this server keeps at most {self.max_sessions} sessions, and every one is "
                                          "running a request", hint="retry later, or send requests without X-Session-Id")
                self._forget(idle, f"it was the least recently used of {self.max_sessions} sessions (--max-sessions) "
                                   "when another one started")
                self.evicted += 1
            s = self._sessions[key] = ServerSession(_new_session(host), host.id, session_id)
        self._sessions.move_to_end(key)
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
