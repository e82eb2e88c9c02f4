"""Mamba2 mixer numerics: prefill over a prompt and single-token decode, one sequence.

Semantics follow transformers 5.24.0 ``Mamba2Mixer`` (its torch fallback path), for one
sequence, float32 end to end:

1. ``in_proj`` splits into ``gate`` [intermediate], ``xBC`` [conv_dim] and ``dt`` [heads], in
   that order. The projection width must be exactly ``intermediate + conv_dim + heads``:
   transformers 5.24 builds ``in_proj`` at that width and has no ``d_mlp`` part any more
   (older releases silently dropped two leading ``d_mlp`` slices), so a wider projection is
   refused by name rather than guessed at.
2. Causal depthwise conv over ``xBC`` with its own state (the last ``kernel`` raw inputs,
   oldest first, as transformers' cache keeps them), bias, SiLU.
3. ``xBC`` splits into x [heads, head_dim], B [n_groups, state], C [n_groups, state]; heads
   ``h`` use group ``h // (heads // n_groups)``.
4. Δ = softplus(dt + dt_bias); decay exp(Δ·A) with A = -exp(A_log); state update
   ``s = s·exp(ΔA) + Δ·x ⊗ B``, output ``y = s·C + D·x``.
   Prefill clamps Δ to ``time_step_limit`` after the softplus (an infinite upper bound is a
   no-op). The single-token step does **not** clamp: transformers' recurrent path
   (``mamba2_selective_state_update``) takes no limit, exactly like the reference
   ``mamba_ssm`` step. With the default limits (0, inf) the two agree; with a binding finite
   limit they differ, in transformers and here alike.
5. Gated RMSNorm with the gate applied *before* the norm (``norm_before_gate=False``):
   ``u = y·silu(gate)``, then RMS-normalised over groups of ``intermediate // n_groups``
   channels (not over the whole intermediate), then times the weight.
6. ``out_proj``.

Neither prefill nor decode loops over positions in Python. Both run the same compiled
kernels (numba, fastmath off) over all T positions in one call: ``_causal_conv_silu`` for
the conv and ``_ssd_scan`` for the sequential SSD recurrence (two loop orders of one
arithmetic), prefill with T = prompt length and decode with T = 1, so decode continues a
prefill with the very same arithmetic. The recurrence is exact: transformers' ``chunk_size``
is a tiling choice of its chunked SSD form and does not change the function; it is carried
in the geometry but not needed here. SiLU uses ``_exp_f32``, an exp built from IEEE adds and
multiplies so that its loops vectorise without fastmath. Weights are only read, never
written; only the small conv weight is re-laid out per call.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from vindex3.errors import ClosureError
from vindex3.operators.mamba2 import Mamba2Params, Mamba2State, Mamba2Weights

from .checks import check_buffers, check_input, conv_2d, expect_operand

__all__ = [
    "Mamba2Geometry",
    "Mamba2State",
    "Mamba2Weights",
    "mamba2_prefill",
    "mamba2_step",
]

F32 = np.float32
_ZERO = F32(0.0)
_NO_BIAS = np.zeros(1, F32)


# The kernels take the operator's own params; Mamba2Geometry builds them from the facts a kernel
# caller states (the written-out widths computed).
Mamba2Geometry = Mamba2Params.kernel_facts


# --------------------------------------------------------------------------- checks


def _mm(w, x: np.ndarray) -> np.ndarray:
    """x [T, in] @ W.T for a float32 array or a weight object."""
    return x @ w.T if isinstance(w, np.ndarray) else w.mm(x)


def _check(w: Mamba2Weights, g: Mamba2Params, state: Mamba2State) -> np.ndarray:
    """Validate operands and state against the geometry; return the 2-D conv weight."""
    defects: list[str] = []
    rows = w.in_proj.shape[0] if getattr(w.in_proj, "ndim", 0) == 2 else 0
    if rows > g.in_proj_dim:
        defects.append(
            f"in_proj: {rows} rows, wider than intermediate + conv_dim + heads = "
            f"{g.in_proj_dim}; an extra d_mlp part is not supported (transformers 5.24 "
            f"Mamba2Mixer has none)"
        )
    else:
        expect_operand("in_proj", w.in_proj, (g.in_proj_dim, g.hidden_size), defects)
    cw = conv_2d(w.conv_weight)
    expect_operand("conv_weight", cw, (g.conv_dim, g.conv_kernel), defects)
    for name, n in (("A_log", g.num_heads), ("D", g.num_heads), ("dt_bias", g.num_heads)):
        expect_operand(name, getattr(w, name), (n,), defects)
    expect_operand("norm_weight", w.norm_weight, (g.intermediate,), defects)
    expect_operand("out_proj", w.out_proj, (g.hidden_size, g.intermediate), defects)
    for name, flag, n in (
        ("in_proj_bias", g.use_bias, g.in_proj_dim),
        ("out_proj_bias", g.use_bias, g.hidden_size),
        ("conv_bias", g.use_conv_bias, g.conv_dim),
    ):
        arr = getattr(w, name)
        if flag:
            expect_operand(name, arr, (n,), defects)
        elif arr is not None:
            defects.append(f"{name}: present, but the geometry declares no such bias")
    if defects:
        raise ClosureError("mamba2 operands do not match the layer geometry", defects)

    check_buffers("mamba2", state, ((name, shape) for name, shape, _ in g.buffers()))
    return cw


# --------------------------------------------------------------------------- elementwise


@intrinsic
def _f32_from_bits(typingctx, bits):  # pragma: no cover - compiled
    """Reinterpret an int32 as the float32 with the same bits (free in machine code)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@numba.njit(inline="always")
