"""Prefill-sized kernels (passes of more than `vindex3.exec.ops.decode.ROWS` positions): the
non-product work of a long pass in a few compiled calls, split over `threads.count()` threads.

* `attend`: softmax attention of T positions for every head, the whole of what
  `vindex3.exec.ops.softmax`'s numpy path does after the projections and per-head QK-norm:
  rotary embedding of q and k (any rope table, partial rotary), the query scale, the write of the
  new K/V rows, scores with score scale, softcap, causal and sliding-window masks, learned sinks,
  softmax and the weighted sum of V. Every feature of the numpy path is covered; the numpy path
  stays for processes that turn the kernels off (``VINDEX3_PREFILL_KERNELS=0``, `set_enabled`).
  Work is split into tasks (kv head, block of `TASK_ROWS` queries); a query's scores run only
  over the keys it sees (causal and window), so the masked triangle is never computed. Within a
  task, sub-blocks of up to `QB_MAX` queries walk their keys in segments of `_key_block` keys:
  a segment's K rows are copied once into a small contiguous tile (the cache's rows lie a
  capacity apart, and a power-of-two capacity put a segment's head dims into a few L1 sets) and
  its K and V rows serve every query of the sub-block from L1; scores and weighted sums keep
  their running sums in registers for up to three heads at once (`_make_scores`, `_make_wsum`).
  The arithmetic of one (query, head) is `vindex3.exec.ops.decode._attend`'s, in the same order
  (scores dim by dim over the head dims, the polynomial exp, numpy's pairwise sum for the
  denominator, the weighted sum of V key by key), so a prefill's attention is the bytes of a
  decode-kernel pass over the same rows, whatever the block partition
  (tests/test_prefill_attend.py steps the decode kernel position by position against it).
* `silu_mul`: SiLU(gate) · up of a gated FFN, rows split over threads (decode's row arithmetic).
* `rms_rows`: RMSNorm of each row, rows split over threads (decode's row arithmetic, which is
  numpy's own bytes).

Each output element is computed by exactly one task from start to end, so the bytes do not
depend on the thread count (tests/test_prefill_attend.py). No fastmath: no reassociation, no
FMA contraction, as the decode kernels."""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ...codecs import threads
from ...codecs.intrinsics import _arrays_at, _consts, _f32, _i32, _int_arg, _load, _vec
from ...switches import EnvSwitch, set_switch
from .decode import _as_f32, _c_vector, _exp, _exp_poly, _max, _rms_rows, _rotate, pairwise_in

F32 = np.float32
TASK_ROWS = (
    32  # queries per attention task: 48 tasks for a 512-token SmolLM2 pass, few enough to be cheap
)


class _Switch:
    on = EnvSwitch("VINDEX3_PREFILL_KERNELS")


PREFILL = _Switch()


def enabled() -> bool:
    return PREFILL.on


def set_enabled(flag: bool | None) -> None:
    """Turn the kernels on or off for this process (None: read ``VINDEX3_PREFILL_KERNELS`` again)."""
    set_switch(PREFILL, "on", flag)


_JIT = {"cache": True, "error_model": "numpy", "nogil": True}
_PAR = dict(_JIT, parallel=True)


@numba.njit(**_PAR)
def _write_kv(k, v, cos, sin, KT, V, row0):  # pragma: no cover - compiled
    """The T new rows: k rotated (decode's `_rotate`) into KT [nkv, hd, rows] at row0.., v into
    V [nkv, rows, hd]. One task per kv head."""
    T, nkv, hd = k.shape
    for j in prange(nkv):
        kr = np.empty((1, hd), np.float32)
        for t in range(T):
            _rotate(k[t, j : j + 1], cos[t], sin[t], F32(1.0), kr)
            for i in range(hd):
                KT[j, i, row0 + t] = kr[0, i]
            for i in range(hd):
                V[j, row0 + t, i] = v[t, j, i]


@numba.njit(**_JIT)
def _exp_shifted(s, m, n):  # pragma: no cover - compiled
    """s[i] = exp(s[i] - m) for i < n, decode's `_exp_into` arithmetic in place, in one pass
    (2^n made from its bits in a register: `_as_f32`, so the loop needs no int32 scratch)."""
    for i in range(n):
        p, fn = _exp_poly(s[i] - m)
        s[i] = p * _as_f32((np.int32(fn) + np.int32(127)) << np.int32(23))


