"""Prefill-sized kernels (passes of more than `vindex3.exec.ops.decode.ROWS` positions): the
non-product work of a long pass in a few compiled calls, split over `threads.count()` threads.

* `attend`: softmax attention of T positions for every head, the whole of what
  `vindex3.exec.ops.softmax`'s numpy path does after the projections and per-head QK-norm:
  rotary embedding of q and k (any rope table, partial rotary), the query scale, the write of the
  new K/V rows, scores with score scale, softcap, causal and sliding-window masks, learned sinks,
  softmax and the weighted sum of V. Every feature of the numpy path is covered; the numpy path
  stays for processes that turn the kernels off (``VINDEX3_PREFILL_KERNELS=0``, `set_enabled`).
  Work is split into tasks (kv head, block of `TASK_ROWS` queries); a query's scores run only
  over the keys it sees (causal and window), so the masked triangle is never computed. The
  arithmetic of one (query, head) is `vindex3.exec.ops.decode._attend`'s, in the same order
  (scores dim by dim over the head dims, the polynomial exp, numpy's pairwise sum for the
  denominator, the weighted sum of V key by key), so a prefill's attention is the bytes of a
  decode-kernel pass over the same rows, whatever the block partition.
* `silu_mul`: SiLU(gate) · up of a gated FFN, rows split over threads (decode's row arithmetic).
* `rms_rows`: RMSNorm of each row, rows split over threads (decode's row arithmetic, which is
  numpy's own bytes).

Each output element is computed by exactly one task from start to end, so the bytes do not
depend on the thread count (tests/test_prefill_attend.py). No fastmath: no reassociation, no
FMA contraction, as the decode kernels."""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...codecs import threads
from ...codecs.intrinsics import _arrays_at, _consts, _f32, _i32, _int_arg, _load, _vec
from ...switches import EnvSwitch, set_switch
from .decode import _exp, _exp_poly, _rms_rows, _rotate, pairwise

F32 = np.float32
TASK_ROWS = (
    32  # queries per attention task: 48 tasks for a 512-token SmolLM2 pass, few enough to be cheap
)


class _Switch:
    on = EnvSwitch("VINDEX3_PREFILL_KERNELS")


PREFILL = _Switch()


def enabled() -> bool:
    return PREFILL.on


def set_enabled(flag: bool | None) -> None:
    """Turn the kernels on or off for this process (None: read ``VINDEX3_PREFILL_KERNELS`` again)."""
    set_switch(PREFILL, "on", flag)


_JIT = {"cache": True, "error_model": "numpy", "nogil": True}
_PAR = dict(_JIT, parallel=True)


@numba.njit(**_PAR)
def _write_kv(k, v, cos, sin, KT, V, row0):  # pragma: no cover - compiled
    """The T new rows: k rotated (decode's `_rotate`) into KT [nkv, hd, rows] at row0.., v into
    V [nkv, rows, hd]. One task per kv head."""
    T, nkv, hd = k.shape
    for j in prange(nkv):
        kr = np.empty((1, hd), np.float32)
        for t in range(T):
            _rotate(k[t, j : j + 1], cos[t], sin[t], F32(1.0), kr)
            for i in range(hd):
                KT[j, i, row0 + t] = kr[0, i]
            for i in range(hd):
                V[j, row0 + t, i] = v[t, j, i]


