"""The input, operand and state-buffer checks every kernel runs before it computes, written
once. Operand checks append a defect (naming the operand, what it is and what was expected) to
a list, so that a kernel refuses every mismatch at once (`ClosureError`); input and buffer
checks raise at the first."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from vindex3.codecs import Weight
from vindex3.errors import StateError

F32 = np.float32


def check_input(x, ndim: int, hidden: int, what: str) -> None:
    """``x`` is float32 [T, hidden] (``ndim`` 2) or [hidden] (``ndim`` 1)."""
    if not isinstance(x, np.ndarray) or x.dtype != F32:
        raise TypeError(f"{what}: input must be a float32 ndarray, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.ndim != ndim or x.shape[-1] != hidden:
        want = "[T, hidden]" if ndim == 2 else "[hidden]"
        raise ValueError(f"{what}: input shape {list(x.shape)}, expected {want} with hidden={hidden}")


def expect_array(name: str, arr, shape: tuple[int, ...], defects: list[str]) -> None:
    """A float32 array of ``shape`` (read whole by the kernel)."""
    if arr is None:
        defects.append(f"{name}: missing, expected float32 {list(shape)}")
    elif not isinstance(arr, np.ndarray):
        defects.append(f"{name}: not an array ({type(arr).__name__})")
    else:
        if arr.dtype != F32:
            defects.append(f"{name}: dtype {arr.dtype}, expected float32")
        if arr.shape != tuple(shape):
            defects.append(f"{name}: shape {list(arr.shape)}, expected {list(shape)}")


def expect_weight(name: str, w, shape: tuple[int, ...], defects: list[str]) -> None:
    """A weight object of ``shape`` (``w.mm(x) = x @ W.T``, any encoding with a codec)."""
    if w is None:
        defects.append(f"{name}: missing, expected a weight {list(shape)}")
    elif not callable(getattr(w, "mm", None)) or not hasattr(w, "shape"):
        defects.append(f"{name}: not a weight object with mm() ({type(w).__name__})")
    elif tuple(w.shape) != tuple(shape):
        defects.append(f"{name}: shape {list(w.shape)}, expected {list(shape)}")


def expect_absent(name: str, v, why: str, defects: list[str]) -> None:
    """An operand the params rule out (another layout's projection, a bias not declared)."""
    if v is not None:
        defects.append(f"{name}: present, but {why}")


def squeeze(arr, shape: tuple[int, ...]):
    """The checkpoint's layouts of a small tensor ([C, 1, K] conv weights, [1, 1, H, 1] A_log)
    as a view of ``shape``; anything else unchanged, for the checks to name."""
    if isinstance(arr, np.ndarray) and arr.shape != shape and arr.size == math.prod(shape):
        return arr.reshape(shape)
    return arr


def conv_2d(cw):
    """A depthwise conv weight stored [C, 1, K] as a [C, K] view (also of a memmap)."""
    if isinstance(cw, np.ndarray) and cw.ndim == 3 and cw.shape[1] == 1:
        cw = cw.reshape(cw.shape[0], cw.shape[2])
    return cw


def check_buffers(op: str, state, buffers: Iterable[tuple[str, tuple[int, ...]]], *, contiguous: bool = False) -> None:
    """Every named buffer of ``state`` is a writable float32 array of its shape (and C-contiguous
    where a compiled kernel indexes it flat)."""
    for name, shape in buffers:
        buf = getattr(state, name, None)
        if (not isinstance(buf, np.ndarray) or buf.dtype != F32 or buf.shape != tuple(shape) or not buf.flags.writeable
                or (contiguous and not buf.flags.c_contiguous)):
            desc = f"{buf.dtype} {list(buf.shape)}" if isinstance(buf, np.ndarray) else repr(buf)
            what = "a writable, contiguous" if contiguous else "a writable"
            raise StateError(f"{op} state buffer '{name}' is {desc}; expected {what} float32 {list(shape)}")


def expect_operand(name: str, v, shape: tuple[int, ...], defects: list[str]) -> None:
    """A weight object or a float32 array of ``shape`` (a kernel that takes either)."""
    if v is not None and isinstance(v, Weight):
        if v.shape != tuple(shape):
            defects.append(f"{name}: shape {list(v.shape)}, expected {list(shape)}")
        return
    expect_array(name, v, shape, defects)
