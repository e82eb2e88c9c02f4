"""numba kernels that multiply by a weight straight from its encoded bytes.

Two paths per encoding:

* **rows** (decode, small T): ``Y[t, o] = sum_j W[o, j] * X[t, j]``. Output rows are split
  over numba's threads (``prange`` over tasks of ``ROWS_PER_TASK`` rows); one row of W is
  read once from memory and dotted with every x row while it sits in L1, so T tokens cost
  one pass over the weight bytes.
* **tiles** (prefill, large T): rows of W are decoded into an f32 tile of about
  ``TILE_BYTES`` and BLAS multiplies the tile; no f32 copy of the whole matrix ever exists.

Arithmetic, and what the results depend on
------------------------------------------
The rows kernels are compiled with ``fastmath={"reassoc"}`` and nothing else: LLVM may
reorder the additions of one dot product (that is what lets it keep several vector
accumulators in registers; with fastmath fully off the reduction stays one scalar chain, or,
written as explicit lanes in an array, a store-to-load chain, and int8/q4 ran 3x slower).
No FMA contraction (no "contract"), no approximate reciprocals or functions, NaN and
infinity semantics kept. The order LLVM picks is fixed in the compiled code, so:

* results are a function of the inputs and the compiled kernel only: every output element is
  computed by exactly one thread from start to end, so the bytes of ``Y`` do not depend on the
  number of threads or on how rows are split into tasks (tests/test_codecs.py asserts this);
* two runs of the same kernel on the same inputs are bit-identical, so Full and Draft, which
  run the same kernels, stay bit-identical;
* the order differs from BLAS's (results differ from ``x @ W.T`` in the last bits) and may
  differ between CPUs with different vector widths (numba compiles for the host CPU), and
  between numba specializations of one kernel (read-only vs writable, contiguous vs strided
  arguments compile separately); Full and Draft both hand it read-only mapped bytes.

The decoders (take, dense, prefill tiles) do no reductions; their values are exact functions
of the bytes (the dequantization each codec documents), identical on every machine.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .f16bits import scale_f32

F32 = np.float32
ROWS_PER_TASK = 16  # output rows per parallel task
TILE_BYTES = 1 << 20  # f32 bytes of one decoded prefill tile (fits the L2 cache)
_FM = {"reassoc"}

# f16 bit patterns -> float32 values, exact (65536 entries, 256 KiB). Used for block scales.
F16_TABLE = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


# --------------------------------------------------------------------------------------------
# rows path: f32 and int8 weights (the element converts to f32 exactly)
@njit(parallel=True, fastmath=_FM, cache=True)
def rows_plain(W, X, Y, rpt):
    """Y[t, o] = W[o] . X[t]; W [O, I] float32 or int8. Benches only: float32 weights multiply
    with intrinsics.float_kernel (a fixed order, every position in one pass over a row)."""
    O, I = W.shape
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            for t in range(T):
                s = F32(0.0)
                for j in range(I):
                    s += F32(W[o, j]) * X[t, j]
                Y[t, o] = s


@njit(parallel=True, fastmath=_FM, cache=True)
def rows_i8_row_scale(Q, S, X, Y, rpt):
    """Y[t, o] = S[o] * (Q[o] . X[t]); Q [O, I] int8, S [O] float32."""
    O, I = Q.shape
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            for t in range(T):
                s = F32(0.0)
                for j in range(I):
                    s += F32(Q[o, j]) * X[t, j]
                Y[t, o] = S[o] * s


@njit(parallel=True, fastmath=_FM, cache=True)
def rows_i8_block_scale(Q, S, X, Y, rpt):
    """Y[t, o] = sum_j S[o, j // 32] * Q[o, j] * X[t, j]; Q [O, I] int8, S [O, I / 32] float32
    (or uint16 half-precision bits, int8h: a row's scales are made float32 first, exactly).
    One flat loop with the scale fetched per element: a loop per block (a horizontal sum per
    32 products) ran 1.6x slower."""
    O, I = Q.shape
    T = X.shape[0]
    nb = S.shape[1]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        sr = np.empty(nb, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            for b in range(nb):
                sr[b] = scale_f32(S[o, b])
            for t in range(T):
                s = F32(0.0)
                for j in range(I):
                    s += F32(Q[o, j]) * (sr[j >> 5] * X[t, j])
                Y[t, o] = s


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


@njit(parallel=True, fastmath=_FM, cache=True)
def rows_bf16(H, X, Y, rpt):
    """Y[t, o] = widen(H[o]) . X[t]; H [O, I] uint16 bf16 bit patterns."""
    O, I = H.shape
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        bu = np.empty(I, np.uint32)
        bf = bu.view(F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            _widen_bf16(H[o], bu)
            for t in range(T):
                s = F32(0.0)
                for j in range(I):
                    s += bf[j] * X[t, j]
                Y[t, o] = s


@njit(parallel=True, fastmath=_FM, cache=True)
def rows_f16(H, X, Y, rpt):
    """Y[t, o] = widen(H[o]) . X[t]; H [O, I] uint16 IEEE half bit patterns."""
    O, I = H.shape
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        bu = np.empty(I, np.uint32)
        bf = bu.view(F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            _widen_f16(H[o], bu, bf)
            for t in range(T):
                s = F32(0.0)
                for j in range(I):
                    s += bf[j] * X[t, j]
                Y[t, o] = s


# --------------------------------------------------------------------------------------------
# 4-bit blocks: 32 weights share an f16 scale d and an f16 offset m; w = d * q + m, q in 0..15.
# Byte l of a block's 16 bytes holds element l (low nibble) and element l + 16 (high nibble).
@njit(parallel=True, fastmath=_FM, cache=True)
def rows_q4(QS, D, M, table, XL, XH, XS, Y, rpt):
    """Y[t, o] = sum_i d[i // 16] * (lo(QS[o, i]) * XL[t, i] + hi(QS[o, i]) * XH[t, i])
    + sum_b m_b * XS[t, b]. XL, XH, XS come from `q4_split_x` (once per call, shared by every
    row): the x elements that byte i's low and high nibbles multiply, and the block sums. One
    flat loop over a row's bytes runs 2x faster than a loop per block."""
    O, H = QS.shape
    nb = D.shape[1]
    T = XL.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        dr = np.empty(nb, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            for b in range(nb):
                dr[b] = table[D[o, b]]
            for t in range(T):
                s = F32(0.0)
                for i in range(H):
                    v = QS[o, i]
                    # back to uint8 before converting: numba types the nibble as int64, and
                    # int64 lanes made this loop 4-5x slower
                    lo = np.uint8(v & np.uint8(15))
                    hi = np.uint8(v >> np.uint8(4))
                    s += dr[i >> 4] * (F32(lo) * XL[t, i] + F32(hi) * XH[t, i])
                for b in range(nb):
                    s += table[M[o, b]] * XS[t, b]
                Y[t, o] = s


@njit(cache=True)
def q4_split_x(X):
    """XL[t, i] = X[t, 32 (i // 16) + i % 16], XH[t, i] = the element 16 further, XS[t, b] the
    sum of block b (in element order)."""
    T, n = X.shape
    H = n // 2
    nb = n // 32
    XL = np.empty((T, H), F32)
    XH = np.empty((T, H), F32)
    XS = np.empty((T, nb), F32)
    for t in range(T):
        for b in range(nb):
            s = F32(0.0)
            for l in range(16):
                a = X[t, 32 * b + l]
                c = X[t, 32 * b + 16 + l]
                XL[t, 16 * b + l] = a
                XH[t, 16 * b + l] = c
            for l in range(32):
                s += X[t, 32 * b + l]
            XS[t, b] = s
    return XL, XH, XS


# --------------------------------------------------------------------------------------------
# groups: several weights against one activation (q/k/v, gate/up) in one launch, tasks of
# ``rpt`` rows laid end to end over the weights (the fixed-order kernels of intrinsics.py use
# these). The reassociating rows kernels above have no group form: a copy of their loop in
# another kernel was measured to sum in another order (int8 at K = 32), so under
# activations = 'exact' those encodings keep one launch per weight and their bytes.
@njit(inline="always")
def _task_starts(n, rows_of, rpt):
    starts = np.empty(n + 1, np.int64)
    starts[0] = 0
    for i in range(n):
        starts[i + 1] = starts[i] + (rows_of[i] + rpt - 1) // rpt
    return starts


@njit(inline="always")
def _which(starts, k):
    i = 0
    while k >= starts[i + 1]:
        i += 1
    return i


# --------------------------------------------------------------------------------------------
# decoders: rows ``rows`` of W into float32 ``out`` [len(rows), I] (take, dense, prefill tiles).
# Each writes exactly the value dense() promises, the documented dequantization. They run on
# one thread: a prefill tile is decoded between two BLAS calls, and numba workers waking while
# BLAS's threads still spin would fight them for the cores; a row gather is a handful of rows.
@njit(cache=True)
def decode_bf16(H, rows, out_u):
    for r in range(rows.shape[0]):
        _widen_bf16(H[rows[r]], out_u[r])


@njit(cache=True)
def decode_f16(H, rows, out_u, out_f):
    for r in range(rows.shape[0]):
        _widen_f16(H[rows[r]], out_u[r], out_f[r])


@njit(cache=True)
def decode_i8_row_scale(Q, S, rows, out):
    I = Q.shape[1]
    for r in range(rows.shape[0]):
        o = rows[r]
        d = S[o]
        for j in range(I):
            out[r, j] = F32(Q[o, j]) * d


@njit(cache=True)
def decode_i8_block_scale(Q, S, rows, out, block):
    nb = S.shape[1]
    for r in range(rows.shape[0]):
        o = rows[r]
        for b in range(nb):
            d = scale_f32(S[o, b])
            base = b * block
            for l in range(block):
                out[r, base + l] = F32(Q[o, base + l]) * d


@njit(cache=True)
def decode_q4(QS, D, M, table, rows, out):
    nb = D.shape[1]
    for r in range(rows.shape[0]):
        o = rows[r]
        for b in range(nb):
            d = table[D[o, b]]
            m = table[M[o, b]]
            for l in range(16):
                v = QS[o, b * 16 + l]
                out[r, b * 32 + l] = d * F32(np.uint8(v & np.uint8(15))) + m
                out[r, b * 32 + 16 + l] = d * F32(np.uint8(v >> np.uint8(4))) + m


# --------------------------------------------------------------------------------------------
# non-finite counts, from the encoded bytes, for the container's first-use scan: exactly the
# elements whose documented value (the dequantization above, in float32) is NaN or infinite.
@njit(cache=True)
def nonfinite_i8_block_scale(Q, S, block):
    bad = 0
    nb = S.shape[1]
    for o in range(Q.shape[0]):
        for b in range(nb):
            d = scale_f32(S[o, b])
            if np.isfinite(d) and abs(d) * F32(128.0) <= F32(3.4028234663852886e38):
                continue  # every code (|q| <= 128) times d is finite
            base = b * block
            for l in range(block):
                v = F32(Q[o, base + l]) * d
                if not np.isfinite(v):
                    bad += 1
    return bad


@njit(cache=True)
def nonfinite_q4(QS, D, M, table):
    bad = 0
    nb = D.shape[1]
    for o in range(QS.shape[0]):
        for b in range(nb):
            d = table[D[o, b]]
            m = table[M[o, b]]
            if np.isfinite(d) and np.isfinite(m):
                continue  # |d*15 + m| <= 16 * 65504: finite in float32
            for l in range(16):
                v = QS[o, b * 16 + l]
                if not np.isfinite(d * F32(np.uint8(v & np.uint8(15))) + m):
                    bad += 1
                if not np.isfinite(d * F32(np.uint8(v >> np.uint8(4))) + m):
                    bad += 1
    return bad
