"""nvfp4: e2m1 (FP4) weights, two per byte, with an e4m3fn scale per 16 consecutive weights of a
row and one float32 global scale per matrix (NVIDIA's NVFP4, as ModelOpt checkpoints store it:
``weight`` uint8 [out, in/2], ``weight_scale`` e4m3 [out, in/16], ``weight_scale_2`` float32).

Value of element (r, c) of matrix m: ``e2m1(q) * (e4m3(s[r, c // 16]) * g[m])``: the block
scale times the global scale, rounded to float32, then times the e2m1 value, rounded again.
Byte i of a row holds element 2i in its low nibble and element 2i + 1 in its high nibble.
e2m1 values: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; e4m3fn as in vindex3.codecs.fp8
(0x7F and 0xFF are NaN).

Bytes, three sections (16-byte aligned): codes uint8 [rows, in/2], scales uint8 [rows, in/16],
global scales float32 [M] (M = prod(shape[:-2]), 1 for a matrix). 4.5 bits per weight plus 32
per matrix. Written from a checkpoint's own codes and scales (`pack`); ``encode`` from float32
is refused by name."""

from __future__ import annotations

import math

import numpy as np

from ..errors import UnsupportedEncoding
from .base import WeightShapeError, register
from .rowwise import (
    BlockCodec,
    RowWeight,
    join_sections,
    rows_cols,
    sections_nbytes,
    split_sections,
)

BLOCK = 16
_K: list = []


def _kernels():
    if not _K:
        from . import fp_kernels

        _K.append(fp_kernels)
    return _K[0]


def _matrices(shape: tuple[int, ...]) -> tuple[int, int]:
    """(M, rows per matrix) of a tensor; a 1-D tensor is one row."""
    if len(shape) < 2:
        return 1, 1
    return int(math.prod(shape[:-2])), int(shape[-2])


class Nvfp4Weight(RowWeight):
    encoding = "nvfp4"

    def __init__(self, p: np.ndarray, sc: np.ndarray, g: np.ndarray, O: int, r0: int, shape):
        super().__init__(shape, p.nbytes + sc.nbytes + g.nbytes)
        self.p, self.sc, self.g, self.O, self.r0 = p, sc, g, O, r0

    def _rows(self, x, y):
        K = _kernels()
        from .kernels import ROWS_PER_TASK

        K.rows_nvfp4(self.p, self.sc, self.g, self.O, self.r0, x, y, ROWS_PER_TASK, K.E2M1, K.E4M3)

    def _decode(self, rows, out):
        K = _kernels()
        K.decode_nvfp4(self.p, self.sc, self.g, self.O, self.r0, rows, out, K.E2M1, K.E4M3)

    def _sub(self, r0, r1, shape):
        return Nvfp4Weight(self.p[r0:r1], self.sc[r0:r1], self.g, self.O, self.r0 + r0, shape)

    def nonfinite(self) -> int:
        bad = 0
        for r0 in range(0, self.rows, 256):
            rows = np.arange(r0, min(self.rows, r0 + 256), dtype=np.int64)
            out = np.empty((rows.size, self.cols), np.float32)
            self._decode(rows, out)
            bad += int(out.size - np.count_nonzero(np.isfinite(out)))
        return bad


class Nvfp4Codec(BlockCodec):
    name = "nvfp4"
    block = BLOCK
    bits_per_weight = 4.5  # plus 32 bits per matrix: nbytes() is exact

    def _sizes(self, shape):
        r, c = rows_cols(shape, self.name)
        M, _ = _matrices(shape)
        return [r * c // 2, r * (c // BLOCK), 4 * M]

    def nbytes(self, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        return sections_nbytes(self._sizes(shape))

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        r, c = rows_cols(shape, self.name)
        _, O = _matrices(shape)
        pb, sb, gb = split_sections(raw, self._sizes(shape), f"nvfp4 tensor of shape {list(shape)}")
        return Nvfp4Weight(pb.reshape(r, c // 2), sb.reshape(r, c // BLOCK), gb.view("<f4"), O, 0, shape)

    def pack(self, codes: np.ndarray, scales: np.ndarray, global_scale) -> np.ndarray:
        """A checkpoint's packed codes [..., out, in/2], its e4m3 scales [..., out, in/16] and its
        global scale(s) (one float32, or one per matrix) -> this encoding's bytes."""
        p = np.ascontiguousarray(codes).view(np.uint8)
        s = np.ascontiguousarray(scales).view(np.uint8)
        shape = (*p.shape[:-1], 2 * p.shape[-1])
        self._check(shape)
        if s.shape != (*p.shape[:-1], shape[-1] // BLOCK):
            raise WeightShapeError(f"nvfp4: scales of shape {list(s.shape)} do not match codes of shape {list(p.shape)} "
                                   f"(one per {BLOCK} weights)")
        M, _ = _matrices(shape)
        g = np.ascontiguousarray(global_scale, dtype="<f4").reshape(-1)
        if g.size == 1 and M > 1:
            g = np.repeat(g, M)
        if g.size != M:
            raise WeightShapeError(f"nvfp4: {g.size} global scales for {M} matrices")
        r = int(math.prod(shape[:-1]))
        return join_sections([p.reshape(r, -1), s.reshape(r, -1), g])

    def stack(self, parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray:
        one = tuple(shape[1:])
        secs = [split_sections(p, self._sizes(one), f"nvfp4 part of shape {list(one)}") for p in parts]
        return join_sections([np.concatenate([s[i] for s in secs]) for i in range(3)])

    def encode(self, arr):
        raise UnsupportedEncoding(f"encoding {self.name!r} is carried from NVFP4 checkpoints (codes, block scales and a "
                                  "global scale); this build does not quantize float32 to it")


register(Nvfp4Codec())
