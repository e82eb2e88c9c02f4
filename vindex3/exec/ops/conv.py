"""The causal depthwise convolution that several recurrent mixers share (Mamba1's conv1d,
LFM2's short convolution, Griffin's conv1d), with its window of past inputs as state.

The state is the last ``K - 1`` inputs, time-major ``[K - 1, channels]`` and oldest first: all a
width-K causal conv needs to continue (transformers keeps K, one more than it reads). Prefill
(T = prompt length) and decode (T = 1) run the same compiled kernel, so a decode step continues a
prefill with the same arithmetic.
"""

from __future__ import annotations

import numba
import numpy as np

from .mamba2 import _silu_f32

F32 = np.float32
_NO_BIAS = np.zeros(1, F32)


@numba.njit(cache=True, error_model="numpy")
def _causal_conv(seq, w_t, bias, has_bias, silu, out):  # pragma: no cover - compiled
    """``seq`` [K - 1 + T, C] (the stored window, then the T new inputs), ``w_t`` the taps as
    [K, C]: out[t, c] = act(sum over k ascending of seq[t + k, c] · w_t[k, c] + bias[c])."""
    T, C = out.shape
    K = w_t.shape[0]
    for t in range(T):
        o = out[t]
        r = seq[t]
        wk = w_t[0]
        for c in range(C):
            o[c] = r[c] * wk[c]
        for k in range(1, K):
            r = seq[t + k]
            wk = w_t[k]
            for c in range(C):
                o[c] += r[c] * wk[c]
        if has_bias:
            for c in range(C):
                o[c] += bias[c]
        if silu:
            for c in range(C):
                o[c] = _silu_f32(o[c])


def taps(conv_weight: np.ndarray) -> np.ndarray:
    """A depthwise conv weight as transformers stores it, [C, 1, K], made [K, C] (contiguous)."""
    return np.ascontiguousarray(conv_weight.reshape(conv_weight.shape[0], conv_weight.shape[-1]).T)


def causal_conv(window: np.ndarray, x: np.ndarray, w_t: np.ndarray, bias: np.ndarray | None,
                silu: bool) -> np.ndarray:
    """Run the conv over ``x`` [T, C] after ``window`` [K - 1, C] (advanced in place to the last
    K - 1 inputs); returns [T, C] float32."""
    T = x.shape[0]
    keep = window.shape[0]
    seq = np.concatenate([window, x], axis=0)
    out = np.empty(x.shape, F32)
    _causal_conv(seq, w_t, _NO_BIAS if bias is None else bias, bias is not None, silu, out)
    if keep:
        window[...] = seq[T:]
    return out
