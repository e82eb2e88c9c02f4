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

float32 and bf16 (`float_kernel`, `rows_bf16`): a row of float32 weights, or of bf16 bit
patterns widened in registers (a 16-bit shift per lane, never a widened row in memory), dotted
with float32 x. Per position L accumulators (f32: 32, bf16: 64), ``acc[i] = acc[i] + w[cL+i] *
x[cL+i]`` chunk by chunk (a product rounded, then a sum rounded: no fused multiply-add), the
K % L tail elements to lanes 0 .. K % L - 1, then the tree of halves L -> L/2 -> ... -> 1. The
order is written in LLVM vector IR without fast-math flags, so LLVM cannot change it: the bytes
are the same on every compile target (generic, haswell and the host give the same bytes; tests
compare the vector path with `_make_float_dots_plain`, the same order in numba loops). The
``dpbf16ps`` instruction would round x to bf16, i.e. change the numbers; it is not used.

Several positions per pass: every kernel takes up to MAX_T (8; bf16 4, whose 64 accumulators
per position would not fit the registers) activation rows per pass over a weight row (a decode batch of streams, a verified draft): each chunk of the row is loaded (and
widened, unpacked or made unsigned) once and updates the accumulators of every position. From
4 positions on (q4: 5), two weight rows are walked side by side, four positions at a time
(`_tile`: a register tile of 2 rows x 4 positions). Each (row, position) keeps its own
accumulators in the one-position order, so its bytes do not depend on T, on the tile nor on
the other rows (tests/test_rows_multi.py): a batched stream equals a lone one, a verified
position equals a step.

Prefetch: every vector dots kernel asks for the weight row's cache lines PREFETCH bytes ahead
(``llvm.prefetch``, which exists on every target and never faults); it changes when bytes
arrive, never a value or the order above. The plain paths do not prefetch.

Groups (`group_kernel`, `group_bf16`, `float_kernel(group=True)`): the weights that multiply
one activation (a layer's q/k/v, an FFN's gate and up) in one launch, the activation quantized once, tasks of
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

from . import atomics as _A
from .f16bits import h2f_ir, scale_f32
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
# Software prefetch: bytes ahead of the current offset along a weight row (rows are contiguous,
# so it runs on into the next rows) at which every dots kernel asks for the weight stream's
# cache lines (one prefetch per 64-byte line of a chunk; one per q4 chunk, half a line). A weight
# larger than the caches was latency-bound: the hardware prefetcher does not run far enough
# ahead (it stops at a 4 KB page; when this was measured a container's segments were mapped in
# 4 KB pages, before vindex3.segments asked for 2 MB ones; the distances were swept again for i8
# with 2 MB pages, docs/container.md, and 8 KB stayed the fastest).
# Measured by bench/prefetch_distance.py (cold, file-mapped weights, 1 thread, vnni512, CPU ms per
# call, load 8-10: noisy; distances of 4-32 KB lie within the noise of one another, 0 and 1 KB
# do not; results/prefetch_distance.json), without -> with:
#   f32  49152x576 T=1 3.84 -> 2.89, T=8 12.0 -> 7.7; 5632x2048 T=8 5.8 -> 4.3
#   i8   32000x2048 T=1 2.66 -> 2.10, T=8 13.6 -> 8.6; 2048x2048 T=8 0.77 -> 0.58
# bf16 and q4 (wall clock, numpy arrays, load 2.5-3.5: results/prefetch_distance_wall_arrays.json):
#   bf16 5632x2048 T=8 3.4 -> 2.0 (8 KB; 4 KB 2.2); q4 32000x2048 T=1 3.6 -> 1.76 (4 KB)
# Whole SmolLM2 decode, 1 thread, fused layers, tokens per CPU-second, median of 3 rounds
# alternated with the kernels without prefetch (load 4-5, results/prefetch_ab_decode.json):
# f32 35 -> 46, int8 q8 99 -> 152, q4 q8 109 -> 123.
# The per-block scale streams (int8 scales, q4 d and m: 1/8 of the bytes) were also tried, at
# 1 KB ahead: no gain beyond the noise, so they are left to the hardware.
# A 64-element chunk's two block scales (int8: S; q4: d and m, f16 converted in lanes with
# vcvtph2ps where the target has F16C, else through the table) are loaded as one <2 x float> and
# multiplied by the activation's two scales in lanes: the same float32 products and the same
# additions in the same order as one block at a time, so no byte changes (the cross-path tests
# compare against the plain path). Hot weights, 1 thread, CPU time on this kind of CPU (AMD Zen 5,
# load 1.4-3): q4 T=1 36 -> 50 G elements/s on SmolLM2's shapes, T=8 1.12-1.15x; int8 T=8
# 1.16x, T=1 within the noise (it is near the memory bound).
SCALE_LANES = True
PREFETCH = {"f32": 4096, "bf16": 8192, "i8": 8192, "q4": 4096}
# Where a CPU's own measurement (bench/prefetch_distance.py on that CPU, quiet) shows a default
# above losing, its entry by the CPU name LLVM gives the compile target: (kind, positions) ->
# bytes. AMD Zen 4 (znver4, load 0.8-1.1, results/prefetch_distance_zen4*.json, CPU ms per call):
# at one position the float rows stream faster with no software prefetch at all (f32 49152x576
# 3.57 against 4.9 at every distance 2-16 KB, 32000x2048 8.2 against 11.0; bf16 49152x576 1.72
# against 2.45-2.49, 32000x2048 4.56 against 7.9-8.5), while at 8 positions prefetch still gains
# (f32 49152x576 13.2 -> 11.1, bf16 7.95 -> 6.7) and i8 and q4 gain at both (q4 32000x2048 T=1
# 2.70 -> 2.24). A whole f32 SmolLM2 decode step there, same process kind, alternated 3 times:
# 27.4-27.8 ms with the default, 23.0-23.8 with this entry.
# The same CPU at several positions (bench/multirow_cold.py, cold, file-mapped, 1 thread, CPU ms
# per call, load 0.4-0.6; results/multirow_cold_zen4_f32*.json, prefetch_distance_zen4_f32_multi.json):
# the f32 passes of 2-5 positions also stream faster without software prefetch, one weight row at
# a time (see TILE_MIN_T_BY_CPU); a SmolLM2 layer's seven products at T = 2, 3, 4, 5 took 0.54,
# 0.71, 0.76, 0.88 ms against 0.83, 0.91, 1.11, 1.24 as the defaults build them (the head
# 49152x576 at T = 2: 4.8 against 6.2).
# AMD Zen 3 (znver3, AVX2 path; cold, file-mapped, 1 thread, CPU ms per call, best of 3 rounds,
# load 0.6, results/prefetch_distance_zen3.json): f32 at one and two positions again streams
# faster without (49152x576 T=1 5.45 against 5.9-6.3 at 2-8 KB, T=2 6.28 against 6.6-7.3;
# 1536x576 T=1 0.199 against 0.214-0.228), at four and eight it needs it (49152x576 T=4 14.2
# against 7.4-7.7); bf16 gains from prefetch at every T there (49152x576 T=1 3.65 -> 2.87-2.92).
# A whole f32 SmolLM2 decode step there against llama.cpp F32 (3 rounds, medians, load 0.8-1.1,
# results/intdot_vs_llamacpp_zen3_f32_noprefetch.json): 0.78x -> 0.95x at 1 thread (30.6 against
# 32.2 tokens/s), 0.95x -> 0.92x at 2 (49.6 against 54.1: both near the 33.9 GB/s stream rate).
PREFETCH_BY_CPU = {"znver4": {("f32", 1): 0, ("bf16", 1): 0, ("f32", 2): 0, ("f32", 3): 0, ("f32", 4): 0,
                              ("f32", 5): 0},
                   "znver3": {("f32", 1): 0, ("f32", 2): 0}}


