"""The executor: prepares a slice's operands from a tensor source (counting every read), binds
each op once (core ops here, slot ops through their operator), and runs batch prefill and
single-position steps in streams, each with its own continuation state and trace. It knows the
layer skeleton and the operator interface, never an operator's kind nor a model family.

    ex = Executor(op_plan, tensor_source, Full())     # Container.executor() builds this
    st = ex.start()                                    # a token stream (a hidden stream for a LayerRange)
    st.prefill(ids); st.step(tok); st.trace; st.last_hidden

Two generic hooks serve the internals queries (vindex3.internals) and cost nothing when unused:
an `Observer` attached to a stream sees every slot's input and write and the residual after it
(one None check per pass), and an intervention (`vindex3.exec.intervention`) given to the
executor binds the FFN kernels it names differently (no check at all on the hot path).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .. import codecs
from ..codecs import Weight
from ..errors import NonFiniteActivation, SliceError, StateError, UnsupportedOperator
from ..operators import ARRAY, FFN, MIXER, distinct_bytes
from ..opplan import Op, OperandRef, OpPlan
from . import heap
from .intervention import Intervention, resolve_stream
from .intervention import resolve as resolve_intervention
from .ops.fused_layer import plan_fused
from .ops.norm import make_weight, norm_fn, rms_norm
from .slice import ExecutionSlice, LayerRange, plan_slice
from .state import ContinuationState, LayerState
from .trace import ExecutionTrace, OpCall

F32 = np.float32

# Every pass holds BLAS at one thread and splits large products over its own threads
# (`_SmallPass`, vindex3.codecs.threads `gemm`): one BLAS thread does matrix-vector work as fast as
# two on a quiet machine and many times faster on a busy one, where spinning BLAS workers fight
# other processes (and our own compiled kernels) for the cores. That holds for prompt-sized
# prefills too: on this 2-core machine at load ~6 an 82-token SmolLM2 prefill took 0.7-7.5 s with
# BLAS's own two threads and 0.28-0.78 s held at one (docs/draft.md, "Where a verify pass goes"),
# and a prompt's prefill starts every generation and server request. A pass of up to this many
# positions splits its products over the decode thread count; a longer one (a long prompt, where
# parallel products pay at any load) over every core the process may use (`pass_threads`). The
# split's blocks depend on a product's shape only, so no pass's bytes depend on either count.
SMALL_PASS = 512
_threads: dict = {}
_NO_LIMIT = contextlib.nullcontext()


class _SmallPass:
    """BLAS held at one thread and large products split by `vindex3.codecs.threads.gemm` over
    ``n`` threads (default: the decode thread count, ``VINDEX3_DECODE_THREADS``, default 1, the
    count the rows kernels use too). Why not BLAS's own threads: see that module ("Large
    products split themselves")."""

    __slots__ = ("_limit", "_n", "_split")

    def __init__(self, n: int | None = None):
        self._n = n

    def __enter__(self):
        from ..codecs import threads

        if "ctl" not in _threads:
            from threadpoolctl import ThreadpoolController

            _threads["ctl"] = ThreadpoolController()
        self._split = threads.SplitProducts(self._n)
        self._split.__enter__()  # reads the count first: a bad VINDEX3_DECODE_THREADS is refused
        try:  # before BLAS's count is touched
            self._limit = _threads["ctl"].limit(limits=1, user_api="blas")
        except BaseException:
            self._split.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> bool:
        self._split.__exit__(*exc)
        self._limit.__exit__(*exc)
        return False


def pass_threads(T: int) -> int:
    """Threads the split products of a pass of T positions share: the decode thread count up to
    ``SMALL_PASS`` positions (and whenever it is above one), every core the process may use
    beyond (a long prompt's products, as BLAS's own threads had them before). Never the bytes:
    a product's blocks are a function of its shape (vindex3.codecs.threads `gemm_cuts`)."""
    from ..codecs import threads

    n = threads.count()
    return n if T <= SMALL_PASS or n > 1 else threads.usable_cores()


def _small_pass_limit(n: int | None = None):
    """The context passes run in (`_SmallPass`): BLAS at one thread, split products over ``n``
    threads (default the decode count)."""
    return _SmallPass(n)


def small_pass_threads():
    """The context decode-sized passes run in (BLAS at one thread, large products split over
    VINDEX3_DECODE_THREADS), for other matrix-vector work (the internals queries) that a busy
    machine slows down the same way."""
    return _small_pass_limit()


