"""Continuation geometry: what state a layer keeps between positions, as a list of named parts.

A part is one of the three kinds of state the graph vocabulary names:

KV         rows per position: a K and a V row of ``kv_dim`` values each (capped at a window)
LATENT     rows per position: one operator-defined row of ``width`` values (not a K/V pair)
RECURRENT  a fixed buffer (a recurrent matrix, a conv window), independent of sequence length

A layer's geometry is the parts of all its ops; a layer with none is stateless. Rows roll back
by truncation; fixed buffers roll back only through a snapshot. Every byte count that STATS,
EXPLAIN, SHOW LAYERS or a provider reports comes from here; operators build their parts with
`kv_rows`, `latent_rows` and `buffer` and never spell a kind themselves."""

from __future__ import annotations

import math
from dataclasses import dataclass

KV = "kv"
LATENT = "latent"
RECURRENT = "recurrent"
KINDS = (KV, LATENT, RECURRENT)

TRUNCATE = "truncate"
SNAPSHOT = "snapshot"

ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2}


@dataclass(frozen=True)
class StatePart:
    name: str  # unique within its layer, e.g. "kv", "ssm", "conv"
    kind: str  # KV | LATENT | RECURRENT
    shape: tuple[int, ...]  # one row's shape (rows) or the whole buffer's (fixed)
    per_position: bool  # rows grow with positions; buffers do not
    rollback: str  # TRUNCATE | SNAPSHOT
    dtype: str = "f32"
    window: int | None = None  # rows kept at most (sliding attention)

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype] if self.per_position else 0

    @property
    def fixed_bytes(self) -> int:
        return 0 if self.per_position else math.prod(self.shape) * ITEMSIZE[self.dtype]

    def bytes_at(self, positions: int) -> int:
        if not self.per_position:
            return self.fixed_bytes
        n = positions if self.window is None else min(positions, self.window)
        return self.row_bytes * n


def kv_rows(kv_dim: int, window: int | None = None, dtype: str = "f32") -> StatePart:
    """A K and a V row of ``kv_dim`` values per position."""
    return StatePart("kv", KV, (2, int(kv_dim)), True, TRUNCATE, dtype, window)


def latent_rows(width: int, name: str = "latent", dtype: str = "f32") -> StatePart:
    """One operator-defined row of ``width`` values per position."""
    return StatePart(name, LATENT, (int(width),), True, TRUNCATE, dtype)


def buffer(name: str, shape: tuple[int, ...], dtype: str = "f32") -> StatePart:
    """A fixed-size buffer; it rolls back only through a snapshot."""
    return StatePart(name, RECURRENT, tuple(int(s) for s in shape), False, SNAPSHOT, dtype)


@dataclass(frozen=True)
class Geometry:
    """The state one layer keeps: the parts of all its ops (none: stateless)."""

    parts: tuple[StatePart, ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.parts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"state part names must be unique within a layer; repeated: {', '.join(dup)}")

    @property
    def stateless(self) -> bool:
        return not self.parts

    def of(self, kind: str) -> tuple[StatePart, ...]:
        return tuple(p for p in self.parts if p.kind == kind)

    def has(self, kind: str) -> bool:
        return any(p.kind == kind for p in self.parts)

    @property
    def bytes_per_position(self) -> int:
        """Bytes added per position while below any window."""
        return sum(p.row_bytes for p in self.parts)

    @property
    def fixed_bytes(self) -> int:
        return sum(p.fixed_bytes for p in self.parts)

    def bytes_at(self, positions: int) -> int:
        return sum(p.bytes_at(positions) for p in self.parts)

    @property
    def rollback(self) -> str:
        """TRUNCATE when every part can be cut back to a position, else SNAPSHOT."""
        return SNAPSHOT if any(p.rollback == SNAPSHOT for p in self.parts) else TRUNCATE

    def describe(self) -> str:
        if not self.parts:
            return "Stateless"
        out = []
        for p in self.of(KV):
            w = f", window={p.window}" if p.window else ""
            out.append(f"Kv{{kv_dim={p.shape[1]}{w}}}")
        for p in self.of(LATENT):
            out.append(f"LatentKv{{width={p.shape[0]}}}")
        bufs = self.of(RECURRENT)
        if bufs:
            out.append("Recurrent{" + ", ".join(f"{b.name}{list(b.shape)}:{b.dtype}" for b in bufs) + "}")
        return " + ".join(out)


STATELESS = Geometry()


def combine(parts: list[StatePart]) -> Geometry:
    return Geometry(tuple(parts))
