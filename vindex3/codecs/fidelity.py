"""How far an encoding of a tensor is from its float32 source, in numbers a report can carry."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .base import Codec, get

F32 = np.float32


@dataclass(frozen=True)
class Fidelity:
    """``max_abs_error``: max |w' - w|. ``max_rel_error``: max |w' - w| / |w| over elements with
    w != 0 (a zero that does not decode to zero makes it infinite). ``rel_rms_error``:
    ||w' - w||_2 / ||w||_2 (0 for an all-zero source decoded exactly). ``bits_per_weight``:
    8 * encoded bytes / elements, padding included."""

    encoding: str
    elements: int
    encoded_bytes: int
    bits_per_weight: float
    max_abs_error: float
    max_rel_error: float
    rel_rms_error: float
    exact: bool

    def as_dict(self) -> dict:
        return asdict(self)


def compare(source: np.ndarray, decoded: np.ndarray, encoding: str, encoded_bytes: int) -> Fidelity:
    """Fidelity of ``decoded`` (float32, the encoding's dense()) against ``source``."""
    w = np.asarray(source, dtype=F32).reshape(-1)
    v = np.asarray(decoded, dtype=F32).reshape(-1)
    if w.shape != v.shape:
        raise ValueError(f"source has {w.size} elements, decoded has {v.size}")
    n = int(w.size)
    diff = np.abs(v.astype(np.float64) - w.astype(np.float64))
    same_nan = np.isnan(w) & np.isnan(v)
    diff[same_nan] = 0.0
    max_abs = float(diff.max()) if n else 0.0
    nz = w != 0
    zero_bad = bool((~nz & (diff > 0)).any())
    max_rel = float(np.inf) if zero_bad else (float((diff[nz] / np.abs(w[nz].astype(np.float64))).max()) if nz.any() else 0.0)
    fin = np.isfinite(w)
    norm = float(np.sqrt(np.sum(w[fin].astype(np.float64) ** 2)))
    err = float(np.sqrt(np.sum(diff[fin] ** 2)))
    rel_rms = err / norm if norm > 0 else (0.0 if err == 0 else float(np.inf))
    exact = bool(np.array_equal(w.view(np.uint32), v.view(np.uint32)))
    return Fidelity(
        encoding=encoding,
        elements=n,
        encoded_bytes=int(encoded_bytes),
        bits_per_weight=(8.0 * encoded_bytes / n) if n else 0.0,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        rel_rms_error=rel_rms,
        exact=exact,
    )


def measure(codec: Codec | str, source: np.ndarray) -> Fidelity:
    """Encode ``source`` with ``codec``, decode it through the codec's weight, compare."""
    c = get(codec) if isinstance(codec, str) else codec
    src = np.ascontiguousarray(source, dtype=F32)
    raw = c.encode(src)
    return compare(src, c.weight(raw, src.shape).dense(), c.name, raw.nbytes)
