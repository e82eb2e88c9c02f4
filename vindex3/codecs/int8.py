"""int8: symmetric 8-bit codes with one float32 scale per block of 32 codes along the last
dimension (9 bits per weight). `Int8RowCodec` (one float32 scale per row, 8 + 32/in bits; not
registered) is kept for the measurement in bench/codecs_fidelity.py and bench/codecs_gemv.py
that chose per-block: on SmolLM2 per-row scales cost 4x the KL (p50) and top-1 agreement of
0.969 instead of 1.000; per-block costs 12% more bytes and 1.4-1.6x the per-row kernel's CPU
time (docs/representations-notes.md).

Quantization of a group g (a block, or a row): d = max|w_g| / 127 (float32), q = round(w / d)
to nearest, ties to even, clipped to [-127, 127]; a group of zeros has d = 0 and q = 0.
Dequantization: w' = float32(q) * d. Non-finite weights are refused by name, and so is a last
dimension that is not a multiple of 32 (per-block only).

int8h: the same codes with each block's scale in half precision (8.5 bits per weight: the bytes
of GGUF's Q8_0, planar). d = float16(max|w_g| / 127) rounded to nearest; q = round(w / d) with
that stored d, ties to even, clipped to [-127, 127]; a block whose d rounds to 0 has q = 0; a
block whose d exceeds float16's range is refused by name. Dequantization: w' = float32(q) x
float32(d). Every kernel reads the scale through `vindex3.codecs.f16bits` (exact: F16C where the
target has it, integer operations elsewhere), so an int8h tensor multiplies bit for bit as the
int8 tensor holding the same codes and the float32 values of its scales (tests/test_int8h.py).

Bytes (sections 16-byte aligned from the tensor's start, see rowwise.py):
  int8       codes int8 [rows, in] | pad | scales <f4 [rows, in / 32]
  int8h      codes int8 [rows, in] | pad | scales <f2 [rows, in / 32] (half-precision bits)
  int8_row   codes int8 [rows, in] | pad | scales <f4 [rows]
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedEncoding
from . import threads
from .base import Codec, check_activations, register
from .rowwise import (
    F32,
    BlockCodec,
    RowWeight,
    join_sections,
    rows_cols,
    sections_nbytes,
    split_sections,
)
from .threads import intdot, kernels

BLOCK = 32  # the kernel indexes scales with j >> 5


class Int8Blocks(RowWeight):
    encoding = "int8"
    fused_kind = "i8"

    def __init__(self, q: np.ndarray, s: np.ndarray, shape):
        super().__init__(shape, sections_nbytes([q.nbytes, s.nbytes]))
        self.q = q  # [rows, in] int8
        self.s = s  # [rows, in / 32] float32

    def _rows(self, x, y):
        K = kernels()
        K.rows_i8_block_scale(self.q, self.s, x, y, K.ROWS_PER_TASK)

    def _decode(self, rows, out):
        from . import kernels as K

        K.decode_i8_block_scale(self.q, self.s, rows, out, BLOCK)

    def _sub(self, r0, r1, shape):
        return type(self)(self.q[r0:r1], self.s[r0:r1], shape)

    def nonfinite(self) -> int:
        from . import kernels as K

        return int(K.nonfinite_i8_block_scale(self.q, self.s, BLOCK)) if self.rows else 0

    def with_activations(self, mode):
        return _Q8[type(self)](self.q, self.s, self.shape) if check_activations(mode) == "q8" else self


class Int8BlocksQ8(Int8Blocks):
    """int8 blocks whose products quantize the activation per block of 32 and sum integer
    products (vindex3.codecs.intrinsics), at every T: a prefill's positions get the bytes each
    would get alone (tests/test_int_prefill.py); mm_t, gathers and dense() are unchanged."""

    activations = "q8"
    fused_kind = "i8q8"

    def _rows(self, x, y):
        I = intdot()
        if threads.team(self.q.nbytes):
            I.team_rows("i8", self.q, self.s, x, y)
        else:
            I.rows_kernel("i8", parallel=threads.parallel(self.q.nbytes))(self.q, self.s, x, y, I.ROWS_PER_TASK)

    def _tiles(self, x, y):
        # a prefill pass does T times a decode step's work: the pool's threshold (threads.parallel)
        # is weighed against weight bytes x positions
        from .inttiles import tiles_kernel

        with threads.launch():
            tiles_kernel("i8", parallel=threads.parallel(self.q.nbytes * x.shape[0]))(self.q, self.s, x, y, intdot().ROWS_PER_TASK)

    @classmethod
    def _group_rows(cls, weights):
        Q, S = tuple(w.q for w in weights), tuple(w.s for w in weights)
        nbytes = sum(q.nbytes for q in Q)
        if not (threads.one_array_type(Q) and threads.one_array_type(S)):
            return None  # a numba tuple indexed at run time holds one array type

        def run(x, ys):
            I = intdot()
            I.group_kernel("i8", parallel=threads.parallel(nbytes))(Q, S, x, ys, I.ROWS_PER_TASK)

        return run

    def with_activations(self, mode):
        return _EXACT[type(self)](self.q, self.s, self.shape) if check_activations(mode) == "exact" else self


class Int8HalfBlocks(Int8Blocks):
    """int8h: int8 blocks whose scales are uint16 half-precision bits [rows, in / 32]; every
    kernel is the int8 one (the scale is made float32 exactly where it is read)."""

    encoding = "int8h"
    fused_kind = "i8"


class Int8HalfBlocksQ8(Int8BlocksQ8):
    encoding = "int8h"
    fused_kind = "i8q8"


_Q8 = {Int8Blocks: Int8BlocksQ8, Int8HalfBlocks: Int8HalfBlocksQ8}
_EXACT = {Int8BlocksQ8: Int8Blocks, Int8HalfBlocksQ8: Int8HalfBlocks}


class Int8Rows(RowWeight):
    encoding = "int8_row"

    def __init__(self, q: np.ndarray, s: np.ndarray, shape):
        super().__init__(shape, sections_nbytes([q.nbytes, s.nbytes]))
        self.q = q  # [rows, in] int8
        self.s = s  # [rows] float32

    def _rows(self, x, y):
        K = kernels()
        K.rows_i8_row_scale(self.q, self.s, x, y, K.ROWS_PER_TASK)

    def _decode(self, rows, out):
        from . import kernels as K

        K.decode_i8_row_scale(self.q, self.s, rows, out)

    def _sub(self, r0, r1, shape):
        return Int8Rows(self.q[r0:r1], self.s[r0:r1], shape)

    def nonfinite(self) -> int:
        bad = 0  # only a row whose scale is non-finite or huge can hold a non-finite value
        with np.errstate(over="ignore", invalid="ignore"):
            for r in np.flatnonzero(~np.isfinite(self.s) | (np.abs(self.s) > F32(3.4e38 / 128))):
                bad += int(np.count_nonzero(~np.isfinite(self.q[r].astype(F32) * self.s[r])))
        return bad


def _quantize(groups: np.ndarray, what: str, half: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """groups [..., g] float32 -> codes int8 [..., g], scales [...]: float32, or with ``half``
    float16 (int8h: the codes are rounded against the stored half-precision scale)."""
    enc = "int8h" if half else "int8"
    if not np.isfinite(groups).all():
        raise UnsupportedEncoding(f"{what}: the tensor holds a non-finite value, which {enc} cannot encode")
    amax = np.abs(groups).max(axis=-1) if groups.shape[-1] else np.zeros(groups.shape[:-1], F32)
    d = (amax / F32(127)).astype(F32)
    stored = d
    if half:
        with np.errstate(over="ignore"):
            stored = d.astype(np.float16)
        if not np.isfinite(stored).all():
            big = float(amax[~np.isfinite(stored)].max())
            raise UnsupportedEncoding(f"{what}: a block's largest magnitude {big:.6g} needs a scale beyond float16's "
                                      "range, which int8h cannot encode (int8 keeps float32 scales)")
        d = stored.astype(F32)
    safe = np.where(d > 0, d, F32(1))
    q = np.clip(np.rint(groups / safe[..., None]), -127, 127).astype(np.int8)
    q[d == 0] = 0
    return q, stored


class Int8Codec(BlockCodec):
    name = "int8"
    represent_target = True  # and int8h, its subclass
    block = BLOCK  # the kernels index scales with j >> 5
    bits_per_weight = 9.0
    half = False  # int8h: scales stored as half-precision bits

    def _sizes(self, r, c):
        return [r * c, (2 if self.half else 4) * r * (c // BLOCK)]

    def nbytes(self, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        return sections_nbytes(self._sizes(*rows_cols(shape, self.name)))

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        r, c = rows_cols(shape, self.name)
        qb, sb = split_sections(raw, self._sizes(r, c), f"{self.name} tensor of shape {list(shape)}")
        cls, dt = (Int8HalfBlocks, "<u2") if self.half else (Int8Blocks, "<f4")
        return cls(qb.view(np.int8).reshape(r, c), sb.view(dt).reshape(r, c // BLOCK), shape)

    def encode(self, arr):
        a = np.ascontiguousarray(arr, dtype=F32)
        self._check(a.shape)
        r, c = rows_cols(a.shape, self.name)
        q, d = _quantize(a.reshape(r, c // BLOCK, BLOCK), self.name, self.half)
        return join_sections([q.reshape(r, c), d.astype("<f2" if self.half else "<f4")])


class Int8HalfCodec(Int8Codec):
    name = "int8h"
    bits_per_weight = 8.5
    half = True


class Int8RowCodec(Codec):
    name = "int8_row"
    bits_per_weight = 8.0  # plus 32 bits of scale per row: nbytes() is exact

    def nbytes(self, shape):
        r, c = rows_cols(tuple(shape), self.name)
        return sections_nbytes([r * c, 4 * r])

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        r, c = rows_cols(shape, self.name)
        qb, sb = split_sections(raw, [r * c, 4 * r], f"int8_row tensor of shape {list(shape)}")
        return Int8Rows(qb.view(np.int8).reshape(r, c), sb.view("<f4"), shape)

    def encode(self, arr):
        a = np.ascontiguousarray(arr, dtype=F32)
        r, c = rows_cols(a.shape, self.name)
        q, d = _quantize(a.reshape(r, c), self.name)
        return join_sections([q, d.astype("<f4")])


register(Int8Codec())
register(Int8HalfCodec())