@numba.njit(**_JIT)
def _scores1(qr, h, KT, j, o, n, s):  # pragma: no cover - compiled
    """s[h, kk] = qr[h] · key (o + kk) for kk < n, keys as columns of KT[j] [hd, rows]: each
    score ((q0·k0 + q1·k1) + q2·k2) + ... over the head dims in order (decode's `_attend`
    order), eight dims a sweep over the keys so that a sweep loads a score once for eight
    products. The key index is unsigned: numba then emits no negative-index wraparound, whose
    per-element select kept the sweep from vectorizing (measured 7x slower)."""
    hd = qr.shape[1]
    ou = np.uint64(o)
    nu = np.uint64(n)
    i = 0
    if hd >= 8:
        c0, c1, c2, c3 = qr[h, 0], qr[h, 1], qr[h, 2], qr[h, 3]
        c4, c5, c6, c7 = qr[h, 4], qr[h, 5], qr[h, 6], qr[h, 7]
        for kk in range(nu):
            r = ou + kk
            s[h, kk] = (
                (
                    (
                        (
                            ((c0 * KT[j, 0, r] + c1 * KT[j, 1, r]) + c2 * KT[j, 2, r])
                            + c3 * KT[j, 3, r]
                        )
                        + c4 * KT[j, 4, r]
                    )
                    + c5 * KT[j, 5, r]
                )
                + c6 * KT[j, 6, r]
            ) + c7 * KT[j, 7, r]
        i = 8
    else:
        c0 = qr[h, 0]
        for kk in range(nu):
            s[h, kk] = c0 * KT[j, 0, ou + kk]
        i = 1
    while i + 8 <= hd:
        c0, c1, c2, c3 = qr[h, i], qr[h, i + 1], qr[h, i + 2], qr[h, i + 3]
        c4, c5, c6, c7 = qr[h, i + 4], qr[h, i + 5], qr[h, i + 6], qr[h, i + 7]
        for kk in range(nu):
            r = ou + kk
            s[h, kk] = (
                (
                    (
                        (
                            (
                                ((s[h, kk] + c0 * KT[j, i, r]) + c1 * KT[j, i + 1, r])
                                + c2 * KT[j, i + 2, r]
                            )
                            + c3 * KT[j, i + 3, r]
                        )
                        + c4 * KT[j, i + 4, r]
                    )
                    + c5 * KT[j, i + 5, r]
                )
                + c6 * KT[j, i + 6, r]
            ) + c7 * KT[j, i + 7, r]
        i += 8
    while i < hd:
        c0 = qr[h, i]
        for kk in range(nu):
            s[h, kk] = s[h, kk] + c0 * KT[j, i, ou + kk]
        i += 1


@numba.njit(**_JIT)
def _scores2(qr, h, KT, j, o, n, s):  # pragma: no cover - compiled
    """`_scores1` for heads h and h + 1 at once (the same keys: one load of a key for both
    heads, two independent chains of additions in flight); head_dim >= 4. Same bytes."""
    hd = qr.shape[1]
    ou = np.uint64(o)
    nu = np.uint64(n)
    a0, a1, a2, a3 = qr[h, 0], qr[h, 1], qr[h, 2], qr[h, 3]
    b0, b1, b2, b3 = qr[h + 1, 0], qr[h + 1, 1], qr[h + 1, 2], qr[h + 1, 3]
    for kk in range(nu):
        r = ou + kk
        k0, k1, k2, k3 = KT[j, 0, r], KT[j, 1, r], KT[j, 2, r], KT[j, 3, r]
        s[h, kk] = ((a0 * k0 + a1 * k1) + a2 * k2) + a3 * k3
        s[h + 1, kk] = ((b0 * k0 + b1 * k1) + b2 * k2) + b3 * k3
    i = 4
    while i + 4 <= hd:
        a0, a1, a2, a3 = qr[h, i], qr[h, i + 1], qr[h, i + 2], qr[h, i + 3]
        b0, b1, b2, b3 = qr[h + 1, i], qr[h + 1, i + 1], qr[h + 1, i + 2], qr[h + 1, i + 3]
        for kk in range(nu):
            r = ou + kk
            k0, k1, k2, k3 = KT[j, i, r], KT[j, i + 1, r], KT[j, i + 2, r], KT[j, i + 3, r]
            s[h, kk] = (((s[h, kk] + a0 * k0) + a1 * k1) + a2 * k2) + a3 * k3
            s[h + 1, kk] = (((s[h + 1, kk] + b0 * k0) + b1 * k1) + b2 * k2) + b3 * k3
        i += 4
    while i < hd:
        a0, b0 = qr[h, i], qr[h + 1, i]
        for kk in range(nu):
            k0 = KT[j, i, ou + kk]
            s[h, kk] = s[h, kk] + a0 * k0
            s[h + 1, kk] = s[h + 1, kk] + b0 * k0
        i += 1


