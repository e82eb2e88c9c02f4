"""A stacked expert bank [E, out, in] stored in another expert order than the logical one (a
representation's ``permutation``: stored slot s holds logical expert ``permutation[s]``).

`PermutedBank` wraps the stored bank's weight object and hands out logical experts, so kernels
see the logical bank: ``expert(e)`` is the stored slot that holds ``e``, over the same bytes, and
``dense()`` is the logical order. The bytes and the arithmetic are the stored bank's, so outputs
equal those of the unpermuted bank bit for bit."""

from __future__ import annotations

import numpy as np

from .base import Weight, WeightShapeError


class PermutedBank(Weight):
    def __init__(self, base: Weight, permutation: list[int]):
        if base.ndim != 3 or base.shape[0] != len(permutation):
            raise WeightShapeError(f"{base!r}: a permutation of {len(permutation)} experts does not fit a bank of shape "
                                   f"{list(base.shape)}")
        super().__init__(base.shape, base.nbytes)
        self.base = base
        self.encoding = base.encoding
        self.permutation = [int(p) for p in permutation]
        self.slot = np.argsort(np.asarray(self.permutation, dtype=np.int64), kind="stable")  # logical -> slot

    def expert(self, e: int) -> Weight:
        if not (0 <= int(e) < self.shape[0]):
            raise WeightShapeError(f"{self!r}: expert {e} is outside [0, {self.shape[0]})")
        return self.base.expert(int(self.slot[int(e)]))

    def dense(self) -> np.ndarray:
        return np.asarray(self.base.dense())[self.slot]

    def nonfinite(self) -> int | None:
        return self.base.nonfinite()

    def __repr__(self) -> str:
        return f"PermutedBank({self.base!r})"