@numba.njit(**_JIT)
def _weighted1(s, h, n, V, j, o, out, t, oh):  # pragma: no cover - compiled
    """out[t, oh, i] = Σ_kk s[h, kk] · V[j, o + kk, i], ((p0·v0 + p1·v1) + p2·v2) + ... over the
    keys in order (decode's `_attend` order), eight keys a sweep over the head dims."""
    hd = V.shape[2]
    if n >= 8:
        p00 = s[h + 0, 0]
        p01 = s[h + 0, 1]
        p02 = s[h + 0, 2]
        p03 = s[h + 0, 3]
        p04 = s[h + 0, 4]
        p05 = s[h + 0, 5]
        p06 = s[h + 0, 6]
        p07 = s[h + 0, 7]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (
                    (
                        (
                            ((p00 * V[j, o, i] + p01 * V[j, o + 1, i]) + p02 * V[j, o + 2, i])
                            + p03 * V[j, o + 3, i]
                        )
                        + p04 * V[j, o + 4, i]
                    )
                    + p05 * V[j, o + 5, i]
                )
                + p06 * V[j, o + 6, i]
            ) + p07 * V[j, o + 7, i]
        kk = 8
    else:
        p00 = s[h + 0, 0]
        for i in range(hd):
            out[t, oh + 0, i] = p00 * V[j, o, i]
        kk = 1
    while kk + 8 <= n:
        r = o + kk
        p00 = s[h + 0, kk]
        p01 = s[h + 0, kk + 1]
        p02 = s[h + 0, kk + 2]
        p03 = s[h + 0, kk + 3]
        p04 = s[h + 0, kk + 4]
        p05 = s[h + 0, kk + 5]
        p06 = s[h + 0, kk + 6]
        p07 = s[h + 0, kk + 7]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (
                    (
                        (
                            (
                                ((out[t, oh + 0, i] + p00 * V[j, r, i]) + p01 * V[j, r + 1, i])
                                + p02 * V[j, r + 2, i]
                            )
                            + p03 * V[j, r + 3, i]
                        )
                        + p04 * V[j, r + 4, i]
                    )
                    + p05 * V[j, r + 5, i]
                )
                + p06 * V[j, r + 6, i]
            ) + p07 * V[j, r + 7, i]
        kk += 8
    while kk < n:
        r = o + kk
        p00 = s[h + 0, kk]
        for i in range(hd):
            out[t, oh + 0, i] = out[t, oh + 0, i] + p00 * V[j, r, i]
        kk += 1


@numba.njit(**_JIT)
def _weighted2(s, h, n, V, j, o, out, t, oh):  # pragma: no cover - compiled
    """`_weighted1` for 2 heads at once (rows h.. of s, heads oh.. of out): one load of a value
    row for all of them, 2 independent chains in flight; the same bytes, four keys a sweep."""
    hd = V.shape[2]
    if n >= 4:
        p00 = s[h + 0, 0]
        p01 = s[h + 0, 1]
        p02 = s[h + 0, 2]
        p03 = s[h + 0, 3]
        p10 = s[h + 1, 0]
        p11 = s[h + 1, 1]
        p12 = s[h + 1, 2]
        p13 = s[h + 1, 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (p00 * V[j, o, i] + p01 * V[j, o + 1, i]) + p02 * V[j, o + 2, i]
            ) + p03 * V[j, o + 3, i]
            out[t, oh + 1, i] = (
                (p10 * V[j, o, i] + p11 * V[j, o + 1, i]) + p12 * V[j, o + 2, i]
            ) + p13 * V[j, o + 3, i]
        kk = 4
    else:
        p00 = s[h + 0, 0]
        p10 = s[h + 1, 0]
        for i in range(hd):
            out[t, oh + 0, i] = p00 * V[j, o, i]
            out[t, oh + 1, i] = p10 * V[j, o, i]
        kk = 1
    while kk + 4 <= n:
        r = o + kk
        p00 = s[h + 0, kk]
        p01 = s[h + 0, kk + 1]
        p02 = s[h + 0, kk + 2]
        p03 = s[h + 0, kk + 3]
        p10 = s[h + 1, kk]
        p11 = s[h + 1, kk + 1]
        p12 = s[h + 1, kk + 2]
        p13 = s[h + 1, kk + 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                ((out[t, oh + 0, i] + p00 * V[j, r, i]) + p01 * V[j, r + 1, i])
                + p02 * V[j, r + 2, i]
            ) + p03 * V[j, r + 3, i]
            out[t, oh + 1, i] = (
                ((out[t, oh + 1, i] + p10 * V[j, r, i]) + p11 * V[j, r + 1, i])
                + p12 * V[j, r + 2, i]
            ) + p13 * V[j, r + 3, i]
        kk += 4
    while kk < n:
        r = o + kk
        p00 = s[h + 0, kk]
        p10 = s[h + 1, kk]
        for i in range(hd):
            out[t, oh + 0, i] = out[t, oh + 0, i] + p00 * V[j, r, i]
            out[t, oh + 1, i] = out[t, oh + 1, i] + p10 * V[j, r, i]
        kk += 1


