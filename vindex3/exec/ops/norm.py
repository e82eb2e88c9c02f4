"""RMSNorm, float32 end to end (as the reference: x * rsqrt(mean(x²) + eps) * (offset + w))."""

from __future__ import annotations

import numpy as np


def make_weight(weight: np.ndarray, offset: float) -> np.ndarray:
    if offset:
        return (np.float32(offset) + weight).astype(np.float32)
    return weight


_sum = np.add.reduce


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    # x: [..., d]. The mean is np.mean's own two ufunc calls (a float32 sum, then a division by
    # the count as an intp, in place), so the bytes are np.mean's; its Python wrapper cost
    # ~10 us a call, 61 calls a decode step on SmolLM2.
    var = _sum(np.square(x), axis=-1, dtype=np.float32, keepdims=True)
    np.true_divide(var, np.intp(x.shape[-1]), out=var, casting="unsafe")
    return weight * (x * (np.float32(1.0) / np.sqrt(var + eps)))
