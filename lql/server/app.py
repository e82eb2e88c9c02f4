"""The ASGI application (Starlette): routes, bearer keys, body and concurrency limits, the one
error boundary, and the glue between the event loop and the models' worker threads.

Every failure leaves as JSON in LQL's one error shape, ``{"error": {type, message, hint, line,
column, expected}}`` (built by `lql.render.error_json`); /v1/query answers with one object per
statement exactly as ``lql --json`` prints them. An unexpected exception is logged here, with
its traceback, and the client gets ``internal error: ...`` naming the statement, status 500."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from .. import ast, errors, loop, render
from .. import results as R
from ..errors import LqlError, LqlSyntaxError
from ..parser import parse_one
from . import completions as C
from . import policy, service
from .config import ServerConfig
from .metrics import Measure, Metrics
from .models import ModelHost
from .sessions import SessionEvicted, SessionStore, TooManySessions
from .worker import JobContext, Stopped

log = logging.getLogger("lql.server")


# ---- refusals of a request, each with its HTTP status ----------------------------------


class Unauthorized(LqlError):
    """No key, or a wrong one, on a server that has a key."""


class BodyTooLarge(LqlError):
    """The request body is larger than --max-body-bytes."""


class ModelNotFound(LqlError):
    """The request names a model this server does not serve."""


class Busy(LqlError):
    """--max-concurrent requests are running and --max-queue are waiting."""


class TimeLimit(LqlError):
    """The request ran past --time-limit and was stopped."""


class NotFound(LqlError):
    """No such endpoint, or not with this method."""


class Gone(Exception):
    """The client disconnected before its request was read: there is no one to answer."""


# A bug in the server, lql or vindex3 (its traceback is in the server's log): the one class the
# statement loop's error boundary raises too, so that a statement's bug is a 500 here.
InternalError = errors.InternalError


_STATUS: dict[type, int] = {
    TooManySessions: 429, SessionEvicted: 410, Unauthorized: 401, BodyTooLarge: 413, ModelNotFound: 404, Busy: 429, TimeLimit: 504, NotFound: 404,
    InternalError: 500, C.RequestRefusal: 400, policy.LimitRefusal: 400, policy.ProfileRefusal: 403,
    policy.PathRefusal: 403,
}


def status_of(err: LqlError) -> int:
    for cls, code in _STATUS.items():
        if isinstance(err, cls):
            return code
    return 400


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(render.dumps_json(obj, indent=None), status_code=status, headers=headers,
                    media_type="application/json")


def error_body(err: LqlError) -> dict:
    return {"error": render.error_json(err, None)["error"]}


def error_response(err: LqlError, headers: dict[str, str] | None = None) -> Response:
    return json_response(error_body(err), status_of(err), headers)


def internal(e: BaseException, what: str) -> InternalError:
    """A bug as the client sees it: one line naming what failed (the traceback is logged)."""
    log.error("internal error in %s", what, exc_info=(type(e), e, e.__traceback__))
    return InternalError(render.internal_error_text(e, debug=True), statement=what)


def stopped_error(s: Stopped, limit: float) -> LqlError:
    if s.reason == "time limit":
        return TimeLimit(f"stopped: the request ran past this server's time limit of {limit:g} s",
                         hint="ask for less work (fewer tokens or statements), or start the server with a larger --time-limit")
    return TimeLimit(f"stopped: {s.reason}")


# ---- concurrency ------------------------------------------------------------------------


class Gate:
    """At most ``limit`` requests run model work at once; up to ``queue`` more wait in order;
    beyond that a request is refused at once (429 with Retry-After)."""

    def __init__(self, limit: int, queue: int, retry_after: int):
        self.limit, self.queue, self.retry_after = limit, queue, retry_after
        self.running = 0
        self._waiters: deque[asyncio.Future] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> Callable[[], None]:
        """Wait for a slot; returns the function that gives it back (safe to call twice)."""
        if self.running < self.limit and not self._waiters:
            self.running += 1
            return self._releaser()
        if len(self._waiters) >= self.queue:
            raise Busy(f"the server is busy: {self.running} requests are running and {len(self._waiters)} waiting "
                       f"(--max-concurrent {self.limit}, --max-queue {self.queue})",
                       hint=f"retry after {self.retry_after} s")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut in self._waiters:
                self._waiters.remove(fut)
            elif fut.done() and not fut.cancelled():
                self._release()  # the slot was handed over as we were cancelled: pass it on
            raise
        return self._releaser()

    def _releaser(self) -> Callable[[], None]:
        done = [False]

        def release() -> None:
            if not done[0]:
                done[0] = True
                self._release()

        return release

    def _release(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot passes to the next waiter; running stays
                return
        self.running -= 1


# ---- the server state -------------------------------------------------------------------


class Server:
    def __init__(self, config: ServerConfig, hosts: list[ModelHost] | None = None):
        self.config = config
        self.limits = config.limits
        self.hosts = {h.id: h for h in (hosts if hosts is not None else [ModelHost(m) for m in config.models])}
        self.sessions = SessionStore(config.limits.session_ttl, config.limits.max_sessions)
        self.gate = Gate(config.limits.max_concurrent, config.limits.max_queue, config.limits.retry_after)
        self.metrics = Metrics()
        self._blas = None
        self._public_pairs: list[tuple[str, str]] | None = None

    def host(self, model: Any) -> ModelHost:
        if model is None:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            raise ModelNotFound("this server serves several models; name one with \"model\"",
                                hint="models: " + ", ".join(sorted(self.hosts)))
        if not isinstance(model, str) or model not in self.hosts:
            raise ModelNotFound(f"this server does not serve a model {model!r}",
                                hint="models: " + ", ".join(sorted(self.hosts)))
        return self.hosts[model]

    def _served_names(self) -> list[tuple[str, str]]:
        """(server path, what a client sees instead), longest path first: each served
        container's directory is its model id; the data directory is the root of the relative
        paths statements name."""
        pairs: list[tuple[str, str]] = []
        for h in self.hosts.values():
            for p in {str(h.spec.path), str(h.container.path), str(Path(h.container.path).resolve())}:
                pairs.append((p, h.id))
        if self.config.data_dir is not None:
            for p in {str(self.config.data_dir), str(Path(self.config.data_dir).resolve())}:
                if p.strip("/"):  # a data directory of / would rewrite every path: left as it is
                    pairs.append((p.rstrip("/") + "/", ""))
                    pairs.append((p, "."))
        return sorted(pairs, key=lambda kv: -len(kv[0]))

    def public(self, obj: Any) -> Any:
        """``obj`` (a result or error as JSON data) with every server file path of a served
        container or the data directory replaced by the name a client knows it by: STATS and
        refusals over HTTP name a container by its model id, never by where it lives here."""
        pairs = self._public_pairs
        if pairs is None:
            pairs = self._public_pairs = self._served_names()

        def walk(v: Any) -> Any:
            if isinstance(v, str):
                for path, name in pairs:
                    if path in v:
                        v = v.replace(path, name)
                return v
            if isinstance(v, dict):
                return {k: walk(x) for k, x in v.items()}
            if isinstance(v, (list, tuple)):
                return [walk(x) for x in v]
            return v

        return walk(obj)

    def start(self) -> None:
        # Hold BLAS at the executor's small-pass thread count (one: large products split over
        # VINDEX3_DECODE_THREADS themselves, vindex3.exec.engine.pass_threads) for the server's
        # life: each model's worker enters and leaves the executor's own limit around small
        # passes, and two workers doing so at once through one process-wide control could
        # otherwise leave BLAS at another count while a split product runs. Parallelism on a
        # server comes from one worker per model instead.
        from threadpoolctl import threadpool_limits

        self._blas = threadpool_limits(limits=1, user_api="blas")
        for h in self.hosts.values():
            h.worker.start()

    def stop(self) -> None:
        for h in self.hosts.values():
            h.worker.stop()
        if self._blas is not None:
            self._blas.restore_original_limits()
            self._blas = None


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refused past ``limit`` bytes without reading the rest."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise BodyTooLarge(f"the request body is {int(size)} bytes, more than this server takes (--max-body-bytes is {limit})")
    chunks, n = [], 0
    seconds = request.app.state.server.limits.time_limit
    try:
        async with asyncio.timeout(seconds):  # a body sent a byte at a time does not hold the server
            async for chunk in request.stream():
                n += len(chunk)
                if n > limit:
                    raise BodyTooLarge(f"the request body is more than {limit} bytes (--max-body-bytes)")
                chunks.append(chunk)
    except TimeoutError:
        raise C.RequestRefusal(f"the request body did not arrive within {seconds:g} s (--time-limit)") from None
    except ClientDisconnect:  # the client went away mid-upload: nobody to answer, nothing to log as a bug
        raise Gone() from None
    try:
        return json.loads(b"".join(chunks) or b"null")
    except (ValueError, UnicodeDecodeError) as e:
        raise C.RequestRefusal(f"the request body is not JSON: {e}") from None
    except RecursionError:  # '[' * 200000: nesting deeper than a JSON reader recurses
        raise C.RequestRefusal("the request body nests arrays or objects too deeply to read",
                               hint="send a flat JSON object") from None


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            cancel.set()
            return


@contextlib.asynccontextmanager
async def watching(request: Request, cancel: threading.Event):
    """Sets ``cancel`` if the client disconnects while the block runs."""
    task = asyncio.ensure_future(_watch_disconnect(request, cancel))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


# ---- endpoints ----------------------------------------------------------------------------


def boundary(fn):
    """The one error boundary of an endpoint: refusals as JSON with their status, anything else
    an internal error (logged with its traceback; never sent)."""

    async def endpoint(request: Request) -> Response:
        try:
            return await fn(request)
        except Gone:  # answered to nobody (the connection is closed); not a bug, not logged as one
            return Response(status_code=499)
        except Busy as e:
            return error_response(e, {"Retry-After": str(request.app.state.server.limits.retry_after)})
        except LqlError as e:
            return error_response(e)
        except Exception as e:  # noqa: BLE001 - the boundary
            return error_response(internal(e, f"{request.method} {request.url.path}"))

    endpoint.__name__ = fn.__name__
    return endpoint


def _server(request: Request) -> Server:
    return request.app.state.server


@boundary
async def health(request: Request) -> Response:
    return json_response({"status": "ok"})


@boundary
async def models(request: Request) -> Response:
    srv = _server(request)
    return json_response({"object": "list", "data": [h.info for h in srv.hosts.values()]})


@boundary
async def model(request: Request) -> Response:
    return json_response(_server(request).host(request.path_params["model"]).info)


@boundary
async def model_stats(request: Request) -> Response:
    srv = _server(request)
    host = srv.host(request.path_params["model"])
    ss = srv.sessions.get(host, None)
    stmt = parse_one("STATS")
    result = await asyncio.wrap_future(host.worker.call(partial(loop.execute_statement, ss.session, stmt)))
    return json_response(srv.public(render.to_json(result)))


_QUERY_FIELDS = {"lql", "model"}


@boundary
async def query(request: Request) -> Response:
    srv = _server(request)
    body = await read_json(request, srv.limits.max_body_bytes)
    if not isinstance(body, dict):
        raise C.RequestRefusal('the request body must be a JSON object: {"lql": "...", "model": "..."}')
    extra = sorted(set(body) - _QUERY_FIELDS)
    if extra:
        raise C.RequestRefusal(f"field {extra[0]!r} is not part of a query", hint='a query is {"lql": "...", "model": "..."}')
    text = body.get("lql")
    if not isinstance(text, str):
        raise C.RequestRefusal('"lql" must be a string of LQL statements')
    host = srv.host(body.get("model"))
    sid = request.headers.get("x-session-id")
    ss = srv.sessions.get(host, sid)
    chunks = await anyio.to_thread.run_sync(lambda: list(loop.chunks(text)))
    count = sum(ch.statements for ch in chunks)  # a pipe a |> b is two statements
    if count > srv.limits.max_statements:
        raise policy.LimitRefusal(f"the request holds {count} statements, more than this server runs in one "
                                  f"request (--max-statements is {srv.limits.max_statements})")
    release = await srv.gate.acquire()
    results: list[dict] = []
    status = 200
    try:
        async with ss.lock:
            ctx = JobContext(deadline=time.monotonic() + srv.limits.time_limit)
            async with watching(request, ctx.cancel):
                for ch in chunks:
                    objs, internal_error = await asyncio.wrap_future(
                        host.worker.call(partial(_run_chunk, srv, ss.session, text, ch, ctx)))
                    results += objs
                    if internal_error:
                        status = 500
                    if not all(o["ok"] for o in objs):
                        break
            ss.last_used = time.monotonic()
    finally:
        release()
    headers = {"X-Session-Id": sid} if sid else None
    return json_response({"model": host.id, "session": sid, "results": srv.public(results)}, status, headers)


def _run_chunk(srv: Server, session, text: str, ch: loop.Chunk, ctx: JobContext) -> tuple[list[dict], bool]:
    """Parse one statement chunk and run what it holds, on the model's worker: the JSON object
    of each statement, stopping at the first failure; and whether a bug was met."""
    ref = R.StatementRef(kind=None, line=ch.line, column=ch.column, text=ch.text)
    try:
        stmts = loop.parse_or_internal(text, ch)
    except InternalError as e:
        err = internal(e.original if e.original is not None else e, ch.text).locate(ch.line, ch.column, ch.text)
        return [render.error_json(err, ref)], True
    except LqlSyntaxError as e:
        return [render.error_json(e, ref)], False
    out: list[dict] = []
    for stmt in stmts:
        obj, bug = _run_statement(srv, session, stmt, ctx)
        out.append(obj)
        if bug or not obj["ok"]:
            return out, bug
    return out, False


def _run_statement(srv: Server, session, stmt: ast.Statement, ctx: JobContext) -> tuple[dict, bool]:
    ref = R.StatementRef(kind=stmt.kind, line=stmt.line, column=stmt.column, text=stmt.source)

    def check(*_a) -> None:
        ctx.check()

    try:
        ctx.check()
        run = policy.check_statement(stmt, srv.config)
        session.on_token, session.on_progress = check, check
        session.writes_derived = srv.config.profile != "read-only"  # a read-only server writes nothing, derived data included
        session.memory_ceiling = srv.limits.memory_ceiling  # OPEN of a new container past it is refused (lql.prepared)
        try:
            out = loop.execute(session, run, before_run=lambda node: policy.check_plan(node, srv.limits))
        finally:
            session.on_token = session.on_progress = None
    except LqlError as e:  # the policy's refusal
        e.locate(stmt.line, stmt.column, stmt.source)
        return render.error_json(e, ref), False
    except Stopped as s:
        err = stopped_error(s, srv.limits.time_limit).locate(stmt.line, stmt.column, stmt.source)
        return render.error_json(err, ref), False
    except Exception as e:  # noqa: BLE001 - the boundary for a statement (the policy met a bug)
        err = internal(e, stmt.source).locate(stmt.line, stmt.column, stmt.source)
        return render.error_json(err, ref), True
    if isinstance(out.error, InternalError):  # the statement loop's boundary met a bug: logged with its traceback
        e = out.error
        err = internal(e.original if e.original is not None else e, stmt.source).locate(stmt.line, stmt.column, stmt.source)
        return render.error_json(err, ref), True
    if out.error is not None:
        return render.error_json(out.error, ref), False
    out.result.statement = ref
    return render.to_json(out.result), False


# ---- OpenAI-compatible completions ------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return b"data: " + render.dumps_json(obj, indent=None).encode("utf-8") + b"\n\n"


class EventStream:
    """A server-sent event stream whose producer is stopped the moment the client disconnects
    (``on_close`` runs in every case: it cancels the generation and frees the slot)."""

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]):
        self.events, self.on_close, self.headers = events, on_close, headers

    async def __call__(self, scope, receive, send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   (b"x-accel-buffering", b"no")] + [(k.lower().encode(), v.encode()) for k, v in self.headers.items()]
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:
                    while True:
                        msg = await receive()
                        if msg["type"] == "http.disconnect":
                            self.on_close()
                            tg.cancel_scope.cancel()
                            return

                tg.start_soon(watch)
                try:
                    await send({"type": "http.response.start", "status": 200, "headers": headers})
                    async for chunk in self.events:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except OSError:  # the client went away while we wrote
                    pass
                finally:
                    tg.cancel_scope.cancel()
        finally:
            self.on_close()
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]


async def _completion(request: Request, chat: bool) -> Response:
    srv = _server(request)
    body = await read_json(request, srv.limits.max_body_bytes)
    req = C.parse_request(C.ChatRequest if chat else C.CompletionRequest, body)
    host = srv.host(req.model)
    max_tokens = C.max_tokens_of(req, srv.limits, default=srv.limits.max_tokens if chat else 16)
    release = await srv.gate.acquire()
    try:
        gens, streams = await asyncio.wrap_future(host.worker.call(partial(_bind_generation, host, req, max_tokens, srv)))
    except BaseException:
        release()
        raise
    loop_ = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    cancel = threading.Event()  # one for every choice: a disconnect or a failure stops them all
    deadline = time.monotonic() + srv.limits.time_limit

    def put(item) -> None:
        loop_.call_soon_threadsafe(events.put_nowait, item)

    for i, (g, st) in enumerate(zip(gens, streams)):
        ctx = JobContext(deadline=deadline, cancel=cancel, emit=lambda ev, i=i: put(("event", i, ev)))
        host.worker.generate(C.run(host, g, ctx, st), ctx, lambda exc, i=i: put(("done", i, exc)), stream=st)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    model_id = host.id
    n = len(gens)

    def close() -> None:
        cancel.set()
        release()

    if req.stream:
        usage_wanted = bool(req.stream_options and req.stream_options.include_usage)
        gen = _stream_events(events, srv, chat, rid, created, model_id, usage_wanted, n, cancel)
        return EventStream(gen, close, {"X-Request-Id": rid})  # type: ignore[return-value]
    want_logprobs = gens[0].top_logprobs is not None
    texts, entries = [""] * n, [[] for _ in range(n)]
    finish: list[str | None] = [None] * n
    usages: list[dict | None] = [None] * n
    try:
        async with watching(request, cancel):
            left = n
            while left:
                kind, i, item = await events.get()
                if kind == "done":
                    if item is not None:
                        raise _as_error(item, srv)
                    left -= 1
                    continue
                texts[i] += item.get("delta", "")
                entries[i] += item.get("logprobs", ())
                if "finish_reason" in item:
                    finish[i], usages[i] = item["finish_reason"], item["usage"]
    finally:
        close()
    usage = _total_usage(usages)
    srv.metrics.usage(model_id, usage)
    choices = []
    for i in range(n):
        if chat:
            lp = _chat_logprobs(entries[i]) if want_logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": lp,
                            "finish_reason": finish[i]})
        else:
            lp = _completion_logprobs(entries[i], 0) if want_logprobs else None
            choices.append({"text": texts[i], "index": i, "logprobs": lp, "finish_reason": finish[i]})
    obj = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
           "model": model_id, "choices": choices, "usage": usage}
    return json_response(obj)


def _total_usage(usages: list[dict | None]) -> dict | None:
    """The usage of a request of n choices: the prompt once, the generated tokens of every choice."""
    got = [u for u in usages if u]
    if not got:
        return None
    prompt = got[0]["prompt_tokens"]
    completion = sum(u["completion_tokens"] for u in got)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _top_dict(top: list | None) -> dict[str, float] | None:
    """Alternatives keyed by their text, most probable first; two tokens with the same text
    (e.g. two halves of UTF-8 characters, both shown as U+FFFD) keep the more probable one."""
    if top is None:
        return None
    out: dict[str, float] = {}
    for _i, t, lp in top:
        out.setdefault(t, lp)
    return out


def _completion_logprobs(entries: list[dict], offset: int) -> dict:
    """The legacy completions shape: parallel lists; ``text_offset`` counts characters of the
    returned text from ``offset`` (the characters sent before these tokens). The chat shape
    (a list per position) keeps every alternative; this one is a dict keyed by text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e["token"])
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [_top_dict(e["top"]) for e in entries], "text_offset": offsets}


