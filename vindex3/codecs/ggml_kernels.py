"""numba kernels for the GGML block encodings (vindex3.codecs.ggml): decoders that turn one
block of a file's bytes into float32 exactly as ``gguf.quants.dequantize`` does, and a rows
kernel that multiplies by a weight straight from those blocks.

Arithmetic
----------
Each decoder performs, element by element, the float32 operations of gguf 0.19's numpy
dequantizer for that type, in the same order and with the same roundings: an f16 scale widened
exactly (a table of all 65536 values), sub-block scales formed as ``d * sc`` (one rounding),
then ``d * q`` or ``d * q + m`` / ``d * q - dm`` (a rounding after each operation; no fused
multiply-add: the decoders are compiled without fastmath, so LLVM may not contract them). The
values are therefore exact functions of the bytes and identical on every machine
(tests/test_codecs_ggml.py compares them bit for bit with ``gguf.quants.dequantize``).

Decode-sized products (`rows_fused`, what GgmlWeight.mm runs for up to ``small_t`` activation
rows) dot each block's codes with x straight from the bytes and apply the block's scale to that
partial sum (see "Fused products" below), with ``fastmath={"reassoc"}`` (as vindex3.codecs.kernels
does: the order of one dot's additions is LLVM's, fixed in the compiled code). `rows_blocks`, the
kernel they replaced (decode a row into an L1 scratch row, then dot), is kept as the bench's
reference arm (bench/ggml_kernels.py). Each output element is computed by one thread, so results
do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

F32 = np.float32
_FM = {"reassoc"}

# f16 bit patterns -> float32 values, exact.
F16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
# e2m1 values doubled (gguf.quants.MXFP4.kvalues), indexed by the 4-bit code
KVALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)

# kind ids (vindex3.codecs.ggml.KINDS holds the same numbers)
Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4 = range(9)
# (elements, bytes) of one block, by kind id
BLOCK = np.array([(32, 34), (32, 18), (32, 20), (32, 22), (32, 24), (256, 144), (256, 176), (256, 210), (32, 17)],
                 dtype=np.int64)


@njit(inline="always")
def _h(b, p, table):
    """The f16 value stored little-endian at bytes p, p+1."""
    return table[np.int64(b[p]) | (np.int64(b[p + 1]) << 8)]


@njit(inline="always")
def _k_scale_min(b, p, j):
    """Q4_K / Q5_K: the 6-bit scale and min of sub-block j from the 12 bytes at p."""
    if j < 4:
        sc = np.int64(b[p + j]) & 63
        mn = np.int64(b[p + 4 + j]) & 63
    else:
        sc = (np.int64(b[p + 8 + j - 4]) & 15) | ((np.int64(b[p + j - 4]) >> 2) & 0x30)
        mn = (np.int64(b[p + 8 + j - 4]) >> 4) | ((np.int64(b[p + 4 + j - 4]) >> 2) & 0x30)
    return sc, mn


@njit(inline="always")
def _q8_0(b, p, out, o, table):
    d = _h(b, p, table)
    q = b[p + 2 : p + 34]
    w = out[o : o + 32]
    for i in range(32):
        w[i] = F32(np.int8(q[i])) * d


@njit(inline="always")
def _q4_0(b, p, out, o, table):
    d = _h(b, p, table)
    q = b[p + 2 : p + 18]
    lo = out[o : o + 16]
    hi = out[o + 16 : o + 32]
    for i in range(16):
        v = q[i]
        lo[i] = d * F32(np.int32(v & np.uint8(15)) - 8)
        hi[i] = d * F32(np.int32(v >> np.uint8(4)) - 8)


@njit(inline="always")
def _q4_1(b, p, out, o, table):
    d = _h(b, p, table)
    m = _h(b, p + 2, table)
    q = b[p + 4 : p + 20]  # views: indices from range() need no negative-index handling
    lo = out[o : o + 16]
    hi = out[o + 16 : o + 32]
    for i in range(16):
        v = q[i]
        lo[i] = d * F32(np.int32(v & np.uint8(15))) + m
        hi[i] = d * F32(np.int32(v >> np.uint8(4))) + m


@njit(inline="always")
def _q5(b, p, out, o, table, with_min):
    d = _h(b, p, table)
    m = F32(0.0)
    q = p + 2
    if with_min:
        m = _h(b, p + 2, table)
        q = p + 4
    qh = np.uint32(b[q]) | (np.uint32(b[q + 1]) << np.uint32(8)) | (np.uint32(b[q + 2]) << np.uint32(16)) | (
        np.uint32(b[q + 3]) << np.uint32(24))
    qs = b[q + 4 : q + 20]
    wl = out[o : o + 16]
    wh = out[o + 16 : o + 32]
    for i in range(16):
        v = qs[i]
        lo = np.int32(v & np.uint8(15)) | (np.int32((qh >> np.uint32(i)) & np.uint32(1)) << 4)
        hi = np.int32(v >> np.uint8(4)) | (np.int32((qh >> np.uint32(i + 16)) & np.uint32(1)) << 4)
        if with_min:
            wl[i] = d * F32(lo) + m
            wh[i] = d * F32(hi) + m
        else:
            wl[i] = d * F32(lo - 16)
            wh[i] = d * F32(hi - 16)


@njit(inline="always")
def _qk(b, p, out, o, table, five):
    d = _h(b, p, table)
    dmin = _h(b, p + 2, table)
    qs = p + 48 if five else p + 16
    for s in range(8):
        sc, mn = _k_scale_min(b, p + 4, s)
        ds = d * F32(sc)
        dm = dmin * F32(mn)
        g = s >> 1
        sh = np.uint8(4 * (s & 1))
        q = b[qs + 32 * g : qs + 32 * g + 32]
        qh = b[p + 16 : p + 48]
        w = out[o + 32 * s : o + 32 * s + 32]
        for l in range(32):
            c = np.int32((q[l] >> sh) & np.uint8(15))
            if five:
                c = c | (np.int32((qh[l] >> np.uint8(s)) & np.uint8(1)) << 4)
            w[l] = ds * F32(c) - dm


@njit(inline="always")
def _q6_k(b, p, out, o, table):
    # element 128 g + 32 j + l (j = 0..3, l = 0..31) takes the low (j = 0, 1) or high (j = 2, 3)
    # nibble of ql[64 g + 32 (j & 1) + l] and bits 2 j, 2 j + 1 of qh[32 g + l]; its scale is
    # sub-block (128 g + 32 j + l) // 16
    d = _h(b, p + 208, table)
    sc = b[p + 192 : p + 208]
    for g in range(2):
        ql = b[p + 64 * g : p + 64 * g + 64]
        qh = b[p + 128 + 32 * g : p + 128 + 32 * g + 32]
        for j in range(4):
            w = out[o + 128 * g + 32 * j : o + 128 * g + 32 * j + 32]
            q = ql[32 * (j & 1) : 32 * (j & 1) + 32]
            sh = 4 * (j >> 1)
            for half in range(2):
                ds = d * F32(np.int8(sc[8 * g + 2 * j + half]))
                for l in range(16 * half, 16 * half + 16):
                    c = ((np.int32(q[l]) >> sh) & 15) | (((np.int32(qh[l]) >> (2 * j)) & 3) << 4)
                    w[l] = ds * F32(c - 32)


@njit(inline="always")
def _kv(c):
    """KVALUES[c] as an integer (e2m1 doubled: 0 1 2 3 4 6 8 12, code 8 and up negative, code 8
    itself +0 as gguf reads it), computed instead of looked up so the loop needs no gather."""
    m = c & 7
    v = m if m < 4 else (2 + (m & 1)) << ((m >> 1) - 1)
    return -v if c & 8 else v


@njit(inline="always")
def _mxfp4(b, p, out, o, kv):
    e = np.uint32(b[p])
    if e < np.uint32(2):
        bits = np.uint32(0x00200000) << e
    else:
        bits = (e - np.uint32(1)) << np.uint32(23)
    d = np.array([bits], dtype=np.uint32).view(np.float32)[0]
    q = b[p + 1 : p + 17]
    lo = out[o : o + 16]
    hi = out[o + 16 : o + 32]
    for i in range(16):
        v = q[i]
        lo[i] = d * F32(_kv(np.int32(v & np.uint8(15))))
        hi[i] = d * F32(_kv(np.int32(v >> np.uint8(4))))


@njit(cache=True)
def decode_row(kind, b, out, table, kv, be, bb):
    """One row of blocks (bytes ``b``) -> ``out`` float32 [blocks * be]. The type is chosen
    once per row; each block decoder is inlined into its own loop."""
    nb = out.shape[0] // be
    if kind == Q8_0:
        for k in range(nb):
            _q8_0(b, k * bb, out, k * be, table)
    elif kind == Q4_0:
        for k in range(nb):
            _q4_0(b, k * bb, out, k * be, table)
    elif kind == Q4_1:
        for k in range(nb):
            _q4_1(b, k * bb, out, k * be, table)
    elif kind == Q5_0:
        for k in range(nb):
            _q5(b, k * bb, out, k * be, table, False)
    elif kind == Q5_1:
        for k in range(nb):
            _q5(b, k * bb, out, k * be, table, True)
    elif kind == Q4_K:
        for k in range(nb):
            _qk(b, k * bb, out, k * be, table, False)
    elif kind == Q5_K:
        for k in range(nb):
            _qk(b, k * bb, out, k * be, table, True)
    elif kind == Q6_K:
        for k in range(nb):
            _q6_k(b, k * bb, out, k * be, table)
    elif kind == MXFP4:
        for k in range(nb):
            _mxfp4(b, k * bb, out, k * be, kv)


@njit(cache=True)
def decode_rows(kind, B, rows, out, table, kv, be, bb):
    """Rows ``rows`` of B [R, row bytes] -> out [len(rows), cols] (one thread: see kernels.py)."""
    for r in range(rows.shape[0]):
        decode_row(kind, B[rows[r]], out[r], table, kv, be, bb)


@njit(parallel=True, fastmath=_FM, cache=True)
def rows_blocks(kind, B, X, Y, rpt, table, kv, be, bb):
    """Y[t, o] = decode(B[o]) . X[t]; B [O, row bytes] uint8 blocks of ``kind``: the decode-then-dot
    kernel `rows_fused` replaced, kept as the bench's reference arm."""
    O = B.shape[0]
    I = X.shape[1]
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        w = np.empty(I, F32)
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            decode_row(kind, B[o], w, table, kv, be, bb)
            for t in range(T):
                s = F32(0.0)
                for j in range(I):
                    s += w[j] * X[t, j]
                Y[t, o] = s


