"""Decode-sized kernels: the non-product work of a pass of at most `ROWS` positions in a few
numba calls instead of many numpy ones (a decode step of SmolLM2 made ~40% of its time of
numpy call overhead around the products). Each kernel is one launch through
`vindex3.codecs.threads.launch` (so that the launch counts of bench/ stay honest):

* `rms_rows`: RMSNorm of each row, byte-identical to `vindex3.exec.ops.norm.rms_norm` (the sum
  of squares replays numpy's pairwise float32 sum: `pairwise`), with the finiteness of every
  row's mean of squares reported back for the caller's refusal.
* `silu_mul`: SiLU(gate) · up of a gated FFN.
* `attend`: one softmax-attention pass over the KV rows for every head: rotary embedding of q
  and k (any rope table, partial rotary), the query scale, the write of the new K/V rows,
  scores with score scale, softcap, causal and sliding-window masks, learned sinks, softmax
  and the weighted sum of V. Its rope and scale are numpy's arithmetic element for element;
  its dot products and sums run in the fixed order written below (not BLAS's), exp is a
  polynomial written out here (`_exp_into`) and tanh libm's double one rounded once to
  float32, so its bytes differ from the numpy path in the last bits and depend on no SIMD
  width numba picks for the target.

No kernel lets LLVM reassociate (no fastmath) nor contract a multiply and an add into an FMA
(numba emits neither by default), so every float operation happens in the order written.
Configurations outside a kernel take the numpy path (`enabled()` is False, more than `ROWS`
positions, an activation other than SiLU); ``VINDEX3_DECODE_KERNELS=0`` turns them off for a
process, `set_enabled` in one (tests and bench/decode_step.py run both paths).
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from ...codecs import threads
from ...codecs.intrinsics import _arrays_at, _f32, _i32, _int_arg, _load, _vec
from ...switches import set_switch
from .norm import DECODE

F32 = np.float32

#: Positions per pass up to which the kernels run (vindex3.exec.batch.ROWS streams share a pass).
ROWS = 8

def enabled() -> bool:
    return DECODE.on


def set_enabled(flag: bool | None) -> None:
    """Turn the kernels on or off for this process (None: read ``VINDEX3_DECODE_KERNELS`` again)."""
    set_switch(DECODE, "on", flag)


_JIT = {"cache": True, "error_model": "numpy", "nogil": True}


def _c_vector(name, *tys):
    for t in tys:
        if not isinstance(t, types.Array) or t.ndim != 1 or t.layout != "C" or t.dtype != types.float32:
            raise TypingError(f"{name}: takes a C-contiguous 1-D float32 array, got {t}")


def _fold8(context, builder, sig, args, start, step):
    """The vectors <8 x float> of a[lo : lo + n8] (args a, lo, n8; n8 a positive multiple of 8)
    folded in order: ``start(first)`` gives the state (a list of values), ``step(state, next)``
    the next state; returns the last state."""
    (aa,) = _arrays_at(context, builder, sig, args, (0,))
    lov, nv = (_int_arg(context, builder, sig.args[i], args[i]) for i in (1, 2))
    c = lambda x: ir.Constant(nv.type, x)
    v8 = _vec(_f32, 8)
    slots = [cgutils.alloca_once_value(builder, v) for v in start(_load(builder, aa.data, lov, v8))]
    with cgutils.for_range(builder, builder.sub(builder.ashr(nv, c(3)), c(1))) as loop:
        x = _load(builder, aa.data, builder.add(lov, builder.shl(builder.add(loop.index, c(1)), c(3))), v8)
        for slot, v in zip(slots, step([builder.load(t) for t in slots], x), strict=True):
            builder.store(v, slot)
    return [builder.load(t) for t in slots]


@intrinsic
def _sum8(typingctx, a, lo, n8):
    """numpy's eight running sums over a[lo : lo + n8] (n8 a positive multiple of 8) held as one
    <8 x float> register, then ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7)): `_leaf`'s
    bytes, one vector addition per eight elements (the scalar form ran at ~2 cycles an element)."""
    _c_vector("_sum8", a)
    sig = types.float32(a, lo, n8)

    def codegen(context, builder, sig, args):
        (r,) = _fold8(context, builder, sig, args, lambda x: [x], lambda st, x: [builder.fadd(st[0], x)])
        e = [builder.extract_element(r, ir.Constant(_i32, k)) for k in range(8)]
        add = builder.fadd
        return add(add(add(e[0], e[1]), add(e[2], e[3])), add(add(e[4], e[5]), add(e[6], e[7])))

    return sig, codegen


@intrinsic
def _max8(typingctx, a, lo, n8):
    """The largest of a[lo : lo + n8] (n8 a positive multiple of 8), NaN when any is NaN, eight
    lanes a step. A maximum's value does not depend on the order it is taken in; only the sign of
    a zero may (x - (+0) and x - (-0) are the same number for every x but a zero, whose exp is 1
    either way)."""
    _c_vector("_max8", a)
    sig = types.float32(a, lo, n8)

    def codegen(context, builder, sig, args):
        def step(st, x):
            return [builder.select(builder.fcmp_ordered(">", x, st[0]), x, st[0]),
                    builder.or_(st[1], builder.fcmp_unordered("uno", x, x))]

        r, nan = _fold8(context, builder, sig, args, lambda x: [x, builder.fcmp_unordered("uno", x, x)], step)
        m = builder.extract_element(r, ir.Constant(_i32, 0))
        for k in range(1, 8):
            x = builder.extract_element(r, ir.Constant(_i32, k))
            m = builder.select(builder.fcmp_ordered(">", x, m), x, m)
        any_nan = builder.icmp_unsigned("!=", builder.bitcast(nan, ir.IntType(8)), ir.Constant(ir.IntType(8), 0))
        return builder.select(any_nan, ir.Constant(_f32, float("nan")), m)

    return sig, codegen


@intrinsic
def _as_f32(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the integer ``bits`` (what a store into an
    int32 array keeps; a register move, no memory)."""
    if not isinstance(bits, types.Integer):
        raise TypingError(f"_as_f32: takes an integer, got {bits}")
    sig = types.float32(bits)

    def codegen(context, builder, sig, args):
        v = args[0]
        if v.type.width > 32:
            v = builder.trunc(v, _i32)
        return builder.bitcast(v, _f32)

    return sig, codegen


