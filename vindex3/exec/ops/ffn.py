"""FFN activations, float32: SiLU, erf-GELU (numba, imported on first use) and tanh-GELU."""

from __future__ import annotations

import math

import numpy as np

from ...errors import UnsupportedOperator


def silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return x / (np.float32(1.0) + np.exp(-x))


_erf_gelu: list = []


def gelu(x: np.ndarray) -> np.ndarray:
    # numba is imported only when an erf-GELU model runs: it costs ~60 MB of resident memory.
    if not _erf_gelu:
        import numba

        @numba.vectorize(["float32(float32)"], cache=True)
        def _gelu_erf(v):
            return np.float32(0.5) * v * (np.float32(1.0) + np.float32(math.erf(v * np.float32(0.7071067811865476))))

        _erf_gelu.append(_gelu_erf)
    return _erf_gelu[0](x)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = np.float32(math.sqrt(2.0 / math.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x * x * x)))


ACTIVATIONS = {"silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedOperator(f"FFN activation {name!r} has no executor (supported: {', '.join(ACTIVATIONS)})") from None