@njit(cache=True)
def nonfinite_blocks(kind, B, table, kv, be, bb):
    """Elements whose decoded value is NaN or infinite."""
    I = B.shape[1] // bb * be
    w = np.empty(I, F32)
    bad = 0
    for o in range(B.shape[0]):
        decode_row(kind, B[o], w, table, kv, be, bb)
        for j in range(I):
            if not np.isfinite(w[j]):
                bad += 1
    return bad


# --------------------------------------------------------------------------------------------
# Fused products (decode-sized, T <= small_t activation rows): each block's codes are dotted with
# x straight from the bytes, never through a decoded scratch row, and the block's scale applied
# to that partial sum:
#     sum_i w_i x_i = d * sum_i c_i x_i  (+ m * sum_i x_i for the types with an offset)
# (per sub-block for the K-quants) instead of sum_i (d * c_i) * x_i: a reassociation of float32
# products (the rows kernel's dot is reassociated already), so the result is within the classical
# bound of a float32 dot product of the exact decoded weights (tests/test_codecs_ggml.py), not
# bit-equal to the decode-then-dot kernel. Each output element is computed by one thread, so
# results do not depend on the thread count.
#
# Why this shape (measured, bench/ggml_kernels.py): numba turns LLVM's SLP vectorizer off, so a
# loop with a constant trip count (16 bytes of a q4 block) is fully unrolled into scalar
# conversions and never vectorized. The inner loops here run to a bound derived from the block
# size argument (a runtime value), so the loop vectorizer takes them, and index with unsigned
# offsets (no negative-index fix-up per access, which also blocks it). Codes stay in 8-bit lanes
# until converted (numba widens small-int arithmetic to int64, which does not vectorize).

