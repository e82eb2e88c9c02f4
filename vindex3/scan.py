"""The first-use scan of a tensor's values: the largest magnitude it decodes to, in its own
encoding, and whether it holds NaN or infinity.

A container's tensors are scanned once, the first time an executor reads them (and by
``verify``). The scan decodes through the encoding's own arithmetic — an int8 tensor is codes
times block scales, a 4-bit tensor its blocks, bf16 and f16 their halves, f32 its floats — so
a resealed int8 scale of 1e30 counts as the 1.3e32 weights it makes, not as the small codes
stored. Its cost is bounded: at most ``CHUNK`` values are decoded at a time (4 MiB of float32
temporaries, whatever the tensor's size), each tensor once per opened container, and what it
cost is recorded (`TensorScan.seconds`; `vindex3.Container.first_use_cost`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

F32 = np.float32
CHUNK = 1 << 20  # values decoded at once: 4 MiB of float32 temporaries

# The largest magnitude a weight may decode to: the square root of float32's largest value
# (2**64, about 1.8e19). Past it a value's square is not a float32, so a norm over any residual
# that carries the weight's product overflows (mean of squares = inf, output exactly 0) -- the
# silent all-zero logits of a resealed bf16 weight of 3e38. No trained model comes within many
# orders of magnitude of it; one bound serves every encoding because it bounds what the
# encoding decodes to, which is what the kernels multiply.
MAGNITUDE_BOUND = float(2.0**64)


@dataclass(frozen=True)
class TensorScan:
    """What the scan of one tensor found and cost."""

    encoding: str
    values: int
    nbytes: int  # stored bytes
    max_abs: float | None  # the largest decoded magnitude (None: nonfinite > 0, or not decodable here)
    nonfinite: int | None  # NaN or infinite values (None: this build cannot decode the encoding)
    seconds: float

    @property
    def absurd(self) -> bool:
        """A finite magnitude at or past `MAGNITUDE_BOUND`."""
        return self.max_abs is not None and self.max_abs >= MAGNITUDE_BOUND


def _extent(part: np.ndarray, scratch: np.ndarray) -> float:
    """max |x| of a float32 array (NaN or inf when it holds one), through ``scratch`` (which may
    be ``part`` itself when the caller owns it): one pass of abs, one of max."""
    if not part.size:
        return 0.0
    a = scratch.reshape(-1)[: part.size].reshape(part.shape)
    np.abs(part, out=a)
    return float(a.max())


def _chunks(w):
    """(values, scratch) pairs: the tensor's values as float32 arrays of at most CHUNK values,
    and where their absolute values may go (None: no decoder here)."""
    from .codecs.f32 import DenseF32
    from .codecs.permuted import PermutedBank
    from .codecs.rowwise import RowWeight

    if isinstance(w, PermutedBank):  # the stored bank's values, in another order
        return _chunks(w.base)
    if isinstance(w, DenseF32):  # a view of the mapped bytes: never written, abs goes to scratch
        flat = w.a.reshape(-1)
        scratch = np.empty(min(CHUNK, flat.size), F32)
        return ((flat[i:i + CHUNK], scratch) for i in range(0, flat.size, CHUNK))
    if isinstance(w, RowWeight):
        def rows():
            n = max(1, CHUNK // max(1, w.cols))
            buf = np.empty((min(n, w.rows), w.cols), F32)
            for r0 in range(0, w.rows, n):
                r1 = min(w.rows, r0 + n)
                out = buf[: r1 - r0]
                w._decode(np.arange(r0, r1, dtype=np.int64), out)  # the encoding's own decode
                yield out, out  # our own buffer: abs in place
        return rows()
    return None


def scan(w) -> TensorScan:
    """Scan one weight object (see the module docstring); values past the bound are reported,
    not refused here (the caller names the tensor)."""
    t0 = time.perf_counter()
    values = int(np.prod(w.shape, dtype=np.int64))
    chunks = _chunks(w)
    if chunks is None:  # an encoding without a decoder here: only its own count, if it has one
        bad = w.nonfinite()
        return TensorScan(w.encoding, values, int(w.nbytes), None, bad, time.perf_counter() - t0)
    top = 0.0
    finite = True
    with np.errstate(invalid="ignore", over="ignore"):
        for part, scratch in chunks:
            m = _extent(part, scratch)
            if not np.isfinite(m):
                finite = False
                break
            top = max(top, m)
    if finite:
        return TensorScan(w.encoding, values, int(w.nbytes), top, 0, time.perf_counter() - t0)
    bad = w.nonfinite()  # the rare path: count them, in the encoding's own way
    return TensorScan(w.encoding, values, int(w.nbytes), None, int(bad) if bad else 1, time.perf_counter() - t0)


def fmt_magnitude(x: float) -> str:
    return f"{x:.3g}"
