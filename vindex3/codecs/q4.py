"""q4: 4-bit codes in blocks of 32 along the last dimension, each block with an f16 scale d
and an f16 offset m: w' = d * q + m (float32 arithmetic), q in 0..15. 5.0 bits per weight.

The arithmetic is the one of GGUF's Q4_1, so a Q4_1 checkpoint (the shipped SmolLM2) is
re-encoded without loss whenever a block uses its lowest and highest code; the bytes are laid
out planar (codes, scales, offsets as three sections) so that kernels read typed arrays.
The layout is documented in docs/container.md, "Weight encodings".

Quantization of a block with minimum lo and maximum hi: m = lo rounded to f16 toward -inf
(every weight is >= m), d = (hi - m) / 15 rounded to f16 to nearest (one f16 step up if that
would clip hi by more than d / 2), q = round((w - m) / d) to nearest even, clipped to 0..15;
a constant block has d = 0. So |w' - w| <= d / 2 (plus float32 rounding). A last dimension
that is not a multiple of 32 is refused by name (`accepts` says so before encoding)."""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedEncoding
from . import threads
from .base import check_activations, register
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

BLOCK = 32
HALF = BLOCK // 2


class Q4Weight(RowWeight):
    encoding = "q4"
    fused_kind = "q4"

    def __init__(self, qs: np.ndarray, d: np.ndarray, m: np.ndarray, shape):
        super().__init__(shape, sections_nbytes([qs.nbytes, d.nbytes, m.nbytes]))
        self.qs = qs  # [rows, in / 2] uint8
        self.d = d  # [rows, in / 32] uint16 (f16 bits)
        self.m = m  # [rows, in / 32] uint16 (f16 bits)

    def _rows(self, x, y):
        K = kernels()
        xl, xh, xs = K.q4_split_x(x)
        K.rows_q4(self.qs, self.d, self.m, K.F16_TABLE, xl, xh, xs, y, K.ROWS_PER_TASK)

    def _decode(self, rows, out):
        from . import kernels as K

        K.decode_q4(self.qs, self.d, self.m, K.F16_TABLE, rows, out)

    def _sub(self, r0, r1, shape):
        return Q4Weight(self.qs[r0:r1], self.d[r0:r1], self.m[r0:r1], shape)

    def nonfinite(self) -> int:
        from . import kernels as K

        return int(K.nonfinite_q4(self.qs, self.d, self.m, K.F16_TABLE)) if self.rows else 0

    def with_activations(self, mode):
        return Q4WeightQ8(self.qs, self.d, self.m, self.shape) if check_activations(mode) == "q8" else self


class Q4WeightQ8(Q4Weight):
    """q4 whose products quantize the activation per block of 32 and sum integer products of
    codes (vindex3.codecs.intrinsics), at every T: a prefill's positions get the bytes each
    would get alone (tests/test_int_prefill.py); mm_t, gathers and dense() are unchanged."""

    activations = "q8"
    fused_kind = "q4q8"

    def _rows(self, x, y):
        I = intdot()
        if threads.team(self.qs.nbytes):
            I.team_rows("q4", self.qs, self.d, self.m, kernels().F16_TABLE, x, y)
        else:
            I.rows_kernel("q4", parallel=threads.parallel(self.qs.nbytes))(self.qs, self.d, self.m, kernels().F16_TABLE,
                                                                           x, y, I.ROWS_PER_TASK)

    def _tiles(self, x, y):
        # a prefill pass does T times a decode step's work: the pool's threshold (threads.parallel)
        # is weighed against weight bytes x positions
        from .inttiles import tiles_kernel

        with threads.launch():
            tiles_kernel("q4", parallel=threads.parallel(self.qs.nbytes * x.shape[0]))(self.qs, self.d, self.m, kernels().F16_TABLE, x, y,
                                                                         intdot().ROWS_PER_TASK)

    def _sub(self, r0, r1, shape):
        return Q4WeightQ8(self.qs[r0:r1], self.d[r0:r1], self.m[r0:r1], shape)

    @classmethod
    def _group_rows(cls, weights):
        QS, D, M = (tuple(getattr(w, a) for w in weights) for a in ("qs", "d", "m"))
        nbytes = sum(q.nbytes for q in QS)
        if not all(threads.one_array_type(t) for t in (QS, D, M)):
            return None  # a numba tuple indexed at run time holds one array type

        def run(x, ys):
            I = intdot()
            I.group_kernel("q4", parallel=threads.parallel(nbytes))(QS, D, M, kernels().F16_TABLE, x, ys, I.ROWS_PER_TASK)

        return run

    def with_activations(self, mode):
        return Q4Weight(self.qs, self.d, self.m, self.shape) if check_activations(mode) == "exact" else self


