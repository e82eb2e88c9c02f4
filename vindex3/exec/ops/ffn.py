"""Gated FFN: down(act(gate(x)) * up(x)), with SiLU and GELU variants."""

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


def make_ffn(act: str, gate, up, down, gate_up=None, gate_b=None, up_b=None, down_b=None, gate_up_b=None):
    f = activation(act)
    gT = gate.T if gate is not None else None
    uT = up.T if up is not None else None
    guT = gate_up.T if gate_up is not None else None
    dT = down.T

    def run(x: np.ndarray) -> np.ndarray:
        if guT is not None:
            gu = x @ guT
            if gate_up_b is not None:
                gu = gu + gate_up_b
            half = gu.shape[-1] // 2
            g, u = gu[..., :half], gu[..., half:]
        else:
            g = x @ gT
            u = x @ uT
            if gate_b is not None:
                g = g + gate_b
            if up_b is not None:
                u = u + up_b
        y = (f(g) * u) @ dT
        if down_b is not None:
            y = y + down_b
        return y

    return run
