"""float32, little-endian, C order: the reference encoding. Weights are views of the mapped
segment, so nothing is copied.

``mm`` of up to ``SMALL_T`` activation rows (decode steps, short drafts) runs the numba rows
kernel (kernels.rows_plain): on these machines it streams the matrix about twice as fast as
BLAS's GEMV (bench/codecs_gemv.py). Its summation order differs from BLAS's, so its results
differ from ``x @ W.T`` in the last bits; they do not depend on the thread count, and every
slice of a model (Full or Draft) runs the same kernel, so bit-identity between them holds.
Larger batches (prefill) stay one BLAS call on the transposed view."""

from __future__ import annotations

import numpy as np

from .base import Codec, Weight, register
from .threads import kernels, launch

F32 = np.dtype("<f4")
SMALL_T = 8  # largest T the rows kernel takes (bench/codecs_gemv.py: at T=8 it still beat BLAS 1.5x)


class DenseF32(Weight):
    encoding = "f32"

    def __init__(self, a: np.ndarray):
        super().__init__(a.shape, a.nbytes)
        self.a = a
        self.aT = a.T if a.ndim == 2 else None

    def mm(self, x: np.ndarray) -> np.ndarray:
        if (
            x.ndim == 2
            and 0 < x.shape[0] <= SMALL_T
            and x.dtype == F32
            and self.a.ndim == 2
            and self.a.flags.c_contiguous
            and x.shape[1] == self.a.shape[1]
        ):
            K = kernels()
            y = np.empty((x.shape[0], self.a.shape[0]), F32)
            with launch():
                K.rows_plain(self.a, np.ascontiguousarray(x), y, K.ROWS_PER_TASK)
            return y
        return x @ self.aT

    def mm_t(self, x: np.ndarray) -> np.ndarray:
        return x @ self.a

    def sub_rows(self, r0: int, r1: int) -> DenseF32:
        if self.a.ndim != 2 or not (0 <= r0 <= r1 <= self.a.shape[0]):
            from .base import WeightShapeError

            raise WeightShapeError(f"{self!r}: sub_rows({r0}, {r1}) is not a row range of a 2-D weight")
        return DenseF32(self.a[r0:r1])

    def take(self, ids: np.ndarray) -> np.ndarray:
        return self.a[ids]

    def dense(self) -> np.ndarray:
        return self.a

    def nonfinite(self) -> int:
        flat = self.a.reshape(-1)
        bad = 0
        step = 1 << 22  # bounded temporaries, whatever the tensor's size
        for i in range(0, flat.size, step):
            part = flat[i : i + step]
            bad += int(part.size - np.count_nonzero(np.isfinite(part)))
        return bad

    def expert(self, e: int) -> DenseF32:
        return DenseF32(self.a[e])


class F32Codec(Codec):
    name = "f32"
    bits_per_weight = 32.0

    def weight(self, raw: np.ndarray, shape: tuple[int, ...]) -> DenseF32:
        return DenseF32(np.ndarray(shape, dtype=F32, buffer=raw))

    def encode(self, arr: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(arr, dtype=F32)
        return a.reshape(-1).view(np.uint8)


register(F32Codec())
