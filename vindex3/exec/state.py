"""The canonical continuation state: one provider holding, per executed layer, exactly the
kind of state its geometry declares (KV rows, recurrent buffers, latent rows), with an
explicit position counter."""

from __future__ import annotations

import numpy as np

from ..continuation import Geometry
from ..errors import StateError

# Rows kept beyond a sliding window, so that a speculative rollback of a few positions still
# finds the keys it needs.
WINDOW_SLACK = 64


class KvRows:
    """K and V rows of one layer: [kv_heads, rows, head_dim] each, grown geometrically."""

    def __init__(self, kv_heads: int, head_dim: int, window: int | None):
        self.kv_heads, self.head_dim, self.window = kv_heads, head_dim, window
        cap = 64
        self.k = np.empty((kv_heads, cap, head_dim), np.float32)
        self.v = np.empty((kv_heads, cap, head_dim), np.float32)
        self.start = 0  # absolute position of row 0
        self.end = 0  # absolute position one past the last row

    def append(self, k: np.ndarray, v: np.ndarray) -> None:
        """k, v: [T, kv_heads, head_dim]."""
        T = k.shape[0]
        self._compact()
        lo = self.end - self.start
        hi = lo + T
        if hi > self.k.shape[1]:
            cap = max(hi, 2 * self.k.shape[1])
            nk = np.empty((self.kv_heads, cap, self.head_dim), np.float32)
            nv = np.empty_like(nk)
            nk[:, :lo] = self.k[:, :lo]
            nv[:, :lo] = self.v[:, :lo]
            self.k, self.v = nk, nv
        self.k[:, lo:hi] = k.transpose(1, 0, 2)
        self.v[:, lo:hi] = v.transpose(1, 0, 2)
        self.end += T

    def _compact(self) -> None:
        if self.window is None:
            return
        keep = self.window + WINDOW_SLACK
        rows = self.end - self.start
        if rows > 2 * keep:
            drop = rows - keep
            self.k[:, : rows - drop] = self.k[:, drop:rows].copy()
            self.v[:, : rows - drop] = self.v[:, drop:rows].copy()
            self.start += drop

    def view(self, from_pos: int) -> tuple[np.ndarray, np.ndarray]:
        if from_pos < self.start:
            raise StateError(f"KV rows before position {self.start} were released (asked for {from_pos})")
        a, b = from_pos - self.start, self.end - self.start
        return self.k[:, a:b], self.v[:, a:b]

    def truncate(self, pos: int) -> None:
        if pos > self.end:
            raise StateError(f"cannot truncate KV rows forward to {pos} (they end at {self.end})")
        if pos < self.start:
            raise StateError(f"cannot roll KV rows back to {pos}: rows before {self.start} were released by the window")
        self.end = pos

    @property
    def nbytes(self) -> int:
        return 2 * (self.end - self.start) * self.kv_heads * self.head_dim * 4

    def copy(self) -> "KvRows":
        c = KvRows(self.kv_heads, self.head_dim, self.window)
        n = self.end - self.start
        c.k = self.k[:, : max(n, 1)].copy()
        c.v = self.v[:, : max(n, 1)].copy()
        c.start, c.end = self.start, self.end
        return c


class LayerState:
    """State of one layer: its KV rows and/or recurrent buffers, per its geometry."""

    __slots__ = ("index", "geometry", "kv", "recurrent")

    def __init__(self, index: int, geometry: Geometry, kv: KvRows | None, recurrent: object | None):
        self.index, self.geometry, self.kv, self.recurrent = index, geometry, kv, recurrent


class ContinuationState:
    """Holds state for the executed layers only. Kinds this provider can hold: kv, recurrent,
    kv_and_recurrent, stateless. Anything else is refused by name before allocating."""

    HOLDS = ("kv", "recurrent", "kv_and_recurrent", "stateless")

    def __init__(self, layers: dict[int, LayerState]):
        self.layers = layers
        self.position = 0

    @classmethod
    def preflight(cls, geometries: dict[int, Geometry]) -> None:
        """Check every executed layer's geometry before allocating anything."""
        bad = [(i, g.kind) for i, g in geometries.items() if g.kind not in cls.HOLDS]
        if bad:
            names = ", ".join(f"layer {i} ({k})" for i, k in bad)
            raise StateError(f"the continuation provider cannot hold {names}; it holds {', '.join(cls.HOLDS)}")

    @property
    def nbytes(self) -> int:
        total = 0
        for ls in self.layers.values():
            if ls.kv is not None:
                total += ls.kv.nbytes
            if ls.recurrent is not None:
                total += sum(getattr(ls.recurrent, b.name).nbytes for b in ls.geometry.buffers)
        return total

    def truncate(self, pos: int) -> None:
        """Roll back to ``pos``. KV rows truncate; recurrent buffers cannot be rolled back
        without a snapshot, so a state that has any refuses by name."""
        if pos > self.position or pos < 0:
            raise StateError(f"cannot truncate to position {pos}: the state is at {self.position}")
        rec = [i for i, ls in self.layers.items() if ls.recurrent is not None]
        if rec and pos != self.position:
            raise StateError(
                f"cannot truncate: layers {rec[:4]}{'…' if len(rec) > 4 else ''} keep recurrent state, which rolls back "
                "only through snapshot() and restore()"
            )
        for ls in self.layers.values():
            if ls.kv is not None:
                ls.kv.truncate(pos)
        self.position = pos

    def snapshot(self) -> dict:
        snap = {"position": self.position, "kv_end": {}, "recurrent": {}}
        for i, ls in self.layers.items():
            if ls.kv is not None:
                snap["kv_end"][i] = ls.kv.end
            if ls.recurrent is not None:
                snap["recurrent"][i] = ls.recurrent.copy()
        return snap

    def restore(self, snap: dict) -> None:
        for i, ls in self.layers.items():
            if ls.kv is not None:
                ls.kv.truncate(snap["kv_end"][i])
            if ls.recurrent is not None:
                ls.recurrent = snap["recurrent"][i].copy()
        self.position = snap["position"]
