"""Integer and bf16 dot products through LLVM's x86 intrinsics, emitted by numba ``@intrinsic``
functions (no C compiler), with a plain numba fallback that computes the same bytes.

Why: plain numba does not vectorize an integer block reduction (numba turns LLVM's SLP
vectorizer off, and ``int32 * int32`` widens to int64), so the int8 and q4 kernels of
kernels.py convert codes to float32 and multiply in float lanes. With the activation quantized
per block of 32 (``activations = 'q8'``, see `quantize_x`), a weight block times an activation
block is an exact integer sum, which the CPU's byte dot instructions compute 4 products per
32-bit lane.

Paths (`PATHS`), chosen from the features of the target numba compiles for (`target_features`:
``NUMBA_CPU_FEATURES`` when set, empty for ``NUMBA_CPU_NAME=generic``, else the host's), never
from the host alone, so that ``NUMBA_CPU_NAME=generic`` runs the fallback and never meets an
instruction its target cannot select:

* ``vnni512``  ``llvm.x86.avx512.vpdpbusd.512`` (AVX512-VNNI): 64 byte products per instruction;
* ``vnni256``  ``llvm.x86.avx512.vpdpbusd.256`` (AVX-VNNI, or AVX512-VNNI with VL): 32;
* ``avx2``     ``vpmaddubsw`` + ``vpmaddwd`` (AVX2), sign moved onto the activation (``vpsignb``)
               so that no 16-bit pair sum saturates (|w| <= 128, |x| <= 127: 2*128*127 < 32767);
* ``plain``    numba loops, for any target.

What every path computes, so that all give the same bytes (tests/test_intrinsics.py)
-----------------------------------------------------------------------------------
A row of K elements (K a multiple of 32) is cut into chunks of 64 (two blocks) and, when
K % 64 == 32, one tail block. Per chunk, 16 integer *lanes*: lane i is the exact sum of the 4
products of elements 4i .. 4i+3 (int32; |lane| <= 4 * 128 * 127). Then, in float32 with
no fused multiply-add and no reassociation:

    acc[i] = acc[i] + float(lane[i]) * scale[block of lane i]      (16 accumulators, chunk order)

the tail block touching lanes 0..7 only. A row's result is the fixed tree
``v8 = acc[:8] + acc[8:]; v4 = v8[:4] + v8[4:]; v2 = v4[:2] + v4[2:]; v2[0] + v2[1]``, plus,
for q4, the offsets' term ``mt`` (from 0, ``mt = mt + m_b * xs_b`` block by block) added last. The integer lanes are exact on every
path and the float steps are the same operations in the same order, so the paths, the targets
and the thread counts all give identical bytes (each output element is computed by one thread).

bf16 (`rows_bf16`): a row of bf16 bit patterns dotted with float32 x, widened in registers (a
16-bit shift per lane, never a widened row in memory), 64 accumulators and a tree of halves, in
plain LLVM vector IR (any target). The ``dpbf16ps`` instruction would round x to bf16, i.e.
change the numbers (an activation treatment of its own); it is not used. BF16Weight multiplies
with it (vindex3.codecs.half).

Groups (`group_kernel`, `group_bf16`): the weights that multiply one activation (a layer's
q/k/v, an FFN's gate and up) in one launch, the activation quantized once, tasks of
``ROWS_PER_TASK`` rows laid end to end over the weights. An output element is the same row dot,
computed by one thread, so the bytes are those of one launch per weight (vindex3.codecs.base
`products` binds them; tests/test_intrinsics.py compares).
"""

from __future__ import annotations

import os

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.errors import TypingError
from numba.extending import intrinsic

from .kernels import _task_starts, _which

F32 = np.float32
BLOCK = 32
ROWS_PER_TASK = 16  # output rows per parallel task (as kernels.py)
PATHS = ("vnni512", "vnni256", "avx2", "plain")
# what each path needs of the target (LLVM feature names, as numba's target string spells them)
NEEDS = {
    "vnni512": ("avx512f", "avx512bw", "avx512vnni"),
    "vnni256": ("avx2", "avxvnni"),
    "avx2": ("avx2",),
    "plain": (),
}
_FORCE_ENV = "VINDEX3_INTDOT_PATH"  # tests and benches force a path by name


