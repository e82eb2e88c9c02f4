"""The client side of ``USE REMOTE 'http://host:port' [MODEL 'id']``, on the standard library
alone (an lql without the ``server`` extra can still talk to a server).

A remote-bound session sends each statement's text to ``POST /v1/query`` under its own
``X-Session-Id`` (so the server keeps its draft depth and settings between statements), padded
with the newlines and spaces that put it at its own line and column, so that positions in the
answer are the local ones. The answer is the JSON object ``lql --json`` prints; it is turned
back into the typed result (or error) it was rendered from, and rendered locally by the one
renderer: a statement run remotely prints exactly what it would print locally.

The key, when the server has one, comes from the environment (``LQL_API_KEY``), never from
the statement text: scripts and histories do not carry it."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
import uuid
from typing import Any

from .. import errors as E
from .. import results as R
from ..errors import LqlError

#: Seconds a client waits for one answer (a server stops a request at its own --time-limit).
TIMEOUT = 600.0
KEY_ENV = "LQL_API_KEY"


class RemoteError(LqlError):
    """A failure reported by (or on the way to) a server; ``kind`` is the server's error type
    (``Unauthorized``, ``Busy``, ``RemoteUnavailable``...), so JSON output names it as the
    server did."""

    def __init__(self, message: str, *, remote_kind: str, hint: str | None = None, line: int | None = None,
                 column: int | None = None, statement: str | None = None):
        super().__init__(message, hint=hint, line=line, column=column, statement=statement)
        self.remote_kind = remote_kind

    @property
    def kind(self) -> str:
        return self.remote_kind


def check_url(url: str) -> str:
    """The server's base URL, or a refusal naming what is wrong with it."""
    from ..errors import StatementError

    try:
        u = urllib.parse.urlsplit(url)
        u.port  # noqa: B018 - raises for a port that is not a number
    except ValueError as e:
        raise StatementError(f"USE REMOTE: {url!r} is not a URL ({e})") from None
    if any(c.isspace() or not c.isprintable() for c in url):
        raise StatementError(f"USE REMOTE: {url!r} holds a blank or a control character; a URL has none",
                             hint="e.g. USE REMOTE 'http://127.0.0.1:8088'")
    if u.scheme not in ("http", "https") or not u.hostname:
        raise StatementError(f"USE REMOTE takes an http:// or https:// URL with a host, got {url!r}",
                             hint="e.g. USE REMOTE 'http://127.0.0.1:8088'")
    if u.username or u.password or u.query or u.fragment:
        raise StatementError(f"USE REMOTE: {url!r} carries credentials, a query or a fragment",
                             hint=f"give the server's address only; a key goes in the {KEY_ENV} environment variable")
    return url.rstrip("/")