def _chat_logprobs(entries: list[dict]) -> dict:
    """The chat shape: one object per token, its alternatives as objects (bytes: the UTF-8 of
    the token's text)."""

    def one(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [{**one(e["token"], e["logprob"]), "top_logprobs": [one(t, lp) for _i, t, lp in e["top"]]}
                        for e in entries], "refusal": None}


def _as_error(exc: BaseException, srv: Server) -> LqlError:
    if isinstance(exc, Stopped):
        return stopped_error(exc, srv.limits.time_limit)
    if isinstance(exc, LqlError):
        return exc
    from ..binding import engine_refusal, is_engine_error

    if isinstance(exc, Exception) and is_engine_error(exc):
        return engine_refusal(exc)
    return internal(exc, "completion")


async def _stream_events(events: asyncio.Queue, srv: Server, chat: bool, rid: str, created: int, model_id: str,
                         usage_wanted: bool, n: int = 1, cancel: threading.Event | None = None) -> AsyncIterator[bytes]:
    """The chunks of ``n`` choices as their tokens come (each chunk names its choice's index);
    one usage chunk for all of them, if asked for; then [DONE]."""
    obj_kind = "chat.completion.chunk" if chat else "text_completion"
    sent = [0] * n  # characters of text sent so far per choice: the completions shape's text_offset

    def chunk(i: int, delta: str | None, finish: str | None, first: bool = False,
              entries: list[dict] | None = None) -> dict:
        if chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if delta is not None:
                d["content"] = delta
            choice = {"index": i, "delta": d, "logprobs": _chat_logprobs(entries) if entries else None,
                      "finish_reason": finish}
        else:
            lp = _completion_logprobs(entries, sent[i]) if entries else None
            choice = {"text": delta or "", "index": i, "logprobs": lp, "finish_reason": finish}
        sent[i] += len(delta or "")
        return {"id": rid, "object": obj_kind, "created": created, "model": model_id, "choices": [choice]}

    if chat:
        for i in range(n):
            yield _sse(chunk(i, "", None, first=True))
    usages: list[dict | None] = [None] * n
    left = n
    while left:
        kind, i, item = await events.get()
        if kind == "done":
            if item is not None:
                if cancel is not None:
                    cancel.set()  # the other choices stop too
                yield _sse(error_body(_as_error(item, srv)))
                return
            left -= 1
            continue
        delta = item.get("delta", "")
        entries = item.get("logprobs")
        if "finish_reason" in item:
            usages[i] = item["usage"]
            if delta or entries:
                yield _sse(chunk(i, delta, None, entries=entries))
            yield _sse(chunk(i, None if chat else "", item["finish_reason"]))
        elif delta or entries:
            yield _sse(chunk(i, delta, None, entries=entries))
    usage = _total_usage(usages)
    srv.metrics.usage(model_id, usage)
    if usage_wanted:
        yield _sse({"id": rid, "object": obj_kind, "created": created, "model": model_id, "choices": [],
                    "usage": usage})
    yield b"data: [DONE]\n\n"


