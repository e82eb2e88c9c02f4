"""What ran: plan indices in order (a count is not an identity), timings, the operand bytes each
call touched, and the records of ops whose kernels report per call (`vindex3.operators.OpRecord`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class OpCall:
    """One call of a reporting op: where it ran (layer, slot, operator name), the positions it
    covered (``position`` .. ``position + positions - 1``), the operand bytes it read, and the
    operator's own record (``detail``, plain data through ``to_data()``)."""

    layer: int
    slot: str
    op: str
    position: int
    positions: int
    bytes_read: int
    detail: Any = None

    def to_data(self) -> dict:
        d = self.detail.to_data() if hasattr(self.detail, "to_data") else self.detail
        return {"layer": self.layer, "slot": self.slot, "op": self.op, "position": self.position,
                "positions": self.positions, "bytes_read": self.bytes_read, "detail": d}


@dataclass
class ExecutionTrace:
    executed_layers: list[int] = field(default_factory=list)
    prepare_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # one entry per prefill/step call
    positions: int = 0
    operand_reads: int = 0  # at preparation: operand references resolved
    bytes_read: int = 0  # at preparation: distinct operand bytes mapped for the slice
    # One entry per prefill/step call: the operand bytes that call touched (at their stored
    # encoding). An op that does not report touches all of its operands; a reporting op counts
    # what it said it read; the embedding counts the rows it gathered.
    step_bytes: list[int] = field(default_factory=list)
    op_calls: list[OpCall] = field(default_factory=list)  # calls of reporting ops, in order
    # how the products treated activations ('exact' | 'q8', vindex3.codecs.base.ACTIVATIONS)
    activations: str = "exact"

    @property
    def total_step_seconds(self) -> float:
        return float(sum(self.step_seconds))

    def calls(self, op: str | None = None, layer: int | None = None) -> list[OpCall]:
        """Recorded calls, optionally of one operator and/or one layer, in execution order."""
        return [c for c in self.op_calls if (op is None or c.op == op) and (layer is None or c.layer == layer)]
