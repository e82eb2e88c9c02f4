"""RMSNorm, float32 end to end (as the reference: x * rsqrt(mean(x²) + eps) * (offset + w))."""

from __future__ import annotations

import numpy as np

from ...switches import EnvSwitch


def make_weight(weight: np.ndarray, offset: float) -> np.ndarray:
    if offset:
        return (np.float32(offset) + weight).astype(np.float32)
    return weight


_sum = np.add.reduce
SMALL_ROWS = 8  # vindex3.exec.ops.decode.ROWS: passes up to this many positions take its kernel


class _Switch:
    """Whether decode-sized passes take the compiled kernels (`vindex3.exec.ops.decode`, whose
    `set_enabled` sets ``on``), and that module once imported (numba costs resident memory a
    run that never decodes should not pay). Plain attributes: the hot path makes no call to ask."""

    on = EnvSwitch("VINDEX3_DECODE_KERNELS")
    mod = None


DECODE = _Switch()


def decode_kernels():
    """vindex3.exec.ops.decode when its kernels are on (imported on first use), else None."""
    if not DECODE.on:
        return None
    if DECODE.mod is None:
        from . import decode

        DECODE.mod = decode
    return DECODE.mod


_prefill: list = []


def prefill_kernels():
    """vindex3.exec.ops.prefill_attend when its kernels are on (imported on first use: numba
    costs resident memory a run that never makes a pass of more than SMALL_ROWS should not
    pay), else None. They are made of the decode kernels and go off with them
    (``VINDEX3_DECODE_KERNELS=0``), or alone (``VINDEX3_PREFILL_KERNELS=0``)."""
    if not DECODE.on:
        return None
    if not _prefill:
        from . import prefill_attend

        _prefill.append(prefill_attend)
    return _prefill[0] if _prefill[0].PREFILL.on else None


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    if (DECODE.on and x.ndim > 1 and x.shape[0] <= SMALL_ROWS and x.dtype == np.float32 and weight.dtype == np.float32
            and (k := DECODE.mod or decode_kernels()) is not None):
        # a decode-sized pass: one compiled call with numpy's own bytes (decode.rms_rows)
        y, ok = k.rms_rows(x, weight, eps)
        if not ok:
            _finite(np.array([np.nan], np.float32))
        return y
    if (x.ndim > 1 and x.shape[0] > SMALL_ROWS and x.dtype == np.float32 and weight.dtype == np.float32
            and (k := prefill_kernels()) is not None):
        # a prefill-sized pass: rows split over the threads, numpy's own bytes (prefill_attend.rms_rows)
        y, ok = k.rms_rows(x, weight, eps)
        if not ok:
            _finite(np.array([np.nan], np.float32))
        return y
    # x: [..., d]. The mean is np.mean's own two ufunc calls (a float32 sum, then a division by
    # the count as an intp, in place), so the bytes are np.mean's; its Python wrapper cost
    # ~10 us a call, 61 calls a decode step on SmolLM2.
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by name just below
        var = _sum(np.square(x), axis=-1, dtype=np.float32, keepdims=True)
    np.true_divide(var, np.intp(x.shape[-1]), out=var, casting="unsafe")
    _finite(var)
    return weight * (x * (np.float32(1.0) / np.sqrt(var + eps)))


def _finite(var: np.ndarray) -> None:
    """A norm's mean of squares (one value per row) must be finite: an overflow here would make
    the norm's output exactly 0 and the model's logits silently 0."""
    if not np.isfinite(var).all():
        from ...errors import NonFiniteActivation

        raise NonFiniteActivation("a norm's mean of squares is not finite in float32 (an activation past float32's "
                                  "range, or NaN, reached it)", site="norm")


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None, eps: np.float32) -> np.ndarray:
    # x: [..., d]; as torch's LayerNorm: the biased variance, float32 throughout
    n = np.intp(x.shape[-1])
    mean = _sum(x, axis=-1, dtype=np.float32, keepdims=True)
    np.true_divide(mean, n, out=mean, casting="unsafe")
    c = x - mean
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is refused by name just below
        var = _sum(np.square(c), axis=-1, dtype=np.float32, keepdims=True)
    np.true_divide(var, n, out=var, casting="unsafe")
    _finite(var)
    y = weight * (c * (np.float32(1.0) / np.sqrt(var + eps)))
    return y if bias is None else y + bias


def norm_fn(kind: str, weight: np.ndarray, bias: np.ndarray | None, eps: np.float32):
    """x -> the norm of x, for a norm kind of the graph (``rms`` or ``layer``)."""
    if kind == "layer":
        return lambda x: layer_norm(x, weight, bias, eps)
    if bias is not None:
        raise ValueError("an RMS norm takes no bias")
    return lambda x: rms_norm(x, weight, eps)