@numba.njit(**_JIT)
def _scores3(qr, h, KT, j, o, n, s):  # pragma: no cover - compiled
    """`_scores1` for heads h, h + 1, h + 2 at once (see `_scores2`); head_dim >= 4. Same bytes."""
    hd = qr.shape[1]
    ou = np.uint64(o)
    nu = np.uint64(n)
    a0, a1, a2, a3 = qr[h, 0], qr[h, 1], qr[h, 2], qr[h, 3]
    b0, b1, b2, b3 = qr[h + 1, 0], qr[h + 1, 1], qr[h + 1, 2], qr[h + 1, 3]
    c0, c1, c2, c3 = qr[h + 2, 0], qr[h + 2, 1], qr[h + 2, 2], qr[h + 2, 3]
    for kk in range(nu):
        r = ou + kk
        k0, k1, k2, k3 = KT[j, 0, r], KT[j, 1, r], KT[j, 2, r], KT[j, 3, r]
        s[h, kk] = ((a0 * k0 + a1 * k1) + a2 * k2) + a3 * k3
        s[h + 1, kk] = ((b0 * k0 + b1 * k1) + b2 * k2) + b3 * k3
        s[h + 2, kk] = ((c0 * k0 + c1 * k1) + c2 * k2) + c3 * k3
    i = 4
    while i + 4 <= hd:
        a0, a1, a2, a3 = qr[h, i], qr[h, i + 1], qr[h, i + 2], qr[h, i + 3]
        b0, b1, b2, b3 = qr[h + 1, i], qr[h + 1, i + 1], qr[h + 1, i + 2], qr[h + 1, i + 3]
        c0, c1, c2, c3 = qr[h + 2, i], qr[h + 2, i + 1], qr[h + 2, i + 2], qr[h + 2, i + 3]
        for kk in range(nu):
            r = ou + kk
            k0, k1, k2, k3 = KT[j, i, r], KT[j, i + 1, r], KT[j, i + 2, r], KT[j, i + 3, r]
            s[h, kk] = (((s[h, kk] + a0 * k0) + a1 * k1) + a2 * k2) + a3 * k3
            s[h + 1, kk] = (((s[h + 1, kk] + b0 * k0) + b1 * k1) + b2 * k2) + b3 * k3
            s[h + 2, kk] = (((s[h + 2, kk] + c0 * k0) + c1 * k1) + c2 * k2) + c3 * k3
        i += 4
    while i < hd:
        a0, b0, c0 = qr[h, i], qr[h + 1, i], qr[h + 2, i]
        for kk in range(nu):
            k0 = KT[j, i, ou + kk]
            s[h, kk] = s[h, kk] + a0 * k0
            s[h + 1, kk] = s[h + 1, kk] + b0 * k0
            s[h + 2, kk] = s[h + 2, kk] + c0 * k0
        i += 1


@numba.njit(**_JIT)
def _exp_shifted(s, m, n, bits):  # pragma: no cover - compiled
    """s[i] = exp(s[i] - m) for i < n, decode's `_exp_into` arithmetic in place (``bits`` an
    int32 scratch of >= n). Written for one array: `_exp_into(s, s, ...)` ran its scalar loop,
    the vector one being guarded by a check that its input and output do not overlap."""
    for i in range(n):
        p, fn = _exp_poly(s[i] - m)
        s[i] = p
        bits[i] = (np.int32(fn) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for i in range(n):
        s[i] = s[i] * scale[i]


@numba.njit(**_JIT)
def _weighted1(s, h, n, V, j, o, out, t, oh):  # pragma: no cover - compiled
    """out[t, oh, i] = Σ_kk s[h, kk] · V[j, o + kk, i], ((p0·v0 + p1·v1) + p2·v2) + ... over the
    keys in order (decode's `_attend` order), eight keys a sweep over the head dims."""
    hd = V.shape[2]
    if n >= 8:
        p00 = s[h + 0, 0]
        p01 = s[h + 0, 1]
        p02 = s[h + 0, 2]
        p03 = s[h + 0, 3]
        p04 = s[h + 0, 4]
        p05 = s[h + 0, 5]
        p06 = s[h + 0, 6]
        p07 = s[h + 0, 7]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (
                    (
                        (
                            ((p00 * V[j, o, i] + p01 * V[j, o + 1, i]) + p02 * V[j, o + 2, i])
                            + p03 * V[j, o + 3, i]
                        )
                        + p04 * V[j, o + 4, i]
                    )
                    + p05 * V[j, o + 5, i]
                )
                + p06 * V[j, o + 6, i]
            ) + p07 * V[j, o + 7, i]
        kk = 8
    else:
        p00 = s[h + 0, 0]
        for i in range(hd):
            out[t, oh + 0, i] = p00 * V[j, o, i]
        kk = 1
    while kk + 8 <= n:
        r = o + kk
        p00 = s[h + 0, kk]
        p01 = s[h + 0, kk + 1]
        p02 = s[h + 0, kk + 2]
        p03 = s[h + 0, kk + 3]
        p04 = s[h + 0, kk + 4]
        p05 = s[h + 0, kk + 5]
        p06 = s[h + 0, kk + 6]
        p07 = s[h + 0, kk + 7]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (
                    (
                        (
                            (
                                ((out[t, oh + 0, i] + p00 * V[j, r, i]) + p01 * V[j, r + 1, i])
                                + p02 * V[j, r + 2, i]
                            )
                            + p03 * V[j, r + 3, i]
                        )
                        + p04 * V[j, r + 4, i]
                    )
                    + p05 * V[j, r + 5, i]
                )
                + p06 * V[j, r + 6, i]
            ) + p07 * V[j, r + 7, i]
        kk += 8
    while kk < n:
        r = o + kk
        p00 = s[h + 0, kk]
        for i in range(hd):
            out[t, oh + 0, i] = out[t, oh + 0, i] + p00 * V[j, r, i]
        kk += 1