@numba.njit(**_JIT)
def _leaf(a, lo, n):  # pragma: no cover - compiled
    """numpy's float32 pairwise sum of at most 128 elements: 8 running sums, then the tail."""
    if n < 8:
        res = F32(-0.0)
        for i in range(lo, lo + n):
            res += a[i]
        return res
    stop = n - (n % 8)
    res = _sum8(a, lo, stop)
    for i in range(stop, n):
        res += a[lo + i]
    return res


@numba.njit(**_JIT)
def _max(x, n):  # pragma: no cover - compiled
    """The largest of x[:n] (n >= 1). With a NaN among them (NaN from the eight-lane part,
    numba's ``max`` in the last n % 8) every exp of the row is NaN whatever this returns."""
    if n < 8:
        m = x[0]
        for i in range(1, n):
            m = max(m, x[i])
        return m
    stop = n - n % 8
    m = _max8(x, 0, stop)
    for i in range(stop, n):
        m = max(m, x[i])
    return m


@numba.njit(**_JIT)
def pairwise(a, lo, n):  # pragma: no cover - compiled
    """Sum of a[lo:lo+n] in numpy's pairwise order for float32 (blocks of at most 128 as
    `_leaf`; a longer range is the sum of its halves, the first half's length cut down to a
    multiple of 8), so that a norm's bytes are numpy's."""
    if n <= 128:
        return _leaf(a, lo, n)
    return pairwise_in(a, lo, n, np.empty((3, 64), np.int64), np.empty(64, np.float32))


