"""Several token streams of one executor advanced by one token each in one pass.

``step_many(streams, tokens)`` is ``[s.step(t) for s, t in zip(streams, tokens)]`` computed
together: the rows of the streams are stacked, and every op that treats rows independently and
keeps no state (norms, residual adds, a stateless FFN that does not report per call) runs once
over all of them, as does the readout (final norm and head); ops that keep state (a
recurrence) or report what each call read run once per stream on that stream's row, with its
state and position. Softmax attention runs in its stages (`split_ops`): the q/k/v projections
and the output projection once over all rows, and only the attention proper (rotary at the
stream's own position, over its own KV rows) per stream -- for all streams in one compiled call
when the decode kernels are on (``attend.rows``: vindex3.exec.ops.decode_many), one call per
stream otherwise or when a stream's attention refuses. The weights of the shared ops are
streamed from memory once per pass instead of once per stream, which is where a decode step's
time goes.

Bit-identical by construction, not by tolerance: at most `ROWS` rows go through one product,
the activation-row count up to which the codecs' rows kernels compute every row exactly as
they compute it alone (vindex3.codecs.f32.SMALL_T, RowWeight.small_t); norms reduce each row on
its own. More streams are cut into passes of `ROWS`. Each stream's state, position, trace
(executed layers, bytes touched, one step entry) and last hidden state end up exactly as its
own ``step`` leaves them; a pass's wall time is recorded in every stream it served.

`Prefetched` wraps a stream for a decode loop that does not know about batching
(vindex3.generate.generate_step): a scheduler computes the stream's next step in a batch,
stores the row, and the loop's own ``step(token)`` then returns it instead of running again.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import NonFiniteActivation, StateError, VindexError
from ..operators import FFN
from ..operators.base import distinct_bytes
from .engine import Executor, Stream, _small_pass_limit, _token_ids

__all__ = ["ROWS", "Prefetched", "prefetch", "row_wise_ops", "split_ops", "step_many"]

#: Rows per pass: the activation rows the codecs' rows kernels take while computing each row as
#: they would alone (larger products go to BLAS, whose sums depend on the row count).
ROWS = 8


def row_wise_ops(ex: Executor) -> dict[int, list[bool]]:
    """Per executed layer, per op: whether the op may run once over rows of several streams
    (a core op, or an FFN slot op that keeps no state and does not report per call)."""
    cached = getattr(ex, "_row_wise", None)
    if cached is not None:
        return cached
    out: dict[int, list[bool]] = {}
    for i, fns in ex._kernels:
        flags = []
        for fn, op in zip(fns, ex.plan.layers[i].ops):
            if op.operator is None:
                flags.append(True)
            else:
                flags.append(op.role == FFN and op.operator.new_state(op.params) is None
                             and not getattr(fn, "reports", True))
        out[i] = flags
    ex._row_wise = out
    return out


def split_ops(ex: Executor) -> dict[int, list[tuple | None]]:
    """Per executed layer, per op: for an op that keeps state per stream but whose kernel comes
    in stages (softmax attention: `vindex3.exec.ops.softmax`), ``(slot, bytes, (project, attend,
    output))``, the stages whose first and last treat rows independently; None otherwise."""
    cached = getattr(ex, "_split_ops", None)
    if cached is not None:
        return cached
    flags = row_wise_ops(ex)
    out: dict[int, list[tuple | None]] = {}
    for i, fns in ex._kernels:
        out[i] = [(op.role, distinct_bytes(op.operands), fn.stages)
                  if not together and getattr(fn, "stages", None) is not None else None
                  for fn, op, together in zip(fns, ex.plan.layers[i].ops, flags[i])]
    ex._split_ops = out
    return out


def _staged(staged, i: int, h: np.ndarray, x: np.ndarray, streams: list[Stream], live: list[int],
            touched: list[int], result: list) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """A staged op over the live rows: its projections once over all of them, its attention per
    stream (that stream's KV rows, at its own position; all streams in one call through
    ``attend.rows`` when it can), its output projection once over the rows that got through.
    Returns (h, x, live) for the rows that go on, None when none does."""
    slot, nb, (project, attend, output) = staged

    def shared_failure(e: Exception, rows: list[int]) -> None:
        err = e.at(i) if isinstance(e, NonFiniteActivation) else e
        for b in rows:
            result[b] = err

    try:
        q, k, v, gate = project(x)
    except Exception as e:  # noqa: BLE001 - a shared stage failed: every stream it served did
        shared_failure(e, live)
        return None
    rows = getattr(attend, "rows", None)
    if rows is not None:
        # every stream's attention in one call; its refusals (a stream's released KV rows, a
        # non-finite norm) come before any state changes, and the streams then attend one by
        # one, so that the refusal is the refusing stream's alone
        kvs = [streams[b].state.layers[i].ops.get(slot) for b in live]
        try:
            out = rows(q, k, v, gate, kvs, [streams[b].state.position for b in live])
        except (StateError, NonFiniteActivation):
            out = None
        except Exception as e:  # noqa: BLE001 - anything else failed the call every stream shared
            shared_failure(e, live)
            return None
        if out is not None:
            for b in live:
                touched[b] += nb
            try:
                y = output(out)
            except Exception as e:  # noqa: BLE001 - a shared stage failed: every stream it served did
                shared_failure(e, live)
                return None
            return h, y, live
    done = _per_stream(live, result, i, lambda r, b: attend(
        q[r:r + 1], k[r:r + 1], v[r:r + 1], None if gate is None else gate[r:r + 1],
        streams[b].state.layers[i].ops.get(slot), streams[b].state.position))
    if not done:
        return None
    kept, keep, heads = (list(t) for t in zip(*done))
    for b in keep:
        touched[b] += nb
    if len(kept) < len(live):
        h = h[kept]
    try:
        y = output(np.concatenate(heads, axis=0))
    except Exception as e:  # noqa: BLE001 - a shared stage failed: every stream it served did
        shared_failure(e, keep)
        return None
    return h, y, keep


def _per_stream(live: list[int], result: list, i: int, call) -> list[tuple[int, int, Any]]:
    """``call(r, b)`` for each live stream b (row r): (r, b, its value) for those that ran; a
    stream whose call fails gets its error in ``result`` (layer i named) and the others go on."""
    done = []
    for r, b in enumerate(live):
        try:
            done.append((r, b, call(r, b)))
        except NonFiniteActivation as e:
            result[b] = e.at(i)
        except Exception as e:  # noqa: BLE001 - this stream's failure; the others go on
            result[b] = e
    return done


def _check(streams: Sequence[Stream], tokens: Sequence[int]) -> Executor:
    if len(streams) != len(tokens):
        raise VindexError(f"step_many takes one token per stream; got {len(streams)} streams and {len(tokens)} tokens")
    if not streams:
        raise VindexError("step_many takes at least one stream")
    ex = streams[0].ex
    if len({id(s) for s in streams}) != len(streams):
        raise VindexError("step_many takes each stream once")
    for s in streams:
        if not isinstance(s, Stream) or s.ex is not ex:
            raise VindexError("step_many takes token streams of one executor")
        if s.observer is not None or s.edits is not None:
            raise VindexError("step_many takes streams without an observer or interventions (step them alone)")
    return ex


def step_many(streams: Sequence[Stream], tokens: Sequence[int]) -> list[np.ndarray | BaseException]:
    """Advance each stream by its token; per stream its logits row (float32 [vocab], the bytes
    ``stream.step(token)`` gives) or the exception its step raised (that stream is left where
    the failure found it, as a failed ``step`` leaves it; the others are unaffected unless the
    failure was in an op they shared, which fails them all)."""
    ex = _check(streams, tokens)
    out: list[np.ndarray | BaseException] = []
    for k in range(0, len(streams), ROWS):
        out += _pass(ex, list(streams[k:k + ROWS]), [int(t) for t in tokens[k:k + ROWS]])
    return out


def _pass(ex: Executor, streams: list[Stream], tokens: list[int]) -> list[np.ndarray | BaseException]:
    t0 = time.perf_counter()
    n = len(streams)
    result: list[np.ndarray | BaseException | None] = [None] * n
    live: list[int] = []
    rows = []
    for b, (s, tok) in enumerate(zip(streams, tokens)):
        try:
            held = s.state.position
            if ex.max_positions is not None and held + 1 > ex.max_positions:
                ex.check_positions(held + 1, "a pass of 1 position(s)" + (f" after {held} held" if held else ""))
            _token_ids([tok], ex.plan.vocab)
            rows.append(ex._embed([tok], held))
            live.append(b)
        except Exception as e:  # noqa: BLE001 - this stream's refusal, handed back as its result
            result[b] = e
    if not live:
        return result  # type: ignore[return-value]
    flags = row_wise_ops(ex)
    split = split_ops(ex)
    h = np.concatenate(rows, axis=0)  # [live, hidden]
    touched = [0] * n
    ran: list[int] = []
    with _small_pass_limit():
        x = h
        for i, fns in ex._kernels:
            for fn, together, staged in zip(fns, flags[i], split[i]):
                if together:
                    s0 = streams[live[0]]
                    try:
                        h, x, nb = fn(h, x, s0.state.layers[i], s0.state.position, False, s0.trace)
                    except Exception as e:  # noqa: BLE001 - a shared op failed: every stream it served did
                        err = e.at(i) if isinstance(e, NonFiniteActivation) else e
                        for b in live:
                            result[b] = err
                        return result  # type: ignore[return-value]
                    for b in live:
                        touched[b] += nb
                    continue
                if staged is not None:
                    out = _staged(staged, i, h, x, streams, live, touched, result)
                    if out is None:
                        return result  # type: ignore[return-value]
                    h, x, live = out
                    continue
                done = _per_stream(live, result, i, lambda r, b, fn=fn, h=h, x=x, i=i: fn(
                    h[r:r + 1], x[r:r + 1], streams[b].state.layers[i], streams[b].state.position, True,
                    streams[b].trace))
                if not done:
                    return result  # type: ignore[return-value]
                live = [b for _, b, _ in done]
                for b, (_, _, nb) in zip(live, (out for *_, out in done)):
                    touched[b] += nb
                h = np.concatenate([out[0] for *_, out in done], axis=0)
                x = np.concatenate([out[1] for *_, out in done], axis=0)
            bad = ~np.isfinite(h).all(axis=1)
            if bad.any():
                for r in np.flatnonzero(bad):
                    result[live[r]] = NonFiniteActivation(f"layer {i}: the residual leaving it holds NaN or infinity",
                                                          layer=i, site="residual_post")
                good = np.flatnonzero(~bad)
                if good.size == 0:
                    return result  # type: ignore[return-value]
                live = [live[r] for r in good]
                h, x = h[good], x[good]
            ran.append(i)
        logits = ex._logits(h)
    seconds = time.perf_counter() - t0
    for r, b in enumerate(live):
        s = streams[b]
        ends = ex._ends_bytes + (ex._row_bytes if ex._row_bytes else 0)
        s.state.position += 1
        s.last_hidden = h[r:r + 1]
        s.trace.executed_layers = list(ran)
        s.trace.step_seconds.append(seconds)
        s.trace.step_bytes.append(touched[b] + ends)
        s.trace.positions += 1
        ex._last = s
        result[b] = logits[r]
    return result  # type: ignore[return-value]


class Prefetched:
    """A token stream whose next ``step`` may already have been computed in a batch
    (`prefetch`): ``wants`` is the token its decode loop will feed next (set by the loop's
    driver, who knows it), None when unknown. ``step(token)`` returns the stored row when it was
    computed for that token, and runs the stream's own step otherwise; a stored row for another
    token is refused (the stream's state has already moved past it). Everything else is the
    stream's."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self.wants: int | None = None
        self._ready: tuple[int, np.ndarray | BaseException] | None = None

    @property
    def ex(self) -> Executor:
        return self.stream.ex

    @property
    def position(self) -> int:
        return self.stream.position

    @property
    def trace(self):
        return self.stream.trace

    @property
    def ready(self) -> bool:
        return self._ready is not None

    def close(self) -> None:
        """Let the stream go: a pending row is dropped, and the executor, which keeps the stream
        that ran last (for ``ex.trace``), forgets it if it is this one, so that its state (KV
        rows) is freed as soon as the caller drops it."""
        self._ready, self.wants = None, None
        if getattr(self.stream.ex, "_last", None) is self.stream:
            self.stream.ex._last = None

    def prefill(self, token_ids, last_only: bool = False) -> np.ndarray:
        if self._ready is not None:
            raise VindexError("a prefetched step is pending: feed its token before a prefill")
        return self.stream.prefill(token_ids, last_only)

    def step(self, token_id: int) -> np.ndarray:
        ready, self._ready = self._ready, None
        self.wants = None
        if ready is None:
            return self.stream.step(token_id)
        tok, row = ready
        if tok != int(token_id):
            raise VindexError(f"a step for token {tok} was prefetched, and the stream was fed {int(token_id)}")
        if isinstance(row, BaseException):
            raise row
        return row


def prefetch(streams: Sequence[Prefetched]) -> list[int]:
    """Compute the wanted step of every given stream that wants one and has none pending, in
    batches of streams that share an executor (`step_many`); returns the rows of each pass."""
    groups: dict[int, list[Prefetched]] = {}
    for p in streams:
        if p.wants is not None and p._ready is None and p.stream.observer is None and p.stream.edits is None:
            groups.setdefault(id(p.stream.ex), []).append(p)
    passes: list[int] = []
    for group in groups.values():
        rows = step_many([p.stream for p in group], [p.wants for p in group])
        for p, row in zip(group, rows):
            p._ready = (int(p.wants), row)
        passes += [min(ROWS, len(group) - k) for k in range(0, len(group), ROWS)]
    return passes
