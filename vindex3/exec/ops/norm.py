"""RMSNorm, float32 end to end (as the reference: x * rsqrt(mean(x²) + eps) * (offset + w))."""

from __future__ import annotations

import numpy as np


def make_weight(weight: np.ndarray, offset: float) -> np.ndarray:
    if offset:
        return (np.float32(offset) + weight).astype(np.float32)
    return weight


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    # x: [..., d]
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return weight * (x * (np.float32(1.0) / np.sqrt(var + eps)))