@numba.njit(**_JIT)
def _weighted3(s, h, n, V, j, o, out, t, oh):  # pragma: no cover - compiled
    """`_weighted1` for 3 heads at once (rows h.. of s, heads oh.. of out): one load of a value
    row for all of them, 3 independent chains in flight; the same bytes, four keys a sweep."""
    hd = V.shape[2]
    if n >= 4:
        p00 = s[h + 0, 0]
        p01 = s[h + 0, 1]
        p02 = s[h + 0, 2]
        p03 = s[h + 0, 3]
        p10 = s[h + 1, 0]
        p11 = s[h + 1, 1]
        p12 = s[h + 1, 2]
        p13 = s[h + 1, 3]
        p20 = s[h + 2, 0]
        p21 = s[h + 2, 1]
        p22 = s[h + 2, 2]
        p23 = s[h + 2, 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                (p00 * V[j, o, i] + p01 * V[j, o + 1, i]) + p02 * V[j, o + 2, i]
            ) + p03 * V[j, o + 3, i]
            out[t, oh + 1, i] = (
                (p10 * V[j, o, i] + p11 * V[j, o + 1, i]) + p12 * V[j, o + 2, i]
            ) + p13 * V[j, o + 3, i]
            out[t, oh + 2, i] = (
                (p20 * V[j, o, i] + p21 * V[j, o + 1, i]) + p22 * V[j, o + 2, i]
            ) + p23 * V[j, o + 3, i]
        kk = 4
    else:
        p00 = s[h + 0, 0]
        p10 = s[h + 1, 0]
        p20 = s[h + 2, 0]
        for i in range(hd):
            out[t, oh + 0, i] = p00 * V[j, o, i]
            out[t, oh + 1, i] = p10 * V[j, o, i]
            out[t, oh + 2, i] = p20 * V[j, o, i]
        kk = 1
    while kk + 4 <= n:
        r = o + kk
        p00 = s[h + 0, kk]
        p01 = s[h + 0, kk + 1]
        p02 = s[h + 0, kk + 2]
        p03 = s[h + 0, kk + 3]
        p10 = s[h + 1, kk]
        p11 = s[h + 1, kk + 1]
        p12 = s[h + 1, kk + 2]
        p13 = s[h + 1, kk + 3]
        p20 = s[h + 2, kk]
        p21 = s[h + 2, kk + 1]
        p22 = s[h + 2, kk + 2]
        p23 = s[h + 2, kk + 3]
        for i in range(hd):
            out[t, oh + 0, i] = (
                ((out[t, oh + 0, i] + p00 * V[j, r, i]) + p01 * V[j, r + 1, i])
                + p02 * V[j, r + 2, i]
            ) + p03 * V[j, r + 3, i]
            out[t, oh + 1, i] = (
                ((out[t, oh + 1, i] + p10 * V[j, r, i]) + p11 * V[j, r + 1, i])
                + p12 * V[j, r + 2, i]
            ) + p13 * V[j, r + 3, i]
            out[t, oh + 2, i] = (
                ((out[t, oh + 2, i] + p20 * V[j, r, i]) + p21 * V[j, r + 1, i])
                + p22 * V[j, r + 2, i]
            ) + p23 * V[j, r + 3, i]
        kk += 4
    while kk < n:
        r = o + kk
        p00 = s[h + 0, kk]
        p10 = s[h + 1, kk]
        p20 = s[h + 2, kk]
        for i in range(hd):
            out[t, oh + 0, i] = out[t, oh + 0, i] + p00 * V[j, r, i]
            out[t, oh + 1, i] = out[t, oh + 1, i] + p10 * V[j, r, i]
            out[t, oh + 2, i] = out[t, oh + 2, i] + p20 * V[j, r, i]
        kk += 1


def _splat(builder, x, w: int):
    v = builder.insert_element(ir.Constant(_vec(_f32, w), None), x, ir.Constant(_i32, 0))
    return builder.shuffle_vector(v, v, _consts(_i32, [0] * w))


def _row_splats(builder, data, x0, stride, H):
    """A function of an element offset k: the H values data[x0 + h·stride + k], each broadcast
    to <8 x float>."""
    rows = [builder.add(x0, builder.mul(ir.Constant(x0.type, h), stride)) for h in range(H)]
    return lambda k: [_splat(builder, builder.load(builder.gep(data, [builder.add(r, k)])), 8) for r in rows]


