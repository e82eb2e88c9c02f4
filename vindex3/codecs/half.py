"""bf16 and f16: 16-bit floats, two bytes per weight, little-endian, C order (one section).

Reading is exact widening: every bf16 and every f16 value (including subnormals, infinities
and NaN payloads) is a float32 value, and ``dense()``/``take()``/the kernels produce exactly
it. Writing rounds float32 to nearest, ties to even. A finite float32 that the 16-bit format
cannot hold (|x| beyond its largest finite value, 65504 for f16) is refused by name instead
of silently becoming infinity."""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedEncoding
from . import threads
from .base import Codec, WeightShapeError, register
from .rowwise import F32, RowWeight, rows_cols
from .threads import intdot, kernels

U16 = np.dtype("<u2")


class Half(RowWeight):
    """[..., in] 16-bit patterns ``h`` (uint16 [rows, in])."""

    def __init__(self, h: np.ndarray, shape: tuple[int, ...]):
        super().__init__(shape, h.nbytes)
        self.h = h  # [rows, in] uint16

    _special: int  # the exponent bits that mark infinity and NaN

    def _sub(self, r0, r1, shape):
        return type(self)(self.h[r0:r1], shape)

    def nonfinite(self) -> int:
        """Elements whose exponent bits are all ones (infinity or NaN), counted in bounded chunks."""
        flat = self.h.reshape(-1)
        mask = np.uint16(self._special)
        bad = 0
        for i in range(0, flat.size, 1 << 22):
            bad += int(np.count_nonzero((flat[i : i + (1 << 22)] & mask) == mask))
        return bad


class BF16Weight(Half):
    encoding = "bf16"
    fused_kind = "bf16"
    _special = 0x7F80

    def _rows(self, x, y):
        # widened in registers, 64 accumulators and a fixed tree (vindex3.codecs.intrinsics):
        # about 2x the rate of widening the row into L1 scratch first (kernels.rows_bf16, still
        # used by f16; bench/intdot_kernels.py), and an order of additions that no target,
        # thread count or number of activation rows changes (the rows share each load of W).
        I = intdot()
        if threads.team(self.h.nbytes):
            I.team_rows("bf16", self.h, x, y)
        else:
            I.rows_bf16("vector", threads.parallel(self.h.nbytes))(self.h, x, y, I.ROWS_PER_TASK)

    @classmethod
    def _group_rows(cls, weights):
        H = tuple(w.h for w in weights)
        nbytes = sum(h.nbytes for h in H)
        if not threads.one_array_type(H):
            return None  # a numba tuple indexed at run time holds one array type

        def run(x, ys):
            I = intdot()
            I.group_bf16("vector", threads.parallel(nbytes))(H, x, ys, I.ROWS_PER_TASK)

        return run

    def _decode(self, rows, out):
        from . import kernels as K

        K.decode_bf16(self.h, rows, out.view(np.uint32))


class F16Weight(Half):
    encoding = "f16"
    _special = 0x7C00

    def _rows(self, x, y):
        K = kernels()
        K.rows_f16(self.h, x, y, K.ROWS_PER_TASK)

    def _decode(self, rows, out):
        from . import kernels as K

        K.decode_f16(self.h, rows, out.view(np.uint32), out)


class _HalfCodec(Codec):
    bits_per_weight = 16.0
    weight_class: type[Half]

    def nbytes(self, shape):
        r, c = rows_cols(tuple(shape), self.name)
        return 2 * r * c

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        r, c = rows_cols(shape, self.name)
        if raw.dtype != np.uint8 or raw.ndim != 1 or raw.shape[0] != 2 * r * c:
            raise WeightShapeError(
                f"{self.name} tensor of shape {list(shape)} needs {2 * r * c} bytes, got {raw.shape} {raw.dtype}"
            )
        return self.weight_class(raw.view(U16).reshape(r, c), shape)

    def _bits(self, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _widen_np(self, h: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def encode(self, arr):
        a = np.ascontiguousarray(arr, dtype=F32)
        h = self._bits(a).astype(U16, copy=False)
        bad = np.isfinite(a.reshape(-1)) & ~np.isfinite(self._widen_np(h))
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise UnsupportedEncoding(
                f"encoding {self.name!r} cannot hold the value {float(a.reshape(-1)[i])!r} "
                f"(element {i}): it is beyond the format's largest finite value"
            )
        return h.reshape(-1).view(np.uint8)


class BF16Codec(_HalfCodec):
    """bfloat16: the upper 16 bits of a float32 (sign, 8 exponent bits, 7 mantissa bits)."""

    name = "bf16"
    represent_target = True
    weight_class = BF16Weight

    def _bits(self, a):
        u = a.reshape(-1).view(np.uint32).astype(np.uint64)
        # round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate
        r = ((u + np.uint64(0x7FFF) + ((u >> np.uint64(16)) & np.uint64(1))) >> np.uint64(16)).astype(np.uint32)
        nan = np.isnan(a.reshape(-1))
        # a NaN keeps its sign and top payload bits and is made quiet (never rounds to infinity)
        r[nan] = (u[nan] >> np.uint64(16)).astype(np.uint32) | np.uint32(0x0040)
        return r.astype(np.uint16)

    def _widen_np(self, h):
        return (h.astype(np.uint32) << np.uint32(16)).view(F32)


class F16Codec(_HalfCodec):
    """IEEE 754 binary16 (sign, 5 exponent bits, 10 mantissa bits)."""

    name = "f16"
    represent_target = True
    weight_class = F16Weight

    def _bits(self, a):
        with np.errstate(over="ignore"):
            return a.reshape(-1).astype(np.float16).view(np.uint16)  # round to nearest even

    def _widen_np(self, h):
        return h.view(np.float16).astype(F32)


register(BF16Codec())
register(F16Codec())
