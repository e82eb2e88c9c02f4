"""Griffin's recurrent block with its RG-LRU (real-gated linear recurrent unit), one sequence,
float32 end to end.

Semantics follow transformers 5.24.0 ``RecurrentGemmaRecurrentBlock`` / ``RecurrentGemmaRglru``
(torch path), for the normed layer input x [T, hidden]:

1. y = act(linear_y(x)) [lru] (GELU, tanh approximation);
2. u = conv1d(linear_x(x)) [lru]: causal depthwise conv with bias, no activation (its window is
   the state part ``conv`` [kernel − 1, lru]);
3. per head block of width bw = lru / heads, gates i = σ(u_h · Wi_h + bi_h), r = σ(u_h · Wr_h + br_h)
   (the weights [heads, bw, bw] multiply from the right, as the reference's ``baddbmm``);
4. log a = −c · r · softplus(Λ) (c = ``log_decay_scale``, 8 in the reference), a = exp(log a);
   the input is u · i · sqrt(1 − exp(2 · log a)), except at the sequence's position 0, where the
   reference resets: the multiplier is 1 and a is 0;
5. h_t = a_t · h_{t−1} + input_t (the state ``rg_lru`` [lru], float32: the reference accumulates
   in float32 whatever the activations' dtype), the output is h_t · y;
6. linear_out.

Prefill and decode run the same compiled scan.
"""

from __future__ import annotations

import numba
import numpy as np

from .conv import causal_conv, taps
from .ffn import gelu_tanh
from .mamba1 import softplus

F32 = np.float32


@numba.njit(cache=True, error_model="numpy")
def _lru_scan(h, a, x, out):  # pragma: no cover - compiled
    """h [W] advanced in place over T positions: h = a[t]·h + x[t]; out[t] = h."""
    T, W = x.shape
    for t in range(T):
        at = a[t]
        xt = x[t]
        o = out[t]
        for i in range(W):
            v = at[i] * h[i] + xt[i]
            h[i] = v
            o[i] = v


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return F32(1.0) / (F32(1.0) + np.exp(-v))


class Prepared:
    __slots__ = ("conv_bias", "decay", "gi_b", "gi_w", "gr_b", "gr_w", "out", "out_bias", "taps", "x", "x_bias", "y",
                 "y_bias")

    def __init__(self, p, o: dict):
        self.y, self.y_bias = o["linear_y"], o["linear_y_bias"]
        self.x, self.x_bias = o["linear_x"], o["linear_x_bias"]
        self.taps, self.conv_bias = taps(o["conv_weight"]), o["conv_bias"]
        self.gi_w, self.gi_b = o["input_gate_weight"], o["input_gate_bias"][:, None, :]
        self.gr_w, self.gr_b = o["recurrent_gate_weight"], o["recurrent_gate_bias"][:, None, :]
        self.decay = (F32(-p.log_decay_scale) * softplus(o["recurrent_param"])).astype(F32)  # −c · softplus(Λ)
        self.out, self.out_bias = o["linear_out"], o["linear_out_bias"]


def rg_lru_forward(x: np.ndarray, p, w: Prepared, h: np.ndarray, window: np.ndarray, p0: int) -> np.ndarray:
    """``x`` [T, hidden] at positions p0 .. p0+T-1 -> [T, hidden], continuing the recurrence ``h``
    [lru] and the conv window ``window`` [kernel − 1, lru] (both advanced in place)."""
    T = x.shape[0]
    nh, bw = p.num_heads, p.lru_width // p.num_heads
    y = gelu_tanh(w.y.mm(x) + w.y_bias)
    u = causal_conv(window, w.x.mm(x) + w.x_bias, w.taps, w.conv_bias, False)
    ub = u.reshape(T, nh, bw).transpose(1, 0, 2)  # [heads, T, bw]
    gi = _sigmoid(np.matmul(ub, w.gi_w) + w.gi_b).transpose(1, 0, 2).reshape(T, -1)
    gr = _sigmoid(np.matmul(ub, w.gr_w) + w.gr_b).transpose(1, 0, 2).reshape(T, -1)
    log_a = gr * w.decay
    a = np.exp(log_a)
    mult = np.sqrt(F32(1.0) - np.exp(F32(2.0) * log_a))
    if p0 == 0:  # the reference's reset at the sequence's first position
        a[0] = F32(0.0)
        mult[0] = F32(1.0)
    inp = (u * gi) * mult
    hs = np.empty_like(inp)
    _lru_scan(h, np.ascontiguousarray(a), inp, hs)
    return w.out.mm(hs * y) + w.out_bias