@numba.njit(**_JIT)
def pairwise_in(a, lo, n, fr, vals):  # pragma: no cover - compiled
    """`pairwise` with its stack given: fr int64 [3, 64] (frames), vals float32 [64], so that
    a kernel summing many rows allocates them once. The recursion runs on this explicit stack
    (numba's cached recursive functions are not reliable); 64 frames hold any length."""
    if n <= 128:
        return _leaf(a, lo, n)
    f_lo, f_n, f_stage = fr[0], fr[1], fr[2]
    sp, vp = 1, 0
    f_lo[0], f_n[0], f_stage[0] = lo, n, 0
    while sp > 0:
        top = sp - 1
        m = f_n[top]
        if m <= 128:
            vals[vp] = _leaf(a, f_lo[top], m)
            vp += 1
            sp -= 1
            continue
        n2 = m // 2
        n2 -= n2 % 8
        if f_stage[top] == 0:
            f_stage[top] = 1
            f_lo[sp], f_n[sp], f_stage[sp] = f_lo[top], n2, 0
            sp += 1
        elif f_stage[top] == 1:
            f_stage[top] = 2
            f_lo[sp], f_n[sp], f_stage[sp] = f_lo[top] + n2, m - n2, 0
            sp += 1
        else:
            vals[vp - 2] = vals[vp - 2] + vals[vp - 1]
            vp -= 1
            sp -= 1
    return vals[0]


# exp in float32 (the Cephes expf scheme): x = n·ln2 + r with ln2 split in two, a degree-6
# polynomial in r, times 2^n built in the exponent bits. Every operation is written out (no libm,
# no FMA), so the bytes are the same on every target and the loops vectorize; within 2e-7
# relative of exp over [-87, 88] (tests/test_decode_kernels.py), where the argument is clamped.
_LOG2E = F32(1.44269504088896341)
_LN2_HI = F32(0.693359375)
_LN2_LO = F32(-2.12194440e-4)
_E0, _E1, _E2 = F32(1.9875691500e-4), F32(1.3981999507e-3), F32(8.3334519073e-3)
_E3, _E4, _E5 = F32(4.1665795894e-2), F32(1.6666665459e-1), F32(5.0000001201e-1)
_EXP_HI = F32(88.0)
_EXP_LO = F32(-87.0)


@numba.njit(**_JIT)
def _exp_poly(x):  # pragma: no cover - compiled
    """(polynomial part, n) of exp(x) = poly · 2^n, x clamped to [-87, 88]."""
    v = min(max(x, _EXP_LO), _EXP_HI)
    fn = np.floor(v * _LOG2E + F32(0.5))
    r = (v - fn * _LN2_HI) - fn * _LN2_LO
    z = r * r
    p = ((((((_E0 * r + _E1) * r + _E2) * r + _E3) * r + _E4) * r + _E5) * z + r) + F32(1.0)
    return p, fn


@numba.njit(**_JIT)
def _exp_into(x, out, n, bits):  # pragma: no cover - compiled
    """out[i] = exp(x[i]) for i < n (out may be x); ``bits`` an int32 scratch of >= n."""
    for i in range(n):
        p, fn = _exp_poly(x[i])
        out[i] = p
        bits[i] = (np.int32(fn) + np.int32(127)) << np.int32(23)
    scale = bits.view(np.float32)
    for i in range(n):
        out[i] = out[i] * scale[i]


@numba.njit(**_JIT)
def _exp(x):  # pragma: no cover - compiled
    """exp of one float32, the same bytes as `_exp_into`."""
    p, fn = _exp_poly(x)
    return F32(math.ldexp(np.float64(p), int(fn)))


@numba.njit(**_JIT)
def _rms_rows(x, w, eps, out):  # pragma: no cover - compiled
    """x, out [R, d]: out = w * (x * (1 / sqrt(mean(x²) + eps))) per row, as norm.rms_norm does
    it (the mean: a float32 sum, then a float64 division by d rounded to float32). Returns
    whether every row's mean of squares is finite."""
    R, d = x.shape
    sq = np.empty(d, np.float32)
    ok = True
    for r in range(R):
        xr = x[r]
        for i in range(d):
            sq[i] = xr[i] * xr[i]
        var = F32(np.float64(pairwise(sq, 0, d)) / np.float64(d))
        if not np.isfinite(var):
            ok = False
        rs = F32(1.0) / np.sqrt(var + eps)
        o = out[r]
        for i in range(d):
            o[i] = w[i] * (xr[i] * rs)
    return ok


