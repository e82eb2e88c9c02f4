"""The blocks of a split product (vindex3.codecs.threads `gemm`) run by numba's own threads.

A prompt's pass alternates products with compiled kernels (norms, attention, SiLU) that run in
numba's OpenMP pool, whose workers spin a while after each region before they sleep
(vindex3.codecs.threads, ``GOMP_SPINCOUNT``). When a product's second block ran on a Python
thread of its own, it started while that worker still spun on the other core, so the two
fought for it: at two threads a 512-token SmolLM2 f32 prefill on AMD Zen 3 took its products
1.5-1.7x faster than one thread where the same blocks alone run 1.8-1.9x faster. Here the blocks
are the iterations of one parallel region: the worker that spins for the next region is the one
that takes the next block.

Each block is the call numpy's ``matmul`` makes for it (numpy/_core/src/umath/matmul.c.src:
``cblas_sgemm(CblasRowMajor, trans1, trans2, M, P, N, 1, A, lda, B, ldb, 0, C, ldc)`` with the
transposes and leading dimensions its ``is_blasable2d`` picks), to the same function of the same
library: numpy's own OpenBLAS (the ``scipy-openblas`` ILP64 build its wheels carry), called
through ctypes from the compiled region. So a block's bytes are ``np.matmul``'s for that block
whoever computes it (tests/test_split_products.py). Anything else falls back to the Python
threads (`run` returns False): another BLAS under numpy, a layout numpy would copy or send to a
special case, a pool smaller than the count asked for."""

from __future__ import annotations

import ctypes
import glob
import itertools
import os

import numba
import numpy as np
from numba import prange

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # cblas.h
_I64 = ctypes.c_int64
_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int, ctypes.c_int, _I64, _I64, _I64, ctypes.c_float, _I64,
                          _I64, _I64, _I64, ctypes.c_float, _I64, _I64)
_state: list = []


def _sgemm():
    """numpy's own cblas_sgemm as a ctypes function, or None (module docstring)."""
    if _state:
        return _state[0]
    fn = None
    try:
        cfg = getattr(np, "__config__", None)
        blas = (getattr(cfg, "CONFIG", {}) or {}).get("Build Dependencies", {}).get("blas", {})
        if blas.get("name") == "scipy-openblas" and "USE64BITINT" in str(blas.get("openblas configuration", "")):
            libs = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs",
                                                 "libscipy_openblas64_*")))
            if len(libs) == 1:
                fn = _PROTO(("scipy_cblas_sgemm64_", ctypes.CDLL(libs[0])))
    except (OSError, AttributeError, TypeError):
        fn = None
    _state.append(fn)
    return fn


@numba.njit(parallel=True, nogil=True, cache=True)
def _blocks(fn, T, K, xp, lda, transb, bp, ldb, bstep, yp, ldc, cuts):  # pragma: no cover - compiled
    """Block i: columns cuts[i]..cuts[i+1] of y [T, N] (C order, ldc) from x [T, K] (C order,
    lda) and the matching columns of b [K, N] (``bstep`` bytes a column)."""
    for i in prange(cuts.shape[0] - 1):
        a = cuts[i]
        fn(_ROW_MAJOR, _NO_TRANS, transb, T, cuts[i + 1] - a, K, np.float32(1.0), xp, lda, bp + a * bstep, ldb,
           np.float32(0.0), yp + a * 4, ldc)


def _c_blasable(a: np.ndarray, width: int) -> bool:
    """numpy's is_blasable2d for float32 rows of ``width`` elements: unit steps along a row,
    whole elements between rows, at least ``width`` apart."""
    s0, s1 = a.strides
    return s1 == 4 and s0 % 4 == 0 and s0 // 4 >= width


def run(x: np.ndarray, bT: np.ndarray, y: np.ndarray, cuts: list[int], n: int) -> bool:
    """y[:, a:b] = x @ bT[:, a:b] for each block (a, b) of ``cuts`` in one parallel region of
    ``n`` threads, the caller holding `threads.launch`; False (nothing computed) when this route
    is not numpy's call (module docstring)."""
    fn = _sgemm()
    if fn is None or n > numba.config.NUMBA_NUM_THREADS:
        return False
    if x.ndim != 2 or bT.ndim != 2 or y.ndim != 2:
        return False
    T, K = x.shape
    N = bT.shape[1]
    if bT.shape[0] != K or y.shape != (T, N) or cuts[0] != 0 or cuts[-1] != N:
        return False  # numpy's own call then says what is wrong; a pointer here would not
    narrow = min(b - a for a, b in itertools.pairwise(cuts))
    if not (x.dtype == bT.dtype == y.dtype == np.float32 and T > 1 and K > 1 and narrow > 1):
        return False  # numpy's special cases (a vector operand) and other types
    if not (_c_blasable(x, K) and _c_blasable(y, N)):
        return False
    if not y.flags.writeable or np.may_share_memory(y, x) or np.may_share_memory(y, bT):
        return False  # numpy refuses the first and copies for the others; a pointer would not
    s0, s1 = bT.strides
    if s1 == 4 and s0 % 4 == 0 and s0 // 4 >= N:
        transb, ldb = _NO_TRANS, s0 // 4  # b itself in rows
    elif s0 == 4 and s1 % 4 == 0 and s1 // 4 >= K:
        transb, ldb = _TRANS, s1 // 4  # the transposed view of a weight [N, K]
    else:
        return False
    numba.set_num_threads(n)
    try:
        _blocks(fn, T, K, x.ctypes.data, x.strides[0] // 4, transb, bT.ctypes.data, ldb, s1, y.ctypes.data,
                y.strides[0] // 4, np.asarray(cuts, np.int64))
    finally:
        from .threads import numba_count

        numba.set_num_threads(numba_count())
    return True
