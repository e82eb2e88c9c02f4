"""Execution slices. ``Draft(end)`` is prefix-only by construction: the type holds one bound,
so it cannot express a scattered subset of layers."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SliceError
from ..opplan import OperandRef, OpPlan


@dataclass(frozen=True)
class Full:
    """Embedding, every layer, final norm and head."""

    def describe(self) -> str:
        return "full model"


@dataclass(frozen=True)
class Draft:
    """Embedding, layers [0, end), then the component's own final norm and head."""

    end: int

    def describe(self) -> str:
        return f"draft depth {self.end}"


@dataclass(frozen=True)
class LayerRange:
    """Layers [start, end): hidden states in, hidden states out, no ends."""

    start: int
    end: int

    def describe(self) -> str:
        return f"layers {self.start}..{self.end - 1}"


ExecutionSlice = Full | Draft | LayerRange


@dataclass
class SlicePlan:
    slice: ExecutionSlice
    model_layers: int
    executed_layers: list[int]
    has_ends: bool
    end_operands: list[OperandRef]
    layer_operands: dict[int, list[OperandRef]]

    @property
    def ends_reads(self) -> int:
        return len(self.end_operands)

    @property
    def ends_bytes(self) -> int:
        """Distinct bytes of the ends: a tied head re-reads the embedding (a read, no new bytes)."""
        return _distinct_bytes(self.end_operands)

    @property
    def layer_reads(self) -> int:
        return sum(len(v) for v in self.layer_operands.values())

    @property
    def layer_bytes(self) -> int:
        return _distinct_bytes([r for v in self.layer_operands.values() for r in v])

    @property
    def total_reads(self) -> int:
        return self.ends_reads + self.layer_reads

    @property
    def total_bytes(self) -> int:
        """Bytes of distinct tensors the slice prepares (a tied head reads the embedding again,
        which costs a read but no new bytes)."""
        return _distinct_bytes(self.operands)

    @property
    def operands(self) -> list[OperandRef]:
        return list(self.end_operands) + [r for i in self.executed_layers for r in self.layer_operands[i]]


def _distinct_bytes(refs: list[OperandRef]) -> int:
    return sum({r.label: r.nbytes for r in refs}.values())


def resolve(sl: ExecutionSlice, num_layers: int) -> tuple[list[int], bool]:
    """The layers a slice executes, and whether it has the ends. Refuses, never clamps."""
    L = num_layers
    if isinstance(sl, Full):
        return list(range(L)), True
    if isinstance(sl, Draft):
        if not isinstance(sl.end, int) or isinstance(sl.end, bool):
            raise SliceError(f"draft depth must be an integer, got {sl.end!r}")
        if sl.end <= 0:
            raise SliceError(f"draft depth {sl.end} leaves nothing between the embedding and the head; the smallest draft is depth 1")
        if sl.end > L:
            raise SliceError(f"draft depth {sl.end} is deeper than the model, which has {L} layers (valid depths: 1..{L})")
        return list(range(sl.end)), True
    if isinstance(sl, LayerRange):
        if sl.start < 0 or sl.end > L or sl.start >= sl.end:
            raise SliceError(f"layer range [{sl.start}, {sl.end}) is not within the model's layers [0, {L}) or is empty")
        return list(range(sl.start, sl.end)), False
    raise SliceError(f"unknown execution slice {sl!r}")


def plan_slice(plan: OpPlan, sl: ExecutionSlice) -> SlicePlan:
    layers, ends = resolve(sl, len(plan.layers))
    end_ops = [r for op in plan.end_ops for r in op.operands.values()] if ends else []
    return SlicePlan(sl, len(plan.layers), layers, ends, end_ops, {i: plan.layers[i].operands() for i in layers})