def _mul_add_into(builder, accs, xs, ys):
    """accs[h][w] = accs[h][w] + xs[h] · ys[w]: a product, then an addition (no FMA)."""
    for h, x in enumerate(xs):
        for w, y in enumerate(ys):
            builder.store(builder.fadd(builder.load(accs[h][w]), builder.fmul(x, y)), accs[h][w])


def _store_rows(builder, data, rows, accs):
    """The <8 x float> sums accs[h][w] stored at element rows[h] + 8w of ``data``."""
    for row, line in zip(rows, accs, strict=True):
        for w, acc in enumerate(line):
            dst = builder.gep(data, [builder.add(row, ir.Constant(row.type, 8 * w))])
            builder.store(builder.load(acc), builder.bitcast(dst, acc.type.pointee.as_pointer()), align=1)


def _halving_blocks(builder, count, W, body):
    """body(i, w) for the blocks that cover ``count`` vectors: count // W blocks of W vectors
    (i: the first vector's index), then one of W/2, W/4, ... 1 for each set bit of the rest
    (W a power of two)."""
    c = lambda x: ir.Constant(count.type, x)
    shift = W.bit_length() - 1
    with cgutils.for_range(builder, builder.ashr(count, c(shift))) as loop:
        body(builder.shl(loop.index, c(shift)), W)
    i = builder.shl(builder.ashr(count, c(shift)), c(shift))
    w = W // 2
    while w >= 1:
        has = builder.icmp_signed("!=", builder.and_(count, c(w)), c(0))
        with builder.if_then(has):
            body(i, w)
        i = builder.add(i, builder.select(has, c(w), c(0)))
        w //= 2


def _make_scores(H: int, W: int):
    """An intrinsic writing the scores of H heads over keys in blocks of 8W (H·W running sums in
    registers): S[s0 + h·ss + kk] = Σ_d Q[q0 + h·hd + d] · KT[k0 + d·rows + kk] for h < H and
    kk < n8 (a multiple of 8), each score in decode's order ((q0·k0 + q1·k1) + q2·k2) + ... over
    the head dims, no FMA. A loaded key vector serves H heads and a broadcast query element W
    vectors of keys; the sums stay in registers across all head dims."""

    @intrinsic
    def scores(typingctx, Q, q0, KT, k0, rows, hd, n8, S, s0, ss):
        _c_vector("scores", Q, KT, S)
        sig = types.void(Q, q0, KT, k0, rows, hd, n8, S, s0, ss)

        def codegen(context, builder, sig, args):
            aq, ak, as_ = _arrays_at(context, builder, sig, args, (0, 2, 7))
            q0v, k0v, rv, hdv, nv, s0v, ssv = (_int_arg(context, builder, sig.args[i], args[i]) for i in (1, 3, 4, 5, 6, 8, 9))
            c = lambda x: ir.Constant(nv.type, x)
            v8 = _vec(_f32, 8)
            qsplat = _row_splats(builder, aq.data, q0v, hdv, H)

            def block(vec, Wb):
                col = builder.add(k0v, builder.shl(vec, c(3)))
                qs = qsplat(c(0))
                ks = [_load(builder, ak.data, builder.add(col, c(8 * w)), v8) for w in range(Wb)]
                accs = [[cgutils.alloca_once_value(builder, builder.fmul(qs[h], ks[w])) for w in range(Wb)] for h in range(H)]
                with cgutils.for_range(builder, builder.sub(hdv, c(1))) as loop:
                    d = builder.add(loop.index, c(1))
                    base = builder.add(col, builder.mul(d, rv))
                    ks = [_load(builder, ak.data, builder.add(base, c(8 * w)), v8) for w in range(Wb)]
                    _mul_add_into(builder, accs, qsplat(d), ks)
                rows_ = [builder.add(builder.add(s0v, builder.mul(c(h), ssv)), builder.shl(vec, c(3))) for h in range(H)]
                _store_rows(builder, as_.data, rows_, accs)

            _halving_blocks(builder, builder.ashr(nv, c(3)), W, block)
            return context.get_dummy_value()

        return sig, codegen

    return scores