U = np.uint64


@njit(cache=True)
def block_sums(X):
    """XS[t, b] = sum of X[t, 32 b : 32 b + 32] (in element order), for the offset terms."""
    T, n = X.shape
    nb = n // 32
    XS = np.empty((T, nb), F32)
    for t in range(T):
        for b in range(nb):
            s = F32(0.0)
            for l in range(32):
                s += X[t, 32 * b + l]
            XS[t, b] = s
    return XS


@njit(inline="always")
def _hu(r, p, table):
    return table[np.int64(r[p]) | (np.int64(r[p + U(1)]) << 8)]


@njit(inline="always", fastmath=_FM)
def _dot_q8_0(r, p, x, o, xs, k, table, n):
    a = F32(0.0)
    for i in range(n):  # n = 32
        a += F32(np.int8(r[p + U(2) + U(i)])) * x[o + U(i)]
    return _hu(r, p, table) * a


@njit(inline="always", fastmath=_FM)
def _dot_q4(r, p, x, o, xs, k, table, n, with_min):
    q = p + U(4) if with_min else p + U(2)
    a = F32(0.0)
    for i in range(n):  # n = 16: byte i holds element i (low nibble) and i + 16 (high)
        v = r[q + U(i)]
        lo = F32(np.uint8(v & np.uint8(15)))
        hi = F32(np.uint8(v >> np.uint8(4)))
        if not with_min:
            lo -= F32(8.0)
            hi -= F32(8.0)
        a += lo * x[o + U(i)] + hi * x[o + U(16) + U(i)]
    s = _hu(r, p, table) * a
    if with_min:
        s += _hu(r, p + U(2), table) * xs[k]
    return s


