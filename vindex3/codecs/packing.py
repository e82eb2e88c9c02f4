"""Container tensors built in an encoding from a checkpoint's quantized parts.

A checkpoint that ships quantized weights stores each matrix as several tensors (gpt-oss's MXFP4
``*_blocks`` and ``*_scales``; DeepSeek-V3's FP8 ``weight`` and ``weight_scale_inv``; ModelOpt's
NVFP4 ``weight``, ``weight_scale`` and ``weight_scale_2``). A family places such a matrix with a
codec name: its sources come in groups of `Packer.arity` tensors, each group packed losslessly
into that codec's bytes (`pack`), and the placement's transform steps are then applied either to
the packed bytes (a native encode: `steps_encoded`, for the steps that only move whole rows or
whole matrices) or to the exactly decoded float32 values (a widening encode).

Encode-side only: nothing here runs when a container is read."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .base import get
from .ggml import KINDS, mxfp4_from_blocks


@dataclass(frozen=True)
class Packer:
    arity: int  # source tensors per packed matrix (or bank)
    shape: Callable[[list[tuple[int, ...]]], tuple[int, ...]]  # logical shape from the sources' shapes
    pack: Callable[[list[np.ndarray]], np.ndarray]  # the sources (as stored) -> the codec's bytes
    row_wise: bool  # every row's bytes are its own (rows can be permuted as bytes)


def _mx_shape(shapes):
    b = shapes[0]
    return (*b[:-2], b[-2] * 32)


PACKERS: dict[str, Packer] = {
    "mxfp4": Packer(2, _mx_shape, lambda a: mxfp4_from_blocks(a[0], a[1]), True),
    "fp8_e4m3_b128": Packer(2, lambda s: tuple(s[0]), lambda a: get("fp8_e4m3_b128").pack(a[0], a[1]), False),
    "nvfp4": Packer(3, lambda s: (*s[0][:-1], 2 * s[0][-1]), lambda a: get("nvfp4").pack(a[0], a[1], a[2]), False),
}


def groups(codec: str, sources: tuple[str, ...]) -> list[tuple[str, ...]]:
    n = PACKERS[codec].arity
    if len(sources) % n:
        raise ValueError(f"{codec}: {len(sources)} source tensors do not form groups of {n}")
    return [tuple(sources[i : i + n]) for i in range(0, len(sources), n)]


def part_shape(codec: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    return tuple(int(d) for d in PACKERS[codec].shape(shapes))


def row_bytes(codec: str, shape: tuple[int, ...]) -> int:
    """Bytes of one row of a row-wise codec."""
    _, be, bb = KINDS[codec]
    return shape[-1] // be * bb


def _merge_in_place(codec: str, shape: tuple[int, ...]) -> bool:
    """Whether merging consecutive matrices [2E, o, i] into [E, 2o, i] leaves this codec's bytes
    as they are: always for a row-wise codec; for fp8's 128 x 128 scale grid when o is a whole
    number of blocks (each section is then already in the merged order)."""
    if PACKERS[codec].row_wise:
        return True
    return codec == "fp8_e4m3_b128" and len(shape) >= 2 and shape[-2] % 128 == 0


def encodable(codec: str, steps: tuple[str, ...], shape: tuple[int, ...]) -> bool:
    """Whether `steps_encoded` applies ``steps`` to this codec's bytes for parts of ``shape``
    (else the tensor is widened)."""
    row_wise = PACKERS[codec].row_wise
    for s in steps:
        if s == "merge_pairs" and not _merge_in_place(codec, shape):
            return False
        if s not in ("stack", "merge_pairs") and not (row_wise and s == "uninterleave_axis1"):
            return False
    return True


def steps_encoded(codec: str, steps: tuple[str, ...], parts: list[np.ndarray], shape: tuple[int, ...]) -> np.ndarray | None:
    """Apply transform ``steps`` to packed ``parts`` (each of logical ``shape``), or None when
    a step cannot be applied to this codec's bytes (the tensor is then widened)."""
    packer = PACKERS[codec]
    xs = list(parts)
    shp = tuple(shape)
    for step in steps:
        if step == "stack":
            if packer.row_wise:
                xs = [np.concatenate(xs)]
            else:
                xs = [get(codec).stack(xs, (len(xs), *shp))]
            shp = (len(parts), *shp)
        elif step == "uninterleave_axis1" and packer.row_wise and len(xs) == 1 and len(shp) == 3:
            rb = row_bytes(codec, shp)
            b = xs[0].reshape(shp[0], shp[1], rb)
            xs = [np.ascontiguousarray(np.concatenate([b[:, 0::2], b[:, 1::2]], axis=1)).reshape(-1)]
        elif step == "merge_pairs" and len(xs) == 1 and _merge_in_place(codec, shp[1:]):
            shp = (shp[0] // 2, 2 * shp[1], *shp[2:])  # C-order rows: the bytes do not move
        else:
            return None
    return xs[0] if len(xs) == 1 else None
