"""The executor: prepares a slice's operands from the memory-mapped segments (counting every
read), compiles each op to a small closure, and runs batch prefill and single-token steps
against one continuation state. It knows operators and surfaces, never model families."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..errors import SliceError, StateError, UnsupportedOperator
from ..opplan import Op, OperandRef
from .ops import ffn as ffn_mod
from .ops import softmax as softmax_mod
from .ops.norm import make_weight, rms_norm
from .slice import ExecutionSlice, LayerRange, plan_slice
from .state import ContinuationState, KvRows, LayerState
from .trace import ExecutionTrace

if TYPE_CHECKING:
    from ..container import Container

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
OpFn = Callable[[np.ndarray, np.ndarray, LayerState, int], tuple[np.ndarray, np.ndarray]]


class PreparedOperands:
    """Only the slice's tensors, as read-only views of the mapped segments. Every operand
    reference resolved counts as one read; bytes count each distinct tensor once."""

    def __init__(self, container: "Container"):
        self._segments = container.segments
        self._cache: dict[str, np.ndarray] = {}
        self.reads = 0
        self.bytes = 0
        self.read_log: list[str] = []

    def get(self, ref: OperandRef) -> np.ndarray:
        self.reads += 1
        self.read_log.append(ref.label)
        arr = self._cache.get(ref.label)
        if arr is None:
            arr = self._segments[ref.object].tensor(ref.tensor)
            if arr.dtype != np.float32:
                raise UnsupportedOperator(f"operand {ref.label} is {arr.dtype}; the executor runs float32 operands")
            self._cache[ref.label] = arr
            self.bytes += ref.nbytes
        return arr


def _compile_op(op: Op, layer: int, W: PreparedOperands) -> OpFn:
    w = {role: W.get(ref) for role, ref in op.operands.items()}
    k = op.kind
    if k == "rms_norm":
        weight = make_weight(w["weight"], op.params["weight_offset"])
        eps = F32(op.params["eps"])

        def norm(h, x, ls, p0):
            return h, rms_norm(h, weight, eps)

        return norm
    if k == "residual_add":
        m = F32(op.params["multiplier"])
        if m == 1:
            return lambda h, x, ls, p0: (h + x, x)
        return lambda h, x, ls, p0: (h + x * m, x)
    if k == "attention":
        attn = softmax_mod.make_attention(op.params, w)
        return lambda h, x, ls, p0: (h, attn(x, ls.kv, p0))
    if k == "gated_ffn":
        f = ffn_mod.make_ffn(
            op.params["activation"], w.get("ffn_gate"), w.get("ffn_up"), w["ffn_down"], w.get("ffn_gate_up"),
            w.get("ffn_gate_bias"), w.get("ffn_up_bias"), w.get("ffn_down_bias"), w.get("ffn_gate_up_bias"),
        )
        return lambda h, x, ls, p0: (h, f(x))
    if k == "mamba2":
        from .ops import mamba2_bind as m2

        run = m2.bind(op.params, w)
        return lambda h, x, ls, p0: (h, run(x, ls.recurrent))
    raise UnsupportedOperator(
        f"layer {layer}: operator {k!r} has no executor in this build (executable: softmax, mamba2)"
    )


class Executor:
    def __init__(self, container: "Container", sl: ExecutionSlice):
        self.container = container
        plan = container.op_plan()
        self.plan = plan
        self.slice = sl
        self.slice_plan = plan_slice(plan, sl)
        self.layers = self.slice_plan.executed_layers
        geoms = {i: plan.layers[i].geometry for i in self.layers}
        ContinuationState.preflight(geoms)  # only the layers this slice executes
        t0 = time.perf_counter()
        W = PreparedOperands(container)
        self.has_ends = self.slice_plan.has_ends
        if self.has_ends:
            self._emb = W.get(plan.embedding.operands["weight"])
            self._emb_mult = F32(plan.embedding.params["multiplier"])
            fn = plan.final_norm
            self._fn_w = make_weight(W.get(fn.operands["weight"]), fn.params["weight_offset"])
            self._fn_eps = F32(fn.params["eps"])
            hd = plan.head
            self._head_T = W.get(hd.operands["weight"]).T
            self._head_mult = F32(hd.params["multiplier"])
            self._softcap = hd.params.get("softcap")
        self._kernels: list[tuple[int, list[OpFn]]] = [
            (i, [_compile_op(op, i, W) for op in plan.layers[i].ops]) for i in self.layers
        ]
        self.prepared = W
        self.trace = ExecutionTrace(
            prepare_seconds=time.perf_counter() - t0, operand_reads=W.reads, bytes_read=W.bytes
        )
        self.last_hidden: np.ndarray | None = None

    # -- state -------------------------------------------------------------------------------
    def new_state(self) -> ContinuationState:
        layers = {}
        for i in self.layers:
            lo = self.plan.layers[i]
            g = lo.geometry
            kv = rec = None
            for op in lo.ops:
                if op.kind == "attention":
                    p = op.params
                    kv = KvRows(p["kv_heads"], p["head_dim"], p["window"])
                elif op.kind == "mamba2":
                    from .ops import mamba2_bind as m2

                    rec = m2.new_state(op.params)
            layers[i] = LayerState(i, g, kv, rec)
        return ContinuationState(layers)

    # -- passes ------------------------------------------------------------------------------
    def _layers(self, h: np.ndarray, state: ContinuationState) -> np.ndarray:
        p0 = state.position
        ran = []
        x = h
        for i, fns in self._kernels:
            ls = state.layers[i]
            for fn in fns:
                h, x = fn(h, x, ls, p0)
            ran.append(i)
        self.trace.executed_layers = ran
        return h

    def _embed(self, ids) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        V = self._emb.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            bad = int(ids[(ids < 0) | (ids >= V)][0])
            raise SliceError(f"token id {bad} is outside the vocabulary [0, {V})")
        h = self._emb[ids]
        if self._emb_mult != 1:
            h = h * self._emb_mult
        return h

    def _logits(self, h: np.ndarray) -> np.ndarray:
        hn = rms_norm(h, self._fn_w, self._fn_eps)
        logits = hn @ self._head_T
        if self._head_mult != 1:
            logits = logits * self._head_mult
        if self._softcap:
            c = F32(self._softcap)
            logits = np.tanh(logits / c) * c
        return logits

    def _run(self, ids, state: ContinuationState, last_only: bool = False) -> np.ndarray:
        if not self.has_ends:
            raise SliceError(f"{self.slice.describe()} has no embedding or head; use run_hidden(h) on a layer range")
        t0 = time.perf_counter()
        h = self._embed(ids)
        T = h.shape[0]
        if T == 0:
            raise SliceError("no tokens to run")
        if T <= SMALL_PASS:
            with _small_pass_limit():
                h = self._layers(h, state)
                logits = self._logits(h[-1:] if last_only else h)
        else:
            h = self._layers(h, state)
            logits = self._logits(h[-1:] if last_only else h)
        state.position += T
        self.last_hidden = h
        self.trace.step_seconds.append(time.perf_counter() - t0)
        self.trace.positions += T
        return logits

    def forward(self, token_ids) -> np.ndarray:
        """Batch prefill from an empty state: float32 logits [positions, vocab]."""
        return self._run(token_ids, self.new_state())

    def run_hidden(self, h: np.ndarray, state: ContinuationState | None = None) -> np.ndarray:
        """Hidden states in, hidden states out, over the slice's layers (for LayerRange)."""
        state = state or self.new_state()
        h = np.asarray(h, dtype=np.float32)
        out = self._layers(h, state)
        state.position += h.shape[0]
        return out

    def start(self) -> "Stream":
        if isinstance(self.slice, LayerRange):
            raise SliceError(f"{self.slice.describe()} has no ends; a token stream needs an embedding and a head")
        return Stream(self)


class Stream:
    """One continuation: prefill (any number of tokens, continuing from the current position),
    single-token steps, rollback."""

    def __init__(self, ex: Executor):
        self.ex = ex
        self.state = ex.new_state()

    @property
    def position(self) -> int:
        return self.state.position

    @property
    def last_hidden(self) -> np.ndarray | None:
        return self.ex.last_hidden

    def prefill(self, token_ids, last_only: bool = False) -> np.ndarray:
        return self.ex._run(token_ids, self.state, last_only)

    def step(self, token_id: int) -> np.ndarray:
        return self.ex._run([int(token_id)], self.state)[0]

    def truncate(self, position: int) -> None:
        self.state.truncate(position)

    def snapshot(self) -> dict:
        return self.state.snapshot()

    def restore(self, snap: dict) -> None:
        if not isinstance(snap, dict) or "position" not in snap:
            raise StateError("restore() takes a snapshot returned by snapshot() of this stream")
        self.state.restore(snap)