def decode_threads() -> int:
    """Threads decode-sized passes (≤ SMALL_PASS positions) run with: the rows kernels and the
    split products (`vindex3.codecs.threads.count`); BLAS itself is held at one."""
    from ..codecs import threads

    return threads.count()


class TensorSource(Protocol):
    """Where an executor reads operands from (a container's segments, a shard's, ...)."""

    def weight(self, ref: OperandRef) -> Weight: ...


class PreparedOperands:
    """Only the slice's tensors, as weight objects over the source's bytes. Every operand
    reference resolved counts as one read; bytes count each distinct tensor once, at its stored
    (encoded) size."""

    def __init__(self, source: TensorSource, activations: str = "exact"):
        self._source = source
        self.activations = codecs.check_activations(activations)
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
            if self.activations != "exact":
                w = w.with_activations(self.activations)
            self._cache[ref.label] = w
            self.bytes += ref.nbytes
        return w

    def held(self, ref: OperandRef) -> Weight:
        """An operand already read (no read counted): for a second binding of the same ops."""
        return self._cache[ref.label]

    def array(self, ref: OperandRef) -> np.ndarray:
        """The operand whole, as float32 (norm weights, biases, small operands)."""
        return self.weight(ref).dense()


def _check_finite(h: np.ndarray, layer: int) -> None:
    """The residual leaving a layer holds no NaN or infinity (one pass over [positions, hidden])."""
    if not np.isfinite(h).all():
        raise NonFiniteActivation(f"layer {layer}: the residual leaving it holds NaN or infinity", layer=layer,
                                  site="residual_post")


# A bound op: (h residual, x current activation, layer state, first position, one position?, the
# stream's trace) -> (h, x, operand bytes this call touched)
OpFn = Callable[[np.ndarray, np.ndarray, LayerState, int, bool, ExecutionTrace], tuple[np.ndarray, np.ndarray, int]]


class Observer:
    """Watches one stream's residual stream: ``ex.start(observer=obs)`` (or ``stream.observer =
    obs``). Per pass (positions ``p0 .. p0+T-1``), in execution order:

    * ``begin(p0, h)``: the residual entering the first executed layer (for a slice with ends:
      the scaled embedding);
    * per executed layer and slot (``site`` is "mixer" or "ffn"): ``slot_input(layer, site, p0,
      x)`` with the input the slot's op reads (after its pre-norm, if any), then ``write(layer,
      site, p0, write, residual)`` with the slot's write (after any post-norm and the residual
      multiplier: exactly what is added to the residual) and the residual after it.

    Arrays are [T, hidden] float32 and belong to the executor: read them, keep references (the
    executor never writes into them afterwards), never modify them. Observing changes no byte of
    the run."""

    def begin(self, p0: int, h: np.ndarray) -> None:
        pass

    def slot_input(self, layer: int, site: str, p0: int, x: np.ndarray) -> None:
        pass

    def write(self, layer: int, site: str, p0: int, write: np.ndarray, residual: np.ndarray) -> None:
        pass

    def enter(self, layer: int, p0: int, h: np.ndarray) -> None:
        """The residual entering ``layer`` (after any stream intervention there)."""

    def leave(self, layer: int, p0: int, h: np.ndarray) -> None:
        """The residual leaving ``layer`` (after any stream intervention there)."""


_SILENT = Observer()


@dataclass(frozen=True)
class Readout:
    """The component's final norm and head: hidden [T, hidden] -> logits [T, vocab], float32.
    Its parts are public so that attributions can freeze the norm's scale."""

    norm_weight: np.ndarray  # [hidden], the weight offset already added
    eps: np.float32
    head: Weight  # [vocab, hidden]
    multiplier: np.float32
    softcap: float | None
    norm_kind: str = "rms"  # "layer": a LayerNorm, with ``norm_bias``
    norm_bias: np.ndarray | None = None
    head_bias: np.ndarray | None = None  # [vocab], added before the multiplier

    def normed(self, h: np.ndarray) -> np.ndarray:
        if self.norm_kind == "layer":
            return norm_fn("layer", self.norm_weight, self.norm_bias, self.eps)(h)
        return rms_norm(h, self.norm_weight, self.eps)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        logits = self.head.mm(self.normed(h))
        if self.head_bias is not None:
            logits = logits + self.head_bias
        if self.multiplier != 1:
            logits = logits * self.multiplier
        if self.softcap:
            c = F32(self.softcap)
            logits = np.tanh(logits / c) * c
        return logits


