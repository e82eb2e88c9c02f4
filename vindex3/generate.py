"""One generate step under every decode loop: INFER ... GENERATE, TRACE, the server's
completions and plain greedy decoding all drive a stream through `generate_step`.

``generate_step(stream, prompt_ids, sampler=..., max_tokens=n)`` is a generator of `Step`
records, one per model call:

* the prompt first: one prefill call over the whole prompt (``feed="prefill"``), or one call
  per prompt position (``feed="step"``, what TRACE shows: a trace and a prediction for every
  position);
* then one call per generated token, feeding the previous pick.

The last prompt call and every generated call pick the next token with the `Sampler`; a call
whose pick is a stop id, or that picked the ``max_tokens``-th token, is the last: the pick is
never fed back. A call runs only when the caller asks for its record, so a caller that stops
early (a stop string, Ctrl-C, a closed connection) costs no call it did not use.

The sampler is what every front end samples with: temperature 0 is the argmax of the float32
logits; above 0, softmax((logits - max) / temperature) in float64, cut to the smallest set
of tokens (by probability, stable order) whose cumulative probability reaches ``top_p``,
renormalised and drawn with ``numpy.random.default_rng(seed)``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from .errors import VindexError

__all__ = ["Sampler", "Step", "generate_step", "top_probabilities"]


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen: ``temperature`` 0 is greedy (argmax); above 0 a nucleus
    sample (``top_p``) from a generator seeded with ``seed`` (None: unseeded, not
    reproducible). A named executor choice: `describe` is what traces record."""

    temperature: float
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, s = self.temperature, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise VindexError(f"sampler temperature must be a finite number >= 0; got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise VindexError(f"sampler top_p must be a number in (0, 1]; got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise VindexError(f"sampler seed must be an integer or None; got {s!r}")

    @classmethod
    def greedy(cls) -> Sampler:
        return cls(temperature=0.0)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def describe(self) -> str:
        if self.is_greedy:
            return "greedy"
        seed = "unseeded" if self.seed is None else f"seed {self.seed}"
        return f"temperature {self.temperature:g}, top_p {self.top_p:g}, {seed}"

    def start(self) -> Callable[[np.ndarray], int]:
        """A picker for one generation (its own random generator, seeded once)."""
        if self.is_greedy:
            return lambda logits: int(np.argmax(logits))
        rng = np.random.default_rng(self.seed)
        return lambda logits: self.draw(logits, rng)

    def draw(self, logits: np.ndarray, rng: np.random.Generator) -> int:
        """One nucleus sample from ``logits`` with ``rng`` (temperature above 0)."""
        x = np.asarray(logits, dtype=np.float64)
        # the maximum first, then the division: every value is <= 0, so a tiny temperature
        # gives -inf (probability 0) instead of inf - inf = NaN
        with np.errstate(over="ignore"):
            x = (x - x.max()) / self.temperature
        p = np.exp(x)
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = order[: int(np.searchsorted(np.cumsum(p[order]), self.top_p)) + 1]
            q = np.zeros_like(p)
            q[keep] = p[keep]
            p = q / q.sum()
        return int(rng.choice(p.shape[0], p=p))


def top_probabilities(logits: np.ndarray, n: int) -> tuple[tuple[int, float], ...]:
    """The ``n`` most likely next tokens as (id, probability): softmax of the raw logits in
    float64, probability descending, then id ascending (ties never depend on a sort)."""
    x = np.asarray(logits).astype(np.float64)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    n = min(n, p.shape[0])
    order = np.lexsort((np.arange(p.shape[0]), -p))[:n]
    return tuple((int(i), float(p[i])) for i in order)


@dataclass(frozen=True)
class Step:
    """One model call of a generation and what was picked from it.

    ``fed``: the token ids the call consumed (the prompt, one prompt position, or the previous
    pick); ``prompt``: whether they came from the prompt; ``position``: positions the stream
    holds after the call. ``token``: the sampler's pick from this call's logits, None where no
    token is generated (prompt positions before the last when the prompt is stepped, or
    ``max_tokens`` 0); ``stop``: the pick is a stop id (the generation ends with it).
    ``logits`` (float32 [vocab], on request), ``top`` ((id, probability) pairs, on request),
    ``executed_layers`` and ``bytes_read`` (this call's entry of the stream's trace, None if the
    stream keeps no trace) and ``seconds`` (wall time of the call)."""

    index: int
    fed: tuple[int, ...]
    prompt: bool
    position: int
    token: int | None
    stop: bool
    logits: np.ndarray | None
    top: tuple[tuple[int, float], ...] | None
    executed_layers: tuple[int, ...] | None
    bytes_read: int | None
    seconds: float
    prompt_rows: np.ndarray | None = None  # the prefill's logits at every prompt position, on request


def _count(name: str, v: Any, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
        raise VindexError(f"generate_step {name} must be an integer >= {lo}; got {v!r}")
    return int(v)


def generate_step(
    stream: Any,
    prompt_ids: Sequence[int],
    *,
    sampler: Sampler,
    max_tokens: int,
    stop_ids: Iterable[int] = (),
    feed: Literal["prefill", "step"] = "prefill",
    logits: bool = False,
    prompt_logits: bool = False,
    top: int = 0,
    observe: Callable[[Step], None] | None = None,
) -> Iterator[Step]:
    """Run ``prompt_ids`` through ``stream`` (``prefill`` / ``step``, e.g. ``executor.start()``,
    positioned where the prompt continues) and generate up to ``max_tokens`` tokens with
    ``sampler``, one `Step` per model call (see the module docstring). ``stop_ids`` end the
    generation on the token that is one (it is reported, never fed). ``observe`` sees every
    record before it is yielded. Arguments are checked when this is called, not when the
    first record is asked for. ``prompt_logits``: the prefill's record also carries the logits
    of every prompt position (``prompt_rows`` [positions, vocab]; what scoring a prompt reads)."""
    if not isinstance(sampler, Sampler):
        raise VindexError(f"generate_step takes a Sampler; got {type(sampler).__name__}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise VindexError("generation needs at least one prompt token")
    max_tokens = _count("max_tokens", max_tokens, 0)
    top = _count("top", top, 0)
    if feed not in ("prefill", "step"):
        raise VindexError(f"generate_step feed must be 'prefill' or 'step'; got {feed!r}")
    stops = frozenset(int(t) for t in stop_ids)
    return _run(stream, prompt, sampler, max_tokens, stops, feed, logits, prompt_logits, top, observe)


def _run(stream, prompt, sampler, max_tokens, stops, feed, want_logits, want_rows, top, observe) -> Iterator[Step]:
    pick = sampler.start()
    trace = getattr(stream, "trace", None)
    prompt_calls = [prompt] if feed == "prefill" else [[t] for t in prompt]
    produced = 0
    index = 0
    token: int | None = None
    while True:
        from_prompt = index < len(prompt_calls)
        fed = prompt_calls[index] if from_prompt else [token]
        t0 = time.perf_counter()
        rows = None
        if from_prompt and feed == "prefill":
            rows = np.asarray(stream.prefill(fed))
            row = rows[-1]
        else:
            row = np.asarray(stream.step(fed[0]))
        seconds = time.perf_counter() - t0
        picks = (not from_prompt or index == len(prompt_calls) - 1) and produced < max_tokens
        token = pick(row) if picks else None
        stop = token is not None and token in stops
        produced += token is not None
        step = Step(
            index=index, fed=tuple(fed), prompt=from_prompt, position=int(stream.position), token=token, stop=stop,
            logits=row if want_logits else None, top=top_probabilities(row, top) if top else None,
            prompt_rows=rows if want_rows and rows is not None else None,
            executed_layers=tuple(int(i) for i in trace.executed_layers) if trace is not None else None,
            bytes_read=int(trace.step_bytes[-1]) if trace is not None and trace.step_bytes else None,
            seconds=seconds,
        )
        if observe is not None:
            observe(step)
        yield step
        index += 1
        if index < len(prompt_calls):
            continue
        if token is None or stop or produced >= max_tokens:
            return
