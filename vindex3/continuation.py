"""Continuation geometry: what state a layer keeps between positions, derived from its ops.

Kv{kv_dim, window}     grows 2·kv_dim values per position (capped at the window)
LatentKv{width}        grows ``width`` values per position (one latent row, not a K/V pair)
Recurrent{buffers}     fixed size, independent of sequence length
KvAndRecurrent         both
Stateless              nothing

Every byte count STATS, EXPLAIN or a provider reports comes from here."""

from __future__ import annotations

import math
from dataclasses import dataclass

ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


@dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str = "f32"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


@dataclass(frozen=True)
class Geometry:
    kind: str  # "kv" | "latent_kv" | "recurrent" | "kv_and_recurrent" | "stateless"
    kv_dim: int = 0
    window: int | None = None
    latent_width: int = 0
    buffers: tuple[Buffer, ...] = ()
    dtype: str = "f32"

    @property
    def keeps_kv(self) -> bool:
        return self.kind in ("kv", "kv_and_recurrent")

    @property
    def bytes_per_position(self) -> int:
        """Bytes added per position while below any window."""
        if self.keeps_kv:
            return 2 * self.kv_dim * ITEMSIZE[self.dtype]
        if self.kind == "latent_kv":
            return self.latent_width * ITEMSIZE[self.dtype]
        return 0

    @property
    def fixed_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def bytes_at(self, positions: int) -> int:
        n = positions if self.window is None else min(positions, self.window)
        return self.bytes_per_position * n + self.fixed_bytes

    def describe(self) -> str:
        if self.kind == "stateless":
            return "Stateless"
        parts = []
        if self.keeps_kv:
            w = f", window={self.window}" if self.window else ""
            parts.append(f"Kv{{kv_dim={self.kv_dim}{w}}}")
        if self.kind == "latent_kv":
            parts.append(f"LatentKv{{width={self.latent_width}}}")
        if self.buffers:
            bufs = ", ".join(f"{b.name}{list(b.shape)}:{b.dtype}" for b in self.buffers)
            parts.append(f"Recurrent{{{bufs}}}")
        return " + ".join(parts)


STATELESS = Geometry("stateless")


def kv(kv_dim: int, window: int | None = None) -> Geometry:
    return Geometry("kv", kv_dim=kv_dim, window=window)


def latent(width: int) -> Geometry:
    return Geometry("latent_kv", latent_width=width)


def recurrent(buffers: list[Buffer]) -> Geometry:
    return Geometry("recurrent", buffers=tuple(buffers))


def combine(parts: list[Geometry]) -> Geometry:
    """Geometry of a layer whose ops keep the given parts of state."""
    parts = [p for p in parts if p.kind != "stateless"]
    if not parts:
        return STATELESS
    if len(parts) == 1:
        return parts[0]
    kvs = [p for p in parts if p.keeps_kv]
    bufs = tuple(b for p in parts for b in p.buffers)
    lat = [p for p in parts if p.kind == "latent_kv"]
    if len(kvs) == 1 and not lat and bufs:
        return Geometry("kv_and_recurrent", kv_dim=kvs[0].kv_dim, window=kvs[0].window, buffers=bufs)
    if not kvs and not lat:
        return Geometry("recurrent", buffers=bufs)
    raise ValueError(f"no geometry combines {[p.kind for p in parts]}")


@dataclass
class Summary:
    layers: int
    kv_layers: int
    kv_bytes_per_position: int  # summed over KV layers (below their windows)
    windowed_kv_layers: int
    recurrent_layers: int
    recurrent_bytes: int  # fixed, independent of sequence length
    latent_layers: int
    latent_bytes_per_position: int
    stateless_layers: int

    def total_at(self, geoms: list[Geometry], positions: int) -> int:
        return sum(g.bytes_at(positions) for g in geoms)


def summarize(geoms: list[Geometry]) -> Summary:
    return Summary(
        layers=len(geoms),
        kv_layers=sum(g.keeps_kv for g in geoms),
        kv_bytes_per_position=sum(g.bytes_per_position for g in geoms if g.keeps_kv),
        windowed_kv_layers=sum(1 for g in geoms if g.keeps_kv and g.window),
        recurrent_layers=sum(1 for g in geoms if g.buffers),
        recurrent_bytes=sum(g.fixed_bytes for g in geoms),
        latent_layers=sum(1 for g in geoms if g.kind == "latent_kv"),
        latent_bytes_per_position=sum(g.bytes_per_position for g in geoms if g.kind == "latent_kv"),
        stateless_layers=sum(1 for g in geoms if g.kind == "stateless"),
    )
