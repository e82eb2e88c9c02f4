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

The rows kernel decodes one weight row into an L1 scratch row (the exact values above) and
dots it with every activation row with ``fastmath={"reassoc"}`` (as vindex3.codecs.kernels
does: the order of one dot's additions is LLVM's, fixed in the compiled code); each output
element is computed by one thread, so results do not depend on the thread count.
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
    """Y[t, o] = decode(B[o]) . X[t]; B [O, row bytes] uint8 blocks of ``kind``."""
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