def target_cpu() -> str:
    """The CPU name numba compiles for: NUMBA_CPU_NAME if set, else LLVM's name for the host."""
    from numba.core import config

    if config.CPU_NAME:
        return str(config.CPU_NAME)
    from llvmlite import binding as ll

    return str(ll.get_host_cpu_name())


# Which cache level a kernel's software prefetch fills (``llvm.prefetch`` locality: 3 all levels,
# the default; 2 and 1 the outer ones), where a CPU's own measurement shows the default losing:
# kind -> locality, by the CPU name LLVM gives the compile target. AMD Zen 4 (znver4): the int8
# q8 products of all 30 SmolLM2 layers (119 MB, the container's file-mapped arrays in 2 MB pages,
# cold), every arm compiled in one process and the arms alternated pass by pass, paired median
# ratio of the times to locality 3 (bench/prefetch_locality.py, 24 rounds, load 0.5-0.9,
# results/prefetch_locality_zen4.json): locality 2 at one thread 0.90x at T = 1, 0.95x at 2,
# 0.98x at 4, 0.97x at 8; at two threads (each thread half of every product) 1.01x, 0.88x,
# 0.95x, 0.95x; locality 1 (the same level on this CPU) within 0.05 of 2, 0 (non-temporal) as
# 3. A whole decode step, 1 thread, the two trees alternated with llama.cpp in the same rounds:
# docs/container.md. q4 (bound by its unpacking at one thread) moved by less than the noise, and
# f32 runs fastest there with no software prefetch at all (PREFETCH_BY_CPU).
PREFETCH_LOCALITY_BY_CPU = {"znver4": {"i8": 2}}


def prefetch_locality(kind: str, cpu: str | None = None) -> int:
    """The locality a ``kind`` kernel's software prefetch asks for on ``cpu`` (default: the
    compile target's): the CPU's entry in PREFETCH_LOCALITY_BY_CPU, else 3."""
    return int(PREFETCH_LOCALITY_BY_CPU.get(target_cpu() if cpu is None else cpu, {}).get(kind, 3))


def prefetch_distance(kind: str, T: int, cpu: str | None = None) -> int:
    """Bytes ahead a ``kind`` kernel prefetches in a pass of ``T`` positions on ``cpu`` (default:
    the compile target's): the CPU's entry in PREFETCH_BY_CPU, else PREFETCH[kind]."""
    table = PREFETCH_BY_CPU.get(target_cpu() if cpu is None else cpu, {})
    return int(table.get((kind, T), PREFETCH[kind]))


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


