"""GGML block encodings, kept byte for byte as a GGUF file stores them: q8_0, q4_0, q4_1,
q5_0, q5_1, q4_k, q5_k, q6_k and mxfp4.

A tensor [..., in] is ``rows`` rows; each row is ``in / block`` blocks of the type's fixed size,
laid out exactly as in the file (no planar split, no re-encoding), so a tensor's bytes are the
GGUF tensor data and its SHA-256 is the file's. Decoding is exact: every value equals what
``gguf.quants.dequantize`` (gguf 0.19) gives for the same block (vindex3/codecs/ggml_kernels.py
says how). A last dimension that is not a multiple of the block is refused by name.

| encoding | block | bytes | bits/weight | value |
|---|---|---|---|---|
| q8_0 | 32 | 34 | 8.5 | d * q (q int8) |
| q4_0 | 32 | 18 | 4.5 | d * (q - 8) |
| q4_1 | 32 | 20 | 5.0 | d * q + m |
| q5_0 | 32 | 22 | 5.5 | d * (q - 16) |
| q5_1 | 32 | 24 | 6.0 | d * q + m |
| q4_k | 256 | 144 | 4.5 | (d * sc_j) * q - (dmin * m_j), 8 sub-blocks of 32 |
| q5_k | 256 | 176 | 5.5 | as q4_k with a fifth bit |
| q6_k | 256 | 210 | 6.5625 | (d * sc_j) * (q - 32), 16 sub-blocks of 16 |
| mxfp4 | 32 | 17 | 4.25 | 2^(e-128) * 2 e2m1(q) (e8m0 scale; OCP MX, gpt-oss experts) |

Other GGUF types (Q2_K, Q3_K, the IQ* and TQ* types, ...) have no codec: a native encode
carries their blocks under the lower-cased type name and whatever must decode them refuses.
"""

from __future__ import annotations

import numpy as np

from ..errors import UnsupportedEncoding
from .base import WeightShapeError, register
from .rowwise import F32, BlockCodec, RowWeight, rows_cols

# name -> (kind id in ggml_kernels, elements per block, bytes per block)
KINDS = {
    "q8_0": (0, 32, 34),
    "q4_0": (1, 32, 18),
    "q4_1": (2, 32, 20),
    "q5_0": (3, 32, 22),
    "q5_1": (4, 32, 24),
    "q4_k": (5, 256, 144),
    "q5_k": (6, 256, 176),
    "q6_k": (7, 256, 210),
    "mxfp4": (8, 32, 17),
}

_K: list = []


def _kernels():
    if not _K:
        from . import ggml_kernels

        _K.append(ggml_kernels)
    return _K[0]


class GgmlWeight(RowWeight):
    """Rows of GGML blocks: ``b`` uint8 [rows, row bytes]."""

    def __init__(self, encoding: str, b: np.ndarray, shape):
        self.encoding = encoding  # per instance: one class serves every block type
        super().__init__(shape, b.nbytes)
        self.kind, self.be, self.bb = KINDS[encoding]
        self.b = b

    def _rows(self, x, y):
        K = _kernels()
        from .kernels import ROWS_PER_TASK

        K.rows_fused(self.kind, self.b, x, K.block_sums(x), y, ROWS_PER_TASK, K.F16, self.be, self.bb)

    def _decode(self, rows, out):
        K = _kernels()
        K.decode_rows(self.kind, self.b, rows, out, K.F16, K.KVALUES, self.be, self.bb)

    def _sub(self, r0, r1, shape):
        return GgmlWeight(self.encoding, self.b[r0:r1], shape)

    def nonfinite(self) -> int:
        K = _kernels()
        if not self.rows:
            return 0
        return int(K.nonfinite_blocks(self.kind, self.b, K.F16, K.KVALUES, self.be, self.bb))


class GgmlCodec(BlockCodec):
    """One GGML block type. ``encode`` quantizes with gguf.quants where it can (q8_0, q4_0,
    q4_1, q5_0, q5_1, mxfp4); the K-quants are only carried from files."""

    def __init__(self, name: str):
        self.name = name
        self.kind, self.block, self.block_bytes = KINDS[name]
        self.bits_per_weight = 8.0 * self.block_bytes / self.block

    def nbytes(self, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        r, c = rows_cols(shape, self.name)
        return r * (c // self.block) * self.block_bytes

    def weight(self, raw, shape):
        shape = tuple(int(s) for s in shape)
        self._check(shape)
        r, c = rows_cols(shape, self.name)
        need = r * (c // self.block) * self.block_bytes
        if raw.dtype != np.uint8 or raw.ndim != 1 or raw.shape[0] != need:
            raise WeightShapeError(f"{self.name} tensor of shape {list(shape)} needs {need} bytes, got {raw.shape} {raw.dtype}")
        return GgmlWeight(self.name, raw.reshape(r, need // r if r else 0), shape)

    def encode(self, arr):
        a = np.ascontiguousarray(arr, dtype=F32)
        self._check(a.shape)
        import gguf
        from gguf.quants import quantize

        try:
            q = quantize(a.reshape(-1, a.shape[-1]) if a.ndim else a, gguf.GGMLQuantizationType[self.name.upper()])
        except NotImplementedError:
            raise UnsupportedEncoding(f"encoding {self.name!r} is carried from GGUF files; this build does not quantize to it") from None
        return np.ascontiguousarray(q).reshape(-1).view(np.uint8)


for _name in KINDS:
    register(GgmlCodec(_name))


def mxfp4_from_blocks(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """gpt-oss's MXFP4 tensors -> mxfp4 bytes, losslessly: ``blocks`` uint8 [..., G, 16] (byte i
    holds element 2i in its low nibble, 2i + 1 in its high nibble) and ``scales`` uint8 [..., G]
    (e8m0 exponents, value 2^(s - 127)) become GGML blocks [..., G, 17]: the exponent byte, then
    16 bytes whose byte j holds element j (low nibble) and element j + 16 (high nibble). The
    values are the same: e2m1(q) * 2^(s - 127) = (2 e2m1(q)) * 2^(s - 128)."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8)
    s = np.ascontiguousarray(scales, dtype=np.uint8)
    if b.shape[-1] != 16 or b.shape[:-1] != s.shape:
        raise WeightShapeError(f"mxfp4: blocks of shape {list(b.shape)} and scales of shape {list(s.shape)} are not "
                               "[..., G, 16] and [..., G]")
    codes = np.stack([b & np.uint8(15), b >> np.uint8(4)], axis=-1).reshape(*b.shape[:-1], 32)
    packed = codes[..., :16] | (codes[..., 16:] << np.uint8(4))
    return np.concatenate([s[..., None], packed], axis=-1).reshape(-1)