@numba.njit(**_JIT)
def _silu_mul(g, u, out):  # pragma: no cover - compiled
    """out = g / (1 + exp(-g)) * u elementwise ([R, n] each; g and u may be strided views)."""
    R, n = out.shape
    e = np.empty(n, np.float32)
    bits = np.empty(n, np.int32)
    for r in range(R):
        gr, ur, o = g[r], u[r], out[r]
        for i in range(n):
            e[i] = -gr[i]
        _exp_into(e, e, n, bits)
        for i in range(n):
            o[i] = gr[i] / (F32(1.0) + e[i]) * ur[i]


@numba.njit(**_JIT)
def _dot(a, b, n):  # pragma: no cover - compiled
    """Σ a[i]·b[i] in a fixed order: 8 running sums (element i into sum i mod 8, ascending),
    combined as ((s0+s1)+(s2+s3))+((s4+s5)+(s6+s7)), then the tail ascending."""
    if n < 8:
        res = F32(0.0)
        for i in range(n):
            res += a[i] * b[i]
        return res
    r0, r1, r2, r3 = a[0] * b[0], a[1] * b[1], a[2] * b[2], a[3] * b[3]
    r4, r5, r6, r7 = a[4] * b[4], a[5] * b[5], a[6] * b[6], a[7] * b[7]
    i = 8
    stop = n - (n % 8)
    while i < stop:
        r0 += a[i] * b[i]
        r1 += a[i + 1] * b[i + 1]
        r2 += a[i + 2] * b[i + 2]
        r3 += a[i + 3] * b[i + 3]
        r4 += a[i + 4] * b[i + 4]
        r5 += a[i + 5] * b[i + 5]
        r6 += a[i + 6] * b[i + 6]
        r7 += a[i + 7] * b[i + 7]
        i += 8
    res = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while i < n:
        res += a[i] * b[i]
        i += 1
    return res


@numba.njit(**_JIT)
def _rotate(x, cos, sin, scale, out):  # pragma: no cover - compiled
    """x, out [heads, hd]; cos, sin [r] (r = 0: no rope). rope.apply's arithmetic: the first r
    dims of each head become x·cos + rot·sin (rot the rotate-half of them), the rest pass; then
    times ``scale`` when it is not 1."""
    H, hd = x.shape
    r = cos.shape[0]
    half = r // 2
    for h in range(H):
        xh, o = x[h], out[h]
        for i in range(half):
            o[i] = xh[i] * cos[i] + (-xh[i + half]) * sin[i]
        for i in range(half, r):
            o[i] = xh[i] * cos[i] + xh[i - half] * sin[i]
        for i in range(r, hd):
            o[i] = xh[i]
        if scale != F32(1.0):
            for i in range(hd):
                o[i] = o[i] * scale


