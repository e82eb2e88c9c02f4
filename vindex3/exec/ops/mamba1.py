"""Mamba1 mixer numerics (the selective scan), one sequence, float32 end to end.

Semantics follow transformers 5.24.0 ``MambaMixer`` / ``FalconMambaMixer`` (their torch path):

1. ``in_proj`` (bias when ``use_bias``) splits into x [inner] and the gate z [inner], in that order.
2. Causal depthwise conv over x (kernel ``conv_kernel``, bias when ``use_conv_bias``), SiLU.
3. ``x_proj`` (no bias) splits into the time-step input [rank], B [state] and C [state]. Falcon-Mamba
   (``bcdt_rms_eps`` not null) RMS-normalises each of the three without a weight: v·rsqrt(mean(v²)+eps).
4. Δ = softplus(dt_proj(dt_in) + dt_proj bias) [inner]; A = −exp(A_log) [inner, state].
5. Per channel d the state row s[d] [state] becomes s·exp(Δ_d·A_d) + (Δ_d·B)·x_d; the output is
   y_d = s[d]·C + D_d·x_d, times silu(z_d).
6. ``out_proj`` (bias when ``use_bias``).

State precision, as the reference judges it: transformers keeps the recurrent state in the input
dtype (``ssm_state = torch.zeros(..., dtype=input_dtype)``) and computes the discretisation in
float32 (``.float()``); with a float32 model both are float32, and so is everything here.

The reference's two paths (its full-sequence scan from a zero state and its one-step
``selective_state_update``) are one function, so prefill and decode run the same compiled
kernel over T positions; unlike the reference's scan, a prefill that continues a state starts
from it (the reference's full-sequence form always starts from zeros).
"""

from __future__ import annotations

import numba
import numpy as np

from .conv import causal_conv, taps
from .mamba2 import _exp_f32, _silu_f32

F32 = np.float32


@numba.njit(cache=True, error_model="numpy")
def _selective_scan(ssm, u, dt, A, B, C, D, z, y):  # pragma: no cover - compiled
    """ssm [inner, N] advanced in place over T positions; u, dt, z, y [T, inner]; A [inner, N];
    B, C [T, N]; D [inner]. The update loop vectorises (no reduction in it); the output sums over
    n ascending from 0, as a plain dot."""
    T, Dn = u.shape
    N = A.shape[1]
    zero = np.float32(0.0)
    for t in range(T):
        b = B[t]
        c = C[t]
        for d in range(Dn):
            s = ssm[d]
            a = A[d]
            dtd = dt[t, d]
            ud = u[t, d]
            for n in range(N):
                s[n] = s[n] * _exp_f32(dtd * a[n]) + (dtd * b[n]) * ud
            acc = zero
            for n in range(N):
                acc += s[n] * c[n]
            y[t, d] = (acc + ud * D[d]) * _silu_f32(z[t, d])


def softplus(v: np.ndarray) -> np.ndarray:
    """log(1 + e^v) without overflow (torch's softplus to float32 rounding)."""
    return np.logaddexp(F32(0.0), v)


def weightless_rms(v: np.ndarray, eps: np.float32) -> np.ndarray:
    """v · rsqrt(mean(v²) + eps) over the last axis (Falcon-Mamba's B, C and Δ norms)."""
    var = np.mean(np.square(v), axis=-1, keepdims=True, dtype=F32)
    return v * (F32(1.0) / np.sqrt(var + eps))


class Prepared:
    """A layer's operands made ready once per executor: the projections as weight objects, the
    conv taps [K, inner], A = −exp(A_log) and the small vectors as float32 arrays."""

    __slots__ = ("A", "D", "conv_bias", "dt_bias", "dt_proj", "in_proj", "in_proj_bias", "out_proj",
                 "out_proj_bias", "taps", "x_proj")

    def __init__(self, operands: dict):
        self.in_proj = operands["in_proj"]
        self.in_proj_bias = operands.get("in_proj_bias")
        self.taps = taps(operands["conv_weight"])
        self.conv_bias = operands.get("conv_bias")
        self.x_proj = operands["x_proj"]
        self.dt_proj = operands["dt_proj"]
        self.dt_bias = operands["dt_proj_bias"]
        self.A = np.ascontiguousarray(-np.exp(operands["A_log"]), dtype=F32)
        self.D = operands["D"]
        self.out_proj = operands["out_proj"]
        self.out_proj_bias = operands.get("out_proj_bias")


def mamba1_forward(x: np.ndarray, p, w: Prepared, ssm: np.ndarray, conv: np.ndarray) -> np.ndarray:
    """The mixer over ``x`` [T, hidden] (the normed layer input), continuing the state ``ssm``
    [inner, state] and the conv window ``conv`` [K - 1, inner] (both advanced in place). ``p``:
    the operator's params (`vindex3.operators.mamba1.Mamba1Params`). Returns [T, hidden] float32."""
    inner, N, R = p.intermediate_size, p.state_size, p.time_step_rank
    xz = w.in_proj.mm(x)
    if w.in_proj_bias is not None:
        xz += w.in_proj_bias
    u = causal_conv(conv, xz[:, :inner], w.taps, w.conv_bias, True)
    dbc = w.x_proj.mm(u)
    dt_in, B, C = dbc[:, :R], dbc[:, R:R + N], dbc[:, R + N:]
    if p.bcdt_rms_eps is not None:
        eps = F32(p.bcdt_rms_eps)
        dt_in, B, C = weightless_rms(dt_in, eps), weightless_rms(B, eps), weightless_rms(C, eps)
    dt = softplus(w.dt_proj.mm(np.ascontiguousarray(dt_in)) + w.dt_bias)
    y = np.empty(u.shape, F32)
    _selective_scan(ssm, u, dt, w.A, np.ascontiguousarray(B), np.ascontiguousarray(C), w.D,
                    np.ascontiguousarray(xz[:, inner:]), y)
    out = w.out_proj.mm(y)
    if w.out_proj_bias is not None:
        out += w.out_proj_bias
    return out
