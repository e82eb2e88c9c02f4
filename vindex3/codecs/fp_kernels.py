"""numba kernels for the small-float encodings with block scales (vindex3.codecs.fp8 and
vindex3.codecs.nvfp4): exact decoders and rows kernels that decode a weight row into an L1
scratch row and dot it with every activation row.

Element values come from 256- and 16-entry tables of exact float32 values (every e4m3 and e2m1
value is a float32); a weight is then one float32 product (fp8: value * block scale) or two
(nvfp4: e2m1 * (e4m3 scale * global scale)), each rounded once, no fused multiply-add (the
decoders are compiled without fastmath). The dot products of a decoded row are those of the f32
rows kernel (vindex3.codecs.intrinsics, an order written in LLVM IR, every activation row in
one pass), one thread per output element: a product equals its dequantized float32 twin's."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from .intrinsics import FLOAT_GEOMETRY, _make_float_dots

F32 = np.float32
_L, _PT = FLOAT_GEOMETRY["f32"]
_dots = _make_float_dots("f32", _L, _PT)


@njit(inline="always")
def _row_dots(w, X, Y, o, tmp):
    """Y[t, o] = w . X[t] for every t, in the f32 rows kernel's order."""
    w2 = w.reshape(1, w.shape[0])
    for t0 in range(0, X.shape[0], _PT):
        _dots(w2, 0, 1, X, t0, tmp)
        for t in range(t0, min(X.shape[0], t0 + _PT)):
            Y[t, o] = tmp[t, 0]


def _e4m3_table() -> np.ndarray:
    """float8 e4m3fn (OCP FP8, "fn": no infinities): sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m * 2^-9); 0x7F and 0xFF are NaN."""
    out = np.empty(256, np.float32)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e = (b >> 3) & 0xF
        m = b & 7
        if e == 15 and m == 7:
            out[b] = np.nan
        elif e == 0:
            out[b] = s * m * 2.0**-9
        else:
            out[b] = s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return out


E4M3 = _e4m3_table()
# e2m1 (OCP FP4): sign, 2 exponent bits, 1 mantissa bit
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


# ------------------------------------------------------------------------------------------------
# fp8 e4m3 with one float32 scale per 128 x 128 block of a matrix
@njit(inline="always")
def _fp8_row(Q, S, O, a, out, table):
    """Row ``a`` (absolute, over every stacked matrix) of codes Q [rows, I] into out [I]."""
    m = a // O
    br = (a % O) >> 7
    I = out.shape[0]
    for c in range(I):
        out[c] = table[Q[c]] * S[m, br, c >> 7]


@njit(cache=True)
def decode_fp8(Q, S, O, r0, rows, out, table):
    for r in range(rows.shape[0]):
        _fp8_row(Q[rows[r]], S, O, r0 + rows[r], out[r], table)


@njit(parallel=True)
def rows_fp8(Q, S, O, r0, X, Y, rpt, table):
    R, I = Q.shape
    T = X.shape[0]
    ntask = (R + rpt - 1) // rpt
    for k in prange(ntask):
        w = np.empty(I, F32)
        tmp = np.empty((T, 1), F32)
        for o in range(k * rpt, min(R, (k + 1) * rpt)):
            _fp8_decode_one(Q[o], S, O, r0 + o, w, table)
            _row_dots(w, X, Y, o, tmp)


@njit(cache=True)
def _fp8_decode_one(q, S, O, a, out, table):
    # not inlined: the decode keeps its own (non-fastmath) compilation inside the rows kernel
    _fp8_row(q, S, O, a, out, table)


# ------------------------------------------------------------------------------------------------
# nvfp4: e2m1 codes, two per byte (element 2i in the low nibble), an e4m3 scale per 16 elements
# and one float32 global scale per matrix
@njit(inline="always")
def _nvfp4_row(P, Sc, G, O, a, out, e2m1, e4m3):
    g = G[a // O]
    nb = Sc.shape[0]
    for b in range(nb):
        d = e4m3[Sc[b]] * g
        for i in range(8):
            v = P[8 * b + i]
            out[16 * b + 2 * i] = e2m1[v & np.uint8(15)] * d
            out[16 * b + 2 * i + 1] = e2m1[v >> np.uint8(4)] * d


@njit(cache=True)
def _nvfp4_decode_one(p, sc, G, O, a, out, e2m1, e4m3):
    _nvfp4_row(p, sc, G, O, a, out, e2m1, e4m3)


@njit(cache=True)
def decode_nvfp4(P, Sc, G, O, r0, rows, out, e2m1, e4m3):
    for r in range(rows.shape[0]):
        o = rows[r]
        _nvfp4_row(P[o], Sc[o], G, O, r0 + o, out[r], e2m1, e4m3)


@njit(parallel=True)
def rows_nvfp4(P, Sc, G, O, r0, X, Y, rpt, e2m1, e4m3):
    R = P.shape[0]
    I = X.shape[1]
    T = X.shape[0]
    ntask = (R + rpt - 1) // rpt
    for k in prange(ntask):
        w = np.empty(I, F32)
        tmp = np.empty((T, 1), F32)
        for o in range(k * rpt, min(R, (k + 1) * rpt)):
            _nvfp4_decode_one(P[o], Sc[o], G, O, r0 + o, w, e2m1, e4m3)
            _row_dots(w, X, Y, o, tmp)
