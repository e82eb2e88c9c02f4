"""Rotary position tables (rotate-half convention), float32, with the scaling types the
supported configs declare: default, linear, llama3."""

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
    raise UnsupportedOperator(f"rope scaling {kind!r} has no executor (supported: linear, llama3)")


class RopeTable:
    """cos/sin rows for absolute positions, grown on demand."""

    def __init__(self, theta: float, dim: int, scaling: dict | None):
        self.inv = inv_freq(theta, dim, scaling)
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
