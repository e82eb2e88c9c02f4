"""What every row-encoded weight shares: a tensor of shape [..., in] is ``rows`` = prod(shape[:-1])
rows of ``in`` elements, each row encoded on its own, so an expert, a row gather or a tile is a
range or a list of rows. Subclasses say how a row is multiplied (`_rows`), how rows are decoded to
float32 (`_decode`) and how a sub-range of rows is viewed (`_sub`).

Byte layouts are planar: each array of the encoding (codes, scales, offsets) is one section of
the tensor's bytes, in a fixed order, every section starting on a 16-byte boundary relative to the
tensor's start (a segment starts every tensor 16-byte aligned, so typed views are aligned)."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..errors import UnsupportedEncoding
from . import threads
from .base import Codec, Weight, WeightShapeError
from .threads import launch

F32 = np.float32
SECTION_ALIGN = 16


def pad16(n: int) -> int:
    return n + (-n) % SECTION_ALIGN


def split_sections(raw: np.ndarray, sizes: list[int], what: str) -> list[np.ndarray]:
    """``raw`` (uint8) cut into sections of ``sizes`` bytes, each starting 16-aligned."""
    need = sections_nbytes(sizes)
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise WeightShapeError(f"{what}: encoded bytes must be a 1-D uint8 array, got {raw.dtype} with shape {list(raw.shape)}")
    if raw.shape[0] != need:
        raise WeightShapeError(f"{what}: encoded length is {raw.shape[0]} bytes, the layout needs {need}")
    out, off = [], 0
    for n in sizes:
        out.append(raw[off : off + n])
        off += pad16(n)
    return out


def sections_nbytes(sizes: list[int]) -> int:
    """Bytes of sections laid out by `split_sections` (the last section is padded too)."""
    return sum(pad16(n) for n in sizes)


def join_sections(parts: list[np.ndarray]) -> np.ndarray:
    """The inverse of `split_sections`: C-order bytes of each part, zero padding between."""
    bufs = [np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts]
    out = np.zeros(sections_nbytes([b.shape[0] for b in bufs]), np.uint8)
    off = 0
    for b in bufs:
        out[off : off + b.shape[0]] = b
        off += pad16(b.shape[0])
    return out


def rows_cols(shape: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(shape) < 1 or any(int(s) < 0 for s in shape):
        raise WeightShapeError(f"{what}: shape {list(shape)} is not a tensor shape")
    return int(math.prod(shape[:-1])), int(shape[-1])


class RowWeight(Weight):
    """A weight whose bytes are per-row encoded. ``small_t``: the largest number of activation
    rows multiplied by the rows kernel; larger batches decode tiles and use BLAS."""

    small_t: int = 8

    def __init__(self, shape: tuple[int, ...], nbytes: int):
        super().__init__(shape, nbytes)
        self.rows, self.cols = rows_cols(self.shape, self.encoding)

    # -- what a subclass provides ------------------------------------------------------------
    def _rows(self, x: np.ndarray, y: np.ndarray) -> None:
        raise NotImplementedError

    def _decode(self, rows: np.ndarray, out: np.ndarray) -> None:
        raise NotImplementedError

    def _sub(self, r0: int, r1: int, shape: tuple[int, ...]) -> RowWeight:
        raise NotImplementedError

    @classmethod
    def _group_rows(cls, weights: tuple[RowWeight, ...]) -> Callable[[np.ndarray, tuple], None] | None:
        """A function (x [T, in] float32 C-contiguous, ys) that writes row products of every
        weight of ``weights`` into ``ys`` (one [T, rows] float32 array each) in one launch, the
        bytes of `_rows` on each; None when the encoding has no such kernel."""
        return None

    @classmethod
    def fused(cls, weights):
        ws = tuple(weights)
        if any(w.ndim != 2 or w.cols != ws[0].cols for w in ws):
            return None
        kernel = cls._group_rows(ws)
        if kernel is None:
            return None
        cols, small = ws[0].cols, min(w.small_t for w in ws)
        sizes = tuple(w.rows for w in ws)

        def run(x: np.ndarray) -> tuple[np.ndarray, ...]:
            if (type(x) is np.ndarray and x.ndim == 2 and x.dtype == F32 and x.shape[1] == cols
                    and 0 < x.shape[0] <= small and x.flags.c_contiguous):
                T = x.shape[0]
                ys = tuple(np.empty((T, r), F32) for r in sizes)
                with launch():
                    kernel(x, ys)
                return ys
            return tuple(w.mm(x) for w in ws)

        return run

    # -- the verbs ---------------------------------------------------------------------------
    def _check_x(self, x: np.ndarray) -> tuple[np.ndarray, bool]:
        if self.ndim != 2:
            raise WeightShapeError(f"{self!r}: mm needs a 2-D weight [out, in]; take expert(e) of a stacked bank first")
        if not isinstance(x, np.ndarray) or x.dtype != F32:
            got = getattr(x, "dtype", type(x).__name__)
            raise WeightShapeError(f"{self!r}: mm takes float32 activations, got {got}")
        if x.ndim not in (1, 2) or x.shape[-1] != self.cols:
            raise WeightShapeError(f"{self!r}: mm takes x [T, {self.cols}], got shape {list(x.shape)}")
        one = x.ndim == 1
        return np.ascontiguousarray(x.reshape(1, -1) if one else x), one

    def mm(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] float32 -> x @ W.T [T, out] float32 (x [in] -> [out])."""
        # the decode step's case first, checked inline (a step makes about a hundred products)
        if (type(x) is np.ndarray and x.ndim == 2 and x.dtype == F32 and 0 < x.shape[0] <= self.small_t
                and x.shape[1] == self.cols and len(self.shape) == 2 and self.rows and x.flags.c_contiguous):
            y = np.empty((x.shape[0], self.rows), F32)
            with launch():
                self._rows(x, y)
            return y
        x2, one = self._check_x(x)
        T = x2.shape[0]
        y = np.empty((T, self.rows), F32)
        if T == 0 or self.rows == 0:
            pass
        elif T <= self.small_t:
            with launch():
                self._rows(x2, y)
        else:
            self._tiles(x2, y)
        return y[0] if one else y

    def _tiles(self, x: np.ndarray, y: np.ndarray) -> None:
        from .kernels import TILE_BYTES

        n = max(16, (TILE_BYTES // (4 * max(1, self.cols))) // 16 * 16)
        tile = np.empty((min(n, self.rows), self.cols), F32)
        for r0 in range(0, self.rows, n):
            r1 = min(self.rows, r0 + n)
            t = tile[: r1 - r0]
            self._decode(np.arange(r0, r1, dtype=np.int64), t)
            threads.gemm(x, t.T, out=y[:, r0:r1])

    def mm_t(self, x: np.ndarray) -> np.ndarray:
        """x [T, out] float32 -> x @ W [T, in]: tiles of rows decoded to float32 (never the whole
        matrix) and accumulated tile by tile with BLAS, in row order."""
        if self.ndim != 2:
            raise WeightShapeError(f"{self!r}: mm_t needs a 2-D weight [out, in]")
        if not isinstance(x, np.ndarray) or x.dtype != F32 or x.ndim != 2 or x.shape[1] != self.rows:
            got = f"{getattr(x, 'dtype', type(x).__name__)} {list(getattr(x, 'shape', []))}"
            raise WeightShapeError(f"{self!r}: mm_t takes float32 x [T, {self.rows}], got {got}")
        from .kernels import TILE_BYTES

        y = np.zeros((x.shape[0], self.cols), F32)
        n = max(16, (TILE_BYTES // (4 * max(1, self.cols))) // 16 * 16)
        tile = np.empty((min(n, self.rows), self.cols), F32)
        for r0 in range(0, self.rows, n):
            r1 = min(self.rows, r0 + n)
            t = tile[: r1 - r0]
            self._decode(np.arange(r0, r1, dtype=np.int64), t)
            y += x[:, r0:r1] @ t
        return y

    def sub_rows(self, r0: int, r1: int) -> RowWeight:
        """Rows r0 .. r1-1 of a 2-D weight, as a weight over the same bytes."""
        if self.ndim != 2 or not (0 <= r0 <= r1 <= self.rows):
            raise WeightShapeError(f"{self!r}: sub_rows({r0}, {r1}) is not a row range of a 2-D weight")
        return self._sub(r0, r1, (r1 - r0, self.cols))

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of a 2-D weight as float32 [len(ids), in], decoded exactly as dense()."""
        if self.ndim != 2:
            raise WeightShapeError(f"{self!r}: take gathers rows of a 2-D weight")
        idx = np.asarray(ids)
        if idx.dtype.kind not in "iu":
            raise WeightShapeError(f"{self!r}: take needs integer row ids, got {idx.dtype}")
        flat = idx.reshape(-1).astype(np.int64)
        if flat.size and (flat.min() < 0 or flat.max() >= self.rows):
            bad = int(flat[(flat < 0) | (flat >= self.rows)][0])
            raise WeightShapeError(f"{self!r}: row id {bad} is outside [0, {self.rows})")
        out = np.empty((flat.size, self.cols), F32)
        if flat.size:
            self._decode(flat, out)
        return out.reshape(idx.shape + (self.cols,))

    def dense(self) -> np.ndarray:
        """The whole tensor decoded to float32: a new array (the only verb that makes one)."""
        out = np.empty((self.rows, self.cols), F32)
        if self.rows:
            self._decode(np.arange(self.rows, dtype=np.int64), out)
        return out.reshape(self.shape)

    def expert(self, e: int) -> RowWeight:
        if self.ndim != 3:
            raise WeightShapeError(f"{self!r}: expert(e) views one matrix of a stacked bank [E, out, in]")
        E, O = self.shape[0], self.shape[1]
        if not (0 <= int(e) < E):
            raise WeightShapeError(f"{self!r}: expert {e} is outside [0, {E})")
        e = int(e)
        return self._sub(e * O, (e + 1) * O, (O, self.cols))


class BlockCodec(Codec):
    """A codec that cuts each row into blocks of ``block`` elements (int8, q4): it holds a tensor
    only when the last dimension is a multiple of the block, and says why not otherwise."""

    block: int = 32

    def accepts(self, shape):
        c = int(shape[-1]) if len(shape) else 0
        if c % self.block:
            return f"its last dimension {c} is not a multiple of {self.block}"
        return None

    def _check(self, shape):
        why = self.accepts(shape)
        if why:
            raise UnsupportedEncoding(f"encoding {self.name!r} cannot hold a tensor of shape {list(shape)}: {why}")
