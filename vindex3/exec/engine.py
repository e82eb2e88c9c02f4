"""The executor: prepares a slice's operands from a tensor source (counting every read), binds
each op once (core ops here, slot ops through their operator), and runs batch prefill and
single-position steps in streams, each with its own continuation state and trace. It knows the
layer skeleton and the operator interface, never an operator's kind nor a model family.

    ex = Executor(op_plan, tensor_source, Full())     # Container.executor() builds this
    st = ex.start()                                    # a token stream (a hidden stream for a LayerRange)
    st.prefill(ids); st.step(tok); st.trace; st.last_hidden
"""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol

import numpy as np

from .. import codecs
from ..codecs import Weight
from ..errors import SliceError, StateError, UnsupportedOperator
from ..operators import ARRAY
from ..opplan import Op, OperandRef, OpPlan
from .ops.norm import make_weight, rms_norm
from .slice import ExecutionSlice, LayerRange, plan_slice
from .state import ContinuationState, LayerState
from .trace import ExecutionTrace

F32 = np.float32

# Small passes (decode steps, short prompts) are matrix-vector work: one BLAS thread does them
# as fast as two on a quiet machine and many times faster on a busy one, where spinning BLAS
# workers fight other processes for the cores. Large prefills keep BLAS's own thread count.
SMALL_PASS = 16
_threads: dict = {}


def _small_pass_limit():
    """A context that holds BLAS at VINDEX3_DECODE_THREADS (default 1) threads."""
    if "ctl" not in _threads:
        import os

        from threadpoolctl import ThreadpoolController

        _threads["ctl"] = ThreadpoolController()
        _threads["n"] = int(os.environ.get("VINDEX3_DECODE_THREADS", "1"))
    return _threads["ctl"].limit(limits=_threads["n"], user_api="blas")


def decode_threads() -> int:
    """BLAS threads that decode-sized passes (≤ SMALL_PASS positions) run with."""
    with _small_pass_limit():
        counts = [i["num_threads"] for i in _threads["ctl"].info() if i.get("user_api") == "blas"]
    return max(counts) if counts else _threads["n"]


class TensorSource(Protocol):
    """Where an executor reads operands from (a container's segments, a shard's, ...)."""

    def weight(self, ref: OperandRef) -> Weight: ...


class PreparedOperands:
    """Only the slice's tensors, as weight objects over the source's bytes. Every operand
    reference resolved counts as one read; bytes count each distinct tensor once, at its stored
    (encoded) size."""

    def __init__(self, source: TensorSource):
        self._source = source
        self._cache: dict[str, Weight] = {}
        self.reads = 0
        self.bytes = 0
        self.read_log: list[str] = []

    def weight(self, ref: OperandRef) -> Weight:
        self.reads += 1
        self.read_log.append(ref.label)
        w = self._cache.get(ref.label)
        if w is None:
            w = self._source.weight(ref)
            self._cache[ref.label] = w
            self.bytes += ref.nbytes
        return w

    def array(self, ref: OperandRef) -> np.ndarray:
        """The operand whole, as float32 (norm weights, biases, small operands)."""
        return self.weight(ref).dense()


# A bound op: (h residual, x current activation, layer state, first position, one position?) -> (h, x)
OpFn = Callable[[np.ndarray, np.ndarray, LayerState, int, bool], tuple[np.ndarray, np.ndarray]]


def _bind_core(op: Op, W: PreparedOperands) -> OpFn:
    if op.kind == "rms_norm":
        weight = make_weight(W.array(op.operands["weight"]), op.params.weight_offset)
        eps = F32(op.params.eps)
        return lambda h, x, ls, p0, one: (h, rms_norm(h, weight, eps))
    if op.kind == "residual_add":
        m = F32(op.params.multiplier)
        if m == 1:
            return lambda h, x, ls, p0, one: (h + x, x)
        return lambda h, x, ls, p0, one: (h + x * m, x)
    raise UnsupportedOperator(f"core op {op.kind!r} has no executor")


def _bind_slot(op: Op, W: PreparedOperands) -> OpFn:
    kinds = {r.name: r.kind for r in op.operator.roles(op.params)}
    operands = {role: (W.array(ref) if kinds.get(role) == ARRAY else W.weight(ref)) for role, ref in op.operands.items()}
    kernel = op.operator.bind(op.params, operands)
    slot = op.role
    prefill, step = kernel.prefill, kernel.step

    def run(h, x, ls, p0, one):
        return h, (step if one else prefill)(x, ls.ops.get(slot), p0)

    return run