def _bind_generation(host: ModelHost, req: C._Common, max_tokens: int, srv: Server) -> tuple[list[C.Generation], list]:
    """The request bound against its model, on the model's worker: token ids, a depth the
    model has (vindex3's SliceError otherwise), the end-of-sequence ids; one generation per
    choice (``n``; choice i samples with seed + i when a seed is given) and the stream each
    decodes in."""
    from ..binding import engine_refusal, is_engine_error

    try:
        if req.draft_depth is not None:
            host.catalog.bind_slice(req.draft_depth)
        if req.speculate is not None:
            host.catalog.bind_slice(req.speculate.depth)
        ids = C.prompt_ids(host.catalog, req, srv.limits)
    except Exception as e:
        if is_engine_error(e):
            raise engine_refusal(e) from None
        raise
    echo = None
    if isinstance(req, C.CompletionRequest) and req.echo:
        echo = req.prompt if isinstance(req.prompt, str) else (host.catalog.decode(ids) or "")
    gens = [C.Generation(ids=ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                         seed=C.choice_seed(req.seed, i), stops=C.stops_of(req), stop_ids=tuple(host.catalog.eos_ids()),
                         depth=req.draft_depth, speculate=req.speculate, top_logprobs=C.top_logprobs_of(req), echo=echo)
            for i in range(req.n)]
    return gens, [C.open_stream(host, g) for g in gens]