def _make_wsum(H: int, W: int):
    """An intrinsic writing H heads' weighted sums of V over head dims in chunks of 8W (H·W
    running sums in registers): O[o0 + h·os + i] = Σ_k P[p0 + h·ps + k] · V[v0 + k·hd + i] for
    h < H, i < hd (a multiple of 8), k < n (>= 1), `_weighted1`'s order (the first product, then
    each next one added, keys in order; no FMA); with ``more`` the sums already in O go on (a
    later segment of the same keys: the order of additions is unchanged). A loaded value vector
    serves H heads: the group's heads read V once from cache instead of H times."""

    @intrinsic
    def wsum(typingctx, P, p0, ps, n, V, v0, hd, O, o0, os_, more):
        _c_vector("wsum", P, V, O)
        if not isinstance(more, types.Boolean):
            raise numba.core.errors.TypingError(f"wsum: ``more`` is a boolean, got {more}")
        sig = types.void(P, p0, ps, n, V, v0, hd, O, o0, os_, more)

        def codegen(context, builder, sig, args):
            ap, av, ao = _arrays_at(context, builder, sig, args, (0, 4, 7))
            p0v, psv, nv, v0v, hdv, o0v, osv = (_int_arg(context, builder, sig.args[i], args[i]) for i in (1, 2, 3, 5, 6, 8, 9))
            morev = context.cast(builder, args[10], sig.args[10], types.boolean)
            c = lambda x: ir.Constant(nv.type, x)
            v8 = _vec(_f32, 8)
            psplat = _row_splats(builder, ap.data, p0v, psv, H)

            def chunk(vec, Wb):
                col = builder.shl(vec, c(3))
                base0 = builder.add(v0v, col)
                ps_ = psplat(c(0))
                vs = [_load(builder, av.data, builder.add(base0, c(8 * w)), v8) for w in range(Wb)]
                orow = [builder.add(builder.add(o0v, builder.mul(c(h), osv)), col) for h in range(H)]
                # the first key's product starts the sums, or (more) the sums in O go on
                accs = [[cgutils.alloca_once_value(builder, builder.select(
                    morev, _load(builder, ao.data, builder.add(orow[h], c(8 * w)), v8), builder.fmul(ps_[h], vs[w])))
                    for w in range(Wb)] for h in range(H)]
                k1 = builder.select(morev, c(0), c(1))
                with cgutils.for_range(builder, builder.sub(nv, k1)) as loop:
                    k = builder.add(loop.index, k1)
                    base = builder.add(base0, builder.mul(k, hdv))
                    vs = [_load(builder, av.data, builder.add(base, c(8 * w)), v8) for w in range(Wb)]
                    _mul_add_into(builder, accs, psplat(k), vs)
                _store_rows(builder, ao.data, orow, accs)

            _halving_blocks(builder, builder.ashr(hdv, c(3)), W, chunk)
            return context.get_dummy_value()

        return sig, codegen

    return wsum


# heads at a time x vectors a block: at most 12 running sums, with the loaded vectors and the
# broadcasts within the 16 vector registers of AVX2
_scores_h1, _scores_h2, _scores_h3 = _make_scores(1, 8), _make_scores(2, 4), _make_scores(3, 2)
_wsum_h1, _wsum_h2, _wsum_h3 = _make_wsum(1, 8), _make_wsum(2, 4), _make_wsum(3, 2)


@numba.njit(**_JIT)
def _copy_cols(src, s0, ss, dst, ds, nrows, n):  # pragma: no cover - compiled
    """dst[r·ds + c] = src[s0 + r·ss + c] for r < nrows, c < n (unsigned indices: no
    negative-index wraparound in the loop)."""
    for r in range(nrows):
        a = np.uint64(s0 + r * ss)
        b = np.uint64(r * ds)
        for c in range(np.uint64(n)):
            dst[b + c] = src[a + c]


#: queries a sub-block at most: a segment's keys are copied and loaded once for this many queries
QB_MAX = 8