@njit(cache=True)
def q8_buffers(X):
    """Empty (XQ, XD, XC, XS) for `quantize_x` of X [T, K] (compiled callers)."""
    T, K = X.shape
    return (np.empty((T, K), np.int8), np.empty((T, K // 32), F32), np.empty((T, K // 4), np.int32),
            np.empty((T, K // 32), F32))


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


def _prefetch(builder, base, offset, locality=3):
    """A software prefetch of the cache line at typed pointer ``base`` + element ``offset``
    (read, data cache; ``locality`` 3 keeps it in all levels, 2 and 1 ask for the outer
    levels). It never faults (it may point past the array) and changes no value; see PREFETCH."""
    p = builder.bitcast(builder.gep(base, [offset]), _i8.as_pointer())
    _call(builder, "llvm.prefetch.p0i8", ir.VoidType(),
          [p, ir.Constant(_i32, 0), ir.Constant(_i32, locality), ir.Constant(_i32, 1)])


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


def _pair(builder, ptr, blk):
    """<2 x float>: the float32 values of blocks ``blk`` and ``blk + 1`` at typed pointer ``ptr``."""
    return _load(builder, builder.bitcast(ptr, _i8.as_pointer()), builder.shl(blk, ir.Constant(blk.type, 2)),
                 _vec(_f32, 2))


def _half_scales(S) -> bool:
    """Whether an int8 rows operand's block scales are half-precision bits (uint16: int8h) rather
    than float32 (int8); anything else is refused by name."""
    if S.dtype == types.uint16:
        return True
    if S.dtype != types.float32:
        raise TypingError(f"int8 block scales are float32 or uint16 (half-precision bits), got {S.dtype}")
    return False


def _scale_one(builder, ptr, blk, half):
    """float: the scale of block ``blk`` at typed pointer ``ptr`` (float32, or half bits made exact)."""
    v = builder.load(builder.gep(ptr, [blk]))
    return h2f_ir(builder, v) if half else v


def _scale_pair(builder, ptr, blk, half):
    """<2 x float>: the scales of blocks ``blk`` and ``blk + 1`` (as `_pair`, for either width)."""
    if not half:
        return _pair(builder, ptr, blk)
    h = _load(builder, builder.bitcast(ptr, _i8.as_pointer()), builder.shl(blk, ir.Constant(blk.type, 1)), _vec(_i16, 2))
    return h2f_ir(builder, h)


def _acc_pair(builder, acc, lanes, s2):
    """acc (a pointer to <16 x float>) += float(lanes) x (s2[0] on lanes 0-7, s2[1] on 8-15)."""
    prod = builder.fmul(builder.sitofp(lanes, _vec(_f32, 16)), _shuffle(builder, s2, s2, [0] * 8 + [1] * 8))
    builder.store(builder.fadd(builder.load(acc), prod), acc)


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


def _arrays_at(context, builder, sig, args, which):
    return [context.make_array(sig.args[i])(context, builder, args[i]) for i in which]


def _check_rows(name, *tys):
    for t in tys:
        if not isinstance(t, types.Array) or t.ndim != 1 or t.layout != "C":
            raise TypingError(f"{name}: every operand must be a C-contiguous 1-D array, got {t}")


def _row_ptr(builder, arr, row, width):
    return builder.gep(arr.data, [builder.mul(row, width)])


def _make_i8_dots(path, pf=None, rows=None, group=None, locality=None, pair_lead=True):
    """dots(Q int8 [O, K], S f32 or f16 bits [O, K/32], o0, o1, XQ int8 [T, K], XD f32 [T, K/32],
    XC int32 [T, K/4], t0, Y f32 [T, O]): Y[t, o] = the documented dot of row o and the codes of
    position t, for rows o0 .. o1 - 1 and positions t0 .. min(T, t0 + MAX_T) - 1. A chunk of a
    row is loaded (and made unsigned) once for every position. ``pf``: the prefetch distance
    in bytes (default prefetch_distance('i8', T); 0: none); ``locality``: the prefetch's (default
    prefetch_locality('i8')); ``rows``, ``group``: see `_tile`
    and `_make_float_dots` (they change no byte)."""

    @intrinsic
    def dots(typingctx, Q, S, o0, o1, XQ, XD, XC, t0, Y):
        _check_multi("i8 dots", (), (Q, S, XQ, XD, XC), Y, t0, o0)
        _check_multi("i8 dots", (), (), Y, o1, o1)
        half = _half_scales(S)
        sig = types.void(Q, S, o0, o1, XQ, XD, XC, t0, Y)

        def codegen(context, builder, sig, args):
            aq, asw, axq, axd, axc, ay = _arrays_at(context, builder, sig, args, (0, 1, 4, 5, 6, 8))
            o0v, o1v, t0v = (_int_arg(context, builder, sig.args[i], args[i]) for i in (2, 3, 7))
            K = builder.extract_value(aq.shape, 1)
            nb = builder.extract_value(asw.shape, 1)
            T = builder.extract_value(axq.shape, 0)
            O = builder.extract_value(ay.shape, 1)
            c = lambda v: ir.Constant(K.type, v)
            K4 = builder.ashr(K, c(2))
            nchunk = builder.ashr(K, c(6))
            has_tail = builder.icmp_signed("!=", builder.and_(K, c(32)), c(0))

            def emit(Tc):
                pos = [builder.add(t0v, c(t)) for t in range(Tc)]
                pxq = [_row_ptr(builder, axq, p, K) for p in pos]
                pxd = [_row_ptr(builder, axd, p, nb) for p in pos]
                pxc = [_row_ptr(builder, axc, p, K4) for p in pos]
                Rt, G = _tile("i8", Tc, rows, group)
                pft = prefetch_distance("i8", Tc) if pf is None else pf
                loc = prefetch_locality("i8") if locality is None else locality
                z = ir.Constant(_vec(_f32, 16), 0.0)
                accs = {R: [[cgutils.alloca_once_value(builder, z) for _ in range(G)] for _ in range(R)] for R in {Rt, 1}}

                def walk(o, R):  # rows o .. o + R - 1, every position, group by group
                    orows = [builder.add(o, c(r)) for r in range(R)]
                    pws = [_row_ptr(builder, aq, orow, K) for orow in orows]
                    psws = [_row_ptr(builder, asw, orow, nb) for orow in orows]
                    lead = _lead(builder, pft, R, K, pair_lead)
                    for g0 in range(0, Tc, G):
                        ts = list(range(g0, min(Tc, g0 + G)))
                        acc = [accs[R][r][: len(ts)] for r in range(R)]
                        for ar in acc:
                            for a in ar:
                                builder.store(z, a)

                        def chunk(off, blk, n, ts=ts, acc=acc):  # n = 64 (two blocks) or 32 (the tail block)
                            ws = [_load(builder, pw, off, _vec(_i8, n)) for pw in pws]
                            b1 = builder.add(blk, c(1))
                            pair = n == 64 and SCALE_LANES
                            if pair:  # a chunk's two scales as <2 x float>: the same products, in lanes
                                sw2 = [_scale_pair(builder, psw, blk, half) for psw in psws]
                            else:
                                sw0 = [_scale_one(builder, psw, blk, half) for psw in psws]
                                sw1 = [_scale_one(builder, psw, b1, half) if n == 64 else None for psw in psws]
                            for j, t in enumerate(ts):
                                x = _load(builder, pxq[t], off, _vec(_i8, n))
                                cc = _load(builder, pxc[t], builder.ashr(off, c(2)), _vec(_i32, n // 4))
                                if pair:
                                    xd2 = _pair(builder, pxd[t], blk)
                                    for r in range(R):
                                        lanes = _lanes(builder, path, ws[r], x, cc, True, n)
                                        _acc_pair(builder, acc[r][j], lanes, builder.fmul(sw2[r], xd2))
                                    continue
                                xd0 = builder.load(builder.gep(pxd[t], [blk]))
                                xd1 = builder.load(builder.gep(pxd[t], [b1])) if n == 64 else None
                                for r in range(R):
                                    lanes = _lanes(builder, path, ws[r], x, cc, True, n)
                                    s0 = builder.fmul(sw0[r], xd0)
                                    if n == 64:
                                        s1 = builder.fmul(sw1[r], xd1)
                                    else:
                                        lanes = _join(builder, lanes, ir.Constant(_vec(_i32, 8), None), 8)
                                        s1 = ir.Constant(_f32, 0.0)
                                    f = builder.sitofp(lanes, _vec(_f32, 16))
                                    prod = builder.fmul(f, _scale16(builder, s0, s1))
                                    builder.store(builder.fadd(builder.load(acc[r][j]), prod), acc[r][j])

                        with cgutils.for_range(builder, nchunk) as loop:
                            i = loop.index
                            if pft and g0 == 0:  # a 64-byte chunk is one cache line
                                for pw in pws:
                                    _prefetch(builder, pw, builder.add(builder.shl(i, c(6)), lead), loc)
                            chunk(builder.shl(i, c(6)), builder.shl(i, c(1)), 64)
                        with builder.if_then(has_tail):
                            chunk(builder.shl(nchunk, c(6)), builder.shl(nchunk, c(1)), 32)
                        for r in range(R):
                            for j, t in enumerate(ts):
                                yo = builder.add(builder.mul(pos[t], O), orows[r])
                                builder.store(_tree16(builder, builder.load(acc[r][j])), builder.gep(ay.data, [yo]))

                _walk_rows(builder, o0v, o1v, Rt, walk)

            _per_T(builder, _tn(builder, T, t0v), emit)
            return context.get_dummy_value()

        return sig, codegen

    return dots


def _make_q4_dots(path, pf=None, rows=None, group=None, locality=3, pair_lead=True):
    """dots(QS uint8 [O, K/2], D, M uint16 [O, K/32] (f16 bits), table f32[65536], o0, o1,
    XQ int8 [T, K], XD f32 [T, K/32], XS f32 [T, K/32], t0, Y f32 [T, O]): as `_make_i8_dots`
    for q4 rows. Byte l of a block's 16 holds element l (low nibble) and l + 16 (high nibble);
    a chunk's codes are unpacked once for every position. The offsets' term ``mt`` is summed
    block by block from 0 (mt = mt + m_b * xs_b) and added to the tree last. ``pf``: the
    prefetch distance in bytes (default prefetch_distance('q4', T); 0: none); ``rows``, ``group``,
    ``locality``: see `_tile` and `_make_float_dots` (they change no byte)."""
    # d and m two blocks at a time in lanes where the target has F16C (SCALE_LANES); the
    # conversion is exact, so the values are the table's
    cvt = SCALE_LANES and "f16c" in target_features()

    @intrinsic
    def dots(typingctx, QS, D, M, table, o0, o1, XQ, XD, XS, t0, Y):
        _check_multi("q4 dots", (table,), (QS, D, M, XQ, XD, XS), Y, t0, o0)
        _check_multi("q4 dots", (), (), Y, o1, o1)
        sig = types.void(QS, D, M, table, o0, o1, XQ, XD, XS, t0, Y)

        def codegen(context, builder, sig, args):
            aq, ad, am, at, axq, axd, axs, ay = _arrays_at(context, builder, sig, args, (0, 1, 2, 3, 6, 7, 8, 10))
            o0v, o1v, t0v = (_int_arg(context, builder, sig.args[i], args[i]) for i in (4, 5, 9))
            H = builder.extract_value(aq.shape, 1)
            nb = builder.extract_value(ad.shape, 1)
            T = builder.extract_value(axq.shape, 0)
            O = builder.extract_value(ay.shape, 1)
            c = lambda v: ir.Constant(H.type, v)
            K = builder.shl(H, c(1))
            nchunk = builder.ashr(H, c(5))
            has_tail = builder.icmp_signed("!=", builder.and_(H, c(16)), c(0))
            pt = at.data

            def emit(Tc):
                pos = [builder.add(t0v, c(t)) for t in range(Tc)]
                pxq = [_row_ptr(builder, axq, p, K) for p in pos]
                pxd = [_row_ptr(builder, axd, p, nb) for p in pos]
                pxs = [_row_ptr(builder, axs, p, nb) for p in pos]
                Rt, G = _tile("q4", Tc, rows, group)
                pft = prefetch_distance("q4", Tc) if pf is None else pf
                z, zf = ir.Constant(_vec(_f32, 16), 0.0), ir.Constant(_f32, 0.0)
                accs = {R: [[cgutils.alloca_once_value(builder, z) for _ in range(G)] for _ in range(R)] for R in {Rt, 1}}
                mts = {R: [[cgutils.alloca_once_value(builder, zf) for _ in range(G)] for _ in range(R)] for R in {Rt, 1}}

                def f16(ptr, blk):
                    bits = builder.zext(builder.load(builder.gep(ptr, [blk])), H.type)
                    return builder.load(builder.gep(pt, [bits]))

                def f16x2(ptr, blk):  # the f16 values of blocks blk, blk + 1 as <2 x float>, exactly
                    h = _load(builder, builder.bitcast(ptr, _i8.as_pointer()), builder.shl(blk, c(1)), _vec(_i16, 2))
                    return builder.fpext(builder.bitcast(h, _vec(ir.HalfType(), 2)), _vec(_f32, 2))

                def walk(o, R):  # rows o .. o + R - 1, every position, group by group
                    orows = [builder.add(o, c(r)) for r in range(R)]
                    pqs = [builder.bitcast(_row_ptr(builder, aq, orow, H), _i8.as_pointer()) for orow in orows]
                    pds = [_row_ptr(builder, ad, orow, nb) for orow in orows]
                    pms = [_row_ptr(builder, am, orow, nb) for orow in orows]
                    lead = _lead(builder, pft, R, H, pair_lead)
                    for g0 in range(0, Tc, G):
                        ts = list(range(g0, min(Tc, g0 + G)))
                        acc = [accs[R][r][: len(ts)] for r in range(R)]
                        mt = [mts[R][r][: len(ts)] for r in range(R)]
                        for r in range(R):
                            for a, m in zip(acc[r], mt[r]):
                                builder.store(z, a)
                                builder.store(zf, m)

                        def chunk(qoff, blk, n, ts=ts, acc=acc, mt=mt):  # n elements: 64 (32 code bytes) or 32 (16)
                            pair = n == 64 and cvt
                            if n == 64:
                                idx = list(range(16)) + list(range(32, 48)) + list(range(16, 32)) + list(range(48, 64))
                            else:
                                idx = list(range(32))
                            ws = []
                            for pq in pqs:
                                v = _load(builder, pq, qoff, _vec(_i8, n // 2))
                                lo = builder.and_(v, _consts(_i8, [15] * (n // 2)))
                                hi = builder.lshr(v, _consts(_i8, [4] * (n // 2)))
                                ws.append(_shuffle(builder, lo, hi, idx))
                            blks = [blk, builder.add(blk, c(1))][: n // 32]
                            if pair:  # a chunk's two blocks' d and m as <2 x float>, converted in lanes
                                dms = [(f16x2(pd, blk), f16x2(pm, blk)) for pd, pm in zip(pds, pms)]
                            else:
                                dms = [[(f16(pd, b), f16(pm, b)) for b in blks] for pd, pm in zip(pds, pms)]
                            for j, t in enumerate(ts):
                                x = _load(builder, pxq[t], builder.shl(qoff, c(1)), _vec(_i8, n))
                                if pair:
                                    xs2, xd2 = _pair(builder, pxs[t], blk), _pair(builder, pxd[t], blk)
                                    for r in range(R):
                                        lanes = _lanes(builder, path, ws[r], x, None, False, n)
                                        d2, m2 = dms[r]
                                        terms = builder.fmul(m2, xs2)  # block order: mt, as below
                                        mtv = builder.load(mt[r][j])
                                        mtv = builder.fadd(mtv, builder.extract_element(terms, ir.Constant(_i32, 0)))
                                        mtv = builder.fadd(mtv, builder.extract_element(terms, ir.Constant(_i32, 1)))
                                        builder.store(mtv, mt[r][j])
                                        _acc_pair(builder, acc[r][j], lanes, builder.fmul(d2, xd2))
                                    continue
                                xss = [builder.load(builder.gep(pxs[t], [b])) for b in blks]
                                xds = [builder.load(builder.gep(pxd[t], [b])) for b in blks]
                                for r in range(R):
                                    lanes = _lanes(builder, path, ws[r], x, None, False, n)
                                    ss = []
                                    for (db, mb), xs, xd in zip(dms[r], xss, xds):  # block order: mt, then the scale
                                        term = builder.fmul(mb, xs)
                                        builder.store(builder.fadd(builder.load(mt[r][j]), term), mt[r][j])
                                        ss.append(builder.fmul(db, xd))
                                    if n == 32:
                                        lanes = _join(builder, lanes, ir.Constant(_vec(_i32, 8), None), 8)
                                        ss.append(ir.Constant(_f32, 0.0))
                                    f = builder.sitofp(lanes, _vec(_f32, 16))
                                    prod = builder.fmul(f, _scale16(builder, ss[0], ss[1]))
                                    builder.store(builder.fadd(builder.load(acc[r][j]), prod), acc[r][j])

                        with cgutils.for_range(builder, nchunk) as loop:
                            i = loop.index
                            if pft and g0 == 0:  # a chunk is 32 code bytes: half a cache line
                                for pq in pqs:
                                    _prefetch(builder, pq, builder.add(builder.shl(i, c(5)), lead), locality)
                            chunk(builder.shl(i, c(5)), builder.shl(i, c(1)), 64)
                        with builder.if_then(has_tail):
                            chunk(builder.shl(nchunk, c(5)), builder.shl(nchunk, c(1)), 32)
                        for r in range(R):
                            for j, t in enumerate(ts):
                                res = builder.fadd(_tree16(builder, builder.load(acc[r][j])), builder.load(mt[r][j]))
                                builder.store(res, builder.gep(ay.data, [builder.add(builder.mul(pos[t], O), orows[r])]))

                _walk_rows(builder, o0v, o1v, Rt, walk)

            _per_T(builder, _tn(builder, T, t0v), emit)
            return context.get_dummy_value()

        return sig, codegen

    return dots


# --------------------------------------------------------------------------------------------
# several positions per pass over a weight row (decode batches, verified drafts): T <= MAX_T
# activation rows share every load of the row. Each position keeps its own accumulators and
# the order of its additions is the one-position order, so a position's bytes do not depend
# on T nor on which other rows ride along (tests/test_rows_multi.py).
MAX_T = 8


def _int_arg(context, builder, ty, val):
    return context.cast(builder, val, ty, types.intp)


def _check_multi(name, rows, X, Y, t0, o):
    _check_rows(name, *rows)
    for t in X + (Y,):
        if not isinstance(t, types.Array) or t.ndim != 2 or t.layout != "C":
            raise TypingError(f"{name}: X and Y must be C-contiguous 2-D arrays, got {t}")
    for t in (t0, o):
        if not isinstance(t, types.Integer):
            raise TypingError(f"{name}: t0 and o must be integers, got {t}")


def _per_T(builder, tn, emit, most=MAX_T):
    """Emit ``emit(Tc)`` for Tc = 1 .. ``most``, the one that runs chosen by ``tn`` at run time
    (each Tc unrolled over its positions, so every accumulator stays in a register)."""
    end = builder.append_basic_block("T.end")
    sw = builder.switch(tn, end)
    for Tc in range(1, most + 1):
        blk = builder.append_basic_block(f"T.{Tc}")
        sw.add_case(ir.Constant(tn.type, Tc), blk)
        builder.position_at_end(blk)
        emit(Tc)
        builder.branch(end)
    builder.position_at_end(end)


def _tn(builder, T, t0, most=MAX_T):
    left = builder.sub(T, t0)
    cap = ir.Constant(T.type, most)
    return builder.select(builder.icmp_signed("<", left, cap), left, cap)


# Register tiles of the several-position passes: from TILE_MIN_T[kind] positions on, two weight
# rows are walked side by side and the positions go in groups of at most TILE_GROUP per walk
# (the second group walks the same two rows again, from the L1 or L2). Each load of an
# activation chunk (and its scales) then serves two weight rows, and a walk keeps at most
# 2 x 4 positions' accumulators. Without it, a pass over 8 positions ran 2-2.5x slower than
# one over 4 on cold weights: it streamed at ~15 GB/s, far below both the memory's rate and the
# kernel's cache-resident compute rate. Measured by bench/multirow_cold.py (cold, file-mapped
# weights, 1 thread, vnni512, CPU ms per call, arms interleaved, load 0.9:
# results/multirow_cold.json), one row x 8 positions -> two rows x 4:
#   f32 49152x576 T=8 6.84 -> 4.33, 1536x576 0.267 -> 0.141, 5632x2048 3.93 -> 2.87 (T=4 1.3-1.9x)
#   i8  49152x576 T=8 3.08 -> 2.36, 5632x2048 1.19 -> 0.91
#   q4  49152x576 T=8 4.58 -> 3.78, 5632x2048 1.95 -> 1.41
# (T = 1 and 2 run the code they ran before; their arms differed by up to 15%: the noise.)
# q4 at T=4 ran 0.95x with it (one row stays there); bf16 (64 accumulators a position, PT = 4)
# keeps one row: two would not fit the registers. Below 4 positions two rows ran 0.75-1.1x.
# Not kept (results/multirow_cold_arms.json):
# three rows or four (x 2 positions), groups of 3, no better than 2 x 4; longer prefetch
# distances (16 KB: 1.33x at f32 49152x576 T=8 in one run, 0.91-0.98x in two others; 8-64 KB
# none steady) and prefetch to L2 (locality 2: 0.87x); ROWS_PER_TASK 8 or 64: +-3%.
# Hot weights (in L2) gain less: T=8 1.06-1.25x. Each row of a walk prefetches at `_lead` (the
# next walk's same row when two rows are longer than PREFETCH): f32 5632x2048 T=4 1.98 -> 1.60
# ms, T=8 3.25 -> 3.06, 49152x576 T=8 4.55 -> 4.37 against one stream's distance (load 1.3,
# results/multirow_cold_arms.json, run "multi_lead"); i8 and q4 rows are shorter than their
# distance there, so nothing changes.
TILE_MIN_T = {"f32": 4, "i8": 4, "q4": 5, "bf16": MAX_T + 1}
# Where a CPU's own measurement shows the tile losing, its first tiled T by the CPU name LLVM gives
# the compile target. AMD Zen 4 (znver4; bench/multirow_cold.py, cold, 1 thread, load 0.4-0.6,
# results/multirow_cold_zen4_f32*.json and _i8_q4.json): f32 one row ran 1.3-1.5x faster than two
# side by side at 4 and 5 positions on SmolLM2's shapes but the down projection (0.91-0.96x), a
# layer's products 1.08x at 6, level at 7 and 8 (two rows kept there); i8 one row 1.10-1.22x at
# 4 positions, two rows 1.0-1.15x at 5 and 8. Bytes do not depend on the tile
# (tests/test_rows_multi.py).
# AMD Zen 3 (znver3, AVX2 path: 16 vector registers; the same bench, 3 rounds, load 0.3-0.7,
# results/multirow_cold_zen3.json, one row against the tiles as built before): one row walks
# faster at 8 positions in every kind (f32 1.04-1.25x, i8 0.98-1.14x, q4 1.29-1.45x on SmolLM2's
# five shapes) and at 5 (f32 0.87-1.10x, i8 1.01-1.15x, q4 1.17-1.25x); at 3 and 4 f32 and i8 lie
# within the noise of one another (0.93-1.17x). So no pass tiles there. The tiles' bytes are
# tested with explicit options (tests/test_rows_multi.py), whatever a CPU's rule.
TILE_MIN_T_BY_CPU = {"znver4": {"f32": 7, "i8": 5}, "znver3": {"f32": MAX_T + 1, "i8": MAX_T + 1, "q4": MAX_T + 1}}
TILE_GROUP = 4


def tile_min_t(kind: str, cpu: str | None = None) -> int:
    """The fewest positions at which a ``kind`` pass walks two weight rows side by side on
    ``cpu`` (default: the compile target's): the CPU's entry in TILE_MIN_T_BY_CPU, else
    TILE_MIN_T[kind]."""
    table = TILE_MIN_T_BY_CPU.get(target_cpu() if cpu is None else cpu, {})
    return int(table.get(kind, TILE_MIN_T[kind]))


def _tile(kind, Tc, rows=None, group=None):
    """(weight rows side by side, positions per walk) of a ``kind`` pass over ``Tc`` positions;
    ``rows`` and ``group``, when given, override the rule (benches)."""
    tiled = Tc >= tile_min_t(kind)
    R = rows if rows is not None else (2 if tiled else 1)
    G = group if group is not None else (TILE_GROUP if tiled else Tc)
    if R < 1 or G < 1:
        raise ValueError(f"a tile needs at least one row and one position, got rows={R} group={G}")
    return R, min(G, Tc)


def _walk_rows(builder, o0, o1, R, walk):
    """``walk(o, R)`` over rows o0 .. o1 - 1, R at a time, then ``walk(o, 1)`` over the last
    (o1 - o0) % R rows."""
    n = builder.sub(o1, o0)
    if R == 1:
        with cgutils.for_range(builder, n) as rl:
            walk(builder.add(o0, rl.index), 1)
        return
    cR = ir.Constant(n.type, R)
    nr = builder.sdiv(n, cR)
    with cgutils.for_range(builder, nr) as rl:
        walk(builder.add(o0, builder.mul(rl.index, cR)), R)
    last = builder.add(o0, builder.mul(nr, cR))
    with cgutils.for_range(builder, builder.sub(n, builder.mul(nr, cR))) as rl:
        walk(builder.add(last, rl.index), 1)


def _lead(builder, pf, R, rowlen, pair_lead=True):
    """The prefetch distance (elements) of each row of an R-row walk: ``pf``, or, when two or
    more rows are walked side by side and R rows are longer than ``pf``, R rows (the same
    offset of the same row in the next walk). Along one stream at ``pf``, the start of a walk's
    second row would be asked for only as its first row ends, after it is needed."""
    c = ir.Constant(rowlen.type, pf)
    if R == 1 or not pair_lead:
        return c
    span = builder.mul(rowlen, ir.Constant(rowlen.type, R))
    return builder.select(builder.icmp_signed(">", span, c), span, c)


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
        s0 = scale_f32(sw[2 * c]) * xd[2 * c]
        s1 = scale_f32(sw[2 * c + 1]) * xd[2 * c + 1] if n == 16 else F32(0.0)
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


@njit
def _i8_dots_plain(Q, S, o0, o1, XQ, XD, XC, t0, Y):
    for o in range(o0, o1):
        for t in range(t0, min(XQ.shape[0], t0 + MAX_T)):
            Y[t, o] = _i8_dot_plain(Q[o], S[o], XQ[t], XD[t], XC[t])


@njit
def _q4_dots_plain(QS, D, M, table, o0, o1, XQ, XD, XS, t0, Y):
    for o in range(o0, o1):
        for t in range(t0, min(XQ.shape[0], t0 + MAX_T)):
            Y[t, o] = _q4_dot_plain(QS[o], D[o], M[o], table, XQ[t], XD[t], XS[t])


_DOTS: dict[tuple[str, str], object] = {}


def dot(kind: str, path: str):
    """The several-positions row dots of ``kind`` ('i8' | 'q4') on ``path`` (numba-callable)."""
    key = (kind, path)
    if key not in _DOTS:
        if path == "plain":
            _DOTS[key] = _i8_dots_plain if kind == "i8" else _q4_dots_plain
        elif not available(path):
            raise ValueError(f"the compile target lacks {', '.join(NEEDS[path])}: path {path!r} cannot run")
        else:
            _DOTS[key] = (_make_i8_dots if kind == "i8" else _make_q4_dots)(path)
    return _DOTS[key]


# --------------------------------------------------------------------------------------------
# row kernels over a whole weight: one output element per (token, row), each by one thread;
# every position of a pass (up to MAX_T) shares each load of a row
def _make_rows_i8(dots, parallel):
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
            for t0 in range(0, T, MAX_T):
                dots(Q, S, k * rpt, min(O, (k + 1) * rpt), XQ, XD, XC, t0, Y)

    return rows


def _make_rows_q4(dots, parallel):
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
            for t0 in range(0, T, MAX_T):
                dots(QS, D, M, table, k * rpt, min(O, (k + 1) * rpt), XQ, XD, XS, t0, Y)

    return rows


# Several weights against one activation (q/k/v, gate/up): one launch, the activation quantized
# once, tasks of ``rpt`` rows laid end to end over the weights. Each output element is the same
# row dot as `rows_kernel` computes, by one thread: the bytes equal one call per weight.
def _make_group_i8(dots, parallel):
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
            k0 = k - starts[i]
            for t0 in range(0, T, MAX_T):
                dots(Qs[i], Ss[i], k0 * rpt, min(rows_of[i], (k0 + 1) * rpt), XQ, XD, XC, t0, Ys[i])

    return group


def _make_group_q4(dots, parallel):
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
            k0 = k - starts[i]
            for t0 in range(0, T, MAX_T):
                dots(QSs[i], Ds[i], Ms[i], table, k0 * rpt, min(rows_of[i], (k0 + 1) * rpt), XQ, XD, XS, t0, Ys[i])

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
# Team kernels: the group kernels' products called by every thread of ONE parallel region (a
# fused layer's, vindex3.exec.ops.fused_source), each thread taking row tasks from counters
# instead of receiving a fixed share, then waiting until every task is done. The tasks (the group
# kernels' ``rpt``-row tasks, laid end to end over the weights) are cut into ``nt`` contiguous
# shares; the k-th thread to arrive owns share k and takes its tasks one at a time from the front,
# so each thread streams one long run of adjacent rows, as a static split would; a thread that has
# finished its own share then takes the others' remaining tasks from their back, so a thread that
# joins late, or is descheduled, leaves its work to the others instead of holding the region.
# A share's counter packs the tasks taken from its front (low 32 bits) and from its back (high
# 32), so one atomic add decides who gets the last task. Each row's dot is the same call on the
# same rows as the group kernel's: the bytes equal the group kernel's whatever thread ran a task
# (tests/test_team.py). Why shares: the guided claims this replaced (a claim took 1 / (2 x
# threads) of the tasks left, from one shared counter) broke each thread's stream into runs of a
# few tasks, each starting cold; the int8 products of all SmolLM2 layers at 2 threads, spinning
# workers, a region per product, took 4.4-4.6 ms with them, 3.65 with shares, 3.2-3.3 with fixed
# halves (ad hoc, Zen 4, load ~1; docs/container.md has the whole decode before and after). ``ctl`` holds the counters (vindex3.codecs.atomics): phase ``p``'s arrivals at
# slot ``2p``, its finished tasks at ``2p + 1``, share s's counter at slot ``16 + p * nt + s``
# (vindex3.codecs.threads `team_ctl_len`); ``nt`` is the region's thread count.
_FRONT = np.int64(1)
_BACK = np.int64(1) << 32
_LOW = (np.int64(1) << 32) - 1


@njit(inline="always")
def _share(ntask, s, nt):  # pragma: no cover - compiled
    """Tasks lo .. hi - 1 of share s."""
    return ntask * s // nt, ntask * (s + 1) // nt


@njit(inline="always")
def _take(ctl, word, length, back):  # pragma: no cover - compiled
    """One task of a share of ``length`` tasks: its offset from the share's start, or -1 when
    none is left; from the front (the owner) or the back (the others)."""
    old = _A.fetch_add(ctl, word, _BACK if back else _FRONT)
    front = old & _LOW
    behind = old >> 32
    if front + behind >= length:
        return -1
    return length - 1 - behind if back else front


@njit(inline="always")
def _claimed(starts, rows_of, i, k, k1, rpt):  # pragma: no cover - compiled
    """Rows of weight i in the claimed tasks k .. k1 - 1 (o0 >= o1: none)."""
    a = max(k, starts[i])
    b = min(k1, starts[i + 1])
    return (a - starts[i]) * rpt, min(rows_of[i], (b - starts[i]) * rpt)


# How a team calls its dots for rows o0 .. o1 - 1 of weight i: ``ws`` the weights' arrays (a
# tuple of tuples, one tuple per array of the encoding), ``xs`` the activation's (float: X; q8:
# its quantized arrays, q4's f16 table first)
def _call_float(dots):
    @njit(inline="always")
    def call(ws, i, o0, o1, xs, t0, Y):  # pragma: no cover - compiled
        dots(ws[0][i], o0, o1, xs[0], t0, Y)

    return call


def _call_i8(dots):
    @njit(inline="always")
    def call(ws, i, o0, o1, xs, t0, Y):  # pragma: no cover - compiled
        dots(ws[0][i], ws[1][i], o0, o1, xs[0], xs[1], xs[2], t0, Y)

    return call


def _call_q4(dots):
    @njit(inline="always")
    def call(ws, i, o0, o1, xs, t0, Y):  # pragma: no cover - compiled
        dots(ws[0][i], ws[1][i], ws[2][i], xs[0], o0, o1, xs[1], xs[2], xs[3], t0, Y)

    return call


def _make_team(call, PT):
    @njit
    def team(ws, xs, Ys, rpt, ctl, p, nt):
        """Ys[i][t, o] = row o of weight i . the activation, the row tasks shared by the region's
        threads (``PT`` positions a pass over a task's rows)."""
        T = Ys[0].shape[0]
        n = len(Ys)
        rows_of = np.empty(n, np.int64)
        for i in range(n):
            rows_of[i] = Ys[i].shape[1]
        starts = _task_starts(n, rows_of, rpt)
        ntask = starts[n]
        c = 2 * p * _A.SLOT
        me = _A.fetch_add(ctl, c, 1) % nt  # arrival order: the share this thread owns
        done = 0
        for j in range(nt):
            sh = (me + j) % nt
            lo, hi = _share(ntask, sh, nt)
            word = (16 + p * nt + sh) * _A.SLOT
            while True:
                off = _take(ctl, word, hi - lo, j > 0)
                if off < 0:
                    break
                k = lo + off
                for i in range(n):
                    o0, o1 = _claimed(starts, rows_of, i, k, k + 1, rpt)
                    if o0 < o1:
                        for t0 in range(0, T, PT):
                            call(ws, i, o0, o1, xs, t0, Ys[i])
                done += 1
        _A.fetch_add(ctl, c + _A.SLOT, done)
        _A.wait_for(ctl, c + _A.SLOT, ntask)

    return team


def _make_team_rows(kind, team):
    """One weight's product as a team (numba's pool: one region, tasks claimed; see above)."""
    if kind in FLOAT_GEOMETRY:
        @njit(parallel=True)
        def rows(W, X, Y, rpt, nt, ctl):
            for _ in prange(nt):
                team(((W,),), (X,), (Y,), rpt, ctl, 0, nt)
    elif kind == "i8":
        @njit(parallel=True)
        def rows(Q, S, X, Y, rpt, nt, ctl):
            XQ, XD, XC, XS = q8_buffers(X)
            quantize_x(X, XQ, XD, XC, XS)
            for _ in prange(nt):
                team(((Q,), (S,)), (XQ, XD, XC), (Y,), rpt, ctl, 0, nt)
    else:
        @njit(parallel=True)
        def rows(QS, D, M, table, X, Y, rpt, nt, ctl):
            XQ, XD, XC, XS = q8_buffers(X)
            quantize_x(X, XQ, XD, XC, XS)
            for _ in prange(nt):
                team(((QS,), (D,), (M,)), (table, XQ, XD, XS), (Y,), rpt, ctl, 0, nt)
    return rows


_TEAM_ROWS: dict[tuple[str, str], object] = {}


def team_rows(kind: str, *arrays, path: str | None = None) -> None:
    """``arrays`` (the weight's arrays as `rows_kernel` / `float_kernel` take them, then X and Y)
    multiplied as a team of `threads.numba_count()` threads: the rows kernel's bytes. The counters
    are zeroed here and passed in, not zeroed in the compiled function that holds the region
    (vindex3.exec.ops.fused_source's team layer says why)."""
    from . import threads

    key = (kind, "vector" if kind in FLOAT_GEOMETRY else (chosen() if path is None else path))
    if key not in _TEAM_ROWS:
        _TEAM_ROWS[key] = _make_team_rows(kind, team_kernel(kind, key[1]))
    nt = threads.numba_count()
    _TEAM_ROWS[key](*arrays, ROWS_PER_TASK, nt, np.zeros(threads.team_ctl_len(nt, 1), np.int64))


_TEAMS: dict[tuple[str, str], object] = {}
TEAM_KINDS = ("f32", "bf16", "i8", "q4")


def team_kernel(kind: str, path: str | None = None):
    """The team kernel of ``kind`` ('f32' | 'bf16': the ``vector`` float dots; 'i8' | 'q4': the
    q8 dots on ``path``, default `chosen()`): ``team(ws, xs, Ys, rpt, ctl, p, nt)``, called by
    every thread of one region (see above; ``ws`` and ``xs`` as `_call_float` / `_call_i8` /
    `_call_q4` read them)."""
    if kind not in TEAM_KINDS:
        raise ValueError(f"no team kernel for {kind!r} (known: {', '.join(TEAM_KINDS)})")
    key = (kind, "vector" if kind in FLOAT_GEOMETRY else (chosen() if path is None else path))
    if key not in _TEAMS:
        if kind in FLOAT_GEOMETRY:
            L, PT = FLOAT_GEOMETRY[kind]
            _TEAMS[key] = _make_team(_call_float(_make_float_dots(kind, L, PT)), PT)
        else:
            _TEAMS[key] = _make_team((_call_i8 if kind == "i8" else _call_q4)(dot(kind, key[1])), MAX_T)
    return _TEAMS[key]


def _tree_halves(builder, v, n):
    """v (<n x float>) summed as the tree of halves: v[i] + v[i + n/2], ... down to one."""
    while n > 1:
        lo, hi = _split(builder, v, n // 2)
        v = builder.fadd(lo, hi)
        n //= 2
    return builder.extract_element(v, ir.Constant(_i32, 0))


# --------------------------------------------------------------------------------------------
# float rows (f32 and bf16 weights times float32 x), several positions per pass over a row.
# Per position, ``lanes`` float32 accumulators: acc[i] = acc[i] + w[cL + i] * x[cL + i] chunk
# by chunk (L = lanes; a product rounded, then a sum rounded: no fused multiply-add), the
# tail elements K - K % L .. K - 1 going to lanes 0 .. K % L - 1 in order, then the tree of
# halves L -> L/2 -> ... -> 1. Written as LLVM vector IR without fast-math flags, so LLVM
# cannot reorder it: the bytes are the same on every target (generic, haswell, the host) and
# equal those of the numba loops of `_make_float_dots_plain`.
VECTOR = 16  # lanes per IR vector operation (one 512-bit register; 8 measured no faster)
F32_LANES = 32  # two 512-bit registers per position: 8 positions keep 16 in registers
BF16_LANES = 64  # the order bf16 products had before positions shared a pass: bytes unchanged


def _make_float_dots(kind: str, L: int, PT: int, pf=None, locality=3, rows=None, group=None, pair_lead=True):
    """dots(W, o0, o1, X, t0, Y): Y[t, o] = W[o] . X[t] for rows o0 .. o1 - 1 and positions
    t = t0 .. min(T, t0 + PT) - 1. W [O, K] float32, or uint16 bf16 bit patterns widened in
    registers; X [T, K], Y [T, O] float32; all C-contiguous. One load of each chunk of a row
    serves every position (of a group); the row loop is in the IR, so a row costs no call.
    ``pf``: prefetch distance in bytes (default prefetch_distance(kind, T); 0: none); ``locality``: the
    prefetch's cache-level hint. ``rows``: weight rows walked side by side in one loop (each
    chunk of X then serves them all); ``group``: positions per walk over those rows (the next
    group walks the same rows again, from the L1); both default to `_tile`'s rule. Every
    (row, position) keeps its own accumulators in the one-position order: no option changes a
    byte."""
    bf16 = kind == "bf16"
    esize = 2 if bf16 else 4

    @intrinsic
    def dots(typingctx, W, o0, o1, X, t0, Y):
        _check_multi(f"{kind} dots", (), (W, X), Y, t0, o0)
        _check_multi(f"{kind} dots", (), (), Y, o1, o1)
        sig = types.void(W, o0, o1, X, t0, Y)

        def codegen(context, builder, sig, args):
            aw, aX, aY = _arrays_at(context, builder, sig, args, (0, 3, 5))
            o0v, o1v, t0v = (_int_arg(context, builder, sig.args[i], args[i]) for i in (1, 2, 4))
            K = builder.extract_value(aw.shape, 1)
            T = builder.extract_value(aX.shape, 0)
            O = builder.extract_value(aY.shape, 1)
            VW = min(L, VECTOR)
            P = L // VW
            vf = _vec(_f32, VW)
            cL = ir.Constant(K.type, L)
            c = lambda v: ir.Constant(K.type, v)
            px = builder.gep(aX.data, [builder.mul(t0v, K)])
            py = builder.gep(aY.data, [builder.mul(t0v, O)])
            nchunk = builder.udiv(K, cL)
            base = builder.mul(nchunk, cL)
            rem = builder.sub(K, base)
            zero = ir.Constant(vf, 0.0)

            def wvec(pw, off):
                if not bf16:
                    return _load(builder, pw, off, vf)
                hv = _load(builder, pw, off, _vec(_i16, VW))
                return builder.bitcast(builder.shl(builder.zext(hv, _vec(_i32, VW)), _consts(_i32, [16] * VW)), vf)

            def wone(pw, i):
                v = builder.load(builder.gep(pw, [i]))
                if not bf16:
                    return v
                return builder.bitcast(builder.shl(builder.zext(v, _i32), ir.Constant(_i32, 16)), _f32)

            def emit(Tc):
                rowoff = [builder.mul(c(t), K) for t in range(Tc)]
                youts = [builder.mul(c(t), O) for t in range(Tc)]
                Rt, G = _tile(kind, Tc, rows, group)
                pft = prefetch_distance(kind, Tc) if pf is None else pf
                # a (row, position)'s L accumulators as P vectors of VW lanes (vector p: lanes p*VW ..)
                accs = {R: [[[cgutils.alloca_once_value(builder, zero) for _ in range(P)] for _ in range(G)]
                            for _ in range(R)] for R in {Rt, 1}}

                def walk(o, R):  # rows o .. o + R - 1, every position, group by group
                    pws = [builder.gep(aw.data, [builder.mul(builder.add(o, c(r)), K)]) for r in range(R)]
                    lead = _lead(builder, pft // esize, R, K, pair_lead)
                    for g0 in range(0, Tc, G):
                        ts = list(range(g0, min(Tc, g0 + G)))
                        acc = [[accs[R][r][t - g0] for t in ts] for r in range(R)]
                        for ar in acc:
                            for at in ar:
                                for a in at:
                                    builder.store(zero, a)
                        with cgutils.for_range(builder, nchunk) as loop:
                            off = builder.mul(loop.index, cL)
                            if pft and g0 == 0:
                                for pw in pws:
                                    for q in range(0, L * esize, 64):  # each line of the chunk
                                        _prefetch(builder, pw, builder.add(off, builder.add(lead, c(q // esize))), locality)
                            for p in range(P):
                                offp = builder.add(off, c(p * VW))
                                wvs = [wvec(pw, offp) for pw in pws]
                                for j, t in enumerate(ts):
                                    xv = _load(builder, px, builder.add(offp, rowoff[t]), vf)
                                    for r in range(R):
                                        a = acc[r][j][p]
                                        builder.store(builder.fadd(builder.load(a), builder.fmul(wvs[r], xv)), a)
                        with cgutils.for_range(builder, rem) as loop:  # the tail: lanes 0 .. rem - 1
                            i = builder.add(base, loop.index)
                            lane = builder.urem(loop.index, c(VW))
                            part = builder.udiv(loop.index, c(VW))
                            for r in range(R):
                                wi = wone(pws[r], i)
                                for j, t in enumerate(ts):
                                    xi = builder.load(builder.gep(px, [builder.add(i, rowoff[t])]))
                                    prod = builder.fmul(wi, xi)
                                    for p in range(P):
                                        with builder.if_then(builder.icmp_unsigned("==", part, c(p))):
                                            v = builder.load(acc[r][j][p])
                                            a = builder.fadd(builder.extract_element(v, lane), prod)
                                            builder.store(builder.insert_element(v, a, lane), acc[r][j][p])
                        for r in range(R):
                            orow = builder.add(o, c(r))
                            for j, t in enumerate(ts):
                                parts = [builder.load(a) for a in acc[r][j]]
                                while len(parts) > 1:  # the first levels of the tree of halves
                                    h = len(parts) // 2
                                    parts = [builder.fadd(parts[i], parts[i + h]) for i in range(h)]
                                res = _tree_halves(builder, parts[0], VW)
                                builder.store(res, builder.gep(py, [builder.add(youts[t], orow)]))

                _walk_rows(builder, o0v, o1v, Rt, walk)

            _per_T(builder, _tn(builder, T, t0v, PT), emit, PT)
            return context.get_dummy_value()

        return sig, codegen

    return dots


@njit(inline="always")
def _w_f32(w, j):
    return w[j]


@njit(inline="always")
def _w_bf16(w, j):
    b = np.empty(1, np.uint32)
    b[0] = np.uint32(w[j]) << np.uint32(16)
    return b.view(F32)[0]


def _make_float_dots_plain(kind: str, L: int, PT: int):
    """`_make_float_dots` in numba loops (no fastmath): the same order, the same bytes."""
    wget = _w_bf16 if kind == "bf16" else _w_f32

    @njit
    def dots(W, o0, o1, X, t0, Y):
        K = W.shape[1]
        tn = min(PT, X.shape[0] - t0)
        acc = np.empty(L, F32)
        for o in range(o0, o1):
            w = W[o]
            for t in range(t0, t0 + tn):
                for i in range(L):
                    acc[i] = F32(0.0)
                for j in range(K):
                    acc[j % L] = acc[j % L] + wget(w, j) * X[t, j]
                n = L // 2
                while n >= 1:
                    for i in range(n):
                        acc[i] = acc[i] + acc[i + n]
                    n //= 2
                Y[t, o] = acc[0]

    return dots


def _make_rows_float(dots, PT, parallel):
    @njit(parallel=parallel)
    def rows(W, X, Y, rpt):
        """Y[t, o] = W[o] . X[t] in the documented order."""
        O = W.shape[0]
        T = X.shape[0]
        ntask = (O + rpt - 1) // rpt
        for k in prange(ntask):
            for t0 in range(0, T, PT):
                dots(W, k * rpt, min(O, (k + 1) * rpt), X, t0, Y)

    return rows


def _make_group_float(dots, PT, parallel):
    @njit(parallel=parallel)
    def group(Ws, X, Ys, rpt):
        """Ys[i][t, o] = Ws[i][o] . X[t]: the rows kernel on each weight, in one launch."""
        T = X.shape[0]
        n = len(Ws)
        rows_of = np.empty(n, np.int64)
        for i in range(n):
            rows_of[i] = Ws[i].shape[0]
        starts = _task_starts(n, rows_of, rpt)
        for k in prange(starts[n]):
            i = _which(starts, k)
            k0 = k - starts[i]
            for t0 in range(0, T, PT):
                dots(Ws[i], k0 * rpt, min(rows_of[i], (k0 + 1) * rpt), X, t0, Ys[i])

    return group


_FLOAT: dict[tuple, object] = {}
# accumulators per position, and positions per pass over a task's rows (their accumulators
# fit the 32 vector registers; more positions take another pass over rows still in L1)
FLOAT_GEOMETRY = {"f32": (F32_LANES, 8), "bf16": (BF16_LANES, 4)}


def float_kernel(kind: str, path: str = "vector", parallel: bool = False, group: bool = False, geometry=None):
    """The rows kernel (``group``: the several-weights kernel) of ``kind`` ('f32' | 'bf16') on
    ``path``: ``vector`` (LLVM vector IR, any target) or ``plain`` (numba loops), the same bytes."""
    L, PT = FLOAT_GEOMETRY[kind] if geometry is None else geometry
    key = (kind, path, parallel, group, L, PT)
    if key not in _FLOAT:
        if path not in ("vector", "plain"):
            raise ValueError(f"unknown {kind} dot path {path!r} (known: vector, plain)")
        dots = _make_float_dots(kind, L, PT) if path == "vector" else _make_float_dots_plain(kind, L, PT)
        _FLOAT[key] = (_make_group_float if group else _make_rows_float)(dots, PT, parallel)
    return _FLOAT[key]


def rows_bf16(path: str = "vector", parallel: bool = False):
    """The bf16 rows kernel (H [O, K] uint16 bit patterns): `float_kernel` ('bf16')."""
    return _float_checked("bf16", path, parallel, False)


def group_bf16(path: str = "vector", parallel: bool = False):
    """`rows_bf16` over a tuple of weights (their bit patterns) and one activation, one launch."""
    return _float_checked("bf16", path, parallel, True)


def _float_checked(kind, path, parallel, group):
    if path not in ("vector", "plain"):
        raise ValueError(f"unknown {kind} dot path {path!r} (known: vector, plain)")
    return float_kernel(kind, path, parallel, group)