class Remote:
    """A session's binding to a server: its URL, the model, and the server-side session id."""

    def __init__(self, url: str, model: str | None = None, *, key: str | None = None, session_id: str | None = None):
        self.url = check_url(url)
        self.model = model
        self.key = key if key is not None else (os.environ.get(KEY_ENV) or None)
        self.session_id = session_id or uuid.uuid4().hex
        self.draft_depth: int | None = None  # as the server's last DRAFT DEPTH / DRAFT OFF answer said

    def __repr__(self) -> str:
        return f"Remote({self.url!r}, model={self.model!r})"

    # ---- HTTP -----------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None) -> Any:
        """One request; the JSON answer, or a `RemoteError` for a failure of any kind."""
        from vindex3 import jsonio

        data = None
        headers = {"Accept": "application/json", "X-Session-Id": self.session_id}
        if body is not None:
            data = json.dumps(body).encode("utf-8")
            headers["Content-Type"] = "application/json"
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        req = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                text = resp.read().decode("utf-8")
                status = resp.status
        except urllib.error.HTTPError as e:
            text = e.read().decode("utf-8", "replace")
            status = e.code
            retry = e.headers.get("Retry-After") if e.headers else None
            try:
                obj = jsonio.loads(text)
            except Exception:  # noqa: BLE001 - not our server's JSON
                obj = None
            if status == 500 and isinstance(obj, dict) and "results" in obj:
                return obj  # a statement met a bug on the server; its object says so
            err = obj.get("error") if isinstance(obj, dict) else None
            if isinstance(err, dict):
                hint = err.get("hint")
                if retry and not hint:
                    hint = f"retry after {retry} s"
                raise RemoteError(f"{self.url}: {err.get('message')}", remote_kind=str(err.get("type") or "RemoteError"),
                                  hint=hint) from None
            raise RemoteError(f"{self.url}{path}: HTTP {status} {e.reason}", remote_kind="RemoteError") from None
        except ValueError as e:  # http.client.InvalidURL and the like: urllib refused the URL itself
            raise RemoteError(f"cannot request {self.url}{path}: {e}", remote_kind="RemoteUnavailable") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise RemoteError(f"cannot reach {self.url}: {reason}", remote_kind="RemoteUnavailable",
                              hint="is `lql serve` running there?") from None
        try:
            return jsonio.loads(text)
        except Exception:  # noqa: BLE001
            raise RemoteError(f"{self.url}{path} answered HTTP {status} with something that is not JSON",
                              remote_kind="RemoteError") from None

    def models(self) -> list[dict]:
        return list(self.request("GET", "/v1/models").get("data", []))

    # ---- statements -------------------------------------------------------------------------

    def run_statement(self, stmt) -> R.Result:
        """Run one parsed statement on the server; its result, or the error it met, raised."""
        text = "\n" * (stmt.line - 1) + " " * (stmt.column - 1) + stmt.source
        answer = self.request("POST", "/v1/query", {"lql": text, "model": self.model})
        objs = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(objs, list) or len(objs) != 1:
            raise RemoteError(f"{self.url} answered a statement with {len(objs or [])} results instead of one",
                              remote_kind="RemoteError")
        result = result_from_json(objs[0])
        if result.kind == "draft":  # DRAFT DEPTH / DRAFT OFF set the depth the server now holds
            self.draft_depth = result.depth
        return result


def _result_classes() -> dict[str, type[R.Result]]:
    out: dict[str, type[R.Result]] = {}
    todo = list(R.Result.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        kind = cls.model_fields["kind"].default
        if isinstance(kind, str):
            out[kind] = cls
    return out


def result_from_json(obj: dict) -> R.Result:
    """The typed result a JSON object (``lql --json``'s shape) was rendered from; an error
    object is raised as the error it describes."""
    if not isinstance(obj, dict) or "ok" not in obj:
        raise RemoteError("the server answered with an object that is not a statement's result", remote_kind="RemoteError")
    if not obj["ok"]:
        raise error_from_json(obj)
    kind = obj.get("kind")
    cls = _result_classes().get(kind)
    if cls is None:
        raise RemoteError(f"the server answered with a result of kind {kind!r}, which this lql does not know",
                          remote_kind="RemoteError", hint="the server runs another version of lql")
    return cls.model_validate({**obj["result"], "kind": kind})


def error_from_json(obj: dict) -> LqlError:
    """An error object as an `LqlError`: LQL's own class when the type names one, else a
    `RemoteError` carrying the server's type."""
    err = obj.get("error") or {}
    stmt = obj.get("statement") or {}
    kw = {"hint": err.get("hint"), "line": err.get("line"), "column": err.get("column"), "statement": stmt.get("text")}
    kind = str(err.get("type") or "RemoteError")
    message = str(err.get("message"))
    cls = getattr(E, kind, None)
    if isinstance(cls, type) and issubclass(cls, LqlError) and cls not in (LqlError, E.LqlSyntaxError, E.EngineRefusal):
        return cls(message, **kw)
    from vindex3 import errors as VE

    engine = getattr(VE, kind, None)
    if isinstance(engine, type) and issubclass(engine, VE.VindexError):  # as a local run raises it
        err = E.EngineRefusal(message, engine_kind=kind, hint=kw["hint"])
        err.line, err.column, err.statement = kw["line"], kw["column"], kw["statement"]
        return err
    return RemoteError(message, remote_kind=kind, **kw)
