"""fp8_e4m3_b128: float8 e4m3fn weights with one float32 scale per 128 x 128 block of each
matrix, as DeepSeek-V3 ships its linears (``weight`` e4m3 [out, in] and ``weight_scale_inv``
float32 [ceil(out/128), ceil(in/128)]; ``quantization_config`` fp8, ``weight_block_size``
[128, 128]).

Value of element (r, c) of a matrix: ``e4m3(q[r, c]) * s[r // 128, c // 128]``, one float32
product (the reference's ``weight.float() * scale_inv``). e4m3fn has no infinities; 0x7F and
0xFF are NaN. A tensor [..., out, in] is ``M = prod(shape[:-2])`` matrices (a stacked expert bank),
each with its own scale grid.

Bytes, two sections (16-byte aligned, vindex3.codecs.rowwise): codes uint8 [M * out, in], then
scales float32 [M, ceil(out/128), ceil(in/128)]. 8 bits per weight plus 32 per 16384 weights.
Written only from a checkpoint's own codes and scales (`pack`); ``encode`` from float32 is
refused by name."""

from __future__ import annotations

import math

import numpy as np

from ..errors import UnsupportedEncoding
from .base import Codec, WeightShapeError, register
from .rowwise import RowWeight, join_sections, sections_nbytes, split_sections

BLOCK = 128
_K: list = []


def _kernels():
    if not _K:
        from . import fp_kernels

        _K.append(fp_kernels)
    return _K[0]


def geometry(shape: tuple[int, ...], what: str) -> tuple[int, int, int, int, int]:
    """(matrices M, rows per matrix O, columns I, scale rows, scale columns) of a tensor."""
    if len(shape) < 2:
        raise UnsupportedEncoding(f"{what}: fp8 block scales need a matrix [..., out, in], got shape {list(shape)}")
    O, I = int(shape[-2]), int(shape[-1])
    M = int(math.prod(shape[:-2]))
    return M, O, I, -(-O // BLOCK), -(-I // BLOCK)


class Fp8Weight(RowWeight):
    encoding = "fp8_e4m3_b128"

    def __init__(self, q: np.ndarray, s: np.ndarray, O: int, r0: int, shape):
        super().__init__(shape, q.nbytes + s.nbytes)
        self.q = q  # [rows, I] uint8 e4m3fn codes
        self.s = s  # [M, ceil(O/128), ceil(I/128)] float32
        self.O = O  # rows per matrix
        self.r0 = r0  # absolute row of this view's first row

    def _rows(self, x, y):
        K = _kernels()
        from .kernels import ROWS_PER_TASK

        K.rows_fp8(self.q, self.s, self.O, self.r0, x, y, ROWS_PER_TASK, K.E4M3)

    def _decode(self, rows, out):
        K = _kernels()
        K.decode_fp8(self.q, self.s, self.O, self.r0, rows, out, K.E4M3)

    def _sub(self, r0, r1, shape):
        return Fp8Weight(self.q[r0:r1], self.s, self.O, self.r0 + r0, shape)

    def nonfinite(self) -> int:
        bad = 0
        for r0 in range(0, self.rows, 256):
            rows = np.arange(r0, min(self.rows, r0 + 256), dtype=np.int64)
            out = np.empty((rows.size, self.cols), np.float32)
            self._decode(rows, out)
            bad += int(out.size - np.count_nonzero(np.isfinite(out)))
        return bad


class Fp8Codec(Codec):
    name = "fp8_e4m3_b128"
    bits_per_weight = 8.0  # plus the scales: nbytes() is exact

    def _sizes(self, shape):
        M, O, I, sr, sc = geometry(shape, self.name)
        return [M * O * I, 4 * M * sr * sc]

    def nbytes(self, shape):
        return sections_nbytes(self._sizes(tuple(int(s) for s in shape)))

    def accepts(self, shape):
        return None if len(shape) >= 2 else "fp8 block scales need a matrix"

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        M, O, I, sr, sc = geometry(shape, self.name)
        qb, sb = split_sections(raw, self._sizes(shape), f"{self.name} tensor of shape {list(shape)}")
        return Fp8Weight(qb.reshape(M * O, I), sb.view("<f4").reshape(M, sr, sc), O, 0, shape)

    def pack(self, codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
        """A checkpoint's e4m3 codes [..., out, in] (uint8 or float8 bytes) and its float32 block
        scales [..., ceil(out/128), ceil(in/128)] -> this encoding's bytes."""
        codes = np.ascontiguousarray(codes).view(np.uint8)
        M, O, I, sr, sc = geometry(codes.shape, self.name)
        s = np.ascontiguousarray(scales, dtype="<f4")
        if s.shape != (*codes.shape[:-2], sr, sc):
            raise WeightShapeError(f"{self.name}: scales of shape {list(s.shape)} do not tile codes of shape "
                                   f"{list(codes.shape)} in 128 x 128 blocks (expected {[*codes.shape[:-2], sr, sc]})")
        return join_sections([codes.reshape(M * O, I), s.reshape(M, sr, sc)])

    def stack(self, parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        """Encoded matrices of one shape [out, in] stacked into [len(parts), out, in]."""
        one = tuple(shape[1:])
        secs = [split_sections(p, self._sizes(one), f"{self.name} part of shape {list(one)}") for p in parts]
        return join_sections([np.concatenate([s[0] for s in secs]), np.concatenate([s[1] for s in secs])])

    def encode(self, arr):
        raise UnsupportedEncoding(f"encoding {self.name!r} is carried from FP8 checkpoints (codes and their block "
                                  "scales); this build does not quantize float32 to it")


register(Fp8Codec())