@numba.njit(**_JIT)
def _query_block(g, S):  # pragma: no cover - compiled
    """Queries a sub-block: QB_MAX, fewer when their scores (QB · g · S float32) would pass 1 MB."""
    return max(1, min(QB_MAX, (1 << 18) // max(1, g * S)))


@numba.njit(**_JIT)
def _key_block(hd):  # pragma: no cover - compiled
    """Keys a segment: 32 at head dim 64, 16 at 128 and above, so that for head dims up to 128 a
    segment's K and V rows (2 · hd · KB float32) fill at most half of a 32 KB L1."""
    return max(16, (2048 // hd) // 8 * 8)


@numba.njit(**_JIT)
def _scores_tail(qr, g, kp, o, n8, n, s, c0):  # pragma: no cover - compiled
    """Scores of the keys in columns o + n8 .. o + n - 1 (fewer than 8) of kp [hd, cols] for the
    g heads into s[hh, c0 + n8 ..], `_make_scores`'s order."""
    hd = qr.shape[1]
    for kk in range(n8, n):
        r = o + kk
        for hh in range(g):
            acc = qr[hh, 0] * kp[0, r]
            for i in range(1, hd):
                acc = acc + qr[hh, i] * kp[i, r]
            s[hh, c0 + kk] = acc


@numba.njit(**_PAR)
def _attend(
    q,
    cos,
    sin,
    qscale,
    KT,
    V,
    base,
    first,
    p0,
    t_lo,
    t_hi,
    window,
    sscale,
    cap,
    sinks,
    tasks,
    keep,
    probs,
    k0,
    out,
):  # pragma: no cover - compiled
    """Queries t_lo .. t_hi-1 (absolute positions p0 + t) of q [T, nh, hd] (projected, before
    rope; cos, sin [T, r], r = 0: no rope) over the KV rows KT [nkv, hd, rows] and V [nkv, rows,
    hd], whose key at absolute position first sits at row ``base``. window <= 0: full span;
    cap <= 0: no softcap; sinks [nh] (empty: none). ``tasks`` [n, 3]: (kv head, first query,
    end query). keep: write the weights into probs [nkv, g, t_hi - t_lo, keys], key column c
    being absolute position k0 + c (masked ones 0). out [T, nh, hd]: rows t_lo .. t_hi-1."""
    nh, hd = q.shape[1], q.shape[2]
    nkv = KT.shape[0]
    g = nh // nkv
    has_sinks = sinks.shape[0] > 0
    S = p0 + t_hi - first  # keys the last query may see, from first
    vrows = V.shape[1]
    rows = KT.shape[2]
    Vf = V.reshape(-1)
    KTf = KT.reshape(-1)
    of = out.reshape(-1)
    KB = _key_block(hd)
    QB = _query_block(g, S)
    for task in prange(tasks.shape[0]):
        j, ta, tb = tasks[task, 0], tasks[task, 1], tasks[task, 2]
        qr = np.empty((QB, g, hd), np.float32)
        qf = qr.reshape(-1)
        s = np.empty((QB, g, S), np.float32)
        sf = s.reshape(-1)
        A = np.empty(QB, np.int64)
        N = np.empty(QB, np.int64)
        kp = np.empty((hd, KB), np.float32)
        kpf = kp.reshape(-1)
        fr = np.empty((3, 64), np.int64)
        vals = np.empty(64, np.float32)
        for u0 in range(ta, tb, QB):
            nq = min(tb, u0 + QB) - u0
            nmax = 0
            for qi in range(nq):
                t = u0 + qi
                _rotate(q[t, j * g : (j + 1) * g], cos[t], sin[t], qscale, qr[qi])
                qpos = p0 + t
                a = 0
                if window > 0:
                    a = max(0, qpos - window + 1 - first)
                A[qi] = a  # s[qi, hh, kk] is key a + kk, at row base + a + kk
                N[qi] = qpos + 1 - first - a
                nmax = max(nmax, N[qi])
            # scores: the sub-block's keys in segments of KB, each copied into ``kp`` [hd, KB]
            # (the cache's rows are far apart: a power-of-two capacity put a segment's head dims
            # into a few L1 sets), then every query's keys in the segment one after another
            first_key = A[0]
            span = A[nq - 1] + N[nq - 1] - first_key
            for c0 in range(0, span, KB):
                kn = min(KB, span - c0)
                r0 = base + first_key + c0
                _copy_cols(KTf, (j * hd) * rows + r0, rows, kpf, KB, hd, kn)
                for qi in range(nq):
                    lo = max(A[qi], first_key + c0)
                    hi = min(A[qi] + N[qi], first_key + c0 + kn)
                    if hi <= lo:
                        continue
                    m = hi - lo
                    m8 = m - m % 8
                    tk = lo - first_key - c0  # the segment's column of key lo
                    sc = lo - A[qi]  # s's column of key lo
                    hh = 0
                    while hh < g:
                        at = (qi * g + hh) * S + sc
                        if g - hh >= 3:
                            _scores_h3(qf, (qi * g + hh) * hd, kpf, tk, KB, hd, m8, sf, at, S)
                            hh += 3
                        elif g - hh == 2:
                            _scores_h2(qf, (qi * g + hh) * hd, kpf, tk, KB, hd, m8, sf, at, S)
                            hh += 2
                        else:
                            _scores_h1(qf, (qi * g + hh) * hd, kpf, tk, KB, hd, m8, sf, at, S)
                            hh += 1
                    _scores_tail(qr[qi], g, kp, tk, m8, m, s[qi], sc)
            for qi in range(nq):
                t = u0 + qi
                n = N[qi]
                for hh in range(g):
                    h = j * g + hh
                    sr = s[qi, hh]
                    if sscale != F32(1.0):  # x · 1 is x: skipping it changes no byte
                        for kk in range(n):
                            sr[kk] = sr[kk] * sscale
                    if cap > F32(0.0):
                        for kk in range(n):
                            sr[kk] = F32(math.tanh(np.float64(sr[kk] / cap))) * cap
                    m = _max(sr, n)
                    if has_sinks and sinks[h] > m:
                        m = sinks[h]
                    _exp_shifted(sr, m, n)
                    den = pairwise_in(sr, 0, n, fr, vals)
                    if has_sinks:
                        den = den + _exp(sinks[h] - m)
                    inv = F32(1.0) / den
                    for kk in range(n):
                        sr[kk] = sr[kk] * inv
                    if keep:
                        pr = probs[j, hh, t - t_lo]
                        lo = first + A[qi] - k0  # column of key a
                        for c in range(pr.shape[0]):
                            pr[c] = F32(0.0)
                        for kk in range(n):
                            pr[lo + kk] = sr[kk]
            if hd % 8 == 0:
                # weighted sums over the same segments (V's rows are contiguous: no copy), in key
                # order: a segment after a query's first adds to the sums the others left in out
                for c0 in range(0, span, KB):
                    kn = min(KB, span - c0)
                    for qi in range(nq):
                        lo = max(A[qi], first_key + c0)
                        hi = min(A[qi] + N[qi], first_key + c0 + kn)
                        if hi <= lo:
                            continue
                        vb = (j * vrows + base + lo) * hd
                        more = lo > A[qi]
                        hh = 0
                        while hh < g:
                            ob = ((u0 + qi) * nh + j * g + hh) * hd
                            at = (qi * g + hh) * S + lo - A[qi]
                            if g - hh >= 3:
                                _wsum_h3(sf, at, S, hi - lo, Vf, vb, hd, of, ob, hd, more)
                                hh += 3
                            elif g - hh == 2:
                                _wsum_h2(sf, at, S, hi - lo, Vf, vb, hd, of, ob, hd, more)
                                hh += 2
                            else:
                                _wsum_h1(sf, at, S, hi - lo, Vf, vb, hd, of, ob, hd, more)
                                hh += 1
            else:  # the same bytes, swept through ``out`` (head_dim not a multiple of 8)
                for qi in range(nq):
                    t = u0 + qi
                    n = N[qi]
                    o = base + A[qi]
                    sq = s[qi]
                    hh = 0
                    while hh < g:
                        if g - hh >= 3:
                            _weighted3(sq, hh, n, V, j, o, out, t, j * g + hh)
                            hh += 3
                        elif g - hh == 2:
                            _weighted2(sq, hh, n, V, j, o, out, t, j * g + hh)
                            hh += 2
                        else:
                            _weighted1(sq, hh, n, V, j, o, out, t, j * g + hh)
                            hh += 1


def _tasks(nkv: int, t_lo: int, t_hi: int) -> np.ndarray:
    """(kv head, first query, end query) tasks over queries t_lo..t_hi-1, ordered so that the
    contiguous chunks numba's static schedule hands each thread carry about equal work: the
    blocks of a causal pass grow with their position, so they go in pairs (shortest, longest),
    (second shortest, second longest), ..."""
    blocks = [(a, min(t_hi, a + TASK_ROWS)) for a in range(t_lo, t_hi, TASK_ROWS)]
    order = []
    i, k = 0, len(blocks) - 1
    while i <= k:
        order.append(blocks[i])
        if k != i:
            order.append(blocks[k])
        i, k = i + 1, k - 1
    return np.array([(j, a, b) for a, b in order for j in range(nkv)], np.int64).reshape(-1, 3)


_NO_SINKS = np.empty(0, np.float32)
_NO_PROBS = np.empty((1, 1, 1, 1), np.float32)


def attend(
    q,
    k,
    v,
    cos,
    sin,
    qscale,
    kv,
    first: int,
    p0: int,
    window: int,
    sscale,
    cap,
    sinks,
    tap,
    block: int,
) -> np.ndarray:
    """q [T, nh, hd], k and v [T, nkv, hd] float32, projected (biases, norms, clamp done);
    ``kv`` the layer's `KvRows` (room for T more rows made here, its end advanced); cos, sin
    [T, r] or None (no rope); window 0: full span; cap 0: no softcap; sinks [nh] or None.
    ``tap`` (or None) is told the weights per block of ``block`` queries, ``tap("weights", q0, k0,
    w [nkv, g, queries, keys])`` as the numpy path tells them; the output bytes are the same
    with or without it. Returns the heads' output [T, nh * hd]."""
    T, nh, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    q = np.ascontiguousarray(q)
    row0 = kv.reserve(T)
    if first < kv.start:
        from ...errors import StateError

        raise StateError(f"KV rows before position {kv.start} were released (asked for {first})")
    if cos is None:
        cos = sin = np.empty((T, 0), np.float32)
    base = first - kv.start
    sinks = _NO_SINKS if sinks is None else sinks
    out = np.empty((T, nh, hd), np.float32)
    with threads.launch():
        _write_kv(np.ascontiguousarray(k), np.ascontiguousarray(v), cos, sin, kv.kt, kv.v, row0)
        kv.end += T
        if tap is None:
            _attend(
                q,
                cos,
                sin,
                qscale,
                kv.kt,
                kv.v,
                base,
                first,
                p0,
                0,
                T,
                window,
                sscale,
                cap,
                sinks,
                _tasks(nkv, 0, T),
                False,
                _NO_PROBS,
                0,
                out,
            )
    if tap is not None:
        for a in range(0, T, block):
            b = min(T, a + block)
            lo = first if window <= 0 else max(first, p0 + a - window + 1)
            hi = p0 + b
            probs = np.empty((nkv, g, b - a, hi - lo), np.float32)
            with threads.launch():
                _attend(
                    q,
                    cos,
                    sin,
                    qscale,
                    kv.kt,
                    kv.v,
                    base,
                    first,
                    p0,
                    a,
                    b,
                    window,
                    sscale,
                    cap,
                    sinks,
                    _tasks(nkv, a, b),
                    True,
                    probs,
                    lo,
                    out,
                )
            tap("weights", p0 + a, lo, probs)
    return out.reshape(T, nh * hd)


@numba.njit(**_PAR)
def _silu_rows(g, u, out, chunk):  # pragma: no cover - compiled
    """out = g / (1 + exp(-g)) * u elementwise, decode's `_silu_mul` arithmetic (its exp the
    polynomial `_exp_poly`), rows in tasks of ``chunk``. Written out rather than calling
    `_silu_mul`, whose in-place exp ran its scalar loop (see `_exp_shifted`)."""
    R, n = out.shape
    for c in prange((R + chunk - 1) // chunk):
        e = np.empty(n, np.float32)
        bits = np.empty(n, np.int32)
        scale = bits.view(np.float32)
        for r in range(c * chunk, min(R, (c + 1) * chunk)):
            for i in range(n):
                p, fn = _exp_poly(-g[r, i])
                e[i] = p
                bits[i] = (np.int32(fn) + np.int32(127)) << np.int32(23)
            for i in range(n):
                out[r, i] = g[r, i] / (F32(1.0) + e[i] * scale[i]) * u[r, i]


def silu_mul(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """SiLU(g) · u for [T, n] float32 (views allowed), rows split over the threads; each row's
    bytes are `vindex3.exec.ops.decode.silu_mul`'s. A view with a row stride (the gate and up
    halves of one fused product) is copied to contiguous rows first: the kernel compiled for a
    strided view cannot vectorize (its strides are unknown) and took 5.5 ns an element against
    1.0 contiguous (512 x 1536, one thread, AMD Zen 3); the copy costs a fraction of that."""
    out = np.empty(g.shape, np.float32)
    g, u = (a if a.flags.c_contiguous else np.ascontiguousarray(a) for a in (g, u))
    with threads.launch():
        _silu_rows(g, u, out, _chunk(g.shape[0]))
    return out


@numba.njit(**_PAR)
def _rms_par(x, w, eps, out, chunk):  # pragma: no cover - compiled
    R = x.shape[0]
    nc = (R + chunk - 1) // chunk
    ok = np.ones(nc, np.bool_)
    for c in prange(nc):
        r0 = c * chunk
        r1 = min(R, r0 + chunk)
        ok[c] = _rms_rows(x[r0:r1], w, eps, out[r0:r1])
    return ok.all()


def rms_rows(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> tuple[np.ndarray, bool]:
    """x [..., d] float32 -> (its RMSNorm, whether every mean of squares is finite), the bytes of
    `vindex3.exec.ops.norm.rms_norm`'s numpy path, rows split over the threads."""
    if type(eps) is not np.float32:
        eps = np.float32(eps)
    shape = x.shape
    x2 = np.ascontiguousarray(x).reshape(-1, shape[-1])
    out = np.empty(x2.shape, np.float32)
    with threads.launch():
        ok = _rms_par(x2, weight, eps, out, _chunk(x2.shape[0]))
    return out.reshape(shape), bool(ok)


def _chunk(rows: int) -> int:
    """Rows per task of the row kernels: a few tasks per thread, at least 8 rows each."""
    return max(8, -(-rows // (4 * threads.count())))
