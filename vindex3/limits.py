"""Named limits on a run: the context length (a graph fact from admission) and the memory a
prefill needs (an estimate from the plan), for front ends to refuse a statement before any work.

* `context_limit(graph_fact, override)` -> (limit or None, where it comes from). The graph's
  ``surface.context_length`` is the limit unless an explicit override is given; an override may
  raise it past the context length (the caller says so, by name). A graph that records no
  context length (a pure recurrence states none; graphs encoded before the fact was recorded
  lack it) sets no limit.
* `check_context(total, limit, source, what)` refuses with `ContextLengthExceeded`.
* `estimate_prefill(plan, positions, slice, start=0, last_only=False)` -> `MemoryEstimate`:
  the bytes of the arrays a prefill of ``positions`` new positions (after ``start`` held ones)
  allocates, by part. `Container.estimate_prefill` is the same question on an opened container.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import ContextLengthExceeded, InputError, LimitExceeded

OVERHEAD = 64 << 10  # array headers, index arrays, masks of a one-position pass
GRAPH_FACT = "the model's context length (surface.context_length, recorded at admission)"
OVERRIDE = "the explicit position limit"
NO_LIMIT = "no recorded context length"


def context_limit(graph_fact: int | None, override: int | None = None) -> tuple[int | None, str]:
    """The position limit in force and where it comes from."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override < 1:
            raise InputError(f"a position limit is a positive integer, got {override!r}")
        return override, OVERRIDE
    if graph_fact is None:
        return None, NO_LIMIT
    return graph_fact, GRAPH_FACT


def check_context(total: int, limit: int | None, source: str = GRAPH_FACT, what: str = "this run") -> None:
    """Refuse when ``total`` positions (prompt and generation together) exceed ``limit``."""
    if limit is not None and total > limit:
        hint = ("shorten the prompt or the generation" if source == OVERRIDE else
                "shorten the prompt or the generation, or raise the limit explicitly "
                "(Container.executor(max_positions=N); in LQL, the context length setting)")
        raise ContextLengthExceeded(f"{what} needs {total} positions; {source} is {limit}", hint=hint)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a prefill needs, by part. ``unknown`` lists the ops that state no estimate (their
    share is missing from ``total``; ``complete`` is False then)."""

    positions: int
    start: int
    parts: dict[str, int]
    unknown: tuple[str, ...] = field(default=())

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    @property
    def complete(self) -> bool:
        return not self.unknown

    def describe(self) -> str:
        body = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.parts.items())
        tail = f"; no estimate for {', '.join(self.unknown)}" if self.unknown else ""
        return f"{format_bytes(self.total)} ({body}{tail})"


def format_bytes(n: int) -> str:
    """Bytes in binary units, for any non-negative integer however large."""
    n = int(n)
    units = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    v, u = float(n), 0
    while v >= 1024 and u < len(units) - 1:
        v /= 1024
        u += 1
    if u == len(units) - 1 and v >= 1024:
        return f"{n:.3e} B"
    return f"{n} B" if u == 0 else f"{v:.1f} {units[u]}"


def _count(v, what: str, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise InputError(f"{what} must be an integer >= {minimum}, got {v!r}")
    return v


def estimate_prefill(plan, positions: int, sl=None, *, start: int = 0, last_only: bool = False) -> MemoryEstimate:
    """The arrays a prefill of ``positions`` new positions after ``start`` held ones allocates
    under slice ``sl`` (the full model by default):

    * state: every executed layer's continuation parts at ``start + positions`` positions, twice
      over for rows (row buffers grow by doubling), plus one layer's copy while it grows;
    * residual: the residual stream, the current activation and a norm's output, [T, hidden];
    * layer work: the largest temporary arrays any one op allocates (ops run one at a time);
    * logits: the head's output [T or 1, vocab] and the final norm's rows;
    * overhead: a fixed 64 KiB for what a short pass allocates besides its arrays.

    The weights are memory-mapped, not allocated, and are not counted.

    An estimate of what numpy allocates, not a measurement; it is meant to be compared with a
    limit before a statement runs (tests/test_limits.py checks it against traced allocations)."""
    from .exec.slice import Full, resolve

    T = _count(positions, "positions", 1)
    p0 = _count(start, "start", 0)
    P = p0 + T
    layers, ends = resolve(sl if sl is not None else Full(), len(plan.layers))
    H = plan.hidden_size
    state = 0
    grow = 0
    work = 0
    unknown: list[str] = []
    for i in layers:
        lo = plan.layers[i]
        layer_state = 0
        for part in lo.geometry.parts:
            if part.per_position:
                rows = P if part.window is None else min(P, part.window + 128)
                layer_state += 2 * rows * part.row_bytes
            else:
                layer_state += part.fixed_bytes
        state += layer_state
        grow = max(grow, layer_state // 2)
        for op in lo.slot_ops():
            if op.operator is None:
                continue
            w = op.operator.work_bytes(op.params, T, P)
            if w is None:
                unknown.append(f"layer {i} {op.kind}")
            else:
                work = max(work, int(w))
    parts = {"state": state + grow, "residual": 3 * T * H * 4, "layer work": work, "overhead": OVERHEAD}
    if ends:
        rows = 1 if last_only else T
        scaled = plan.head.params.get("multiplier") != 1 or bool(plan.head.params.get("softcap"))
        parts["logits"] = rows * plan.vocab * 4 * (2 if scaled else 1) + rows * H * 4
    return MemoryEstimate(positions=T, start=p0, parts=parts, unknown=tuple(unknown))


def check_memory(estimate: MemoryEstimate, limit: int, what: str = "this statement") -> None:
    """Refuse (LimitExceeded) when the estimate exceeds ``limit`` bytes, stating both."""
    if estimate.total > limit:
        raise LimitExceeded(f"{what} would need about {estimate.describe()}; the memory limit is {format_bytes(limit)}",
                            hint="shorten the prompt, or raise the memory limit explicitly")