def _exp_f32(x):  # pragma: no cover - compiled
    """exp(x) in float32 from IEEE adds and multiplies only (Cephes expf: two-part ln 2
    reduction, degree-6 polynomial, 2^n assembled from its bits), so the loops that use it
    vectorise with fastmath off (no contraction into FMA: the same bits on every machine).
    Relative error <= 1e-7 (about 1.3 ulp; NumPy's float32 exp is within 2e-7); x below
    -87.3 gives about 1e-38 (never a true zero), x from 88.72 gives inf; NaN propagates."""
    if x < np.float32(-87.33654):
        x = np.float32(-87.33654)
    elif x > np.float32(88.72283):
        x = np.float32(88.72283)
    z = np.floor(x * np.float32(1.44269504088896341) + np.float32(0.5))
    r = x - z * np.float32(0.693359375)
    r = r - z * np.float32(-2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * (r * r) + r + np.float32(1.0)
    return p * _f32_from_bits((np.int32(z) + np.int32(127)) << np.int32(23))


@numba.njit(inline="always")
def _silu_f32(v):  # pragma: no cover - compiled
    return v / (np.float32(1.0) + _exp_f32(-v))


def _softplus(v: np.ndarray) -> np.ndarray:
    # log(1 + e^v) without overflow; equals torch's softplus (threshold 20) to float32 rounding.
    return np.logaddexp(_ZERO, v)


@numba.njit(cache=True, error_model="numpy")
def _gated_rmsnorm_kernel(y, gate, weight, n_groups, eps, out):  # pragma: no cover - compiled
    """transformers' MambaRMSNormGated with norm_before_gate=False, for rows of y [T, W]:
    u = y * silu(gate); per group of W // n_groups channels u *= 1/sqrt(mean(u^2) + eps);
    out = u * weight. The mean of squares is accumulated in float64, then cast."""
    T, W = y.shape
    gs = W // n_groups
    for t in range(T):
        yr = y[t]
        gr = gate[t]
        o = out[t]
        for i in range(W):
            o[i] = yr[i] * _silu_f32(gr[i])
        for gi in range(n_groups):
            lo = gi * gs
            acc = 0.0
            for i in range(lo, lo + gs):
                acc += np.float64(o[i]) * np.float64(o[i])
            r = np.float32(1.0 / np.sqrt(acc / gs + eps))
            for i in range(lo, lo + gs):
                o[i] = (o[i] * r) * weight[i]


def _gated_rmsnorm(
    y: np.ndarray, gate: np.ndarray, w: Mamba2Weights, g: Mamba2Params
) -> np.ndarray:
    """Gate first, then RMS over n_groups groups (not the whole width), then the weight."""
    out = np.empty(y.shape, F32)
    _gated_rmsnorm_kernel(y, gate, w.norm_weight, g.n_groups, float(g.norm_eps), out)
    return out


# --------------------------------------------------------------------------- scan


# The recurrence, for each position t and head h (group g = h // (H // G)):
#     s[p, n] = s[p, n] * dA[t, h] + xdt[t, h, p] * B[t, g, n]
#     y[t, h, p] = sum over n ascending, starting from 0, of s[p, n] * C[t, g, n]
# Two loop orders compute exactly this arithmetic (fastmath is off, nothing is reassociated),
# so they give bit-identical results and either may run any T; the dispatcher picks by speed.


@numba.njit(cache=True)
def _ssd_scan_cols(ssm, xdt, dA, B, C, y):  # pragma: no cover - compiled
    """Long T: each head works on a transposed copy [N, P] of its state, so the update and
    the output sums both run over contiguous p, vectorised across independent outputs."""
    T, H, P = xdt.shape
    G = B.shape[1]
    N = B.shape[2]
    hpg = H // G
    S = np.empty((N, P), np.float32)
    for h in range(H):
        gi = h // hpg
        for p in range(P):
            for n in range(N):
                S[n, p] = ssm[h, p, n]
        for t in range(T):
            da = dA[t, h]
            xr = xdt[t, h]
            yr = y[t, h]
            for p in range(P):
                yr[p] = 0.0
            for n in range(N):
                bn = B[t, gi, n]
                cn = C[t, gi, n]
                sr = S[n]
                for p in range(P):
                    v = sr[p] * da + xr[p] * bn
                    sr[p] = v
                    yr[p] += v * cn
        for p in range(P):
            for n in range(N):
                ssm[h, p, n] = S[n, p]


@numba.njit(cache=True)
def _ssd_scan_rows(ssm, xdt, dA, B, C, y):  # pragma: no cover - compiled
    """Short T (decode): in place on the [P, N] rows, no transposition; the update runs over
    contiguous n, the output sums four rows at a time to overlap their dependency chains."""
    T, H, P = xdt.shape
    G = B.shape[1]
    N = B.shape[2]
    hpg = H // G
    zero = np.float32(0.0)
    for t in range(T):
        for h in range(H):
            gi = h // hpg
            da = dA[t, h]
            b = B[t, gi]
            c = C[t, gi]
            S = ssm[h]
            for p in range(P):
                s = S[p]
                dx = xdt[t, h, p]
                for n in range(N):
                    s[n] = s[n] * da + dx * b[n]
            p0 = 0
            while p0 + 4 <= P:
                s0 = S[p0]
                s1 = S[p0 + 1]
                s2 = S[p0 + 2]
                s3 = S[p0 + 3]
                a0 = zero
                a1 = zero
                a2 = zero
                a3 = zero
                for n in range(N):
                    cn = c[n]
                    a0 += s0[n] * cn
                    a1 += s1[n] * cn
                    a2 += s2[n] * cn
                    a3 += s3[n] * cn
                y[t, h, p0] = a0
                y[t, h, p0 + 1] = a1
                y[t, h, p0 + 2] = a2
                y[t, h, p0 + 3] = a3
                p0 += 4
            for p in range(p0, P):
                s = S[p]
                a = zero
                for n in range(N):
                    a += s[n] * c[n]
                y[t, h, p] = a


_ROWS_MAX_T = 4  # up to this many positions the row kernel is the faster one


def _ssd_scan(ssm, xdt, dA, B, C, y) -> None:
    """Advance ``ssm`` [H, P, N] over T positions, writing y [T, H, P] (no D term)."""
    if xdt.shape[0] <= _ROWS_MAX_T:
        _ssd_scan_rows(ssm, xdt, dA, B, C, y)
    else:
        _ssd_scan_cols(ssm, xdt, dA, B, C, y)


@numba.njit(cache=True, error_model="numpy")
def _causal_conv_silu(seq, cw_t, bias, has_bias, out):  # pragma: no cover - compiled
    """Causal depthwise conv + bias + SiLU: ``seq`` is [K + T, C] (the K stored inputs, then
    the T new ones), ``cw_t`` the conv weight as [K, C]; for t < T
        out[t, c] = silu(sum over k ascending of seq[t + 1 + k, c] * cw_t[k, c] + bias[c]).
    Prefill (T = prompt length) and decode (T = 1) share it, so their conv arithmetic is one.
    """
    T, C = out.shape
    K = cw_t.shape[0]
    for t in range(T):
        o = out[t]
        r = seq[t + 1]
        wk = cw_t[0]
        for c in range(C):
            o[c] = r[c] * wk[c]
        for k in range(1, K):
            r = seq[t + 1 + k]
            wk = cw_t[k]
            for c in range(C):
                o[c] += r[c] * wk[c]
        if has_bias:
            for c in range(C):
                o[c] += bias[c]
        for c in range(C):
            o[c] = _silu_f32(o[c])


def _run_conv(
    state_conv: np.ndarray, xbc_in: np.ndarray, cw: np.ndarray, w: Mamba2Weights
) -> np.ndarray:
    """Run the conv (+SiLU) over ``xbc_in`` [T, conv_dim] after the stored inputs and move the
    stored window forward; returns the SiLU output [T, conv_dim]."""
    T = xbc_in.shape[0]
    seq = np.concatenate([state_conv.T, xbc_in], axis=0)  # [K + T, conv_dim]
    out = np.empty(xbc_in.shape, F32)
    has_bias = w.conv_bias is not None
    bias = np.asarray(w.conv_bias) if has_bias else _NO_BIAS
    _causal_conv_silu(seq, np.ascontiguousarray(cw.T), bias, has_bias, out)
    state_conv[...] = seq[T:].T
    return out


def _ssm_norm(
    zxbcdt: np.ndarray,  # [T, in_proj_dim] the projection (gate and dt are read from it)
    xbc: np.ndarray,  # [T, conv_dim] the conv output after SiLU
    w: Mamba2Weights,
    g: Mamba2Params,
    ssm: np.ndarray,  # [H, P, N], advanced in place
    clamp_dt: bool,
) -> np.ndarray:
    """SSD recurrence with D skip, gated RMSNorm: returns [T, intermediate] float32."""
    T = zxbcdt.shape[0]
    ni, cd, gn = g.intermediate, g.conv_dim, g.n_groups * g.state_size
    xs = xbc[:, :ni].reshape(T, g.num_heads, g.head_dim)
    Bm = np.ascontiguousarray(xbc[:, ni : ni + gn].reshape(T, g.n_groups, g.state_size))
    Cm = np.ascontiguousarray(xbc[:, ni + gn :].reshape(T, g.n_groups, g.state_size))
    dt = _softplus(zxbcdt[:, ni + cd :] + w.dt_bias)  # [T, H]
    if clamp_dt:
        lo, hi = g.time_step_limit
        dt = np.clip(dt, F32(lo), F32(hi))
    A = -np.exp(w.A_log)
    dA = np.ascontiguousarray(np.exp(dt * A))
    xdt = np.ascontiguousarray(xs * dt[:, :, None])
    y = np.empty(xs.shape, F32)
    _ssd_scan(ssm, xdt, dA, Bm, Cm, y)
    y += xs * w.D[:, None]
    return _gated_rmsnorm(y.reshape(T, ni), zxbcdt[:, :ni], w, g)


# --------------------------------------------------------------------------- prefill


def mamba2_prefill(
    x: np.ndarray, w: Mamba2Weights, g: Mamba2Params, state: Mamba2State
) -> np.ndarray:
    """Run the mixer over ``x`` [T, hidden] (the normed layer input) from ``state``; return
    [T, hidden] float32 and leave ``state`` where a following prefill or step continues.

    Works from a zero state and from one left by an earlier prefill or step (a prompt fed in
    several calls gives what one call gives). Δ is clamped to ``time_step_limit`` for every
    position, as transformers' chunk path does; note that transformers routes a *one-token*
    call on an already-started cache to its unclamped recurrent path instead, so a caller
    that wants that behaviour for T == 1 continuations uses ``mamba2_step``.
    """
    check_input(x, 2, g.hidden_size, "mamba2_prefill")
    cw = _check(w, g, state)
    T = x.shape[0]
    if T == 0:
        return np.zeros((0, g.hidden_size), F32)
    ni, cd = g.intermediate, g.conv_dim

    zxbcdt = _mm(w.in_proj, x)
    if w.in_proj_bias is not None:
        zxbcdt += w.in_proj_bias

    xbc = _run_conv(state.conv, zxbcdt[:, ni : ni + cd], cw, w)
    u = _ssm_norm(zxbcdt, xbc, w, g, state.ssm, clamp_dt=True)
    out = _mm(w.out_proj, u)
    if w.out_proj_bias is not None:
        out += w.out_proj_bias
    return out


# --------------------------------------------------------------------------- step


def mamba2_step(
    x: np.ndarray, w: Mamba2Weights, g: Mamba2Params, state: Mamba2State
) -> np.ndarray:
    """One token: ``x`` [hidden] -> [hidden] float32, advancing ``state`` in place.

    Δ is not clamped to ``time_step_limit`` here, as in transformers' recurrent path."""
    check_input(x, 1, g.hidden_size, "mamba2_step")
    cw = _check(w, g, state)
    ni, cd = g.intermediate, g.conv_dim

    zxbcdt = w.in_proj @ x if isinstance(w.in_proj, np.ndarray) else w.in_proj.mm(x[None])[0]
    if w.in_proj_bias is not None:
        zxbcdt += w.in_proj_bias

    xbc = _run_conv(state.conv, zxbcdt[None, ni : ni + cd], cw, w)
    u = _ssm_norm(zxbcdt[None], xbc, w, g, state.ssm, clamp_dt=False)[0]
    out = w.out_proj @ u if isinstance(w.out_proj, np.ndarray) else w.out_proj.mm(u[None])[0]
    if w.out_proj_bias is not None:
        out += w.out_proj_bias
    return out
