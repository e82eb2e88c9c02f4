"""What a verifying pass costs on this process's executor, in decode steps: ``cost(T)`` is the
wall time of one pass over T positions divided by that of a single-position step (so
``cost(1) == 1``). A speculative round that verifies k drafts runs one pass of k + 1 positions,
so a drafter that knows the curve can weigh the tokens a proposal is expected to win against
what verifying it costs here, now — the curve moves with the kernels (a multi-row product that
streams its weights faster makes every T > 1 cheaper), the thread count and the machine.

`PassCosts` is measured once per process for a (container, slice, activations, threads) key
(`pass_costs`: rounds of passes over T = 1 .. t_max positions after a short context, each T's
time over the same round's single step, the median over the rounds kept: a pass and the step
it is divided by run within a round of each other, so a load that changes between rounds
cancels, and one descheduled pass does not move the median) and then learns from the rounds
the generations run (`observe`: each round that verified T positions over the plain steps just
before it, the median of the recent such ratios), so a cost that changes while the process runs
is followed.
A curve given by value (`PassCosts.linear`, `PassCosts.of`) never learns: tests and replays
stay deterministic.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import VindexError

CONTEXT = 16  # tokens held before a measured pass (a short prompt: attention is not what is measured)
ROUNDS = 3  # interleaved measuring rounds; the median of each T's per-round ratio is kept
WINDOW = 9  # recent passes per T the learned curve reads (a median: one descheduled pass does not move it)
MIN_SEEN = 3  # rounds of a T before the learned figure replaces the measured one
STEPS = 3  # plain steps a round's time is divided by (their median)


class PassCosts:
    """cost(T) in decode steps for T = 1 .. ``len(curve)`` (``curve[0]`` is 1); past the last
    measured T the last increment continues. Non-decreasing by construction (a pass over more
    positions never costs less; a lower reading is noise)."""

    def __init__(self, curve: Sequence[float], source: str = "given", learns: bool = False):
        c = [float(x) for x in curve]
        if not c or c[0] != 1.0 or any(not np.isfinite(x) or x <= 0 for x in c):
            raise VindexError(f"a pass-cost curve starts at cost(1) = 1 and holds positive numbers; got {list(curve)!r}")
        self.source = source  # "measured" | "given" | "linear c"
        self.learns = learns
        self._base = c
        self._curve = _monotone(c)
        self._seen: dict[int, deque] = {}  # T -> recent rounds' cost over the steps before them
        self._steps: deque = deque(maxlen=STEPS)  # the last plain steps' seconds

    @classmethod
    def linear(cls, c: float) -> PassCosts:
        """1 + c (T - 1): every verified position beyond the first costs ``c`` steps."""
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < 1:
            raise VindexError(f"lookup verify_cost must be a number in (0, 1) (decode steps per position); got {c!r}")
        return cls([1.0, 1.0 + float(c)], f"linear {float(c):g}")

    @classmethod
    def of(cls, value: Any) -> PassCosts:
        """A curve from what a caller gives: a PassCosts, a number c (`linear`), or cost(T) for
        T = 1, 2, ... as a sequence starting at 1."""
        if isinstance(value, PassCosts):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls.linear(value)
        if isinstance(value, (list, tuple)):
            return cls(value, "given")
        raise VindexError(f"lookup verify_cost must be a number, a cost curve or None (measured); got {value!r}")

    def cost(self, T: int) -> float:
        c = self._curve
        if T <= len(c):
            return c[T - 1]
        step = c[-1] - c[-2] if len(c) > 1 else 0.0
        return c[-1] + step * (T - len(c))

    def curve(self, t_max: int | None = None) -> list[float]:
        return [self.cost(T) for T in range(1, (t_max or len(self._curve)) + 1)]

    def observe(self, T: int, seconds: float) -> None:
        """A round that ran one pass over ``T`` positions took ``seconds`` (drafting and
        rollback included: what the round cost). A round over T > 1 positions is divided by the
        median of the last few plain steps before it (so a load that drifts over the generation
        cancels); cost(T) becomes the median of the last ``WINDOW`` such ratios once there are
        ``MIN_SEEN``. Learning curves only."""
        if not self.learns or T < 1 or not seconds > 0:
            return
        if T == 1:
            self._steps.append(seconds)
            return
        if not self._steps:
            return
        ratio = max(1.0, seconds / statistics.median(self._steps))
        seen = self._seen.setdefault(T, deque(maxlen=WINDOW))
        seen.append(ratio)
        if len(seen) < MIN_SEEN:
            return
        c = list(self._base)
        while len(c) < T:
            c.append(c[-1] + (c[-1] - c[-2] if len(c) > 1 else 0.0))
        c[T - 1] = statistics.median(seen)
        self._base = c
        # non-decreasing by raising only: a cost read too low makes a drafter propose drafts that
        # do not pay (slower than plain decoding), one read too high only proposes fewer
        self._curve = _monotone(c)


def _monotone(c: list[float]) -> list[float]:
    out, hi = [], 0.0
    for x in c:
        hi = max(hi, x)
        out.append(hi)
    return out


def measure(ex: Any, t_max: int, rounds: int = ROUNDS) -> list[float]:
    """cost(T) for T = 1 .. ``t_max`` on executor ``ex``: ``rounds`` rounds of one pass of each
    T (a step first) after a ``CONTEXT``-token prefill in a fresh stream, rolled back after each
    pass; per T the median over the rounds of its time over the round's step. Token ids are
    arbitrary (the cost does not read them). Context and T are cut to the executor's position
    limit, so a run that fits it is never refused by its own measurement."""
    vocab = int(ex.plan.vocab)
    limit = getattr(ex, "max_positions", None)  # the run's own limit: the measurement stays inside it
    if limit is not None:
        t_max = max(1, min(t_max, int(limit)))
    ctx = CONTEXT if limit is None else max(0, min(CONTEXT, int(limit) - t_max))
    ids = [(7 + 131 * i) % vocab for i in range(ctx + t_max)]
    st = ex.start()
    if ctx:
        st.prefill(ids[:ctx])
    base = st.position
    st.prefill(ids[ctx:ctx + t_max])  # warm: the first pass of a size may compile or fault pages in
    st.truncate(base)
    ratios: list[list[float]] = [[] for _ in range(t_max)]
    for _ in range(rounds):
        times = []
        for T in range(1, t_max + 1):
            t0 = time.perf_counter()
            st.prefill(ids[ctx:ctx + T])
            times.append(time.perf_counter() - t0)
            st.truncate(base)
        for T in range(t_max):
            ratios[T].append(times[T] / times[0])
    return [1.0] + [max(1.0, statistics.median(r)) for r in ratios[1:]]


_CACHE: dict[tuple, PassCosts] = {}


def pass_costs(container: Any, ex: Any, t_max: int) -> PassCosts:
    """The learning cost curve of this process for ``ex`` (measured on first use, up to T =
    ``t_max``; measured again when a longer one is asked), shared by every generation that
    runs the same container, slice, activations and thread count."""
    from ..codecs import threads

    sl = getattr(ex, "slice", None)
    key = (str(getattr(container, "digest", id(container))), type(ex).__name__,
           sl.describe() if sl is not None else None, getattr(ex, "activations", "exact"), threads.count())
    pc = _CACHE.get(key)
    if pc is None or len(pc._base) < t_max:
        pc = PassCosts(measure(ex, t_max), "measured", learns=True)
        _CACHE[key] = pc
    return pc