def quantize_blocks(blocks: np.ndarray, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """blocks [n, 32] float32 -> q uint8 [n, 32] (0..15), d and m float16 [n]."""
    if not np.isfinite(blocks).all():
        raise UnsupportedEncoding(f"{what}: the tensor holds a non-finite value, which q4 cannot encode")
    lo = blocks.min(axis=1)
    hi = blocks.max(axis=1)
    f16max = float(np.finfo(np.float16).max)
    if blocks.size and (lo.min() < -f16max or hi.max() > f16max):
        raise UnsupportedEncoding(f"{what}: a weight's magnitude exceeds {f16max}, the largest f16 block offset q4 stores")
    with np.errstate(over="ignore"):
        m = lo.astype(np.float16)
        up = m.astype(F32) > lo
        m[up] = np.nextafter(m[up], np.float16(-np.inf))
        mf = m.astype(F32)
        d = ((hi - mf) / F32(15)).astype(np.float16)
        for _ in range(4):  # at most a step or two: f16 rounding can leave hi just out of reach
            df = d.astype(F32)
            with np.errstate(divide="ignore", invalid="ignore"):
                short = (hi - mf) > df * F32(15.5)
            if not short.any():
                break
            d[short] = np.nextafter(d[short], np.float16(np.inf))
        if not np.isfinite(d).all():
            raise UnsupportedEncoding(f"{what}: a block's range is too wide for an f16 scale")
    df = d.astype(F32)
    safe = np.where(df > 0, df, F32(1))
    q = np.clip(np.rint((blocks - mf[:, None]) / safe[:, None]), 0, 15).astype(np.uint8)
    q[df == 0] = 0
    return q, d, m


class Q4Codec(BlockCodec):
    name = "q4"
    represent_target = True
    block = BLOCK
    bits_per_weight = 5.0

    @staticmethod
    def _sizes(r: int, c: int) -> list[int]:
        return [r * c // 2, 2 * r * (c // BLOCK), 2 * r * (c // BLOCK)]

    def nbytes(self, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        return sections_nbytes(self._sizes(*rows_cols(shape, self.name)))

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        r, c = rows_cols(shape, self.name)
        qb, db, mb = split_sections(raw, self._sizes(r, c), f"q4 tensor of shape {list(shape)}")
        nb = c // BLOCK
        return Q4Weight(qb.reshape(r, c // 2), db.view("<u2").reshape(r, nb), mb.view("<u2").reshape(r, nb), shape)

    def encode(self, arr):
        a = np.ascontiguousarray(arr, dtype=F32)
        self._check(a.shape)
        r, c = rows_cols(a.shape, self.name)
        nb = c // BLOCK
        q, d, m = quantize_blocks(a.reshape(r * nb, BLOCK), self.name)
        packed = (q[:, :HALF] | (q[:, HALF:] << np.uint8(4))).reshape(r, c // 2)
        return join_sections([packed, d.view("<u2").reshape(r, nb), m.view("<u2").reshape(r, nb)])


register(Q4Codec())
