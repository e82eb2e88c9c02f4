"""Prefill-sized integer products (``activations = 'q8'``, T > small_t positions): register tiles
of several weight rows times several positions, the activation quantized once per call.

Why: the rows kernels of vindex3.codecs.intrinsics load one weight row's chunk and update up to
8 positions; for a prompt of hundreds of positions that is one weight load per position pair
but 2 activation loads (codes and corrections) and a scale built from two scalar products per
(row, position, chunk). Here a tile of ``R`` rows x ``P`` positions loads, per chunk of 64
elements, R weight vectors and P activation vectors and makes R x P integer dots from them, the
block scales multiplied as vectors (R scale vectors of the rows times P of the positions).

Bytes: every (row, position) pair computes exactly the float steps of the rows kernel of its
path (intrinsics module docstring: integer lanes per chunk, ``acc = acc + float(lane) * (sw_b *
xd_b)`` chunk by chunk without fused multiply-add, the same tail block, the same tree of
halves; q4's offsets term ``mt = mt + m_b * xs_b`` block by block, added last). A product of two
float32 vectors is the product of their elements, so the bytes of a prefill are those of its
positions decoded one at a time (tests/test_int_prefill.py), on every path and thread count.
Rows and positions that do not fill a tile go to the rows kernel's dots (the same bytes).

The ``plain`` path (no vector instructions on the target) has no tile kernel: it runs the rows
kernel over all positions, which is what the tiles compute.

Measured (T = 512, 1 thread, CPU time, SmolLM2's shapes, load 1-3): int8 rows kernel ~60-70 G
multiply-adds a second, 4 x 4 tiles ~105-120 G (2 x 8 and 2 x 6 within noise, 1 x 8 ~85 G, 3 x 4
and 8 x 2 slower); q4 rows kernel ~50 G, 2 x 8 tiles over unpacked codes ~80-95 G. Tried and
dropped: one multiply per row for the 2P scale products and a permute per pair (instead of a
multiply per pair) was 1.1-1.5x slower (the permutes contend with the dots).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .intrinsics import (
    MAX_T,
    _arrays_at,
    _call,
    _check_multi,
    _consts,
    _f32,
    _half_scales,
    _i8,
    _i32,
    _int_arg,
    _join,
    _lanes,
    _load,
    _row_ptr,
    _scale16,
    _scale_one,
    _scale_pair,
    _shuffle,
    _tree16,
    _vec,
    chosen,
    dot,
)

F32 = np.float32
TASK_ROWS = 16  # weight rows per parallel task: their bytes stay in L1 while positions pass over them
# register tile: rows x positions (R*P accumulators of 16 floats, R weight vectors, R row scales)
TILE = {"i8": (4, 4), "q4": (2, 8)}
# Where a path's own measurement shows another tile winning: path -> kind -> (rows, positions).
# AVX2 has 16 vector registers, not 32: a 4 x 4 tile's accumulators alone (16 x <16 x float>,
# 32 ymm) spill. AMD Zen 3 (bench/int_tiles.py: T = 512, 1 thread, CPU time, SmolLM2's four
# layer shapes, best of 3, G multiply-adds a CPU-second, two runs, load 0.6-1.1;
# results/int_tiles_zen3_{i8,q4}.json): i8 4 x 4 23.6-24.8, 2 x 8 26.8, 2 x 4 24.9-26.1, 2 x 3
# 25.8-26.8, 1 x 3 30.3-30.7, 1 x 4 29.5-30.1, 1 x 6 30.0-30.4, 1 x 8 27.9-28.9; q4 2 x 8
# 20.6-26.9, 2 x 4 23.3-27.4, 4 x 4 20.0-27.4, 1 x 4 30.5-31.9, 1 x 6 28.3-29.8, 1 x 8 31.5-31.7.
# A whole prefill-512 against llama.cpp (bench/intdot_vs_llamacpp.py --prefill, 2 rounds,
# results/intdot_prefill_zen3_tiles.json): int8 q8 / Q8_0 0.83x -> 0.89x at 1 thread, 0.75x ->
# 0.98x at 2; q4 q8 / Q4_1 1.35x -> 1.76x and 1.30x -> 1.59x. (The 256-bit VNNI path has the
# same 16 registers; not measured, so it keeps TILE.)
TILE_BY_PATH = {"avx2": {"i8": (1, 4), "q4": (1, 4)}}


def default_tile(kind: str, path: str) -> tuple[int, int]:
    """The register tile a ``kind`` prefill uses on ``path``: its TILE_BY_PATH entry, else TILE."""
    return TILE_BY_PATH.get(path, {}).get(kind, TILE[kind])


def _spread16(builder, v):
    """<16 x float>: v[0] (of a <2 x float>) in lanes 0..7, v[1] in lanes 8..15."""
    return _shuffle(builder, v, v, [0] * 8 + [1] * 8)


def _pair16(builder, ptr, blk):
    """<16 x float>: ptr[blk] in lanes 0..7, ptr[blk + 1] in lanes 8..15."""
    v = builder.load(builder.bitcast(builder.gep(ptr, [blk]), _vec(_f32, 2).as_pointer()), align=4)
    return _spread16(builder, v)


def _make_i8_tile(path: str, R: int, P: int):
    """tile(Q, S, o0, XQ, XD, XC, t0, Y): Y[t, o] for rows o0 .. o0 + R - 1 and positions
    t0 .. t0 + P - 1 (all present), in the rows kernel's order per pair."""

    @intrinsic
    def tile(typingctx, Q, S, o0, XQ, XD, XC, t0, Y):
        _check_multi("i8 tile", (), (Q, S, XQ, XD, XC), Y, t0, o0)
        half = _half_scales(S)
        sig = types.void(Q, S, o0, XQ, XD, XC, t0, Y)

        def codegen(context, builder, sig, args):
            aq, asw, axq, axd, axc, ay = _arrays_at(context, builder, sig, args, (0, 1, 3, 4, 5, 7))
            o0v, t0v = (_int_arg(context, builder, sig.args[i], args[i]) for i in (2, 6))
            K = builder.extract_value(aq.shape, 1)
            nb = builder.extract_value(asw.shape, 1)
            O = builder.extract_value(ay.shape, 1)
            c = lambda v: ir.Constant(K.type, v)
            K4 = builder.ashr(K, c(2))
            nchunk = builder.ashr(K, c(6))
            has_tail = builder.icmp_signed("!=", builder.and_(K, c(32)), c(0))
            rows = [builder.add(o0v, c(r)) for r in range(R)]
            pos = [builder.add(t0v, c(p)) for p in range(P)]
            pw = [_row_ptr(builder, aq, o, K) for o in rows]
            psw = [_row_ptr(builder, asw, o, nb) for o in rows]
            pxq = [_row_ptr(builder, axq, t, K) for t in pos]
            pxd = [_row_ptr(builder, axd, t, nb) for t in pos]
            pxc = [_row_ptr(builder, axc, t, K4) for t in pos]
            v16 = _vec(_f32, 16)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16, 0.0)) for _ in range(P)] for _ in range(R)]

            with cgutils.for_range(builder, nchunk) as loop:
                off = builder.shl(loop.index, c(6))
                blk = builder.shl(loop.index, c(1))
                ws = [_load(builder, p, off, _vec(_i8, 64)) for p in pw]
                sws = [_spread16(builder, _scale_pair(builder, p, blk, half)) for p in psw]
                for p in range(P):
                    x = _load(builder, pxq[p], off, _vec(_i8, 64))
                    cc = _load(builder, pxc[p], builder.ashr(off, c(2)), _vec(_i32, 16))
                    xd = _pair16(builder, pxd[p], blk)
                    for r in range(R):
                        lanes = _lanes(builder, path, ws[r], x, cc, True, 64)
                        prod = builder.fmul(builder.sitofp(lanes, v16), builder.fmul(sws[r], xd))
                        a = accs[r][p]
                        builder.store(builder.fadd(builder.load(a), prod), a)
            with builder.if_then(has_tail):  # the rows kernel's tail block, pair by pair
                off = builder.shl(nchunk, c(6))
                blk = builder.shl(nchunk, c(1))
                for r in range(R):
                    w = _load(builder, pw[r], off, _vec(_i8, 32))
                    sw0 = _scale_one(builder, psw[r], blk, half)
                    for p in range(P):
                        x = _load(builder, pxq[p], off, _vec(_i8, 32))
                        cc = _load(builder, pxc[p], builder.ashr(off, c(2)), _vec(_i32, 8))
                        lanes = _join(builder, _lanes(builder, path, w, x, cc, True, 32), ir.Constant(_vec(_i32, 8), None), 8)
                        s0 = builder.fmul(sw0, builder.load(builder.gep(pxd[p], [blk])))
                        prod = builder.fmul(builder.sitofp(lanes, v16), _scale16(builder, s0, ir.Constant(_f32, 0.0)))
                        a = accs[r][p]
                        builder.store(builder.fadd(builder.load(a), prod), a)
            for r in range(R):
                for p in range(P):
                    yo = builder.add(builder.mul(pos[p], O), rows[r])
                    builder.store(_tree16(builder, builder.load(accs[r][p])), builder.gep(ay.data, [yo]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


def _make_q4u_tile(path: str, R: int, P: int):
    """tile(U, DF, MF, u0, o0, XQ, XD, XST, t0, Y): q4 rows whose codes were unpacked to bytes in
    element order (U [n, K] uint8, 0..15) and whose f16 scales and offsets were looked up (DF, MF
    [n, K/32] float32) once per task (`_unpack_q4`): rows u0 .. u0 + R - 1 of U are rows o0 ..
    of Y. XST [K/32, T] is XS transposed, so that a block's offsets terms of P positions (one
    vector, ``mt = mt + m_b * xs_b`` element-wise) are one load. The float steps of the rows
    kernel, the same bytes. (Unpacking once per task rather than per row chunk of each tile
    measured 1.1-1.25x faster at T = 512; without it 1 x 8 tiles were best, with it 2 x 8.)"""

    @intrinsic
    def tile(typingctx, U, DF, MF, u0, o0, XQ, XD, XST, t0, Y):
        _check_multi("q4 unpacked tile", (), (U, DF, MF, XQ, XD, XST), Y, t0, o0)
        _check_multi("q4 unpacked tile", (), (), Y, u0, u0)
        sig = types.void(U, DF, MF, u0, o0, XQ, XD, XST, t0, Y)

        def codegen(context, builder, sig, args):
            au, ad, am, axq, axd, axs, ay = _arrays_at(context, builder, sig, args, (0, 1, 2, 5, 6, 7, 9))
            u0v, o0v, t0v = (_int_arg(context, builder, sig.args[i], args[i]) for i in (3, 4, 8))
            K = builder.extract_value(au.shape, 1)
            nb = builder.extract_value(ad.shape, 1)
            O = builder.extract_value(ay.shape, 1)
            TT = builder.extract_value(axs.shape, 1)
            c = lambda v: ir.Constant(K.type, v)
            nchunk = builder.ashr(K, c(6))
            has_tail = builder.icmp_signed("!=", builder.and_(K, c(32)), c(0))
            urows = [builder.add(u0v, c(r)) for r in range(R)]
            rows = [builder.add(o0v, c(r)) for r in range(R)]
            pos = [builder.add(t0v, c(p)) for p in range(P)]
            pw = [builder.bitcast(_row_ptr(builder, au, u, K), _i8.as_pointer()) for u in urows]
            pd = [_row_ptr(builder, ad, u, nb) for u in urows]
            pm = [_row_ptr(builder, am, u, nb) for u in urows]
            pxq = [_row_ptr(builder, axq, t, K) for t in pos]
            pxd = [_row_ptr(builder, axd, t, nb) for t in pos]
            v16 = _vec(_f32, 16)
            vP = _vec(_f32, P)
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16, 0.0)) for _ in range(P)] for _ in range(R)]
            mts = [cgutils.alloca_once_value(builder, ir.Constant(vP, 0.0)) for _ in range(R)]

            def splat(v, n):
                u = builder.insert_element(ir.Constant(_vec(_f32, n), None), v, ir.Constant(_i32, 0))
                return _shuffle(builder, u, u, [0] * n)

            def xs_vec(blk):  # <P x float>: XST[blk, t0 .. t0 + P - 1]
                ptr = builder.gep(axs.data, [builder.add(builder.mul(blk, TT), t0v)])
                return builder.load(builder.bitcast(ptr, vP.as_pointer()), align=4)

            def mt_step(r, blk, xs):
                m = builder.load(builder.gep(pm[r], [blk]))
                builder.store(builder.fadd(builder.load(mts[r]), builder.fmul(splat(m, P), xs)), mts[r])

            with cgutils.for_range(builder, nchunk) as loop:
                off = builder.shl(loop.index, c(6))
                blk = builder.shl(loop.index, c(1))
                b1 = builder.add(blk, c(1))
                xs0, xs1 = xs_vec(blk), xs_vec(b1)
                ws = [_load(builder, p, off, _vec(_i8, 64)) for p in pw]
                sds = [_pair16(builder, p, blk) for p in pd]
                for r in range(R):  # block order as the rows kernel: mt with block b, then b + 1
                    mt_step(r, blk, xs0)
                    mt_step(r, b1, xs1)
                for p in range(P):
                    x = _load(builder, pxq[p], off, _vec(_i8, 64))
                    xd = _pair16(builder, pxd[p], blk)
                    for r in range(R):
                        lanes = _lanes(builder, path, ws[r], x, None, False, 64)
                        prod = builder.fmul(builder.sitofp(lanes, v16), builder.fmul(sds[r], xd))
                        a = accs[r][p]
                        builder.store(builder.fadd(builder.load(a), prod), a)
            with builder.if_then(has_tail):  # the rows kernel's tail block, pair by pair
                off = builder.shl(nchunk, c(6))
                blk = builder.shl(nchunk, c(1))
                xs0 = xs_vec(blk)
                for r in range(R):
                    w = _load(builder, pw[r], off, _vec(_i8, 32))
                    d0 = builder.load(builder.gep(pd[r], [blk]))
                    mt_step(r, blk, xs0)
                    for p in range(P):
                        x = _load(builder, pxq[p], off, _vec(_i8, 32))
                        lanes = _join(builder, _lanes(builder, path, w, x, None, False, 32), ir.Constant(_vec(_i32, 8), None), 8)
                        s0 = builder.fmul(d0, builder.load(builder.gep(pxd[p], [blk])))
                        prod = builder.fmul(builder.sitofp(lanes, v16), _scale16(builder, s0, ir.Constant(_f32, 0.0)))
                        a = accs[r][p]
                        builder.store(builder.fadd(builder.load(a), prod), a)
            for r in range(R):
                mt = builder.load(mts[r])
                for p in range(P):
                    res = builder.fadd(_tree16(builder, builder.load(accs[r][p])), builder.extract_element(mt, ir.Constant(_i32, p)))
                    builder.store(res, builder.gep(ay.data, [builder.add(builder.mul(pos[p], O), rows[r])]))
            return context.get_dummy_value()

        return sig, codegen

    return tile