@njit(inline="always", fastmath=_FM)
def _dot_q5(r, p, x, o, xs, k, table, n, with_min):
    q = p + U(4) if with_min else p + U(2)
    # the 32 fifth bits: element i's is bit i of the little-endian word at q
    qh = np.uint32(r[q]) | (np.uint32(r[q + U(1)]) << np.uint32(8)) | (np.uint32(r[q + U(2)]) << np.uint32(16)) | (
        np.uint32(r[q + U(3)]) << np.uint32(24))
    a = F32(0.0)
    for i in range(n):  # n = 16
        v = r[q + U(4) + U(i)]
        hl = np.uint8((qh >> np.uint32(i)) & np.uint32(1))
        hh = np.uint8((qh >> np.uint32(i + 16)) & np.uint32(1))
        lo = F32(np.uint8((v & np.uint8(15)) | (hl << np.uint8(4))))
        hi = F32(np.uint8((v >> np.uint8(4)) | (hh << np.uint8(4))))
        if not with_min:
            lo -= F32(16.0)
            hi -= F32(16.0)
        a += lo * x[o + U(i)] + hi * x[o + U(16) + U(i)]
    s = _hu(r, p, table) * a
    if with_min:
        s += _hu(r, p + U(2), table) * xs[k]
    return s


@njit(inline="always", fastmath=_FM)
def _dot_qk(r, p, x, o, xs, k, table, n, five):
    d = _hu(r, p, table)
    dmin = _hu(r, p + U(2), table)
    qs = p + U(48) if five else p + U(16)
    s = F32(0.0)
    for g in range(4):  # 64 elements: sub-block 2g from the low nibbles, 2g + 1 from the high
        q = qs + U(32 * g)
        x0 = o + U(64 * g)
        s0 = np.uint8(2 * g)
        s1 = np.uint8(2 * g + 1)
        a0 = F32(0.0)
        a1 = F32(0.0)
        for l in range(n):  # n = 32
            v = r[q + U(l)]
            c0 = np.uint8(v & np.uint8(15))
            c1 = np.uint8(v >> np.uint8(4))
            if five:
                h = r[p + U(16) + U(l)]
                c0 = np.uint8(c0 | (((h >> s0) & np.uint8(1)) << np.uint8(4)))
                c1 = np.uint8(c1 | (((h >> s1) & np.uint8(1)) << np.uint8(4)))
            a0 += F32(c0) * x[x0 + U(l)]
            a1 += F32(c1) * x[x0 + U(32) + U(l)]
        sc0, mn0 = _k_scale_min(r, p + U(4), 2 * g)
        sc1, mn1 = _k_scale_min(r, p + U(4), 2 * g + 1)
        b = 8 * k + 2 * g
        s += (d * F32(sc0)) * a0 - (dmin * F32(mn0)) * xs[b]
        s += (d * F32(sc1)) * a1 - (dmin * F32(mn1)) * xs[b + 1]
    return s