@numba.njit(**_JIT)
def _attend(q, k, v, cos, sin, qscale, KT, V, row0, first, start, p0, window, sscale, cap, sinks, keep, probs,
            out):  # pragma: no cover - compiled
    """One attention pass of T positions from p0 for every head.

    q [T, nh, hd], k and v [T, nkv, hd] (projected, before rope); cos, sin [T, r] (r = 0: no
    rope); KT [nkv, hd, rows] and V [nkv, rows, hd] the layer's KV rows (K transposed), the T new
    rows written at row0.. (rotated k, and v); the keys in reach are absolute positions first ..
    p0+T-1, at row first - start. window <= 0: full span. cap <= 0: no softcap. sinks [nh]
    (empty: none). keep: write the attention weights into probs [nkv, g, T, S] (S keys from
    ``first``; masked ones 0). out [T, nh, hd]: the heads' output.

    Order of the float operations: a score is ((q0·k0 + q1·k1) + q2·k2) + ... over the head
    dims in order, then times the score scale; the softmax denominator is numpy's pairwise sum
    of the exponentials; an output dim is ((p0·v0 + p1·v1) + ...) over the keys in order. The
    loops over keys (scores) and over head dims (output) have independent lanes, so whatever
    width the target vectorizes them at, each value is computed the same way."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    S = p0 + T - first
    base = first - start
    qr = np.empty((nh, hd), np.float32)
    for t in range(T):
        _rotate(k[t], cos[t], sin[t], F32(1.0), qr[:nkv])
        for j in range(nkv):
            for i in range(hd):
                KT[j, i, row0 + t] = qr[j, i]
            V[j, row0 + t, :] = v[t, j]
    s = np.empty(S, np.float32)
    bits = np.empty(S, np.int32)
    acc = np.empty(hd, np.float32)
    has_sinks = sinks.shape[0] > 0
    for t in range(T):
        _rotate(q[t], cos[t], sin[t], qscale, qr)
        qpos = p0 + t
        for h in range(nh):
            j = h // g
            qh = qr[h]
            # keys kk in [a, b) are visible: causal, and within the window
            a = 0
            if window > 0:
                a = max(0, qpos - window + 1 - first)
            b = qpos + 1 - first
            n = b - a
            sk = s[a:b]
            kr = KT[j, 0, base + a:base + b]
            q0 = qh[0]
            for kk in range(n):
                sk[kk] = q0 * kr[kk]
            for i in range(1, hd):
                kr = KT[j, i, base + a:base + b]
                qi = qh[i]
                for kk in range(n):
                    sk[kk] += qi * kr[kk]
            m = F32(-np.inf)
            for kk in range(n):
                sc = sk[kk] * sscale
                if cap > F32(0.0):
                    sc = sc / cap
                    sc = F32(math.tanh(np.float64(sc)))
                    sc = sc * cap
                sk[kk] = sc
                m = max(m, sc)
            if has_sinks and sinks[h] > m:
                m = sinks[h]
            for kk in range(n):
                sk[kk] = sk[kk] - m
            _exp_into(sk, sk, n, bits)
            den = pairwise(s, a, n)
            if has_sinks:
                den = den + _exp(sinks[h] - m)
            inv = F32(1.0) / den
            for kk in range(n):
                sk[kk] = sk[kk] * inv
            p = sk[0]
            vr = V[j, base + a]
            for i in range(hd):
                acc[i] = p * vr[i]
            for kk in range(1, n):
                p = sk[kk]
                vr = V[j, base + a + kk]
                for i in range(hd):
                    acc[i] += p * vr[i]
            out[t, h, :] = acc
            if keep:
                pr = probs[j, h - j * g, t]
                for kk in range(S):
                    pr[kk] = s[kk] if a <= kk < b else F32(0.0)


def rms_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> tuple[np.ndarray, bool]:
    """x [..., d] float32 -> (its RMSNorm, whether every mean of squares is finite)."""
    if type(eps) is not np.float32:  # a float64 eps would make the kernel's mean float64
        eps = np.float32(eps)
    if x.ndim == 2 and x.flags.c_contiguous:
        out = np.empty(x.shape, np.float32)
        with threads.launch():
            ok = _rms_rows(x, weight, eps, out)
        return out, ok
    shape = x.shape
    x2 = np.ascontiguousarray(x).reshape(-1, shape[-1])
    out = np.empty(x2.shape, np.float32)
    with threads.launch():
        ok = _rms_rows(x2, weight, eps, out)
    return out.reshape(shape), ok


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SiLU(g) · u for [T, n] float32 (views allowed)."""
    out = np.empty(g.shape, np.float32)
    with threads.launch():
        _silu_mul(g, u, out)
    return out


_NO_ROPE = np.empty((ROWS, 0), np.float32)
_NO_SINKS = np.empty(0, np.float32)
_NO_PROBS = np.empty((1, 1, 1, 1), np.float32)


def attend(q, k, v, cos, sin, qscale, kv, first: int, p0: int, window: int, sscale, cap, sinks,
           probs: np.ndarray | None) -> np.ndarray:
    """q [T, nh, hd], k and v [T, nkv, hd] float32, projected (biases, norms, clamp done);
    ``kv`` the layer's `KvRows` (capacity for T more rows ensured here, its end advanced).
    Returns the heads' output [T, nh * hd]."""
    T, nh, hd = q.shape
    row0 = kv.reserve(T)
    if first < kv.start:
        from ...errors import StateError

        raise StateError(f"KV rows before position {kv.start} were released (asked for {first})")
    if cos is None:
        cos = sin = _NO_ROPE
    out = np.empty((T, nh, hd), np.float32)
    with threads.launch():
        _attend(q, k, v, cos, sin, qscale, kv.kt, kv.v, row0, first, kv.start, p0, window, sscale, cap,
                _NO_SINKS if sinks is None else sinks, probs is not None, _NO_PROBS if probs is None else probs, out)
    kv.end += T
    return out.reshape(T, nh * hd)