# --------------------------------------------------------------------------------------------
# which path the target can run
def target_features() -> set[str]:
    """The LLVM features of the target numba compiles for (its JIT codegen's own rule:
    NUMBA_CPU_FEATURES if set, '' for NUMBA_CPU_NAME=generic, else the host's)."""
    from numba.core import config

    raw = config.CPU_FEATURES
    if raw is None:
        from llvmlite import binding as ll

        raw = ll.get_host_cpu_features().flatten()
    return {f[1:] for f in str(raw).split(",") if f.startswith("+")}


def _is_x86() -> bool:
    from llvmlite import binding as ll

    return ll.get_process_triple().split("-")[0] in ("x86_64", "i386", "i686", "amd64")


def available(path: str, features: set[str] | None = None) -> bool:
    """Can the compile target run ``path``?"""
    if path not in NEEDS:
        raise ValueError(f"unknown integer dot path {path!r} (known: {', '.join(PATHS)})")
    if path == "plain":
        return True
    feats = target_features() if features is None else features
    if path == "vnni256" and "avxvnni" not in feats and {"avx512vnni", "avx512vl"} <= feats:
        return _is_x86()  # the EVEX form of the same instruction
    return _is_x86() and all(f in feats for f in NEEDS[path])


def best(features: set[str] | None = None) -> str:
    """The fastest path the target can run (``plain`` when it lacks every feature)."""
    for p in PATHS:
        if available(p, features):
            return p
    return "plain"


_chosen: list[str] = []


def chosen() -> str:
    """The path products use: ``VINDEX3_INTDOT_PATH`` when set (refused by name if the target
    cannot run it), else `best()`; decided once per process (see `use`)."""
    if not _chosen:
        _chosen.append(_choose())
    return _chosen[0]


def use(path: str | None) -> None:
    """Make products use ``path`` from now on (None: decide again from the environment and
    the target). For tests and benches that compare paths in one process."""
    _chosen.clear()
    if path is not None:
        if not available(path):
            raise ValueError(f"the compile target lacks {', '.join(NEEDS[path])}: path {path!r} cannot run")
        _chosen.append(path)


def _choose() -> str:
    want = os.environ.get(_FORCE_ENV)
    if want:
        if want not in NEEDS:
            from ..errors import ConfigError

            raise ConfigError(f"{_FORCE_ENV}={want!r} is not an integer dot path (known: {', '.join(PATHS)})")
        if not available(want):
            from ..errors import ConfigError

            raise ConfigError(f"{_FORCE_ENV}={want!r}: the compile target lacks {', '.join(NEEDS[want])}")
        return want
    return best()


# --------------------------------------------------------------------------------------------
# activation quantization: per block of 32, d = max|x| / 127, q = round(x / d) (ties to even)
@njit(cache=True)
def quantize_x(X, XQ, XD, XC, XS):
    """X [T, K] float32 -> XQ int8 [T, K] codes, XD float32 [T, K/32] block scales, XC int32
    [T, K/4] lane corrections (-128 * the sum of each 4 codes, for the XOR-ed weights of the
    vnni int8 path), XS float32 [T, K/32] d * (sum of the block's codes) (q4's offset term).
    A block holding a NaN or an infinity gets the scale NaN (so its products are NaN)."""
    T, K = X.shape
    nb = K // 32
    for t in range(T):
        for b in range(nb):
            amax = F32(0.0)
            bad = False
            for l in range(32):
                v = X[t, 32 * b + l]
                if not np.isfinite(v):
                    bad = True
                a = abs(v)
                amax = max(amax, a)
            d = amax / F32(127.0)
            s = 0
            if bad or amax == F32(0.0):
                for l in range(32):
                    XQ[t, 32 * b + l] = 0
                XD[t, b] = F32(np.nan) if bad else F32(0.0)
            else:
                for l in range(32):
                    q = np.rint(X[t, 32 * b + l] / d)
                    q = min(max(q, F32(-127.0)), F32(127.0))
                    XQ[t, 32 * b + l] = np.int8(q)
                    s += np.int32(q)
                XD[t, b] = d
            XS[t, b] = XD[t, b] * F32(s)
            for g in range(8):
                c = np.int32(0)
                for l in range(4):
                    c += np.int32(XQ[t, 32 * b + 4 * g + l])
                XC[t, 8 * b + g] = np.int32(-128) * c


