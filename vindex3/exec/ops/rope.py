"""Rotary position tables (rotate-half convention), float32, with the scaling types the
supported configs declare: default, linear, llama3, yarn.

YaRN (transformers 5.24 ``_compute_yarn_parameters``): per frequency a blend of the plain
(extrapolated) and the factor-divided (interpolated) inverse frequency, by a linear ramp over
the rotary dims between the correction range of ``beta_fast`` and ``beta_slow`` rotations at
``original_max_position_embeddings`` (floored / ceiled when ``truncate``); cos and sin are then
multiplied by ``attention_factor``. Admission resolves every one of these values and records
it in the graph (the defaults the reference fills in included)."""

from __future__ import annotations

import math

import numpy as np

from ...errors import UnsupportedOperator


def inv_freq(theta: float, dim: int, scaling: dict | None) -> np.ndarray:
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv = (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)
    if scaling is None:
        return inv
    kind = scaling.get("type")
    if kind == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if kind == "llama3":
        factor = scaling["factor"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old / lo, old / hi
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wl, inv / np.float32(factor), inv).astype(np.float32)
        smooth = ((np.float32(old) / wavelen - np.float32(lo)) / np.float32(hi - lo)).astype(np.float32)
        smoothed = ((1 - smooth) * scaled / np.float32(factor) + smooth * scaled).astype(np.float32)
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    if kind == "yarn":
        return _yarn_inv_freq(theta, dim, scaling)
    raise UnsupportedOperator(f"rope scaling {kind!r} has no executor (supported: linear, llama3, yarn)")


def _yarn_inv_freq(theta: float, dim: int, s: dict) -> np.ndarray:
    base, factor, orig = float(theta), float(s["factor"]), float(s["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:  # python floats, as the reference
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(float(s["beta_fast"])), correction_dim(float(s["beta_slow"]))
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    pos = (np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))).astype(np.float32)
    extrapolated = np.float32(1.0) / pos
    interpolated = np.float32(1.0) / (np.float32(factor) * pos)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    keep = np.float32(1.0) - ramp.astype(np.float32)
    return (interpolated * (np.float32(1.0) - keep) + extrapolated * keep).astype(np.float32)


def attention_factor(scaling: dict | None) -> float:
    """The factor cos and sin are multiplied by (1 unless the scaling declares one)."""
    return float(scaling.get("attention_factor", 1.0)) if scaling else 1.0


class RopeTable:
    """cos/sin rows for absolute positions, grown on demand."""

    def __init__(self, theta: float, dim: int, scaling: dict | None):
        self.inv = inv_freq(theta, dim, scaling)
        self.factor = np.float32(attention_factor(scaling))
        self.dim = dim
        self.cos = np.empty((0, dim), np.float32)
        self.sin = np.empty((0, dim), np.float32)

    def rows(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        need = start + count
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 256)
            pos = np.arange(n, dtype=np.float32)
            freqs = np.outer(pos, self.inv).astype(np.float32)
            emb = np.concatenate([freqs, freqs], axis=-1)
            self.cos, self.sin = np.cos(emb), np.sin(emb)
            if self.factor != 1:
                self.cos, self.sin = self.cos * self.factor, self.sin * self.factor
        return self.cos[start:need], self.sin[start:need]


def apply(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x: [T, heads, d]; cos/sin: [T, r] with r <= d. The first r dims of each head rotate
    (rotate-half within them); the remaining d - r pass unchanged (partial rotary)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        out = np.empty(x.shape, np.float32)
        out[..., :r] = apply(x[..., :r], cos, sin)
        out[..., r:] = x[..., r:]
        return out
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