@njit(inline="always", fastmath=_FM)
def _dot_q6_k(r, p, x, o, xs, k, table, n):
    d = _hu(r, p + U(208), table)
    s = F32(0.0)
    for g in range(2):
        for half in range(2):
            l0 = U(16 * half)
            ql = p + U(64 * g) + l0
            qh = p + U(128 + 32 * g) + l0
            e = o + U(128 * g) + l0
            a0 = F32(0.0)
            a1 = F32(0.0)
            a2 = F32(0.0)
            a3 = F32(0.0)
            for i in range(n):  # n = 16
                u = r[ql + U(i)]
                w = r[ql + U(32) + U(i)]
                h = r[qh + U(i)]
                c0 = F32(np.uint8((u & np.uint8(15)) | ((h & np.uint8(3)) << np.uint8(4)))) - F32(32.0)
                c1 = F32(np.uint8((w & np.uint8(15)) | (((h >> np.uint8(2)) & np.uint8(3)) << np.uint8(4)))) - F32(32.0)
                c2 = F32(np.uint8((u >> np.uint8(4)) | (((h >> np.uint8(4)) & np.uint8(3)) << np.uint8(4)))) - F32(32.0)
                c3 = F32(np.uint8((w >> np.uint8(4)) | ((h >> np.uint8(6)) << np.uint8(4)))) - F32(32.0)
                a0 += c0 * x[e + U(i)]
                a1 += c1 * x[e + U(32) + U(i)]
                a2 += c2 * x[e + U(64) + U(i)]
                a3 += c3 * x[e + U(96) + U(i)]
            sc = p + U(192 + 8 * g + half)
            s += (d * F32(np.int8(r[sc]))) * a0 + (d * F32(np.int8(r[sc + U(2)]))) * a1
            s += (d * F32(np.int8(r[sc + U(4)]))) * a2 + (d * F32(np.int8(r[sc + U(6)]))) * a3
    return s


@njit(inline="always", fastmath=_FM)
def _dot_mxfp4(r, p, x, o, xs, k, table, n):
    e = np.uint32(r[p])
    if e < np.uint32(2):
        bits = np.uint32(0x00200000) << e
    else:
        bits = (e - np.uint32(1)) << np.uint32(23)
    d = np.array([bits], dtype=np.uint32).view(np.float32)[0]
    a = F32(0.0)
    for i in range(n):  # n = 16
        v = r[p + U(1) + U(i)]
        a += F32(_kv(np.int32(v & np.uint8(15)))) * x[o + U(i)] + F32(_kv(np.int32(v >> np.uint8(4)))) * x[o + U(16) + U(i)]
    return d * a


@njit(fastmath=_FM, cache=True)
def dot_row(kind, r, x, xs, table, be, bb):
    """decode(r) . x for one row of blocks ``r`` (see above). Inner trip counts come from ``be``
    (a runtime value: see above) and equal the constants in the comments."""
    nb = r.shape[0] // bb
    s = F32(0.0)
    if kind == Q8_0:
        for k in range(nb):
            s += _dot_q8_0(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be)
    elif kind == Q4_0:
        for k in range(nb):
            s += _dot_q4(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 1, False)
    elif kind == Q4_1:
        for k in range(nb):
            s += _dot_q4(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 1, True)
    elif kind == Q5_0:
        for k in range(nb):
            s += _dot_q5(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 1, False)
    elif kind == Q5_1:
        for k in range(nb):
            s += _dot_q5(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 1, True)
    elif kind == Q4_K:
        for k in range(nb):
            s += _dot_qk(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 3, False)
    elif kind == Q5_K:
        for k in range(nb):
            s += _dot_qk(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 3, True)
    elif kind == Q6_K:
        for k in range(nb):
            s += _dot_q6_k(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 4)
    elif kind == MXFP4:
        for k in range(nb):
            s += _dot_mxfp4(r, U(k) * U(bb), x, U(k) * U(be), xs, k, table, be >> 1)
    return s


@njit(parallel=True, fastmath=_FM, cache=True)
def rows_fused(kind, B, X, XS, Y, rpt, table, be, bb):
    """Y[t, o] = decode(B[o]) . X[t] by `dot_row`; XS from `block_sums(X)`."""
    O = B.shape[0]
    T = X.shape[0]
    ntask = (O + rpt - 1) // rpt
    for k in prange(ntask):
        for o in range(k * rpt, min(O, (k + 1) * rpt)):
            for t in range(T):
                Y[t, o] = dot_row(kind, B[o], X[t], XS[t], table, be, bb)