@njit(inline="always")
def _unpack_q4(QS, D, M, table, o0, o1, U, DF, MF):
    """Rows o0 .. o1 - 1 of q4 into U (codes in element order: byte l of a block's 16 holds
    element l in its low nibble and l + 16 in its high one), DF and MF (the f16 tables' floats)."""
    H = QS.shape[1]
    for i in range(o1 - o0):
        q = QS[o0 + i]
        u = U[i]
        for b in range(H // 16):
            for l in range(16):
                v = q[16 * b + l]
                u[32 * b + l] = v & np.uint8(15)
                u[32 * b + 16 + l] = v >> np.uint8(4)
        for b in range(D.shape[1]):
            DF[i, b] = table[D[o0 + i, b]]
            MF[i, b] = table[M[o0 + i, b]]


# --------------------------------------------------------------------------------------------
# the activation quantization of intrinsics.quantize_x, in LLVM vector IR (that loop runs
# element by element: ~1 ns an element, a tenth of a prefill product's time at K = 576)
@intrinsic
def _quantize_vec(typingctx, X, XQ, XD, XC, XS):
    """intrinsics.quantize_x, the same bytes: per block of 32, amax = the largest |x| (the
    largest of the magnitudes' bit patterns: for finite floats their order is the float order),
    a block holding a non-finite value gets codes 0 and the scale NaN; else d = amax / 127,
    q = rint(x / d) (ties to even) clipped to [-127, 127]; XS = d * sum(q), XC = -128 * the sum
    of each 4 codes."""
    for t in (X, XQ, XD, XC, XS):
        if not isinstance(t, types.Array) or t.ndim != 2 or t.layout != "C":
            raise TypingError(f"quantize: operands must be C-contiguous 2-D arrays, got {t}")
    sig = types.void(X, XQ, XD, XC, XS)

    def codegen(context, builder, sig, args):
        ax, aq, ad, ac, as_ = _arrays_at(context, builder, sig, args, (0, 1, 2, 3, 4))
        T = builder.extract_value(ax.shape, 0)
        K = builder.extract_value(ax.shape, 1)
        c = lambda v: ir.Constant(K.type, v)
        nb = builder.ashr(K, c(5))
        n = builder.mul(T, nb)  # blocks, row after row: block i of the flat arrays
        v16f, v32i = _vec(_f32, 16), _vec(_i32, 32)
        with cgutils.for_range(builder, n) as loop:
            i = loop.index
            e = builder.shl(i, c(5))
            a = _join(builder, _load(builder, ax.data, e, v16f), _load(builder, ax.data, builder.add(e, c(16)), v16f), 16)
            mag = builder.and_(builder.bitcast(a, v32i), _consts(_i32, [0x7FFFFFFF] * 32))
            m = _call(builder, "llvm.vector.reduce.smax.v32i32", _i32, [mag])
            amax = builder.bitcast(m, _f32)
            bad = builder.icmp_signed(">=", m, ir.Constant(_i32, 0x7F800000))
            skip = builder.or_(bad, builder.icmp_signed("==", m, ir.Constant(_i32, 0)))
            d = builder.fdiv(amax, ir.Constant(_f32, 127.0))
            dv = _shuffle(builder, builder.insert_element(ir.Constant(_vec(_f32, 32), None), d, ir.Constant(_i32, 0)),
                          ir.Constant(_vec(_f32, 32), None), [0] * 32)
            q = _call(builder, "llvm.rint.v32f32", _vec(_f32, 32), [builder.fdiv(a, dv)])
            q = _call(builder, "llvm.maxnum.v32f32", _vec(_f32, 32), [q, _consts(_f32, [-127.0] * 32)])
            q = _call(builder, "llvm.minnum.v32f32", _vec(_f32, 32), [q, _consts(_f32, [127.0] * 32)])
            qi = builder.select(skip, ir.Constant(v32i, None), builder.fptosi(q, v32i))
            builder.store(builder.trunc(qi, _vec(_i8, 32)),
                          builder.bitcast(builder.gep(aq.data, [e]), _vec(_i8, 32).as_pointer()), align=1)
            dd = builder.select(skip, builder.select(bad, ir.Constant(_f32, float("nan")), ir.Constant(_f32, 0.0)), d)
            builder.store(dd, builder.gep(ad.data, [i]))
            ssum = _call(builder, "llvm.vector.reduce.add.v32i32", _i32, [qi])
            builder.store(builder.fmul(dd, builder.sitofp(ssum, _f32)), builder.gep(as_.data, [i]))
            p2 = builder.add(_shuffle(builder, qi, qi, list(range(0, 32, 2))), _shuffle(builder, qi, qi, list(range(1, 32, 2))))
            p4 = builder.add(_shuffle(builder, p2, p2, list(range(0, 16, 2))), _shuffle(builder, p2, p2, list(range(1, 16, 2))))
            cc = builder.mul(p4, _consts(_i32, [-128] * 8))
            builder.store(cc, builder.bitcast(builder.gep(ac.data, [builder.shl(i, c(3))]), _vec(_i32, 8).as_pointer()), align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit
def quantize(X, XQ, XD, XC, XS):
    """intrinsics.quantize_x (the same outputs, byte for byte; tests/test_int_prefill.py)."""
    _quantize_vec(X, XQ, XD, XC, XS)


def _make_tiles_i8(tile, dots, R, P, parallel):
    @njit(parallel=parallel)
    def tiles(Q, S, X, Y, rpt):
        """Y[t, o] = row o of int8 blocks (codes Q, scales S) . q8(X[t]), every T."""
        O = Q.shape[0]
        T, K = X.shape
        XQ = np.empty((T, K), np.int8)
        XD = np.empty((T, K // 32), F32)
        XC = np.empty((T, K // 4), np.int32)
        XS = np.empty((T, K // 32), F32)
        quantize(X, XQ, XD, XC, XS)
        TP = T - T % P
        ntask = (O + rpt - 1) // rpt
        for k in prange(ntask):
            o0 = k * rpt
            o1 = min(O, o0 + rpt)
            oR = o0 + (o1 - o0) // R * R
            for t0 in range(0, TP, P):
                for o in range(o0, oR, R):
                    tile(Q, S, o, XQ, XD, XC, t0, Y)
            if TP < T:  # positions short of a tile (fewer than P <= MAX_T)
                dots(Q, S, o0, oR, XQ, XD, XC, TP, Y)
            if oR < o1:  # rows short of a tile
                for t0 in range(0, T, MAX_T):
                    dots(Q, S, oR, o1, XQ, XD, XC, t0, Y)

    return tiles


def _make_tiles_q4u(tile, dots, R, P, parallel):
    @njit(parallel=parallel)
    def tiles(QS, D, M, table, X, Y, rpt):
        """Y[t, o] = row o of q4 (codes QS, f16 scales D and offsets M) . q8(X[t]), every T; each
        task's rows unpacked once (`_unpack_q4`) for all its tiles."""
        O = QS.shape[0]
        T, K = X.shape
        XQ = np.empty((T, K), np.int8)
        XD = np.empty((T, K // 32), F32)
        XC = np.empty((T, K // 4), np.int32)
        XS = np.empty((T, K // 32), F32)
        quantize(X, XQ, XD, XC, XS)
        XST = np.ascontiguousarray(XS.T)
        TP = T - T % P
        ntask = (O + rpt - 1) // rpt
        for k in prange(ntask):
            o0 = k * rpt
            o1 = min(O, o0 + rpt)
            oR = o0 + (o1 - o0) // R * R
            U = np.empty((rpt, K), np.uint8)
            DF = np.empty((rpt, K // 32), F32)
            MF = np.empty((rpt, K // 32), F32)
            _unpack_q4(QS, D, M, table, o0, oR, U, DF, MF)
            for t0 in range(0, TP, P):
                for o in range(o0, oR, R):
                    tile(U, DF, MF, o - o0, o, XQ, XD, XST, t0, Y)
            if TP < T:
                dots(QS, D, M, table, o0, oR, XQ, XD, XS, TP, Y)
            if oR < o1:
                for t0 in range(0, T, MAX_T):
                    dots(QS, D, M, table, oR, o1, XQ, XD, XS, t0, Y)

    return tiles


_TILES: dict[tuple, object] = {}


def tiles_kernel(kind: str, path: str | None = None, parallel: bool = False, tile: tuple[int, int] | None = None):
    """The prefill kernel of ``kind`` ('i8' | 'q4') on ``path`` (default: the intrinsics
    module's `chosen()`): the arguments of intrinsics.rows_kernel, any T, the same bytes.
    ``tile``: (rows, positions) of a register tile (default `default_tile`; positions <= MAX_T)."""
    from .intrinsics import PATHS, rows_kernel

    path = chosen() if path is None else path
    if kind not in TILE:
        raise ValueError(f"unknown prefill tile kind {kind!r} (known: {', '.join(TILE)})")
    if path not in PATHS:
        raise ValueError(f"unknown integer dot path {path!r} (known: {', '.join(PATHS)})")
    R, P = default_tile(kind, path) if tile is None else tile
    if not (1 <= P <= MAX_T and 1 <= R):
        raise ValueError(f"a register tile of {R} rows x {P} positions: positions must be 1..{MAX_T}, rows >= 1")
    if path == "plain":
        return rows_kernel(kind, path, parallel)
    key = (kind, path, parallel, R, P)
    if key not in _TILES:
        if kind == "i8":
            _TILES[key] = _make_tiles_i8(_make_i8_tile(path, R, P), dot("i8", path), R, P, parallel)
        else:
            _TILES[key] = _make_tiles_q4u(_make_q4u_tile(path, R, P), dot("q4", path), R, P, parallel)
    return _TILES[key]
