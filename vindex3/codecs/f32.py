"""float32, little-endian, C order: the reference encoding. Weights are views of the mapped
segment; ``mm`` is one BLAS call on the transposed view, so nothing is copied."""

from __future__ import annotations

import numpy as np

from .base import Codec, Weight, register

F32 = np.dtype("<f4")


class DenseF32(Weight):
    encoding = "f32"

    def __init__(self, a: np.ndarray):
        super().__init__(a.shape, a.nbytes)
        self.a = a
        self.aT = a.T if a.ndim == 2 else None

    def mm(self, x: np.ndarray) -> np.ndarray:
        return x @ self.aT

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

    def expert(self, e: int) -> "DenseF32":
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
