"""Numerics of the ``mamba2_mup`` operator: a Mamba2 mixer with per-section µP multipliers on its
input projection and an optional gated norm (Falcon-H1's SSM branch), one sequence, float32.

Semantics follow transformers 5.24.0 ``FalconH1Mixer`` (its torch path), after the caller has
applied the member's input multiplier (``ssm_in_multiplier``):

1. ``zxbcdt = in_proj(x)`` (bias when declared), times the multiplier of each section
   (gate [inner], x [inner], B [groups·state], C [groups·state], dt [heads]: ``ssm_multipliers``).
2. Causal depthwise conv + SiLU over x|B|C (vindex3.exec.ops.conv; its window is the state part
   ``conv`` [kernel − 1, conv_dim]).
3. Δ = softplus(dt + dt_bias), clamped to ``time_step_limit`` in the chunk form only (the
   reference's recurrent one-step path takes no limit, as for ``mamba2``); per head the state
   decays by exp(Δ·A), A = −exp(A_log), and gains Δ·x ⊗ B; y = s·C + D·x (the SSD recurrence of
   vindex3.exec.ops.mamba2, ``_ssd_scan``, an array kernel shared as it is).
4. No gated norm (the released checkpoints' ``mamba_rms_norm: false``): y · silu(gate). With one,
   RMS over ``n_groups`` groups times its weight, the gate applied before or after the norm.
5. ``out_proj`` (bias when declared).
"""

from __future__ import annotations

import numpy as np

from .conv import causal_conv, taps
from .mamba1 import softplus
from .mamba2 import _ssd_scan

F32 = np.float32


def _silu(v: np.ndarray) -> np.ndarray:
    return v / (F32(1.0) + np.exp(-v))


class Prepared:
    """A layer's operands, ready once per executor; ``mup`` is the per-column multiplier vector
    [in_proj_dim] (None when every section's multiplier is 1)."""

    __slots__ = ("A", "D", "conv_bias", "dt_bias", "in_proj", "in_proj_bias", "mup", "norm_weight", "out_proj",
                 "out_proj_bias", "taps")

    def __init__(self, p, operands: dict):
        self.in_proj = operands["in_proj"]
        self.in_proj_bias = operands.get("in_proj_bias")
        self.taps = taps(operands["conv_weight"])
        self.conv_bias = operands.get("conv_bias")
        self.A = (-np.exp(operands["A_log"])).astype(F32)
        self.D = operands["D"]
        self.dt_bias = operands["dt_bias"]
        self.norm_weight = operands.get("gated_norm")
        self.out_proj = operands["out_proj"]
        self.out_proj_bias = operands.get("out_proj_bias")
        gn = p.n_groups * p.state_size
        widths = (p.intermediate_size, p.intermediate_size, gn, gn, p.num_heads)
        m = p.projection_multipliers
        self.mup = None if all(v == 1.0 for v in m) else np.concatenate(
            [np.full(w, F32(v), F32) for w, v in zip(widths, m)])


def _gated_norm(y: np.ndarray, gate: np.ndarray, p, w: Prepared) -> np.ndarray:
    T, W = y.shape
    if p.gated_norm == "none":
        return y * _silu(gate)
    if p.gated_norm == "gate_then_norm":
        y = y * _silu(gate)
    g = y.reshape(T, p.n_groups, W // p.n_groups)
    var = np.mean(np.square(g), axis=-1, keepdims=True, dtype=F32)
    out = (w.norm_weight.reshape(p.n_groups, -1) * (g * (F32(1.0) / np.sqrt(var + F32(p.norm_eps))))).reshape(T, W)
    if p.gated_norm == "norm_then_gate":
        out = out * _silu(gate)
    return out


def mamba2_mup_forward(x: np.ndarray, p, w: Prepared, ssm: np.ndarray, conv: np.ndarray, clamp_dt: bool) -> np.ndarray:
    """``x`` [T, hidden] -> [T, hidden], continuing ``ssm`` [heads, head_dim, state] and the
    conv window ``conv`` [kernel − 1, conv_dim] (both advanced in place). ``clamp_dt``: the chunk
    form (Δ clamped to the limit) rather than the recurrent one."""
    T = x.shape[0]
    ni, cd, gn, nh = p.intermediate_size, p.conv_dim, p.n_groups * p.state_size, p.num_heads
    z = w.in_proj.mm(x)
    if w.in_proj_bias is not None:
        z += w.in_proj_bias
    if w.mup is not None:
        z *= w.mup
    xbc = causal_conv(conv, z[:, ni:ni + cd], w.taps, w.conv_bias, True)
    xs = xbc[:, :ni].reshape(T, nh, p.head_dim)
    Bm = np.ascontiguousarray(xbc[:, ni:ni + gn].reshape(T, p.n_groups, p.state_size))
    Cm = np.ascontiguousarray(xbc[:, ni + gn:].reshape(T, p.n_groups, p.state_size))
    dt = softplus(z[:, ni + cd:] + w.dt_bias)
    if clamp_dt:
        lo, hi = p.time_step_limit
        dt = np.clip(dt, F32(lo), F32(hi))
    dA = np.ascontiguousarray(np.exp(dt * w.A))
    xdt = np.ascontiguousarray(xs * dt[:, :, None])
    y = np.empty(xs.shape, F32)
    _ssd_scan(ssm, xdt, dA, Bm, Cm, y)
    y += xs * w.D[:, None]
    out = w.out_proj.mm(_gated_norm(y.reshape(T, ni), z[:, :ni], p, w))
    if w.out_proj_bias is not None:
        out += w.out_proj_bias
    return out