@numba.njit(**_JIT)
def _weighted2(s, h, n, V, j, o, out, t, oh):  # pragma: no cover - compiled
    """`_weighted1` for 2 heads at once (rows h.. of s, heads oh.. of out): one load of a value
    row for all of them, 2 independent chains in flight; the same bytes, four keys a sweep."""
    hd = V.shape[2]
    if n >= 4:
        p00 = s[h + 0, 0]
        p01 = s[h + 0, 1]
        p02 = s[h + 0, 2]
        p03 = s[h + 0, 3]
        p10 = s[h + 1, 0]
        p11 = s[h + 1, 1]
        p12 = s[h + 1, 2]
        p13 = s[h + 1, 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (p00 * V[j, o, i] + p01 * V[j, o + 1, i]) + p02 * V[j, o + 2, i]
            ) + p03 * V[j, o + 3, i]
            out[t, oh + 1, i] = (
                (p10 * V[j, o, i] + p11 * V[j, o + 1, i]) + p12 * V[j, o + 2, i]
            ) + p13 * V[j, o + 3, i]
        kk = 4
    else:
        p00 = s[h + 0, 0]
        p10 = s[h + 1, 0]
        for i in range(hd):
            out[t, oh + 0, i] = p00 * V[j, o, i]
            out[t, oh + 1, i] = p10 * V[j, o, i]
        kk = 1
    while kk + 4 <= n:
        r = o + kk
        p00 = s[h + 0, kk]
        p01 = s[h + 0, kk + 1]
        p02 = s[h + 0, kk + 2]
        p03 = s[h + 0, kk + 3]
        p10 = s[h + 1, kk]
        p11 = s[h + 1, kk + 1]
        p12 = s[h + 1, kk + 2]
        p13 = s[h + 1, kk + 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                ((out[t, oh + 0, i] + p00 * V[j, r, i]) + p01 * V[j, r + 1, i])
                + p02 * V[j, r + 2, i]
            ) + p03 * V[j, r + 3, i]
            out[t, oh + 1, i] = (
                ((out[t, oh + 1, i] + p10 * V[j, r, i]) + p11 * V[j, r + 1, i])
                + p12 * V[j, r + 2, i]
            ) + p13 * V[j, r + 3, i]
        kk += 4
    while kk < n:
        r = o + kk
        p00 = s[h + 0, kk]
        p10 = s[h + 1, kk]
        for i in range(hd):
            out[t, oh + 0, i] = out[t, oh + 0, i] + p00 * V[j, r, i]
            out[t, oh + 1, i] = out[t, oh + 1, i] + p10 * V[j, r, i]
        kk += 1


