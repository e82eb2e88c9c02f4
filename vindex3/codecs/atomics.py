"""Atomic counters for compiled code: the few operations the team kernels of
vindex3.codecs.intrinsics need to share one parallel region among its threads (claiming row
tasks, counting finished ones, waiting for a phase to end).

numba has no atomics of its own; these are LLVM's, emitted through ``@intrinsic``:

* `fetch_add` (``atomicrmw add``, sequentially consistent): claims and counts. Its release half
  is what makes a thread's output rows visible to a thread that later sees the count.
* `load_acquire`: reads a counter so that everything written before the matching `fetch_add`
  is visible after it.
* `pause`: the spin-wait hint (``pause`` on x86; nothing elsewhere).

A counter is one int64 element of a ``ctl`` array; `SLOT` int64s apart (64 bytes, one cache
line) so two counters never share a line. `phase_first` / `phase_end` / `phase_wait` make a
step that one thread of the team runs (the first to arrive) and the others wait for.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

SLOT = 8  # int64s per counter: one 64-byte cache line
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


def _ptr(context, builder, sig, args):
    aryty = sig.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])


@intrinsic
def fetch_add(typingctx, arr, idx, val):
    """The value of ``arr[idx]`` before adding ``val`` to it atomically (int64 arrays)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, types.int64, types.int64)

    def codegen(context, builder, sig, args):
        return builder.atomic_rmw("add", _ptr(context, builder, sig, args), args[2], "seq_cst")

    return sig, codegen


@intrinsic
def load_acquire(typingctx, arr, idx):
    """``arr[idx]`` read with acquire ordering (int64 arrays)."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64):
        return None
    sig = types.int64(arr, types.int64)

    def codegen(context, builder, sig, args):
        return builder.load_atomic(_ptr(context, builder, sig, args), "acquire", 8)

    return sig, codegen


@intrinsic
def pause(typingctx):
    """The spin-wait hint."""
    sig = types.none()

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always")
def wait_for(ctl, i, n):  # pragma: no cover - compiled
    """Spin until ``ctl[i]`` reaches ``n``."""
    while load_acquire(ctl, i) < n:
        pause()


@njit(inline="always")
def phase_first(ctl, p):  # pragma: no cover - compiled
    """True for exactly one caller of phase ``p`` (the first to arrive)."""
    return fetch_add(ctl, 2 * p * SLOT, 1) == 0


@njit(inline="always")
def phase_end(ctl, p):  # pragma: no cover - compiled
    """The caller that `phase_first` chose has finished phase ``p``."""
    fetch_add(ctl, (2 * p + 1) * SLOT, 1)


@njit(inline="always")
def phase_wait(ctl, p):  # pragma: no cover - compiled
    """Wait until phase ``p``'s one step has finished."""
    wait_for(ctl, (2 * p + 1) * SLOT, 1)
