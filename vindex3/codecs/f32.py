"""float32, little-endian, C order: the reference encoding. Weights are views of the mapped
segment, so nothing is copied.

``mm`` of up to ``SMALL_T`` activation rows (decode steps, batched streams, verified drafts,
short prompts) runs the f32 rows kernel of vindex3.codecs.intrinsics (`float_kernel`): every row of W is read
once for all the activation rows, and each product is summed in an order written out in LLVM
vector IR (32 accumulators per position, a fixed tree), not left to LLVM. So a product's bytes
do not depend on how many activation rows ride along (a batched stream equals a lone one, a
verified draft position equals a step), on the thread count, or on the CPU target numba
compiles for (generic, haswell and the host give the same bytes). They differ from BLAS's
``x @ W.T`` in the last bits. Several f32 weights against one activation (q/k/v, gate/up) run
in one launch (`fused`). Larger batches (prefill) stay one BLAS product on the transposed view
(`threads.gemm`, split over the decode threads when large)."""

from __future__ import annotations

import numpy as np

from . import threads
from .base import Codec, Weight, register
from .threads import intdot, launch

F32 = np.dtype("<f4")
# Largest T the rows kernel takes. Whole SmolLM2 passes of T positions after a 64-token prefill
# (Zen 4, OpenBLAS 0.3.31, ms, rows kernel against BLAS): one thread T = 9 74 / 131, 16 93 / 142, 32 156 / 189,
# 48 220 / 234, 64 280 / 279, 96 431 / 371; two threads T = 9 40 / 119, 16 50 / 125, 32 82 / 153,
# 64 152 / 233, 128 296 / 337 (a pass this small holds BLAS at one thread; its products are too
# small to split). One limit for every thread count, so a pass's bytes never depend on it.
SMALL_T = 64


class DenseF32(Weight):
    encoding = "f32"
    fused_kind = "f32"

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
            I = intdot()
            y = np.empty((x.shape[0], self.a.shape[0]), F32)
            with launch():
                if threads.team(self.a.nbytes):
                    I.team_rows("f32", self.a, np.ascontiguousarray(x), y)
                else:
                    I.float_kernel("f32", "vector", threads.parallel(self.a.nbytes))(self.a, np.ascontiguousarray(x), y,
                                                                                     I.ROWS_PER_TASK)
            return y
        return threads.gemm(x, self.aT)

    @classmethod
    def fused(cls, weights):
        ws = tuple(weights)
        A = tuple(w.a for w in ws)
        if any(a.ndim != 2 or a.shape[1] != A[0].shape[1] for a in A) or not threads.one_array_type(A):
            return None  # a numba tuple indexed at run time holds one array type
        cols = A[0].shape[1]
        sizes = tuple(a.shape[0] for a in A)
        nbytes = sum(a.nbytes for a in A)

        def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
            if (type(x) is np.ndarray and x.ndim == 2 and x.dtype == F32 and x.shape[1] == cols
                    and 0 < x.shape[0] <= SMALL_T and x.flags.c_contiguous):
                I = intdot()
                ys = tuple(np.empty((x.shape[0], r), F32) for r in sizes)
                with launch():
                    I.float_kernel("f32", "vector", threads.parallel(nbytes), True)(A, x, ys, I.ROWS_PER_TASK)
                return ys
            return tuple(w.mm(x) for w in ws)

        return run

    def mm_t(self, x: np.ndarray) -> np.ndarray:
        return threads.gemm(x, self.a)

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
    represent_target = True
    bits_per_weight = 32.0

    def weight(self, raw: np.ndarray, shape: tuple[int, ...]) -> DenseF32:
        return DenseF32(np.ndarray(shape, dtype=F32, buffer=raw))

    def encode(self, arr: np.ndarray) -> np.ndarray:
        a = np.ascontiguousarray(arr, dtype=F32)
        return a.reshape(-1).view(np.uint8)


register(F32Codec())
