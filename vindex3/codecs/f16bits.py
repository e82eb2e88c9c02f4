"""IEEE half-precision bit patterns (uint16) to float32, exactly: LLVM's ``fpext`` where the
compile target has F16C (one ``vcvtph2ps``), else integer operations (no library call, which
numba's JIT could not link on a target without F16C). Both give numpy's float16 -> float32, so
the value is the same on every target (bar NaN payloads, which F16C quiets).

``h2f_ir`` emits the conversion for an LLVM i16 or <n x i16> value (the kernels' intrinsics);
``scale_f32`` is the same for numba code: float32 in, the same float32 out; uint16 in, the value
its half-precision bits hold. A kernel written over ``scale_f32(S[o, b])`` therefore serves
float32 scales and half-precision scales with one source (vindex3/codecs/int8.py, int8h).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core.errors import TypingError
from numba.extending import intrinsic

_I32 = ir.IntType(32)
_F32 = ir.FloatType()


def _has_f16c() -> bool:
    from .intrinsics import target_features

    return "f16c" in target_features()


def h2f_ir(builder: ir.IRBuilder, h: ir.Value) -> ir.Value:
    """float (or <n x float>) holding the half-precision value of i16 (or <n x i16>) ``h``:
    ``fpext`` where the target has F16C; else normal numbers by moving the fields (exponent +
    112), subnormals as m x 2^-24 (exact in float32), zeros signed, infinities and NaNs with
    their payload shifted as numpy does. (Without F16C, the integer form measured 0.89x the
    int8 decode at one thread on Zen 4: it runs once per two blocks of every row.)"""
    n = h.type.count if isinstance(h.type, ir.VectorType) else None
    fty = ir.VectorType(_F32, n) if n else _F32
    if _has_f16c():
        hty = ir.VectorType(ir.HalfType(), n) if n else ir.HalfType()
        return builder.fpext(builder.bitcast(h, hty), fty)
    ity = ir.VectorType(_I32, n) if n else _I32

    def k(v, ty=ity):
        return ir.Constant(ty, [v] * n) if n else ir.Constant(ty, v)

    x = builder.zext(h, ity)
    sign = builder.shl(builder.and_(x, k(0x8000)), k(16))
    e = builder.and_(builder.lshr(x, k(10)), k(31))
    m = builder.and_(x, k(1023))
    mant = builder.shl(m, k(13))
    normal = builder.or_(builder.shl(builder.add(e, k(112)), k(23)), mant)
    special = builder.or_(k(0x7F800000), mant)
    sub = builder.bitcast(builder.fmul(builder.uitofp(m, fty), k(2.0**-24, fty)), ity)
    bits = builder.select(builder.icmp_unsigned("==", e, k(0)), sub,
                          builder.select(builder.icmp_unsigned("==", e, k(31)), special, normal))
    return builder.bitcast(builder.or_(bits, sign), fty)


@intrinsic
def scale_f32(typingctx, v):
    """float32(v) for a float32 ``v`` (unchanged); the float32 value of the half-precision bits
    of a uint16 ``v``."""
    if v == types.float32:
        def codegen(context, builder, sig, args):
            return args[0]
    elif v == types.uint16:
        def codegen(context, builder, sig, args):
            return h2f_ir(builder, args[0])
    else:
        raise TypingError(f"scale_f32: a scale is float32 or uint16 (half-precision bits), got {v}")
    return types.float32(v), codegen
