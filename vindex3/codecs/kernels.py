"""numba kernels that multiply by a weight straight from its encoded bytes.

Two paths per encoding:

* **rows** (decode, small T): ``Y[t, o] = sum_j W[o, j] * X[t, j]``. Output rows are split
  over numba's threads (``prange`` over tasks of ``ROWS_PER_TASK`` rows); one row of W is
  read once from memory and dotted with every x row while it sits in L1, so T tokens cost
  one pass over the weight bytes.
* **tiles** (prefill, large T): rows of W are decoded into an f32 tile of about
  ``TILE_BYTES`` and BLAS multiplies the tile; no f32 copy of the whole matrix ever exists.

Summation order, and why results do not depend on the thread count
-------------------------------------------------------------------
fastmath is off everywhere. A dot product is accumulated in ``lanes`` partial sums: lane
``l`` adds the products of elements ``l, l + lanes, l + 2*lanes, ...`` in that order, then
the lanes are added in order 0, 1, ..., lanes-1, then the tail (``n % lanes`` elements) in
order. That order is written in the source, so LLVM may not change it; it vectorizes the
lane loop because lanes are independent (no reassociation needed). ``lanes`` is passed at
run time on purpose: a compile-time trip count of 16 gets fully unrolled into scalar code
before the loop vectorizer runs (numba keeps LLVM's SLP vectorizer off). Every output
element is computed by exactly one thread, start to end, so the bytes of ``Y`` do not
depend on the thread count or on how rows are split into tasks. The order differs from
BLAS's, so a rows-path result differs from ``x @ W.T`` in the last bits; two runs of the
same kernel on the same inputs are bit-identical.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32
LANES = 16  # float32 lanes of one dot product (an AVX-512 register; two AVX2 registers)
ROWS_PER_TASK = 16  # output rows per parallel task
TILE_BYTES = 1 << 20  # f32 bytes of one decoded prefill tile (fits the L2 cache)

# f16 bit patterns -> float32 values, exact (65536 entries, 256 KiB). Used for block scales.
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# --------------------------------------------------------------------------------------------
# one dot product in a fixed order
@njit(inline="always")
def _dot(w, x, acc, lanes):
    n = x.shape[0]
    nb = n // lanes
    for l in range(lanes):
        acc[l] = F32(0.0)
    for b in range(nb):
        base = b * lanes
        for l in range(lanes):
            acc[l] += F32(w[base + l]) * x[base + l]
    s = acc[0]
    for l in range(1, lanes):
        s += acc[l]
    for j in range(nb * lanes, n):
        s += F32(w[j]) * x[j]
    return s


# --------------------------------------------------------------------------------------------
# rows path: f32 and int8 weights (the element converts to f32 exactly)
@njit(parallel=True, cache=True)
def rows_plain(W, X, Y, lanes, rpt):
    """Y[t, o] = W[o] . X[t]; W [O, I] float32 or int8."""
    O = W.shape[0]
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        acc = np.empty(lanes, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            w = W[o]
            for t in range(T):
                Y[t, o] = _dot(w, X[t], acc, lanes)


@njit(parallel=True, cache=True)
def rows_i8_row_scale(Q, S, X, Y, lanes, rpt):
    """Y[t, o] = S[o] * (Q[o] . X[t]); Q [O, I] int8, S [O] float32."""
    O = Q.shape[0]
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        acc = np.empty(lanes, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            w = Q[o]
            d = S[o]
            for t in range(T):
                Y[t, o] = d * _dot(w, X[t], acc, lanes)


@njit(parallel=True, cache=True)
def rows_i8_block_scale(Q, S, X, Y, block, rpt):
    """Y[t, o] = sum_b S[o, b] * (Q[o, b-block] . X[t, b-block]); lanes = block (a run-time 32)."""
    O = Q.shape[0]
    T = X.shape[0]
    nb = S.shape[1]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        acc = np.empty(block, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            q = Q[o]
            s = S[o]
            for t in range(T):
                x = X[t]
                for l in range(block):
                    acc[l] = F32(0.0)
                for b in range(nb):
                    d = s[b]
                    base = b * block
                    for l in range(block):
                        acc[l] += d * (F32(q[base + l]) * x[base + l])
                r = acc[0]
                for l in range(1, block):
                    r += acc[l]
                Y[t, o] = r


# --------------------------------------------------------------------------------------------
# 16-bit weights: a row is widened into an L1 scratch row (bit exact), then dotted.
@njit(inline="always")
def _widen_bf16(h, out_u):
    for j in range(h.shape[0]):
        out_u[j] = np.uint32(h[j]) << np.uint32(16)


@njit(inline="always")
def _widen_f16(h, out_u, out_f):
    # Normal numbers, infinities and NaNs: move sign, exponent and mantissa into f32 position
    # and rebias the exponent (15 -> 127); exponent 31 becomes 255. Zeros and subnormals
    # (exponent 0) are exact small integers times 2^-24: a second pass writes those as floats,
    # so no subnormal float arithmetic (and no flush-to-zero setting) is involved.
    n = h.shape[0]
    for j in range(n):
        v = np.uint32(h[j])
        sign = (v & np.uint32(0x8000)) << np.uint32(16)
        e = v & np.uint32(0x7C00)
        body = (v & np.uint32(0x7FFF)) << np.uint32(13)
        if e == np.uint32(0x7C00):
            body = body | np.uint32(0x7F800000)
        else:
            body = body + np.uint32(112 << 23)
        out_u[j] = sign | body
    for j in range(n):
        v = np.uint32(h[j])
        if (v & np.uint32(0x7C00)) == np.uint32(0):
            m = F32(v & np.uint32(0x3FF)) * F32(5.9604644775390625e-08)  # 2^-24
            out_f[j] = -m if (v & np.uint32(0x8000)) else m


@njit(parallel=True, cache=True)
def rows_bf16(H, X, Y, lanes, rpt):
    """Y[t, o] = widen(H[o]) . X[t]; H [O, I] uint16 bf16 bit patterns."""
    O, I = H.shape
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        acc = np.empty(lanes, F32)
        bu = np.empty(I, np.uint32)
        bf = bu.view(F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            _widen_bf16(H[o], bu)
            for t in range(T):
                Y[t, o] = _dot(bf, X[t], acc, lanes)


@njit(parallel=True, cache=True)
def rows_f16(H, X, Y, lanes, rpt):
    """Y[t, o] = widen(H[o]) . X[t]; H [O, I] uint16 IEEE half bit patterns."""
    O, I = H.shape
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        acc = np.empty(lanes, F32)
        bu = np.empty(I, np.uint32)
        bf = bu.view(F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            _widen_f16(H[o], bu, bf)
            for t in range(T):
                Y[t, o] = _dot(bf, X[t], acc, lanes)


# --------------------------------------------------------------------------------------------
# 4-bit blocks: 32 weights share an f16 scale d and an f16 offset m; w = d * q + m, q in 0..15.
# Byte l of a block's 16 bytes holds element l (low nibble) and element l + 16 (high nibble).
@njit(parallel=True, cache=True)
def rows_q4(QS, D, M, table, X, XS, Y, half, rpt):
    """Y[t, o] = sum_b d_b * (q_b . x_b) + m_b * sum(x_b); ``half`` is a run-time 16, XS [T, nb]
    the block sums of X (computed once per call, shared by every row)."""
    O = QS.shape[0]
    nb = D.shape[1]
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        acc = np.empty(2 * half, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            qs = QS[o]
            dd = D[o]
            mm = M[o]
            for t in range(T):
                x = X[t]
                xs = XS[t]
                for l in range(2 * half):
                    acc[l] = F32(0.0)
                macc = F32(0.0)
                for b in range(nb):
                    d = table[dd[b]]
                    qb = b * half
                    xb = 2 * qb
                    for l in range(half):
                        v = qs[qb + l]
                        acc[l] += d * (F32(v & np.uint8(15)) * x[xb + l])
                        acc[half + l] += d * (F32(v >> np.uint8(4)) * x[xb + half + l])
                    macc += table[mm[b]] * xs[b]
                r = acc[0]
                for l in range(1, 2 * half):
                    r += acc[l]
                Y[t, o] = r + macc


@njit(cache=True)
def block_sums(X, block):
    """XS[t, b] = sum of X[t, b*block : (b+1)*block], in element order."""
    T, n = X.shape
    nb = n // block
    XS = np.empty((T, nb), F32)
    for t in range(T):
        for b in range(nb):
            s = F32(0.0)
            for j in range(b * block, (b + 1) * block):
                s += X[t, j]
            XS[t, b] = s
    return XS


# --------------------------------------------------------------------------------------------
# decoders: rows ``rows`` of W into float32 ``out`` [len(rows), I] (take, dense, prefill tiles).
# Each writes exactly the value dense() promises, the documented dequantization.
@njit(parallel=True, cache=True)
def decode_bf16(H, rows, out_u):
    for r in prange(rows.shape[0]):
        _widen_bf16(H[rows[r]], out_u[r])


@njit(parallel=True, cache=True)
def decode_f16(H, rows, out_u, out_f):
    for r in prange(rows.shape[0]):
        _widen_f16(H[rows[r]], out_u[r], out_f[r])


@njit(parallel=True, cache=True)
def decode_i8_row_scale(Q, S, rows, out):
    I = Q.shape[1]
    for r in prange(rows.shape[0]):
        o = rows[r]
        d = S[o]
        for j in range(I):
            out[r, j] = F32(Q[o, j]) * d


@njit(parallel=True, cache=True)
def decode_i8_block_scale(Q, S, rows, out, block):
    nb = S.shape[1]
    for r in prange(rows.shape[0]):
        o = rows[r]
        for b in range(nb):
            d = S[o, b]
            for j in range(b * block, (b + 1) * block):
                out[r, j] = F32(Q[o, j]) * d


@njit(parallel=True, cache=True)
def decode_q4(QS, D, M, table, rows, out, half):
    nb = D.shape[1]
    for r in prange(rows.shape[0]):
        o = rows[r]
        for b in range(nb):
            d = table[D[o, b]]
            m = table[M[o, b]]
            qb = b * half
            xb = 2 * qb
            for l in range(half):
                v = QS[o, qb + l]
                out[r, xb + l] = d * F32(v & np.uint8(15)) + m
                out[r, xb + half + l] = d * F32(v >> np.uint8(4)) + m