@boundary
async def completions(request: Request) -> Response:
    return await _completion(request, chat=False)


@boundary
async def chat_completions(request: Request) -> Response:
    return await _completion(request, chat=True)


# ---- tokenizer, embeddings, metrics ------------------------------------------------------


async def _on_worker(host: ModelHost, fn):
    """``fn()`` on the model's worker; vindex3's refusals (no tokenizer, ...) as typed refusals."""
    from ..binding import engine_refusal, is_engine_error

    try:
        return await asyncio.wrap_future(host.worker.call(fn))
    except Exception as e:
        if is_engine_error(e):
            raise engine_refusal(e) from None
        raise


async def _tokenizer_call(request: Request, model, fn) -> Response:
    """A /tokenize or /detokenize body validated as ``model`` and answered by ``fn(catalog, req)``
    on the model's worker."""
    srv = _server(request)
    req = C.validate(model, await read_json(request, srv.limits.max_body_bytes))
    host = srv.host(req.model)
    out = await _on_worker(host, partial(fn, host.catalog, req))
    return json_response({"model": host.id, **out})


@boundary
async def tokenize(request: Request) -> Response:
    return await _tokenizer_call(request, service.TokenizeRequest, service.tokenize)


@boundary
async def detokenize(request: Request) -> Response:
    return await _tokenizer_call(request, service.DetokenizeRequest, service.detokenize)


