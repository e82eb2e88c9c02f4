"""One run with its residual stream kept: the residual entering the first executed layer, every
slot's write and the residual after it (and, when asked, every slot's input), through the
executor's `Observer` hook. The run itself is the executor's own: observing changes no byte."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ..exec.engine import Executor, Observer


@dataclass
class SiteWrite:
    layer: int
    site: str  # "mixer" | "ffn"
    operator: str  # the slot's op kind (softmax, mamba2, gated_ffn, ...)
    write: np.ndarray  # [T, hidden]: exactly what was added to the residual
    residual: np.ndarray  # [T, hidden]: the residual after it


@dataclass
class CapturedRun:
    ids: list[int]
    logits: np.ndarray  # [T, vocab]: the run's own output
    embedding: np.ndarray  # [T, hidden]: the residual entering the first executed layer
    writes: list[SiteWrite]  # in execution order
    inputs: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)  # (layer, site) -> [T, hidden]
    executed: list[int] = field(default_factory=list)

    def after(self, layer: int) -> np.ndarray:
        """The residual after ``layer`` (after its last write)."""
        return [w for w in self.writes if w.layer == layer][-1].residual

    @property
    def final(self) -> np.ndarray:
        return self.writes[-1].residual if self.writes else self.embedding


class _Capture(Observer):
    def __init__(self, plan, inputs: bool):
        self.plan = plan
        self.keep_inputs = inputs
        self.embedding = None
        self.writes: list[SiteWrite] = []
        self.inputs: dict[tuple[int, str], np.ndarray] = {}

    def begin(self, p0, h):
        self.embedding = h

    def slot_input(self, layer, site, p0, x):
        if self.keep_inputs:
            self.inputs[(layer, site)] = x

    def write(self, layer, site, p0, write, residual):
        kind = next(op.kind for op in self.plan.layers[layer].slot_ops() if op.role == site)
        self.writes.append(SiteWrite(layer, site, kind, write, residual))


def capture(ex: Executor, ids: Sequence[int], *, inputs: bool = False) -> CapturedRun:
    """Prefill ``ids`` in one pass through a fresh stream of ``ex`` and keep its residual stream."""
    cap = _Capture(ex.plan, inputs)
    st = ex.start(observer=cap)
    logits = np.asarray(st.prefill(list(ids)))
    return CapturedRun(list(ids), logits, cap.embedding, cap.writes, cap.inputs, list(st.trace.executed_layers))
