"""Softmax attention of one decode position for each of several streams, in one compiled call.

A batched decode pass (vindex3.exec.batch) runs attention's projections once over the rows of
all its streams, but the attention proper belongs to each stream: its own KV rows, its own
position. `attend_many` does that per-stream part for every stream of the pass in one launch,
where a pass of 8 streams otherwise made 8 calls per layer, each with its own Python glue
(rotary rows, array checks, a kernel launch).

Each stream's part is `vindex3.exec.ops.decode._attend` itself, called on that stream's row,
its KV rows, its rotary row and its position: the same compiled arithmetic (no fastmath, no
contraction), so the heads' output of every stream has the bytes of that stream's lone step.
The KV rows of the streams are handed over as tuples of arrays (numba indexes a tuple of one
array type at run time), padded to `ROWS` so that one compilation serves every stream count.
"""

from __future__ import annotations

import numba
import numpy as np

from ...codecs import threads
from ...errors import StateError
from .decode import _JIT, _NO_PROBS, ROWS, _attend

__all__ = ["attend_many"]


@numba.njit(**_JIT)
def _attend_many(q, k, v, cos, sin, qscale, KTs, Vs, row0s, firsts, starts, p0s, window, sscale, cap, sinks,
                 no_probs, out):  # pragma: no cover - compiled
    """q [N, nh, hd], k and v [N, nkv, hd]: one projected row per stream; cos, sin [N, r];
    KTs, Vs: the streams' KV arrays (decode._attend's KT and V); row0s, firsts, starts, p0s
    [N]: per stream the row its new K/V goes to, the first position in reach, the position of
    its row 0 and its own position. no_probs: decode._attend's unused weights array (an
    argument: a module global is a read-only constant to numba). out [N, nh, hd]."""
    for n in range(q.shape[0]):
        _attend(q[n:n + 1], k[n:n + 1], v[n:n + 1], cos[n:n + 1], sin[n:n + 1], qscale, KTs[n], Vs[n], row0s[n],
                firsts[n], starts[n], p0s[n], window, sscale, cap, sinks, False, no_probs, out[n:n + 1])


_NO_ROPE = np.empty((8, 0), np.float32)
_NO_SINKS = np.empty(0, np.float32)


def _padded(arrays: list) -> tuple:
    """The streams' arrays as a tuple of `ROWS` (the first repeated; the kernel reads only the
    first N): one compiled kernel serves every stream count."""
    return tuple(arrays) + (arrays[0],) * (ROWS - len(arrays))


def attend_many(q, k, v, cos, sin, qscale, kvs, p0s, window: int | None, sscale, cap, sinks) -> np.ndarray:
    """One decode position per stream: q [N, nh, hd], k and v [N, nkv, hd] float32 C-contiguous
    (projected: biases, norms, clamp done); cos, sin [N, r] the rotary rows at each stream's
    position (None: no rope); ``kvs`` the streams' `KvRows` of this layer (room for one more row
    ensured here, each end advanced by one), ``p0s`` their positions. Returns the heads' output
    [N, nh * hd], row n the bytes `decode.attend` gives stream n alone. Every stream's KV rows
    are checked before any is written: a refusal leaves all of them as they were."""
    N, nh, hd = q.shape
    if not 0 < N <= ROWS:
        raise ValueError(f"attend_many takes 1 to {ROWS} streams, got {N}")
    row0s = np.empty(N, np.int64)
    firsts = np.empty(N, np.int64)
    starts = np.empty(N, np.int64)
    for n, (kv, p0) in enumerate(zip(kvs, p0s)):
        first = 0 if window is None else max(0, p0 - window + 1)
        row0s[n] = kv.reserve(1)
        if first < kv.start:
            raise StateError(f"KV rows before position {kv.start} were released (asked for {first})")
        firsts[n], starts[n] = first, kv.start
    if cos is None:
        cos = sin = _NO_ROPE[:N]
    out = np.empty((N, nh, hd), np.float32)
    with threads.launch():
        _attend_many(q, k, v, cos, sin, qscale, _padded([kv.kt for kv in kvs]), _padded([kv.v for kv in kvs]),
                     row0s, firsts, starts, np.asarray(p0s, np.int64), 0 if window is None else window, sscale, cap,
                     _NO_SINKS if sinks is None else sinks, _NO_PROBS, out)
    for kv in kvs:
        kv.end += 1
    return out.reshape(N, nh * hd)
