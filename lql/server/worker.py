"""One worker thread per model: the only thread that touches that model's container, its
executors, its tokenizer and the LQL sessions bound to it.

Why a thread per model, and one: an executor is not safe to run from two threads at once
(it remembers the stream that ran last, and it holds BLAS at one thread around small passes
through a process-wide control), and numpy releases the GIL inside matrix products, so the
event loop stays free while a model computes. The worker serializes everything on its model
and interleaves the generations it runs *token by token*: each active generation advances by
one step per round, so sixteen streams on one model all make progress, and a cancelled or
timed-out generation is dropped at its next step. One-shot calls (an LQL statement, STATS for
/v1/models/{id}/stats) run whole, between two rounds.

Batching: a generation may hand the worker its stream (a `vindex3.exec.batch.Prefetched`).
At the start of a round, the next decode step of every generation whose stream says which
token it will feed (``wants``) is computed in one batched pass per executor
(`vindex3.exec.batch.prefetch`: up to 8 rows per pass, each row the bytes of its lone step);
the round then advances every generation, whose own step picks up its row. Prefills, the
first step of a generation and anything a lone stream is left to do run as before.

Work arrives from the event loop through a queue; results go back through futures (calls) or
an ``emit`` callback the event loop gave (generations), which must be thread-safe."""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("lql.server")


class Stopped(BaseException):
    """Raised inside model work to stop it: the client went away or the time limit passed.
    A BaseException so that no ``except Exception`` in a command or in vindex3 swallows it."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason  # "disconnect" | "time limit"


@dataclass
class JobContext:
    """What a piece of model work may ask: whether to stop (``check``), and how to send an
    event to its request at once (``emit``, for work that produces events from a callback)."""

    deadline: float  # time.monotonic() past which the work is stopped
    cancel: threading.Event = field(default_factory=threading.Event)
    emit: Callable[[Any], None] = lambda ev: None

    def check(self) -> None:
        if self.cancel.is_set():
            raise Stopped("disconnect")
        if time.monotonic() > self.deadline:
            raise Stopped("time limit")


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


@dataclass
class _Gen:
    gen: Iterator[Any]
    ctx: JobContext
    done: Callable[[BaseException | None], None]  # called once: None when the generator ended
    stream: Any = None  # a vindex3.exec.batch.Prefetched the worker may compute steps of, in batches


_STOP = object()


class ModelWorker:
    def __init__(self, name: str):
        self.name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._active: deque[_Gen] = deque()
        self._thread = threading.Thread(target=self._run, name=f"lql-model-{name}", daemon=True)
        self._started = False
        self._generations = 0  # admitted and not finished (a job being stepped is out of _active)
        # batched passes by the number of rows they computed (what /metrics shows as batch sizes)
        self.batches: dict[int, int] = {}
        # seconds the thread spent on each kind of work (/metrics): batched passes, generation
        # steps (prefills, lone steps and picking up a batched row) and one-shot calls
        self.seconds: dict[str, float] = {"batched": 0.0, "steps": 0.0, "calls": 0.0}

    def start(self) -> None:
        """Start the thread (idempotent; called by the server's lifespan, or on first use)."""
        if not self._started:
            self._started = True
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        if self._started:
            self._q.put(_STOP)
            self._thread.join(timeout)

    @property
    def active_generations(self) -> int:
        """Generations admitted to the worker and not yet finished."""
        return self._generations

    # ---- submitting work (from any thread) ------------------------------------------------

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run ``fn()`` on the worker, whole; its result or exception on the future."""
        self.start()
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put(_Call(fn, fut))
        return fut

    def generate(self, gen: Iterator[Any], ctx: JobContext, done: Callable[[BaseException | None], None],
                 stream: Any = None) -> None:
        """Advance ``gen`` one step per round, ``ctx.emit`` each value it yields; then
        ``done(None)``, or ``done(exc)`` when it raised or was stopped (`Stopped`). ``stream``:
        the generation's `vindex3.exec.batch.Prefetched`, whose wanted steps the worker computes
        in batches with other generations'."""
        self.start()
        self._q.put(_Gen(gen, ctx, done, stream))

    # ---- the thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._q.get(block=not self._active)
            except queue.Empty:
                item = None
            while item is not None:
                if item is _STOP:
                    for job in self._active:
                        self._finish(job, Stopped("shutdown"))
                    self._active.clear()
                    return
                if isinstance(item, _Call):
                    t0 = time.perf_counter()
                    self._run_call(item)
                    self.seconds["calls"] += time.perf_counter() - t0
                else:
                    self._generations += 1
                    self._active.append(item)
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    item = None
            t0 = time.perf_counter()
            self._prefetch()
            t1 = time.perf_counter()
            for _ in range(len(self._active)):
                job = self._active.popleft()
                if self._step(job):
                    self._active.append(job)
            self.seconds["batched"] += t1 - t0
            self.seconds["steps"] += time.perf_counter() - t1

    def _prefetch(self) -> None:
        """The wanted next steps of the active generations, batched (nothing for fewer than two:
        a lone stream steps itself)."""
        streams = [job.stream for job in self._active if job.stream is not None and job.stream.wants is not None
                   and not job.stream.ready and not job.ctx.cancel.is_set()]
        if len(streams) < 2:
            return
        from vindex3.exec.batch import prefetch

        try:
            passes = prefetch(streams)
        except Exception:  # refused before any work (step_many checks first): each stream steps alone
            log.exception("a batched step was refused; the generations step alone")
            return
        for rows in passes:
            self.batches[rows] = self.batches.get(rows, 0) + 1

    @staticmethod
    def _run_call(call: _Call) -> None:
        if not call.future.set_running_or_notify_cancel():
            return
        try:
            call.future.set_result(call.fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting request as it is
            call.future.set_exception(e)

    def _step(self, job: _Gen) -> bool:
        """One step of a generation; False when it is over."""
        try:
            job.ctx.check()
            ev = next(job.gen)
        except StopIteration:
            self._finish(job, None)
            return False
        except BaseException as e:  # noqa: BLE001 - Stopped, a refusal, or a bug: the request reports it
            self._finish(job, e)
            return False
        try:
            job.ctx.emit(ev)
        except Exception:  # noqa: BLE001 - the request is gone; drop the generation
            self._finish(job, Stopped("disconnect"))
            return False
        return True

    def _finish(self, job: _Gen, exc: BaseException | None) -> None:
        self._generations -= 1
        try:
            job.gen.close()  # type: ignore[attr-defined]
        except BaseException:
            log.exception("closing a generation failed")
        job.stream = None  # the thread's last-job variable must not keep a stream's state alive
        try:
            job.done(exc)
        except Exception:
            log.exception("reporting the end of a generation failed")