@numba.njit(**_JIT)
def _weighted3(s, h, n, V, j, o, out, t, oh):  # pragma: no cover - compiled
    """`_weighted1` for 3 heads at once (rows h.. of s, heads oh.. of out): one load of a value
    row for all of them, 3 independent chains in flight; the same bytes, four keys a sweep."""
    hd = V.shape[2]
    if n >= 4:
        p00 = s[h + 0, 0]
        p01 = s[h + 0, 1]
        p02 = s[h + 0, 2]
        p03 = s[h + 0, 3]
        p10 = s[h + 1, 0]
        p11 = s[h + 1, 1]
        p12 = s[h + 1, 2]
        p13 = s[h + 1, 3]
        p20 = s[h + 2, 0]
        p21 = s[h + 2, 1]
        p22 = s[h + 2, 2]
        p23 = s[h + 2, 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (p00 * V[j, o, i] + p01 * V[j, o + 1, i]) + p02 * V[j, o + 2, i]
            ) + p03 * V[j, o + 3, i]
            out[t, oh + 1, i] = (
                (p10 * V[j, o, i] + p11 * V[j, o + 1, i]) + p12 * V[j, o + 2, i]
            ) + p13 * V[j, o + 3, i]
            out[t, oh + 2, i] = (
                (p20 * V[j, o, i] + p21 * V[j, o + 1, i]) + p22 * V[j, o + 2, i]
            ) + p23 * V[j, o + 3, i]
        kk = 4
    else:
        p00 = s[h + 0, 0]
        p10 = s[h + 1, 0]
        p20 = s[h + 2, 0]
        for i in range(hd):
            out[t, oh + 0, i] = p00 * V[j, o, i]
            out[t, oh + 1, i] = p10 * V[j, o, i]
            out[t, oh + 2, i] = p20 * V[j, o, i]
        kk = 1
    while kk + 4 <= n:
        r = o + kk
        p00 = s[h + 0, kk]
        p01 = s[h + 0, kk + 1]
        p02 = s[h + 0, kk + 2]
        p03 = s[h + 0, kk + 3]
        p10 = s[h + 1, kk]
        p11 = s[h + 1, kk + 1]
        p12 = s[h + 1, kk + 2]
        p13 = s[h + 1, kk + 3]
        p20 = s[h + 2, kk]
        p21 = s[h + 2, kk + 1]
        p22 = s[h + 2, kk + 2]
        p23 = s[h + 2, kk + 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                ((out[t, oh + 0, i] + p00 * V[j, r, i]) + p01 * V[j, r + 1, i])
                + p02 * V[j, r + 2, i]
            ) + p03 * V[j, r + 3, i]
            out[t, oh + 1, i] = (
                ((out[t, oh + 1, i] + p10 * V[j, r, i]) + p11 * V[j, r + 1, i])
                + p12 * V[j, r + 2, i]
            ) + p13 * V[j, r + 3, i]
            out[t, oh + 2, i] = (
                ((out[t, oh + 2, i] + p20 * V[j, r, i]) + p21 * V[j, r + 1, i])
                + p22 * V[j, r + 2, i]
            ) + p23 * V[j, r + 3, i]
        kk += 4
    while kk < n:
        r = o + kk
        p00 = s[h + 0, kk]
        p10 = s[h + 1, kk]
        p20 = s[h + 2, kk]
        for i in range(hd):
            out[t, oh + 0, i] = out[t, oh + 0, i] + p00 * V[j, r, i]
            out[t, oh + 1, i] = out[t, oh + 1, i] + p10 * V[j, r, i]
            out[t, oh + 2, i] = out[t, oh + 2, i] + p20 * V[j, r, i]
        kk += 1


def _splat(builder, x, w: int):
    v = builder.insert_element(ir.Constant(_vec(_f32, w), None), x, ir.Constant(_i32, 0))
    return builder.shuffle_vector(v, v, _consts(_i32, [0] * w))