def _preflight(plan: OpPlan, layers: list[int], refs: list[OperandRef]) -> None:
    """Refuse by name, before reading anything, what this slice cannot execute."""
    for i in layers:
        for op in plan.layers[i].slot_ops():
            if op.operator is None:
                from ..operators import registered

                runnable = ", ".join(n for n, _ in registered())
                what = "operator" if op.role == "mixer" else f"{op.role} kind"
                raise UnsupportedOperator(
                    f"layer {i}: {what} {op.kind!r} has no executor in this build (executable operators: {runnable})"
                )
    for ref in refs:
        codecs.get(ref.dtype, what=f"operand {ref.label}")


class Executor:
    """Prepared once per slice; runs any number of streams.

    Every stream is limited to ``max_positions`` positions (prompt and generation together): the
    graph's context length by default, or an explicit override (which may exceed it). A graph
    that records no context length sets no limit unless one is given. A pass that would go past
    the limit is refused before any work (`ContextLengthExceeded`); `check_positions` asks the
    same question up front."""

    def __init__(self, plan: OpPlan, source: TensorSource, sl: ExecutionSlice, *, max_positions: int | None = None):
        from ..limits import context_limit

        self.plan = plan
        self.slice = sl
        self.max_positions, self.limit_source = context_limit(plan.context_length, max_positions)
        self.slice_plan = plan_slice(plan, sl)
        self.layers = self.slice_plan.executed_layers
        _preflight(plan, self.layers, self.slice_plan.operands)
        t0 = time.perf_counter()
        W = PreparedOperands(source)
        self.has_ends = self.slice_plan.has_ends
        if self.has_ends:
            self._emb = W.weight(plan.embedding.operands["weight"])
            self._emb_mult = F32(plan.embedding.params.multiplier)
            fn = plan.final_norm
            self._fn_w = make_weight(W.array(fn.operands["weight"]), fn.params.weight_offset)
            self._fn_eps = F32(fn.params.eps)
            hd = plan.head
            self._head = W.weight(hd.operands["weight"])
            self._head_mult = F32(hd.params.multiplier)
            self._softcap = hd.params.softcap
        self._kernels: list[tuple[int, list[OpFn]]] = [
            (i, [(_bind_slot(op, W) if op.operator is not None else _bind_core(op, W)) for op in plan.layers[i].ops])
            for i in self.layers
        ]
        self.prepared = W
        self.prepare_seconds = time.perf_counter() - t0
        self.operand_reads = W.reads
        self.bytes_read = W.bytes
        self._last: _StreamBase | None = None

    # -- state -------------------------------------------------------------------------------
    def new_state(self) -> ContinuationState:
        layers = {}
        for i in self.layers:
            lo = self.plan.layers[i]
            ops = {op.role: s for op in lo.slot_ops() if (s := op.operator.new_state(op.params)) is not None}
            layers[i] = LayerState(i, lo.geometry, ops)
        return ContinuationState(layers)

    def new_trace(self) -> ExecutionTrace:
        return ExecutionTrace(prepare_seconds=self.prepare_seconds, operand_reads=self.operand_reads,
                              bytes_read=self.bytes_read)

    @property
    def trace(self) -> ExecutionTrace:
        """The trace of the stream that ran last (after ``forward(ids)``: that forward's)."""
        return self._last.trace if self._last is not None else self.new_trace()

    @property
    def last_hidden(self) -> np.ndarray | None:
        return self._last.last_hidden if self._last is not None else None

    def check_positions(self, total: int, what: str = "this run") -> None:
        """Refuse (ContextLengthExceeded) when ``total`` positions exceed the limit."""
        from ..limits import check_context

        check_context(total, self.max_positions, self.limit_source, what)

    # -- passes ------------------------------------------------------------------------------
    def _layers(self, h: np.ndarray, state: ContinuationState, trace: ExecutionTrace) -> np.ndarray:
        p0 = state.position
        one = h.shape[0] == 1
        ran = []
        x = h
        for i, fns in self._kernels:
            ls = state.layers[i]
            for fn in fns:
                h, x = fn(h, x, ls, p0, one)
            ran.append(i)
        trace.executed_layers = ran
        return h

    def _embed(self, ids) -> np.ndarray:
        ids = _token_ids(ids, self._emb.shape[0])
        V = self._emb.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise SliceError(f"token id {bad} is outside the vocabulary [0, {V})")
        h = self._emb.take(ids)
        if self._emb_mult != 1:
            h = h * self._emb_mult
        return h

    def _logits(self, h: np.ndarray) -> np.ndarray:
        hn = rms_norm(h, self._fn_w, self._fn_eps)
        logits = self._head.mm(hn)
        if self._head_mult != 1:
            logits = logits * self._head_mult
        if self._softcap:
            c = F32(self._softcap)
            logits = np.tanh(logits / c) * c
        return logits

    def _pass(self, h: np.ndarray, stream: _StreamBase, ends: bool, last_only: bool = False) -> np.ndarray:
        t0 = time.perf_counter()
        T = h.shape[0]
        if T == 0:
            raise SliceError("no positions to run")
        if self.max_positions is not None and stream.state.position + T > self.max_positions:
            held = stream.state.position
            self.check_positions(held + T, f"a pass of {T} position(s)" + (f" after {held} held" if held else ""))
        out = None
        if T <= SMALL_PASS:
            with _small_pass_limit():
                h = self._layers(h, stream.state, stream.trace)
                if ends:
                    out = self._logits(h[-1:] if last_only else h)
        else:
            h = self._layers(h, stream.state, stream.trace)
            if ends:
                out = self._logits(h[-1:] if last_only else h)
        stream.state.position += T
        stream.last_hidden = h
        stream.trace.step_seconds.append(time.perf_counter() - t0)
        stream.trace.positions += T
        self._last = stream
        return h if out is None else out

    def forward(self, token_ids) -> np.ndarray:
        """Batch prefill in a fresh stream: float32 logits [positions, vocab]."""
        if not self.has_ends:
            raise SliceError(f"{self.slice.describe()} has no embedding or head; run hidden states through "
                             "start().prefill_hidden(h) on a layer range")
        return self.start().prefill(token_ids)

    def start(self) -> Stream | HiddenStream:
        """A new stream with its own state and trace: token ids in and logits out for a slice
        with ends, hidden states in and out for a `LayerRange`."""
        if isinstance(self.slice, LayerRange) or not self.has_ends:
            return HiddenStream(self)
        return Stream(self)