def prepare_ends(plan: OpPlan, W: PreparedOperands) -> tuple[Weight, np.float32, Readout]:
    """The embedding weight, its multiplier and the readout (final norm and head) of a plan:
    what every executor with ends holds (one process, or the driver of a sharded model)."""
    return W.weight(plan.embedding.operands["weight"]), F32(plan.embedding.params.multiplier), make_readout(plan, W)


def make_readout(plan: OpPlan, W: PreparedOperands) -> Readout:
    """A plan's final norm and head, read through ``W``."""
    fn, hd = plan.final_norm, plan.head
    return Readout(make_weight(W.array(fn.operands["weight"]), fn.params.weight_offset), F32(fn.params.eps),
                   W.weight(hd.operands["weight"]), F32(hd.params.multiplier), hd.params.softcap,
                   "layer" if fn.kind == "layer_norm" else "rms",
                   W.array(fn.operands["bias"]) if "bias" in fn.operands else None,
                   W.array(hd.operands["bias"]) if "bias" in hd.operands else None)


def _bind_core(op: Op, W: PreparedOperands) -> OpFn:
    nbytes = distinct_bytes(op.operands)
    if op.kind == "rms_norm":
        weight = make_weight(W.array(op.operands["weight"]), op.params.weight_offset)
        eps = F32(op.params.eps)
        if op.params.post:  # a post-norm: of the slot's write
            return lambda h, x, ls, p0, one, tr: (h, rms_norm(x, weight, eps), nbytes)
        return lambda h, x, ls, p0, one, tr: (h, rms_norm(h, weight, eps), nbytes)
    if op.kind in ("layer_norm", "parallel_fork"):
        kind = "layer" if op.kind == "layer_norm" else op.params.norm
        norm = norm_fn(kind, make_weight(W.array(op.operands["weight"]), op.params.weight_offset),
                       W.array(op.operands["bias"]) if "bias" in op.operands else None, F32(op.params.eps))
        if op.kind == "layer_norm":
            if op.params.post:
                return lambda h, x, ls, p0, one, tr: (h, norm(x), nbytes)
            return lambda h, x, ls, p0, one, tr: (h, norm(h), nbytes)
        # parallel: x is the mixer's write; the FFN reads the layer's input h, normed
        m = F32(op.params.multiplier)
        if m == 1:
            return lambda h, x, ls, p0, one, tr: (h + x, norm(h), nbytes)
        return lambda h, x, ls, p0, one, tr: (h + x * m, norm(h), nbytes)
    if op.kind == "residual_add":
        # the new residual is also the current activation: a slot with no pre-norm (placement
        # post_only) reads the residual itself
        m = F32(op.params.multiplier)

        def add(h, x, ls, p0, one, tr):
            h = h + x if m == 1 else h + x * m
            return h, h, 0

        return add
    raise UnsupportedOperator(f"core op {op.kind!r} has no executor")


def slot_operands(op: Op, W: PreparedOperands) -> dict[str, Any]:
    """A slot op's operands as its operator's ``bind`` takes them (role -> Weight or array)."""
    kinds = {r.name: r.kind for r in op.operator.roles(op.params)}
    return {role: (W.array(ref) if kinds.get(role) == ARRAY else W.weight(ref)) for role, ref in op.operands.items()}


def _bind_slot(op: Op, W: PreparedOperands, layer: int, ablate: np.ndarray | None = None) -> OpFn:
    operands = slot_operands(op, W)
    if ablate is None:
        kernel = op.operator.bind(op.params, operands)
    else:  # resolve_intervention has checked that the operator opts into features
        kernel = op.operator.bind_ablated(op.params, operands, ablate)
    slot = op.role
    prefill, step = kernel.prefill, kernel.step
    if not kernel.reports:
        nbytes = distinct_bytes(op.operands)

        def run(h, x, ls, p0, one, tr):
            return h, (step if one else prefill)(x, ls.ops.get(slot), p0), nbytes

        run.reports = False  # vindex3.exec.batch may run it once over several streams' rows
        run.stages = getattr(kernel, "stages", None)  # ... or its row-wise stages (softmax attention)
        return run
    name = op.kind

    def run_reporting(h, x, ls, p0, one, tr):
        y, rec = (step if one else prefill)(x, ls.ops.get(slot), p0)
        tr.op_calls.append(OpCall(layer, slot, name, p0, x.shape[0], int(rec.bytes_read), rec.detail))
        return h, y, int(rec.bytes_read)

    run_reporting.reports = True
    return run_reporting