@intrinsic
def _wsum(typingctx, P, p0, n, V, v0, hd, O, o0):
    """O[o0 + i] = Σ_k P[p0 + k] · V[v0 + k·hd + i] for i < hd (a multiple of 8), k < n (>= 1),
    over 1-D float32 arrays: `_weighted1`'s arithmetic (the first product, then each next one
    added, keys in order; no fused multiply-add) with the running sums of 64 head dims held in
    eight vector registers across the keys instead of reloaded from ``out`` every four or eight
    keys. AMD Zen 3, head_dim 64, 3 heads at 37-512 keys: 19-22 G multiply-adds a second against
    `_weighted3`'s 11-12 in the same process (1.6-2.0x), the same bytes (tests/test_prefill_attend.py)."""
    sig = types.void(P, p0, n, V, v0, hd, O, o0)

    def codegen(context, builder, sig, args):
        ap, av, ao = _arrays_at(context, builder, sig, args, (0, 3, 6))
        p0v, nv, v0v, hdv, o0v = (_int_arg(context, builder, sig.args[i], args[i]) for i in (1, 2, 4, 5, 7))
        c = lambda x: ir.Constant(nv.type, x)
        v8 = _vec(_f32, 8)

        def chunk(W: int, col):  # head dims col .. col + 8W - 1
            p = _splat(builder, builder.load(builder.gep(ap.data, [p0v])), 8)
            base0 = builder.add(v0v, col)
            accs = [cgutils.alloca_once_value(builder, builder.fmul(p, _load(builder, av.data, builder.add(base0, c(8 * w)), v8)))
                    for w in range(W)]
            with cgutils.for_range(builder, builder.sub(nv, c(1))) as loop:
                k = builder.add(loop.index, c(1))
                pk = _splat(builder, builder.load(builder.gep(ap.data, [builder.add(p0v, k)])), 8)
                base = builder.add(base0, builder.mul(k, hdv))
                for w in range(W):
                    x = _load(builder, av.data, builder.add(base, c(8 * w)), v8)
                    builder.store(builder.fadd(builder.load(accs[w]), builder.fmul(pk, x)), accs[w])
            for w in range(W):
                dst = builder.gep(ao.data, [builder.add(o0v, builder.add(col, c(8 * w)))])
                builder.store(builder.load(accs[w]), builder.bitcast(dst, v8.as_pointer()), align=1)

        nvec = builder.ashr(hdv, c(3))
        n64 = builder.ashr(nvec, c(3))
        with cgutils.for_range(builder, n64) as loop:  # 64 dims at a time, then 32, 16 and 8
            chunk(8, builder.shl(loop.index, c(6)))
        col = builder.shl(n64, c(6))
        for W in (4, 2, 1):
            has = builder.icmp_signed("!=", builder.and_(nvec, c(W)), c(0))
            with builder.if_then(has):
                chunk(W, col)
            col = builder.add(col, builder.select(has, c(8 * W), c(0)))
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**_JIT)
def _max(x, n):  # pragma: no cover - compiled
    """The largest of x[:n] (n >= 1), in eight lanes (a maximum's value does not depend on the
    order it is taken in)."""
    m = x[0]
    if n >= 8:
        m0, m1, m2, m3, m4, m5, m6, m7 = x[0], x[1], x[2], x[3], x[4], x[5], x[6], x[7]
        stop = n - n % 8
        for i in range(8, stop, 8):
            m0, m1, m2, m3 = max(m0, x[i]), max(m1, x[i + 1]), max(m2, x[i + 2]), max(m3, x[i + 3])
            m4, m5, m6, m7 = (
                max(m4, x[i + 4]),
                max(m5, x[i + 5]),
                max(m6, x[i + 6]),
                max(m7, x[i + 7]),
            )
        m = max(max(max(m0, m1), max(m2, m3)), max(max(m4, m5), max(m6, m7)))
        for i in range(stop, n):
            m = max(m, x[i])
    else:
        for i in range(1, n):
            m = max(m, x[i])
    return m