@boundary
async def embeddings(request: Request) -> Response:
    srv = _server(request)
    req = C.validate(service.EmbeddingRequest, await read_json(request, srv.limits.max_body_bytes))
    host = srv.host(req.model)
    service.inputs_of(req)  # refused before a slot is taken
    release = await srv.gate.acquire()
    try:
        ctx = JobContext(deadline=time.monotonic() + srv.limits.time_limit)
        async with watching(request, ctx.cancel):
            try:
                out = await _on_worker(host, partial(service.embed, host, req, srv.limits, ctx.check))
            except Stopped as s:
                raise stopped_error(s, srv.limits.time_limit) from None
    finally:
        release()
    srv.metrics.embedding_tokens[host.id] += out["usage"]["prompt_tokens"]
    return json_response(out)


@boundary
async def openapi(request: Request) -> Response:
    from .openapi import document

    return json_response(document(keyed=_server(request).config.api_key is not None))


@boundary
async def metrics(request: Request) -> Response:
    srv = _server(request)
    gauges = {
        "lql_requests_running": [({}, srv.gate.running)],
        "lql_requests_waiting": [({}, srv.gate.waiting)],
        "lql_generations_active": [({"model": h.id}, h.worker.active_generations) for h in srv.hosts.values()],
    }
    batches = {h.id: dict(h.worker.batches) for h in srv.hosts.values()}
    busy = {h.id: dict(h.worker.seconds) for h in srv.hosts.values()}
    return Response(srv.metrics.text(gauges, batches, busy), media_type="text/plain; version=0.0.4; charset=utf-8")