def _preflight(plan: OpPlan, layers: list[int], refs: list[OperandRef], source: TensorSource | None = None) -> None:
    """Refuse by name, before reading anything, what this slice cannot execute: an operator
    without an executor, and an operand stored in an encoding without a codec (named with its
    representation and object)."""
    for i in layers:
        for op in plan.layers[i].slot_ops():
            if op.operator is None:
                from ..operators import registered

                runnable = ", ".join(n for n, _ in registered())
                what = "operator" if op.role == "mixer" else f"{op.role} kind"
                raise UnsupportedOperator(
                    f"layer {i}: {what} {op.kind!r} has no executor in this build (executable operators: {runnable})"
                )
            op.operator.preflight(op.params, f"layer {i} ({op.kind})")
    for ref in refs:
        if not codecs.is_known(ref.dtype):
            key = getattr(source, "representation_key", None)
            rep = key(ref.object) if key is not None else f"{ref.object}@{ref.dtype}"
            raise codecs.cannot_execute(ref.dtype, rep, ref.object, ref.tensor)


class Executor:
    """Prepared once per slice (and intervention, if any); runs any number of streams.

    Every stream is limited to ``max_positions`` positions (prompt and generation together): the
    graph's context length by default, or an explicit override (which may exceed it). A graph
    that records no context length sets no limit unless one is given. A pass that would go past
    the limit is refused before any work (`ContextLengthExceeded`); `check_positions` asks the
    same question up front."""

    def __init__(self, plan: OpPlan, source: TensorSource, sl: ExecutionSlice, intervention: Intervention | None = None,
                 *, max_positions: int | None = None, activations: str = "exact"):
        from ..limits import context_limit
        from ..switches import check_all

        check_all()  # a bad switch value is named before any work, whichever paths this model takes
        heap.tune()  # large temporaries kept in the heap, not faulted in afresh (vindex3.exec.heap)
        codecs.threads.count()  # and so is a bad VINDEX3_DECODE_THREADS
        # how products treat activations ('exact' | 'q8', vindex3.codecs.base.ACTIVATIONS):
        # a choice of the run, recorded in every trace and record it writes
        self.activations = codecs.check_activations(activations)
        self.plan = plan
        self.slice = sl
        self.max_positions, self.limit_source = context_limit(plan.context_length, max_positions)
        self.slice_plan = plan_slice(plan, sl)
        self.layers = self.slice_plan.executed_layers
        _preflight(plan, self.layers, self.slice_plan.operands, source)
        ablate = resolve_intervention(intervention, plan, self.layers, sl.describe())
        self.intervention = intervention
        t0 = time.perf_counter()
        W = PreparedOperands(source, self.activations)
        self.has_ends = self.slice_plan.has_ends
        self.readout: Readout | None = None
        if self.has_ends:
            self._emb, self._emb_mult, self.readout = prepare_ends(plan, W)
            pos = plan.embedding.operands.get("positions")
            self._pos = W.weight(pos) if pos is not None else None
            # what the ends touch per call: final norm and head whole; the embedding's gathered
            # rows (none extra when the head is the embedding itself, read whole anyway)
            fn, hd = plan.final_norm, plan.head
            self._ends_bytes = distinct_bytes({**{f"final_norm.{k}": r for k, r in fn.operands.items()},
                                               **{f"head.{k}": r for k, r in hd.operands.items()}})
            emb_ref = plan.embedding.operands["weight"]
            self._row_bytes = 0 if emb_ref.label in {r.label for r in hd.operands.values()} else emb_ref.nbytes // emb_ref.shape[0]
        self._kernels: list[tuple[int, list[OpFn]]] = [
            (i, [(_bind_slot(op, W, i, ablate.get(i) if op.role == FFN else None) if op.operator is not None
                  else _bind_core(op, W)) for op in plan.layers[i].ops])
            for i in self.layers
        ]
        # What an observer is told about each op: (slot, multiplier) of a residual add, (slot,
        # None) of a slot op, None of a norm.
        self._sites: dict[int, list[tuple[str, np.float32 | None] | None]] = {i: [_site(op) for op in plan.layers[i].ops]
                                                                             for i in self.layers}
        # decode-sized passes of plain pre-norm blocks: one compiled call a layer (same bytes)
        self.fused = plan_fused(plan, self.layers, self._kernels, W, intervention,
                                self.readout.head if self.readout is not None else None)
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
                              bytes_read=self.bytes_read, activations=self.activations)

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
    def _layers_observed(self, h: np.ndarray, state: ContinuationState, trace: ExecutionTrace,
                         obs: Observer, ed=None) -> tuple[np.ndarray, int]:
        """`_layers` with an observer and/or stream interventions (``ed``, a
        `vindex3.exec.intervention.StreamEdits`): without edits the same arithmetic in the same
        order (so the same bytes), with each residual add spelled out so that the write it adds
        can be shown or replaced. At a layer boundary the current activation is the residual, so
        an edited residual is both."""
        p0 = state.position
        one = h.shape[0] == 1
        ran = []
        touched = 0
        x = h
        obs.begin(p0, h)
        for i, fns in self._kernels:
            ls = state.layers[i]
            if ed is not None and ed.has(i, "residual"):
                h = x = ed.apply(i, "residual", p0, h)
            obs.enter(i, p0, h)
            for fn, site in zip(fns, self._sites[i]):
                if site is None:
                    h, x, n = fn(h, x, ls, p0, one, trace)
                    touched += n
                elif len(site) == 3:  # a parallel fork: the mixer's write joins the residual here
                    w = x if site[1] == 1 else x * site[1]
                    before = h
                    h, x, n = fn(h, x, ls, p0, one, trace)
                    touched += n
                    if ed is not None and ed.has(i, site[0]):  # the fork's FFN input reads the layer input
                        w = ed.apply(i, site[0], p0, w)
                        h = before + w
                    obs.write(i, site[0], p0, w, h)
                elif site[1] is None:
                    obs.slot_input(i, site[0], p0, x)
                    if ed is not None and ed.runs_slot(i, site[0]):  # a HEADS patch runs the slot itself
                        h, x, n = ed.run_slot(i, site[0], h, x, ls, p0, one, trace)
                    else:
                        h, x, n = fn(h, x, ls, p0, one, trace)
                    touched += n
                else:
                    w = x if site[1] == 1 else x * site[1]
                    if ed is not None and ed.has(i, site[0]):
                        w = ed.apply(i, site[0], p0, w)
                    h = h + w
                    x = h
                    obs.write(i, site[0], p0, w, h)
            if ed is not None and ed.has(i, "residual_post"):
                h = x = ed.apply(i, "residual_post", p0, h)
            obs.leave(i, p0, h)
            _check_finite(h, i)
            ran.append(i)
        trace.executed_layers = ran
        return h, touched

    def _layers(self, h: np.ndarray, state: ContinuationState, trace: ExecutionTrace) -> tuple[np.ndarray, int]:
        p0 = state.position
        one = h.shape[0] == 1
        fused = self.fused.begin(h.shape[0], p0) if self.fused.takes(h.shape[0]) else {}
        ran = []
        touched = 0
        x = h
        for i, fns in self._kernels:
            ls = state.layers[i]
            try:
                step = fused.get(i)
                if step is not None:  # one compiled call for the whole layer (it checks finiteness itself)
                    h, n = step(h, ls)
                    x = h
                    touched += n
                    ran.append(i)
                    continue
                for fn in fns:
                    h, x, n = fn(h, x, ls, p0, one, trace)
                    touched += n
            except NonFiniteActivation as e:
                raise e.at(i) from None
            _check_finite(h, i)
            ran.append(i)
        trace.executed_layers = ran
        return h, touched

    def embed(self, ids, p0: int = 0) -> np.ndarray:
        """Token ids at positions p0, p0+1, ... -> the residual entering layer 0 (embedding rows
        times its multiplier, plus the learned position rows when the model has them)."""
        if not self.has_ends:
            raise SliceError(f"{self.slice.describe()} has no embedding")
        return self._embed(ids, p0)

    def _embed(self, ids, p0: int = 0) -> np.ndarray:
        ids = _token_ids(ids, self._emb.shape[0])
        V = self._emb.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise SliceError(f"token id {bad} is outside the vocabulary [0, {V})")
        h = self._emb.take(ids)
        if self._emb_mult != 1:
            h = h * self._emb_mult
        if self._pos is not None:  # learned absolute positions: row p at position p
            P = self._pos.shape[0]
            if p0 + ids.size > P:
                raise SliceError(f"position {p0 + ids.size - 1} has no row in the learned position embedding "
                                 f"({P} positions)")
            h = h + self._pos.take(np.arange(p0, p0 + ids.size))
        return h

    def _logits(self, h: np.ndarray) -> np.ndarray:
        return self.readout(h)

    def _pass(self, h: np.ndarray, stream: _StreamBase, ends: bool, last_only: bool = False,
              ends_bytes: int = 0) -> np.ndarray:
        t0 = time.perf_counter()
        T = h.shape[0]
        if T == 0:
            raise SliceError("no positions to run")
        if self.max_positions is not None and stream.state.position + T > self.max_positions:
            held = stream.state.position
            self.check_positions(held + T, f"a pass of {T} position(s)" + (f" after {held} held" if held else ""))
        out = None
        obs, ed = stream.observer, stream.edits
        with _small_pass_limit(pass_threads(T)) if not self.fused.blas_free(T) else _NO_LIMIT:
            h, touched = self._layers(h, stream.state, stream.trace) if obs is None and ed is None else \
                self._layers_observed(h, stream.state, stream.trace, obs or _SILENT, ed)
            if ends:
                out = self._logits(h[-1:] if last_only else h)
        stream.state.position += T
        stream.last_hidden = h
        stream.trace.step_seconds.append(time.perf_counter() - t0)
        stream.trace.step_bytes.append(touched + ends_bytes)
        stream.trace.positions += T
        self._last = stream
        return h if out is None else out

    def forward(self, token_ids, interventions=()) -> np.ndarray:
        """Batch prefill in a fresh stream: float32 logits [positions, vocab]. ``interventions``
        (`vindex3.exec.intervention.Patch`, `Steer`) change this run only."""
        if not self.has_ends:
            raise SliceError(f"{self.slice.describe()} has no embedding or head; run hidden states through "
                             "start().prefill_hidden(h) on a layer range")
        st = self.start(interventions=interventions)
        if st.edits is not None:  # a lone prefill: a patch past its prompt would never apply
            st.edits.check_within(_token_ids(token_ids, self.plan.vocab).size, "forward()")
        return st.prefill(token_ids)

    def start(self, observer: Observer | None = None, interventions=()) -> Stream | HiddenStream:
        """A new stream with its own state and trace: token ids in and logits out for a slice
        with ends, hidden states in and out for a `LayerRange`. An observer, if given, sees the
        stream's residual stream (see `Observer`); ``interventions`` (Patch, Steer) change every
        pass of this stream, checked against this slice before anything runs."""
        edits = resolve_stream(interventions, self.plan, self.layers, self.slice.describe(), self.prepared)
        if isinstance(self.slice, LayerRange) or not self.has_ends:
            return HiddenStream(self, observer, edits)
        return Stream(self, observer, edits)

    def run_with_cache(self, token_ids, sites=("residual",), interventions=()) -> dict[str, np.ndarray]:
        """Prefill ``token_ids`` in one fresh stream and return the values at ``sites``, keyed
        ``"L12.residual"`` ([positions, hidden] float32), plus ``"logits"``. A site is a key
        (``"L3.ffn"``: refused by name when layer 3 lacks it) or a bare site name (``"ffn"``:
        every executed layer that has it)."""
        from .cache import cache_run

        return cache_run(self, token_ids, sites, interventions)


def _site(op: Op) -> tuple | None:
    if op.kind == "parallel_fork":
        return "mixer", F32(op.params.multiplier), "fork"
    if op.kind == "residual_add":
        return op.role.removesuffix("_residual"), F32(op.params.multiplier)
    if op.role in (MIXER, FFN):
        return op.role, None
    return None


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
    def __init__(self, ex: Executor, observer: Observer | None = None, edits=None):
        self.ex = ex
        self.state = ex.new_state()
        self.trace = ex.new_trace()
        self.last_hidden: np.ndarray | None = None
        self.observer = observer
        self.edits = edits  # vindex3.exec.intervention.StreamEdits, or None for a clean stream

    @property
    def interventions(self) -> list[dict]:
        """The stream interventions this stream runs, as records (empty for a clean stream)."""
        return self.edits.records() if self.edits is not None else []

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
        rows = np.unique(ids).size if ex._row_bytes else 0
        return ex._pass(ex._embed(ids, held), self, True, last_only, ex._ends_bytes + rows * ex._row_bytes)

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