@numba.njit(**_PAR)
def _attend(
    q,
    cos,
    sin,
    qscale,
    KT,
    V,
    base,
    first,
    p0,
    t_lo,
    t_hi,
    window,
    sscale,
    cap,
    sinks,
    tasks,
    keep,
    probs,
    k0,
    out,
):  # pragma: no cover - compiled
    """Queries t_lo .. t_hi-1 (absolute positions p0 + t) of q [T, nh, hd] (projected, before
    rope; cos, sin [T, r], r = 0: no rope) over the KV rows KT [nkv, hd, rows] and V [nkv, rows,
    hd], whose key at absolute position first sits at row ``base``. window <= 0: full span;
    cap <= 0: no softcap; sinks [nh] (empty: none). ``tasks`` [n, 3]: (kv head, first query,
    end query). keep: write the weights into probs [nkv, g, t_hi - t_lo, keys], key column c
    being absolute position k0 + c (masked ones 0). out [T, nh, hd]: rows t_lo .. t_hi-1."""
    nh, hd = q.shape[1], q.shape[2]
    nkv = KT.shape[0]
    g = nh // nkv
    has_sinks = sinks.shape[0] > 0
    S = p0 + t_hi - first  # keys the last query may see, from first
    rows = V.shape[1]
    Vf = V.reshape(-1)
    of = out.reshape(-1)
    for task in prange(tasks.shape[0]):
        j, ta, tb = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        qr = np.empty((g, hd), np.float32)
        s = np.empty((g, S), np.float32)
        sf = s.reshape(-1)
        bits = np.empty(S, np.int32)
        for t in range(ta, tb):
            _rotate(q[t, j * g : (j + 1) * g], cos[t], sin[t], qscale, qr)
            qpos = p0 + t
            a = 0
            if window > 0:
                a = max(0, qpos - window + 1 - first)
            n = qpos + 1 - first - a
            o = base + a  # row of key a; s[hh, kk] is key a + kk
            # the heads of the group in threes and twos (one load of a key row for all) when
            # head_dim allows, else one by one: the same bytes either way
            hh = 0
            while hh < g:
                if hd >= 4 and g - hh >= 3:
                    _scores3(qr, hh, KT, j, o, n, s)
                    hh += 3
                elif hd >= 4 and g - hh == 2:
                    _scores2(qr, hh, KT, j, o, n, s)
                    hh += 2
                else:
                    _scores1(qr, hh, KT, j, o, n, s)
                    hh += 1
            for hh in range(g):
                h = j * g + hh
                sr = s[hh]
                if sscale != F32(1.0):  # x · 1 is x: skipping it changes no byte
                    for kk in range(n):
                        sr[kk] = sr[kk] * sscale
                if cap > F32(0.0):
                    for kk in range(n):
                        sr[kk] = F32(math.tanh(np.float64(sr[kk] / cap))) * cap
                m = _max(sr, n)
                if has_sinks and sinks[h] > m:
                    m = sinks[h]
                _exp_shifted(sr, m, n, bits)
                den = pairwise(sr, 0, n)
                if has_sinks:
                    den = den + _exp(sinks[h] - m)
                inv = F32(1.0) / den
                for kk in range(n):
                    sr[kk] = sr[kk] * inv
                if keep:
                    pr = probs[j, hh, t - t_lo]
                    lo = first + a - k0  # column of key a
                    for c in range(pr.shape[0]):
                        pr[c] = F32(0.0)
                    for kk in range(n):
                        pr[lo + kk] = sr[kk]
            if hd % 8 == 0:  # head by head, the running sums in registers (`_wsum`)
                for hh in range(g):
                    _wsum(sf, hh * S, n, Vf, (j * rows + o) * hd, hd, of, (t * nh + j * g + hh) * hd)
            else:  # the same bytes, swept through ``out`` (head_dim not a multiple of 8)
                hh = 0
                while hh < g:
                    if g - hh >= 3:
                        _weighted3(s, hh, n, V, j, o, out, t, j * g + hh)
                        hh += 3
                    elif g - hh == 2:
                        _weighted2(s, hh, n, V, j, o, out, t, j * g + hh)
                        hh += 2
                    else:
                        _weighted1(s, hh, n, V, j, o, out, t, j * g + hh)
                        hh += 1


def _tasks(nkv: int, t_lo: int, t_hi: int) -> np.ndarray:
    """(kv head, first query, end query) tasks over queries t_lo..t_hi-1, ordered so that the
    contiguous chunks numba's static schedule hands each thread carry about equal work: the
    blocks of a causal pass grow with their position, so they go in pairs (shortest, longest),
    (second shortest, second longest), ..."""
    blocks = [(a, min(t_hi, a + TASK_ROWS)) for a in range(t_lo, t_hi, TASK_ROWS)]
    order = []
    i, k = 0, len(blocks) - 1
    while i <= k:
        order.append(blocks[i])
        if k != i:
            order.append(blocks[k])
        i, k = i + 1, k - 1
    return np.array([(j, a, b) for a, b in order for j in range(nkv)], np.int64).reshape(-1, 3)


_NO_SINKS = np.empty(0, np.float32)
_NO_PROBS = np.empty((1, 1, 1, 1), np.float32)


