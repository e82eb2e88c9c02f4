"""The canonical continuation state: per executed layer, the state object of each op that keeps
any (keyed by the op's slot in the layer, "mixer" or "ffn"), with an explicit position counter.

Every op state answers the same questions (`OpState`): how many bytes it holds, a snapshot and a
restore, and a truncation to an earlier position (refused by name where a recurrence cannot be
cut back). The provider only iterates; it never asks what kind of state an op keeps."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..continuation import TRUNCATE, Geometry
from ..errors import StateError


class OpState:
    """What every op's state answers. Subclasses: rows that grow per position (truncatable), and
    fixed buffers (`BufferState`, snapshot only)."""

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    def snapshot(self) -> Any:
        raise NotImplementedError

    def restore(self, snap: Any) -> None:
        raise NotImplementedError

    def truncate(self, position: int) -> None:
        raise NotImplementedError


class BufferState(OpState):
    """Named fixed-size float32 buffers (a recurrence). A snapshot copies them; truncation is
    refused: a recurrence cannot be cut back without one."""

    names: tuple[str, ...] = ()

    def __init__(self, *arrays: np.ndarray, **buffers: np.ndarray):
        if len(arrays) > len(self.names):
            raise StateError(f"{type(self).__name__} holds {len(self.names)} buffers ({', '.join(self.names)}); got {len(arrays)}")
        buffers = {**dict(zip(self.names, arrays)), **buffers}
        if set(buffers) != set(self.names):
            raise StateError(f"{type(self).__name__} holds buffers {', '.join(self.names)}; got {', '.join(sorted(buffers))}")
        for k, v in buffers.items():
            setattr(self, k, v)

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.names)

    def copy(self) -> BufferState:
        """An independent state of the same kind: buffers copied, everything else carried."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        for n in self.names:
            setattr(new, n, getattr(self, n).copy())
        return new

    def _extra(self) -> dict:
        """State beyond the buffers that a snapshot must carry (e.g. whether the layer ran)."""
        return {}

    def snapshot(self) -> dict:
        return {"buffers": {n: getattr(self, n).copy() for n in self.names}, "extra": dict(self._extra())}

    def restore(self, snap: dict) -> None:
        for n in self.names:
            getattr(self, n)[...] = snap["buffers"][n]
        for k, v in snap["extra"].items():
            setattr(self, k, v)

    def truncate(self, position: int) -> None:
        raise StateError(
            f"{type(self).__name__} keeps a recurrence ({', '.join(self.names)}), which cannot be truncated to "
            f"position {position}; it rolls back only through snapshot() and restore()"
        )


class RecurrentState(BufferState):
    """A recurrence's fixed buffers (``names``, shapes from its params' ``buffers()``) and
    whether the layer has run (transformers' "the cache holds a state for this layer"): the
    choice between a chunked pass and a single step depends on the state alone, and a snapshot
    carries it."""

    def __init__(self, *buffers: np.ndarray, started: bool = False, **named: np.ndarray):
        super().__init__(*buffers, **named)
        self.started = started

    @classmethod
    def zeros(cls, p: Any) -> RecurrentState:
        """Zero buffers of the shapes ``p.buffers()`` states: (name, shape, dtype)."""
        return cls(**{name: np.zeros(shape, np.float32) for name, shape, _ in p.buffers()})

    def _extra(self) -> dict:
        return {"started": self.started}


class LayerState:
    """The state of one layer: op slot -> that op's state."""

    __slots__ = ("geometry", "index", "ops")

    def __init__(self, index: int, geometry: Geometry, ops: dict[str, OpState]):
        self.index, self.geometry, self.ops = index, geometry, ops

    def __getitem__(self, slot: str) -> OpState | None:
        return self.ops.get(slot)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.ops.values())


class ContinuationState:
    """State for the executed layers only, and the position the next token takes."""

    def __init__(self, layers: dict[int, LayerState]):
        self.layers = layers
        self.position = 0

    @property
    def nbytes(self) -> int:
        return sum(ls.nbytes for ls in self.layers.values())

    def truncate(self, pos: int) -> None:
        """Roll back to ``pos``. Rows truncate; a state with any fixed recurrence refuses by name
        (it rolls back through snapshot and restore), before anything is cut."""
        if isinstance(pos, bool) or not isinstance(pos, int) or pos > self.position or pos < 0:
            raise StateError(f"cannot truncate to position {pos!r}: the state is at {self.position}")
        if pos == self.position:
            return
        held = [i for i, ls in self.layers.items() if ls.geometry.rollback != TRUNCATE]
        if held:
            more = "…" if len(held) > 4 else ""
            raise StateError(
                f"cannot truncate: layers {held[:4]}{more} keep recurrent state, which rolls back only through "
                "snapshot() and restore()"
            )
        for ls in self.layers.values():
            for s in ls.ops.values():
                s.truncate(pos)
        self.position = pos

    def snapshot(self) -> dict:
        return {
            "position": self.position,
            "layers": {i: {k: s.snapshot() for k, s in ls.ops.items()} for i, ls in self.layers.items()},
        }

    def restore(self, snap: dict) -> None:
        if not isinstance(snap, dict) or set(snap) != {"position", "layers"} or set(snap["layers"]) != set(self.layers):
            raise StateError("restore() takes a snapshot returned by snapshot() of this stream")
        for i, ls in self.layers.items():
            for k, s in ls.ops.items():
                s.restore(snap["layers"][i][k])
        self.position = snap["position"]