def _token_ids(token_ids, vocab: int) -> np.ndarray:
    """Token ids as int64 [n]. Anything but integers (a float, a bool, a string, an integer no
    int64 holds) is refused by name, never truncated or overflowed."""
    try:
        arr = np.asarray(token_ids)
    except (OverflowError, ValueError, TypeError):
        arr = np.asarray(list(token_ids), dtype=object)
    if arr.size and (arr.dtype.kind not in "iu" or (arr.dtype.kind == "u" and int(arr.max()) >= 2**63)):
        flat = arr.reshape(-1)
        bad = next((t for t in flat if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer))
                    or not -(2**63) <= int(t) < 2**63), flat[0])
        raise SliceError(f"token id {str(bad)[:40]!s} is not an id of the vocabulary [0, {vocab})")
    return arr.astype(np.int64).reshape(-1)


class _StreamBase:
    def __init__(self, ex: Executor):
        self.ex = ex
        self.state = ex.new_state()
        self.trace = ex.new_trace()
        self.last_hidden: np.ndarray | None = None

    @property
    def position(self) -> int:
        return self.state.position

    def truncate(self, position: int) -> None:
        self.state.truncate(position)

    def snapshot(self) -> dict:
        return self.state.snapshot()

    def restore(self, snap: Any) -> None:
        if not isinstance(snap, dict) or "position" not in snap:
            raise StateError("restore() takes a snapshot returned by snapshot() of this stream")
        self.state.restore(snap)


class Stream(_StreamBase):
    """One token continuation: prefill (any number of tokens, continuing from the current
    position), single-token steps, rollback."""

    def prefill(self, token_ids, last_only: bool = False) -> np.ndarray:
        ids = _token_ids(token_ids, self.ex.plan.vocab)
        ex, held = self.ex, self.state.position
        if ex.max_positions is not None and held + ids.size > ex.max_positions:  # before the embedding gather
            ex.check_positions(held + ids.size, f"a pass of {ids.size} position(s)" + (f" after {held} held" if held else ""))
        return ex._pass(ex._embed(ids), self, True, last_only)

    def step(self, token_id: int) -> np.ndarray:
        return self.prefill([int(token_id)])[0]


class HiddenStream(_StreamBase):
    """A layer range's continuation: hidden states [T, hidden] in, hidden states out, with the
    range's own state (so a range can run in another process and hand its output on)."""

    def _check(self, h) -> np.ndarray:
        h = np.asarray(h)
        if h.dtype != F32 or h.ndim != 2 or h.shape[1] != self.ex.plan.hidden_size:
            raise SliceError(f"a hidden stream takes float32 [positions, {self.ex.plan.hidden_size}]; "
                             f"got {h.dtype} {list(h.shape)}")
        return h

    def prefill_hidden(self, h) -> np.ndarray:
        return self.ex._pass(self._check(h), self, False)

    def step_hidden(self, h) -> np.ndarray:
        h = self._check(h)
        if h.shape[0] != 1:
            raise SliceError(f"step_hidden takes one position, got {h.shape[0]}")
        return self.ex._pass(h, self, False)