def attend(
    q,
    k,
    v,
    cos,
    sin,
    qscale,
    kv,
    first: int,
    p0: int,
    window: int,
    sscale,
    cap,
    sinks,
    tap,
    block: int,
) -> np.ndarray:
    """q [T, nh, hd], k and v [T, nkv, hd] float32, projected (biases, norms, clamp done);
    ``kv`` the layer's `KvRows` (room for T more rows made here, its end advanced); cos, sin
    [T, r] or None (no rope); window 0: full span; cap 0: no softcap; sinks [nh] or None.
    ``tap`` (or None) is told the weights per block of ``block`` queries, ``tap("weights", q0, k0,
    w [nkv, g, queries, keys])`` as the numpy path tells them; the output bytes are the same
    with or without it. Returns the heads' output [T, nh * hd]."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    q = np.ascontiguousarray(q)
    row0 = kv.reserve(T)
    if first < kv.start:
        from ...errors import StateError

        raise StateError(f"KV rows before position {kv.start} were released (asked for {first})")
    if cos is None:
        cos = sin = np.empty((T, 0), np.float32)
    base = first - kv.start
    sinks = _NO_SINKS if sinks is None else sinks
    out = np.empty((T, nh, hd), np.float32)
    with threads.launch():
        _write_kv(np.ascontiguousarray(k), np.ascontiguousarray(v), cos, sin, kv.kt, kv.v, row0)
        kv.end += T
        if tap is None:
            _attend(
                q,
                cos,
                sin,
                qscale,
                kv.kt,
                kv.v,
                base,
                first,
                p0,
                0,
                T,
                window,
                sscale,
                cap,
                sinks,
                _tasks(nkv, 0, T),
                False,
                _NO_PROBS,
                0,
                out,
            )
    if tap is not None:
        for a in range(0, T, block):
            b = min(T, a + block)
            lo = first if window <= 0 else max(first, p0 + a - window + 1)
            hi = p0 + b
            probs = np.empty((nkv, g, b - a, hi - lo), np.float32)
            with threads.launch():
                _attend(
                    q,
                    cos,
                    sin,
                    qscale,
                    kv.kt,
                    kv.v,
                    base,
                    first,
                    p0,
                    a,
                    b,
                    window,
                    sscale,
                    cap,
                    sinks,
                    _tasks(nkv, a, b),
                    True,
                    probs,
                    lo,
                    out,
                )
            tap("weights", p0 + a, lo, probs)
    return out.reshape(T, nh * hd)


@numba.njit(**_PAR)
def _silu_rows(g, u, out, chunk):  # pragma: no cover - compiled
    """out = g / (1 + exp(-g)) * u elementwise, decode's `_silu_mul` arithmetic (its exp the
    polynomial `_exp_poly`), rows in tasks of ``chunk``. Written out rather than calling
    `_silu_mul`, whose in-place exp ran its scalar loop (see `_exp_shifted`)."""
    R, n = out.shape
    for c in prange((R + chunk - 1) // chunk):
        e = np.empty(n, np.float32)
        bits = np.empty(n, np.int32)
        scale = bits.view(np.float32)
        for r in range(c * chunk, min(R, (c + 1) * chunk)):
            for i in range(n):
                p, fn = _exp_poly(-g[r, i])
                e[i] = p
                bits[i] = (np.int32(fn) + np.int32(127)) << np.int32(23)
            for i in range(n):
                out[r, i] = g[r, i] / (F32(1.0) + e[i] * scale[i]) * u[r, i]


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SiLU(g) · u for [T, n] float32 (views allowed), rows split over the threads; each row's
    bytes are `vindex3.exec.ops.decode.silu_mul`'s."""
    out = np.empty(g.shape, np.float32)
    with threads.launch():
        _silu_rows(g, u, out, _chunk(g.shape[0]))
    return out


@numba.njit(**_PAR)
def _rms_par(x, w, eps, out, chunk):  # pragma: no cover - compiled
    R = x.shape[0]
    nc = (R + chunk - 1) // chunk
    ok = np.ones(nc, np.bool_)
    for c in prange(nc):
        r0 = c * chunk
        r1 = min(R, r0 + chunk)
        ok[c] = _rms_rows(x[r0:r1], w, eps, out[r0:r1])
    return ok.all()


def rms_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> tuple[np.ndarray, bool]:
    """x [..., d] float32 -> (its RMSNorm, whether every mean of squares is finite), the bytes of
    `vindex3.exec.ops.norm.rms_norm`'s numpy path, rows split over the threads."""
    if type(eps) is not np.float32:
        eps = np.float32(eps)
    shape = x.shape
    x2 = np.ascontiguousarray(x).reshape(-1, shape[-1])
    out = np.empty(x2.shape, np.float32)
    with threads.launch():
        ok = _rms_par(x2, weight, eps, out, _chunk(x2.shape[0]))
    return out.reshape(shape), bool(ok)


def _chunk(rows: int) -> int:
    """Rows per task of the row kernels: a few tasks per thread, at least 8 rows each."""
    return max(8, -(-rows // (4 * threads.count())))