# ---- the application ------------------------------------------------------------------------


class KeyCheck:
    """Bearer keys: every path but /health and /v1/health needs ``Authorization: Bearer KEY`` when
    the server has a key (/metrics too: a scraper sends the key); compared in constant time."""

    OPEN_PATHS = ("/health", "/v1/health")

    def __init__(self, app, key: str | None):
        self.app = app
        self.key = key.encode("utf-8") if key else None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or self.key is None or scope.get("path") in self.OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        got = b""
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                got = value
                break
        scheme, _, token = got.partition(b" ")
        if not (scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)):
            err = Unauthorized("this server needs an API key: send Authorization: Bearer KEY" if not got
                               else "the API key is not valid for this server",
                               hint="the key is the one the server was started with (--api-key or --api-key-file)")
            resp = error_response(err, {"WWW-Authenticate": "Bearer"})
            await resp(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _http_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, HTTPException):
        what = f"{request.method} {request.url.path}"
        if exc.status_code == 405:
            return json_response(error_body(NotFound(f"{what}: this endpoint does not take {request.method}")), 405)
        return json_response(error_body(NotFound(f"{what}: no such endpoint",
                                                 hint="endpoints: /health, /metrics, /openapi.json, /tokenize, /detokenize, /v1/health, "
                                                      "/v1/models, /v1/models/{id}/stats, /v1/query, /v1/completions, "
                                                      "/v1/chat/completions, /v1/embeddings")),
                             exc.status_code)
    return error_response(internal(exc, f"{request.method} {request.url.path}"))


def create_app(config: ServerConfig, hosts: list[ModelHost] | None = None) -> Starlette:
    """The ASGI app serving ``config``'s models (opened now). Its lifespan starts the models'
    workers and holds BLAS threads; ``app.state.server`` is the `Server`."""
    server = Server(config, hosts)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.start()
        try:
            yield
        finally:
            server.stop()

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/embeddings", embeddings, methods=["POST"]),
        Route("/v1/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}/stats", model_stats, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/query", query, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error, Exception: _http_error})
    app.state.server = server
    app.add_middleware(KeyCheck, key=config.api_key)
    if config.cors_origins:  # outside the key check: a browser's preflight carries no key
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Session-Id"],
                           expose_headers=["X-Session-Id", "X-Request-Id", "Retry-After"], max_age=600)
    app.add_middleware(Measure, metrics=server.metrics)  # outermost: refused keys are counted too
    return app