def quantized(X: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`quantize_x` with fresh outputs: (XQ, XD, XC, XS)."""
    T, K = X.shape
    XQ = np.empty((T, K), np.int8)
    XD = np.empty((T, K // 32), F32)
    XC = np.empty((T, K // 4), np.int32)
    XS = np.empty((T, K // 32), F32)
    quantize_x(X, XQ, XD, XC, XS)
    return XQ, XD, XC, XS


# --------------------------------------------------------------------------------------------
# LLVM IR pieces
_i8, _i16, _i32, _i64, _f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()


def _vec(t, n):
    return ir.VectorType(t, n)


def _consts(t, vals):
    return ir.Constant(_vec(t, len(vals)), [ir.Constant(t, v) for v in vals])


def _call(builder, name, ret, args):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _load(builder, base, offset, vty):
    """A vector load of ``vty`` at byte pointer ``base`` + element offset (align 1)."""
    p = builder.gep(base, [offset])
    return builder.load(builder.bitcast(p, vty.as_pointer()), align=1)


def _shuffle(builder, a, b, idx):
    return builder.shuffle_vector(a, b, _consts(_i32, idx))


def _split(builder, v, n):
    """Two halves of a vector of 2n elements."""
    return _shuffle(builder, v, v, list(range(n))), _shuffle(builder, v, v, list(range(n, 2 * n)))


def _join(builder, a, b, n):
    return _shuffle(builder, a, b, list(range(2 * n)))


def _lanes_avx2_32(builder, w32, x32, signed_w):
    """<8 x i32>: lane i = sum of products 4i..4i+3 of 32 bytes (w signed int8 or unsigned)."""
    v32i8 = _vec(_i8, 32)
    if signed_w:
        a = _call(builder, "llvm.abs.v32i8", v32i8, [w32, ir.Constant(ir.IntType(1), 0)])
        b = _call(builder, "llvm.x86.avx2.psign.b", v32i8, [x32, w32])
    else:
        a, b = w32, x32
    p16 = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", _vec(_i16, 16), [a, b])
    return _call(builder, "llvm.x86.avx2.pmadd.wd", _vec(_i32, 8), [p16, _consts(_i16, [1] * 16)])


def _dpbusd(builder, width, acc, u, s):
    """vpdpbusd: acc (<n x i32>) += groups of 4 (u8 of ``u``) x (s8 of ``s``)."""
    vi = _vec(_i32, width // 4)
    return _call(builder, f"llvm.x86.avx512.vpdpbusd.{width * 8}", vi,
                 [acc, builder.bitcast(u, vi), builder.bitcast(s, vi)])


def _lanes(builder, path, w, x, corr, signed_w, n):
    """Exact int lanes (<n/4 x i32>) of n weight bytes ``w`` (int8, or unsigned codes 0..15)
    times n activation codes ``x``; ``corr`` (<n/4 x i32>) = -128 * sum of each 4 x codes,
    needed by the vnni paths for signed weights (made unsigned by XOR 0x80)."""
    if path == "avx2":
        if n == 32:
            return _lanes_avx2_32(builder, w, x, signed_w)
        wl, wh = _split(builder, w, 32)
        xl, xh = _split(builder, x, 32)
        return _join(builder, _lanes_avx2_32(builder, wl, xl, signed_w), _lanes_avx2_32(builder, wh, xh, signed_w), 8)
    if signed_w:
        w = builder.xor(w, _consts(_i8, [-128] * n))
        acc = corr
    else:
        acc = ir.Constant(_vec(_i32, n // 4), None)
    if path == "vnni512" and n == 64:
        return _dpbusd(builder, 64, acc, w, x)
    if n == 32:
        return _dpbusd(builder, 32, acc, w, x)
    wl, wh = _split(builder, w, 32)
    xl, xh = _split(builder, x, 32)
    al, ah = _split(builder, acc, 8)
    return _join(builder, _dpbusd(builder, 32, al, wl, xl), _dpbusd(builder, 32, ah, wh, xh), 8)


def _scale16(builder, s0, s1):
    v = ir.Constant(_vec(_f32, 2), None)
    v = builder.insert_element(v, s0, ir.Constant(_i32, 0))
    v = builder.insert_element(v, s1, ir.Constant(_i32, 1))
    return _shuffle(builder, v, v, [0] * 8 + [1] * 8)


def _tree16(builder, acc):
    a, b = _split(builder, acc, 8)
    v8 = builder.fadd(a, b)
    a, b = _split(builder, v8, 4)
    v4 = builder.fadd(a, b)
    a, b = _split(builder, v4, 2)
    v2 = builder.fadd(a, b)
    return builder.fadd(builder.extract_element(v2, ir.Constant(_i32, 0)), builder.extract_element(v2, ir.Constant(_i32, 1)))


def _arrays(context, builder, sig, args):
    return [context.make_array(t)(context, builder, v) for t, v in zip(sig.args, args)]


def _check_rows(name, *tys):
    for t in tys:
        if not isinstance(t, types.Array) or t.ndim != 1 or t.layout != "C":
            raise TypingError(f"{name}: every operand must be a C-contiguous 1-D array, got {t}")


def _make_i8_dot(path):
    """row_dot(qw int8[K], sw f32[K/32], qx int8[K], xd f32[K/32], xc int32[K/4]) -> float32."""

    @intrinsic
    def dot(typingctx, qw, sw, qx, xd, xc):
        _check_rows("i8 dot", qw, sw, qx, xd, xc)
        sig = types.float32(qw, sw, qx, xd, xc)

        def codegen(context, builder, sig, args):
            aw, asw, ax, axd, axc = _arrays(context, builder, sig, args)
            K = builder.extract_value(aw.shape, 0)
            pw, px = aw.data, ax.data
            psw, pxd, pxc = asw.data, axd.data, axc.data
            acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_f32, 16), 0.0))
            nchunk = builder.ashr(K, ir.Constant(K.type, 6))

            def chunk(off, blk, n):  # n = 64 (two blocks) or 32 (the tail block)
                w = _load(builder, pw, off, _vec(_i8, n))
                x = _load(builder, px, off, _vec(_i8, n))
                c = _load(builder, pxc, builder.ashr(off, ir.Constant(K.type, 2)), _vec(_i32, n // 4))
                lanes = _lanes(builder, path, w, x, c, True, n)
                s0 = builder.fmul(builder.load(builder.gep(psw, [blk])), builder.load(builder.gep(pxd, [blk])))
                if n == 64:
                    b1 = builder.add(blk, ir.Constant(K.type, 1))
                    s1 = builder.fmul(builder.load(builder.gep(psw, [b1])), builder.load(builder.gep(pxd, [b1])))
                else:
                    lanes = _join(builder, lanes, ir.Constant(_vec(_i32, 8), None), 8)
                    s1 = ir.Constant(_f32, 0.0)
                f = builder.sitofp(lanes, _vec(_f32, 16))
                builder.store(builder.fadd(builder.load(acc), builder.fmul(f, _scale16(builder, s0, s1))), acc)

            with cgutils.for_range(builder, nchunk) as loop:
                i = loop.index
                chunk(builder.shl(i, ir.Constant(K.type, 6)), builder.shl(i, ir.Constant(K.type, 1)), 64)
            has_tail = builder.icmp_signed("!=", builder.and_(K, ir.Constant(K.type, 32)), ir.Constant(K.type, 0))
            with builder.if_then(has_tail):
                off = builder.shl(nchunk, ir.Constant(K.type, 6))
                chunk(off, builder.shl(nchunk, ir.Constant(K.type, 1)), 32)
            return _tree16(builder, builder.load(acc))

        return sig, codegen

    return dot


def _make_q4_dot(path):
    """row_dot(qs uint8[K/2], d uint16[K/32], m uint16[K/32] (f16 bits), table f32[65536],
    qx int8[K], xd f32[K/32], xs f32[K/32]) -> float32. Byte l of a block's 16 holds element
    l (low nibble) and l + 16 (high nibble). The offsets' term ``mt`` is summed block by block
    from 0 (mt = mt + m_b * xs_b) and added to the tree last."""

    @intrinsic
    def dot(typingctx, qs, d, m, table, qx, xd, xs):
        _check_rows("q4 dot", qs, d, m, table, qx, xd, xs)
        sig = types.float32(qs, d, m, table, qx, xd, xs)

        def codegen(context, builder, sig, args):
            aq, ad, am, at, ax, axd, axs = _arrays(context, builder, sig, args)
            H = builder.extract_value(aq.shape, 0)
            pq = builder.bitcast(aq.data, _i8.as_pointer())
            pd, pm, pt, px, pxd, pxs = ad.data, am.data, at.data, ax.data, axd.data, axs.data
            acc = cgutils.alloca_once_value(builder, ir.Constant(_vec(_f32, 16), 0.0))
            mt = cgutils.alloca_once_value(builder, ir.Constant(_f32, 0.0))
            nchunk = builder.ashr(H, ir.Constant(H.type, 5))

            def f16(ptr, blk):
                bits = builder.zext(builder.load(builder.gep(ptr, [blk])), H.type)
                return builder.load(builder.gep(pt, [bits]))

            def block(blk):
                """(d_b * xd_b) and mt += m_b * xs_b, in block order."""
                mb = builder.fmul(f16(pm, blk), builder.load(builder.gep(pxs, [blk])))
                builder.store(builder.fadd(builder.load(mt), mb), mt)
                return builder.fmul(f16(pd, blk), builder.load(builder.gep(pxd, [blk])))

            def chunk(qoff, blk, n):  # n elements: 64 (32 code bytes) or 32 (16)
                v = _load(builder, pq, qoff, _vec(_i8, n // 2))
                lo = builder.and_(v, _consts(_i8, [15] * (n // 2)))
                hi = builder.lshr(v, _consts(_i8, [4] * (n // 2)))
                if n == 64:
                    idx = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
                else:
                    idx = list(range(32))
                w = _shuffle(builder, lo, hi, idx)
                x = _load(builder, px, builder.shl(qoff, ir.Constant(H.type, 1)), _vec(_i8, n))
                lanes = _lanes(builder, path, w, x, None, False, n)
                s0 = block(blk)
                if n == 64:
                    s1 = block(builder.add(blk, ir.Constant(H.type, 1)))
                else:
                    lanes = _join(builder, lanes, ir.Constant(_vec(_i32, 8), None), 8)
                    s1 = ir.Constant(_f32, 0.0)
                f = builder.sitofp(lanes, _vec(_f32, 16))
                builder.store(builder.fadd(builder.load(acc), builder.fmul(f, _scale16(builder, s0, s1))), acc)

            with cgutils.for_range(builder, nchunk) as loop:
                i = loop.index
                chunk(builder.shl(i, ir.Constant(H.type, 5)), builder.shl(i, ir.Constant(H.type, 1)), 64)
            has_tail = builder.icmp_signed("!=", builder.and_(H, ir.Constant(H.type, 16)), ir.Constant(H.type, 0))
            with builder.if_then(has_tail):
                chunk(builder.shl(nchunk, ir.Constant(H.type, 5)), builder.shl(nchunk, ir.Constant(H.type, 1)), 32)
            return builder.fadd(_tree16(builder, builder.load(acc)), builder.load(mt))

        return sig, codegen

    return dot


# --------------------------------------------------------------------------------------------
# the plain path: the same lanes and the same float steps, in numba loops
@njit(inline="always")
def _tree_plain(acc):
    v8 = np.empty(8, F32)
    for i in range(8):
        v8[i] = acc[i] + acc[i + 8]
    v4 = np.empty(4, F32)
    for i in range(4):
        v4[i] = v8[i] + v8[i + 4]
    a = v4[0] + v4[2]
    b = v4[1] + v4[3]
    return a + b


@njit
def _i8_dot_plain(qw, sw, qx, xd, xc):
    K = qw.shape[0]
    acc = np.zeros(16, F32)
    nchunk = K >> 6
    for c in range(nchunk + ((K >> 5) & 1)):
        n = 16 if c < nchunk else 8
        s0 = sw[2 * c] * xd[2 * c]
        s1 = sw[2 * c + 1] * xd[2 * c + 1] if n == 16 else F32(0.0)
        for i in range(n):
            lane = np.int32(0)
            for k in range(4):
                j = 64 * c + 4 * i + k
                lane += np.int32(qw[j]) * np.int32(qx[j])
            acc[i] = acc[i] + F32(lane) * (s0 if i < 8 else s1)
    return _tree_plain(acc)


@njit
def _q4_dot_plain(qs, d, m, table, qx, xd, xs):
    H = qs.shape[0]
    acc = np.zeros(16, F32)
    mt = F32(0.0)
    nchunk = H >> 5
    for c in range(nchunk + ((H >> 4) & 1)):
        n = 16 if c < nchunk else 8
        mt = mt + table[m[2 * c]] * xs[2 * c]
        s0 = table[d[2 * c]] * xd[2 * c]
        s1 = F32(0.0)
        if n == 16:
            mt = mt + table[m[2 * c + 1]] * xs[2 * c + 1]
            s1 = table[d[2 * c + 1]] * xd[2 * c + 1]
        for i in range(n):
            lane = np.int32(0)
            for k in range(4):
                e = 4 * i + k  # element within the chunk, natural order
                blk = e >> 5
                el = e & 31
                byte = qs[32 * c + 16 * blk + (el & 15)]
                code = np.int32(byte & np.uint8(15)) if el < 16 else np.int32(byte >> np.uint8(4))
                lane += code * np.int32(qx[64 * c + e])
            acc[i] = acc[i] + F32(lane) * (s0 if i < 8 else s1)
    return _tree_plain(acc) + mt


_DOTS: dict[tuple[str, str], object] = {}


def dot(kind: str, path: str):
    """The row dot of ``kind`` ('i8' | 'q4') on ``path`` (a numba-callable function)."""
    key = (kind, path)
    if key not in _DOTS:
        if path == "plain":
            _DOTS[key] = _i8_dot_plain if kind == "i8" else _q4_dot_plain
        elif not available(path):
            raise ValueError(f"the compile target lacks {', '.join(NEEDS[path])}: path {path!r} cannot run")
        else:
            _DOTS[key] = (_make_i8_dot if kind == "i8" else _make_q4_dot)(path)
    return _DOTS[key]


# --------------------------------------------------------------------------------------------
# row kernels over a whole weight: one output element per (token, row), each by one thread
def _make_rows_i8(rowdot, parallel):
    @njit(parallel=parallel)
    def rows(Q, S, X, Y, rpt):
        """Y[t, o] = row o of int8 blocks (codes Q, scales S) . q8(X[t])."""
        O = Q.shape[0]
        T, K = X.shape
        XQ = np.empty((T, K), np.int8)
        XD = np.empty((T, K // 32), F32)
        XC = np.empty((T, K // 4), np.int32)
        XS = np.empty((T, K // 32), F32)
        quantize_x(X, XQ, XD, XC, XS)
        ntask = (O + rpt - 1) // rpt
        for k in prange(ntask):
            for o in range(k * rpt, min(O, (k + 1) * rpt)):
                for t in range(T):
                    Y[t, o] = rowdot(Q[o], S[o], XQ[t], XD[t], XC[t])

    return rows


def _make_rows_q4(rowdot, parallel):
    @njit(parallel=parallel)
    def rows(QS, D, M, table, X, Y, rpt):
        """Y[t, o] = row o of q4 (codes QS, f16 scales D and offsets M) . q8(X[t])."""
        O = QS.shape[0]
        T, K = X.shape
        XQ = np.empty((T, K), np.int8)
        XD = np.empty((T, K // 32), F32)
        XC = np.empty((T, K // 4), np.int32)
        XS = np.empty((T, K // 32), F32)
        quantize_x(X, XQ, XD, XC, XS)
        ntask = (O + rpt - 1) // rpt
        for k in prange(ntask):
            for o in range(k * rpt, min(O, (k + 1) * rpt)):
                for t in range(T):
                    Y[t, o] = rowdot(QS[o], D[o], M[o], table, XQ[t], XD[t], XS[t])

    return rows


# Several weights against one activation (q/k/v, gate/up): one launch, the activation quantized
# once, tasks of ``rpt`` rows laid end to end over the weights. Each output element is the same
# row dot as `rows_kernel` computes, by one thread: the bytes equal one call per weight.
def _make_group_i8(rowdot, parallel):
    @njit(parallel=parallel)
    def group(Qs, Ss, X, Ys, rpt):
        """Ys[i][t, o] = row o of int8 weight i (Qs[i], Ss[i]) . q8(X[t]), q8(X) computed once."""
        T, K = X.shape
        XQ = np.empty((T, K), np.int8)
        XD = np.empty((T, K // 32), F32)
        XC = np.empty((T, K // 4), np.int32)
        XS = np.empty((T, K // 32), F32)
        quantize_x(X, XQ, XD, XC, XS)
        n = len(Qs)
        rows_of = np.empty(n, np.int64)
        for i in range(n):
            rows_of[i] = Qs[i].shape[0]
        starts = _task_starts(n, rows_of, rpt)
        for k in prange(starts[n]):
            i = _which(starts, k)
            Q, S, Y = Qs[i], Ss[i], Ys[i]
            k0 = k - starts[i]
            for o in range(k0 * rpt, min(rows_of[i], (k0 + 1) * rpt)):
                for t in range(T):
                    Y[t, o] = rowdot(Q[o], S[o], XQ[t], XD[t], XC[t])

    return group


def _make_group_q4(rowdot, parallel):
    @njit(parallel=parallel)
    def group(QSs, Ds, Ms, table, X, Ys, rpt):
        """Ys[i][t, o] = row o of q4 weight i . q8(X[t]), q8(X) computed once."""
        T, K = X.shape
        XQ = np.empty((T, K), np.int8)
        XD = np.empty((T, K // 32), F32)
        XC = np.empty((T, K // 4), np.int32)
        XS = np.empty((T, K // 32), F32)
        quantize_x(X, XQ, XD, XC, XS)
        n = len(QSs)
        rows_of = np.empty(n, np.int64)
        for i in range(n):
            rows_of[i] = QSs[i].shape[0]
        starts = _task_starts(n, rows_of, rpt)
        for k in prange(starts[n]):
            i = _which(starts, k)
            QS, D, M, Y = QSs[i], Ds[i], Ms[i], Ys[i]
            k0 = k - starts[i]
            for o in range(k0 * rpt, min(rows_of[i], (k0 + 1) * rpt)):
                for t in range(T):
                    Y[t, o] = rowdot(QS[o], D[o], M[o], table, XQ[t], XD[t], XS[t])

    return group


_GROUPS: dict[tuple[str, str, bool], object] = {}


def group_kernel(kind: str, path: str | None = None, parallel: bool = False):
    """The kernel of ``kind`` ('i8' | 'q4') that multiplies a tuple of weights (tuples of their
    arrays, of one array type each) by one activation in one launch: the bytes of `rows_kernel`
    on each weight, with the activation quantized once."""
    key = (kind, chosen() if path is None else path, parallel)
    if key not in _GROUPS:
        _GROUPS[key] = (_make_group_i8 if kind == "i8" else _make_group_q4)(dot(kind, key[1]), parallel)
    return _GROUPS[key]


_ROWS: dict[tuple[str, str, bool], object] = {}


def rows_kernel(kind: str, path: str | None = None, parallel: bool = False):
    """The rows kernel of ``kind`` ('i8' | 'q4') on ``path`` (default: `chosen()`), serial or
    parallel (numba's pool; ~1 us more per call, so one thread runs the serial one)."""
    key = (kind, chosen() if path is None else path, parallel)
    if key not in _ROWS:
        _ROWS[key] = (_make_rows_i8 if kind == "i8" else _make_rows_q4)(dot(kind, key[1]), parallel)
    return _ROWS[key]


# --------------------------------------------------------------------------------------------
# bf16 rows: a row of bf16 bit patterns times float32 x, widened in registers. 64 accumulators:
# acc[i] = acc[i] + widen(h[64c + i]) * x[64c + i] chunk by chunk (the tail chunk touches lanes
# 0 .. K%64 - 1), then the tree of halves 64 -> 32 -> ... -> 1. Plain LLVM vector IR (no x86
# intrinsic), so it compiles for any target; `_bf16_chunks_plain` is the same in numba loops.
BF16_LANES = 64


def _tree_halves(builder, v, n):
    """v (<n x float>) summed as the tree of halves: v[i] + v[i + n/2], ... down to one."""
    while n > 1:
        lo, hi = _split(builder, v, n // 2)
        v = builder.fadd(lo, hi)
        n //= 2
    return builder.extract_element(v, ir.Constant(_i32, 0))


def _bf16_chunk_loop(builder, ah, ax, cur, nchunk, K):
    vf = _vec(_f32, BF16_LANES)
    with cgutils.for_range(builder, nchunk) as loop:
        off = builder.mul(loop.index, ir.Constant(K.type, BF16_LANES))
        hv = _load(builder, ah.data, off, _vec(_i16, BF16_LANES))
        wide = builder.shl(builder.zext(hv, _vec(_i32, BF16_LANES)), _consts(_i32, [16] * BF16_LANES))
        xv = _load(builder, ax.data, off, vf)
        builder.store(builder.fadd(builder.load(cur), builder.fmul(builder.bitcast(wide, vf), xv)), cur)


@intrinsic
def _bf16_dot_whole(typingctx, h, x):
    """The whole documented bf16 dot of a row whose length is a multiple of 64."""
    _check_rows("bf16 dot", h, x)
    sig = types.float32(h, x)

    def codegen(context, builder, sig, args):
        ah, ax = _arrays(context, builder, sig, args)
        K = builder.extract_value(ah.shape, 0)
        cur = cgutils.alloca_once_value(builder, ir.Constant(_vec(_f32, BF16_LANES), 0.0))
        _bf16_chunk_loop(builder, ah, ax, cur, builder.udiv(K, ir.Constant(K.type, BF16_LANES)), K)
        return _tree_halves(builder, builder.load(cur), BF16_LANES)

    return sig, codegen


@intrinsic
def _bf16_chunks_vec(typingctx, h, x, acc):
    """acc[0:64] (float32, in and out) += the full chunks of row h (uint16) times x."""
    _check_rows("bf16 dot", h, x, acc)
    sig = types.void(h, x, acc)

    def codegen(context, builder, sig, args):
        ah, ax, aacc = _arrays(context, builder, sig, args)
        K = builder.extract_value(ah.shape, 0)
        pacc = builder.bitcast(aacc.data, _vec(_f32, BF16_LANES).as_pointer())
        cur = cgutils.alloca_once_value(builder, builder.load(pacc, align=4))
        _bf16_chunk_loop(builder, ah, ax, cur, builder.udiv(K, ir.Constant(K.type, BF16_LANES)), K)
        builder.store(builder.load(cur), pacc, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit
def _bf16_chunks_plain(h, x, acc):
    K = h.shape[0]
    for c in range(K // 64):
        for i in range(64):
            w = np.array([np.uint32(h[64 * c + i]) << np.uint32(16)], np.uint32).view(F32)[0]
            acc[i] = acc[i] + w * x[64 * c + i]


def _make_bf16_dot(chunks):
    @njit
    def dot(h, x, acc):
        for i in range(64):
            acc[i] = F32(0.0)
        chunks(h, x, acc)
        K = h.shape[0]
        base = (K // 64) * 64
        wb = np.empty(1, np.uint32)
        wf = wb.view(F32)
        for i in range(K - base):
            wb[0] = np.uint32(h[base + i]) << np.uint32(16)
            acc[i] = acc[i] + wf[0] * x[base + i]
        n = 32
        while n >= 1:
            for i in range(n):
                acc[i] = acc[i] + acc[i + n]
            n //= 2
        return acc[0]

    return dot


def _make_rows_bf16(rowdot, whole, parallel):
    @njit(parallel=parallel)
    def rows(H, X, Y, rpt):
        """Y[t, o] = widen(H[o]) . X[t] in the documented order."""
        O, K = H.shape
        T = X.shape[0]
        fast = whole and K % 64 == 0
        ntask = (O + rpt - 1) // rpt
        for k in prange(ntask):
            acc = np.empty(64, F32)
            for o in range(k * rpt, min(O, (k + 1) * rpt)):
                for t in range(T):
                    if fast:
                        Y[t, o] = _bf16_dot_whole(H[o], X[t])
                    else:
                        Y[t, o] = rowdot(H[o], X[t], acc)

    return rows


_BF16: dict[tuple[str, bool], object] = {}


def rows_bf16(path: str = "vector", parallel: bool = False):
    """The bf16 rows kernel: ``vector`` (LLVM vector IR, any target) or ``plain`` (numba loops),
    the same bytes."""
    key = (path, parallel)
    if key not in _BF16:
        if path not in ("vector", "plain"):
            raise ValueError(f"unknown bf16 dot path {path!r} (known: vector, plain)")
        chunks = _bf16_chunks_vec if path == "vector" else _bf16_chunks_plain
        _BF16[key] = _make_rows_bf16(_make_bf16_dot(chunks), path == "vector", parallel)
    return _BF16[key]


def _make_group_bf16(rowdot, whole, parallel):
    @njit(parallel=parallel)
    def group(Hs, X, Ys, rpt):
        """Ys[i][t, o] = widen(Hs[i][o]) . X[t]: `rows_bf16` on each weight, in one launch."""
        T, K = X.shape
        fast = whole and K % 64 == 0
        n = len(Hs)
        rows_of = np.empty(n, np.int64)
        for i in range(n):
            rows_of[i] = Hs[i].shape[0]
        starts = _task_starts(n, rows_of, rpt)
        for k in prange(starts[n]):
            i = _which(starts, k)
            H, Y = Hs[i], Ys[i]
            k0 = k - starts[i]
            acc = np.empty(64, F32)
            for o in range(k0 * rpt, min(rows_of[i], (k0 + 1) * rpt)):
                for t in range(T):
                    if fast:
                        Y[t, o] = _bf16_dot_whole(H[o], X[t])
                    else:
                        Y[t, o] = rowdot(H[o], X[t], acc)

    return group


_BF16_GROUPS: dict[tuple[str, bool], object] = {}


def group_bf16(path: str = "vector", parallel: bool = False):
    """`rows_bf16` over a tuple of weights (their bit patterns) and one activation, one launch."""
    key = (path, parallel)
    if key not in _BF16_GROUPS:
        if path not in ("vector", "plain"):
            raise ValueError(f"unknown bf16 dot path {path!r} (known: vector, plain)")
        chunks = _bf16_chunks_vec if path == "vector" else _bf16_chunks_plain
        _BF16_GROUPS[key] = _make_group_bf16(_make_bf16_dot(chunks), path == "vector", parallel)
    return _BF16_GROUPS[key]
