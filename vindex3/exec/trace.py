"""What ran: plan indices in order (a count is not an identity), and timings."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ExecutionTrace:
    executed_layers: list[int] = field(default_factory=list)
    prepare_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)  # one entry per prefill/step call
    positions: int = 0
    operand_reads: int = 0
    bytes_read: int = 0

    @property
    def total_step_seconds(self) -> float:
        return float(sum(self.step_seconds))
