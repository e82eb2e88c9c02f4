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

With a ``drafter`` (speculative decoding, greedy only) a generated call may verify drafted
tokens: the drafter proposes up to k tokens continuing the context, one multi-position call
consumes the pending pick and the k proposals, the longest prefix of proposals that the
sampler's own picks agree with is kept (`Step.accepted`) and the pick after it is the record's
``token``; the stream is rolled back to the kept tokens through its state parts (truncate, or
snapshot, restore and a replay of the kept tokens where a part keeps a recurrence). A round with
no proposal is the plain single-token step. The tokens are the greedy decode's, by construction.

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
from typing import Any, Literal, Protocol

import numpy as np

from .errors import VindexError

__all__ = ["Drafter", "Sampler", "Step", "generate_step", "top_probabilities"]


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
    proposed: tuple[int, ...] = ()  # with a drafter: the drafted tokens this call verified
    accepted: tuple[int, ...] = ()  # of those, the ones kept: emitted before ``token``
    calls: int = 1  # model calls this record made (2 when a snapshot rollback replayed kept tokens)

    @property
    def emitted(self) -> tuple[int, ...]:
        """The tokens this record generates, in order: the accepted drafts, then ``token``."""
        return self.accepted + ((self.token,) if self.token is not None else ())


class Drafter(Protocol):
    """What speculative decoding asks of a drafter (prompt lookup, a reduced-depth draft, ...).
    ``name`` is recorded; ``begin`` sees the prompt once, ``accept`` every token generated
    after it (in order, the first pick included), and ``propose(limit)`` returns at most
    ``limit`` tokens that continue the context so far ([] to take a plain step)."""

    name: str

    def begin(self, prompt: Sequence[int]) -> None: ...

    def accept(self, tokens: Sequence[int]) -> None: ...

    def propose(self, limit: int) -> list[int]: ...


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
    drafter: Drafter | None = None,
    rollback: Literal["truncate", "snapshot"] | None = None,
) -> Iterator[Step]:
    """Run ``prompt_ids`` through ``stream`` (``prefill`` / ``step``, e.g. ``executor.start()``,
    positioned where the prompt continues) and generate up to ``max_tokens`` tokens with
    ``sampler``, one `Step` per model call (see the module docstring). ``stop_ids`` end the
    generation on the token that is one (it is reported, never fed). ``observe`` sees every
    record before it is yielded. Arguments are checked when this is called, not when the
    first record is asked for. ``prompt_logits``: the prefill's record also carries the logits
    of every prompt position (``prompt_rows`` [positions, vocab]; what scoring a prompt reads).
    ``drafter``: speculative decoding (see the module docstring; greedy sampler and prefill
    feed only); ``rollback``: how the stream forgets rejected drafts, "truncate" or "snapshot"
    (None: truncate when every state part of the stream truncates, else snapshot)."""
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
    if drafter is not None:
        if not sampler.is_greedy:
            raise VindexError(f"speculative decoding verifies drafts greedily; the sampler is {sampler.describe()}",
                              hint="use temperature 0, or generate without a drafter")
        if feed != "prefill":
            raise VindexError("speculative decoding feeds the prompt in one prefill; got feed 'step'")
        mode = _rollback_mode(stream) if rollback is None else rollback
        if mode not in ("truncate", "snapshot"):
            raise VindexError(f"generate_step rollback must be 'truncate' or 'snapshot'; got {mode!r}")
        return _run_drafted(stream, prompt, sampler, max_tokens, stops, logits, prompt_logits, top, observe,
                            drafter, mode)
    return _run(stream, prompt, sampler, max_tokens, stops, feed, logits, prompt_logits, top, observe)


def _rollback_mode(stream: Any) -> str:
    """"truncate" when every state part of the stream's layers cuts back to a position, else
    "snapshot" (asked of the parts' geometry, never of an operator's kind)."""
    from .continuation import TRUNCATE

    layers = getattr(getattr(stream, "state", None), "layers", None)
    if layers is None:
        raise VindexError(f"speculative decoding needs a stream with a continuation state; got {type(stream).__name__}")
    return "truncate" if all(ls.geometry.rollback == TRUNCATE for ls in layers.values()) else "snapshot"


def _trace_facts(stream: Any) -> tuple[tuple[int, ...] | None, int | None]:
    trace = getattr(stream, "trace", None)
    if trace is None:
        return None, None
    return (tuple(int(i) for i in trace.executed_layers),
            int(trace.step_bytes[-1]) if trace.step_bytes else None)


def _run_drafted(stream, prompt, sampler, max_tokens, stops, want_logits, want_rows, top, observe,
                 drafter, mode) -> Iterator[Step]:
    """The drafted decode loop: one prompt prefill, then rounds of (proposal, one verifying
    call, rollback); a round without proposals is the plain single-token step."""
    pick = sampler.start()
    t0 = time.perf_counter()
    rows = np.asarray(stream.prefill(prompt))
    row = rows[-1]
    seconds = time.perf_counter() - t0
    token = pick(row) if max_tokens > 0 else None
    stop = token is not None and token in stops
    produced = int(token is not None)
    layers, nbytes = _trace_facts(stream)
    step = Step(index=0, fed=tuple(prompt), prompt=True, position=int(stream.position), token=token, stop=stop,
                logits=row if want_logits else None, top=top_probabilities(row, top) if top else None,
                prompt_rows=rows if want_rows else None, executed_layers=layers, bytes_read=nbytes,
                seconds=seconds)
    if observe is not None:
        observe(step)
    yield step
    if token is None or stop or produced >= max_tokens:
        return
    drafter.begin(prompt)
    drafter.accept((token,))
    index = 1
    while True:
        t0 = time.perf_counter()
        limit = max_tokens - produced - 1  # a round emits up to k + 1 tokens: never overshoot
        props = [int(t) for t in drafter.propose(limit)] if limit > 0 else []
        if len(props) > limit:
            raise VindexError(f"drafter {drafter.name!r} proposed {len(props)} tokens where at most {limit} fit")
        calls = 1
        if not props:
            row = np.asarray(stream.step(token))
            fed: tuple[int, ...] = (token,)
            emitted = [pick(row)]
        else:
            base = stream.position
            snap = stream.snapshot() if mode == "snapshot" else None
            fed = (token, *props)
            rows = np.asarray(stream.prefill(list(fed)))
            j = 0
            while j < len(props) and pick(rows[j]) == props[j]:
                j += 1
            emitted = props[:j] + [pick(rows[j])]
            row = rows[j]
            for i, t in enumerate(emitted):  # a stop id ends the generation on itself
                if t in stops:
                    emitted = emitted[: i + 1]
                    row = rows[i]
                    break
            kept = [token, *emitted[:-1]]  # consumed by the verifying call and kept
            if stream.position != base + len(kept):
                if mode == "truncate":
                    stream.truncate(base + len(kept))
                else:
                    stream.restore(snap)
                    stream.prefill(kept)
                    calls += 1
        seconds = time.perf_counter() - t0
        token = emitted[-1]
        stop = token in stops
        produced += len(emitted)
        layers, nbytes = _trace_facts(stream)
        step = Step(index=index, fed=fed, prompt=False, position=int(stream.position), token=token, stop=stop,
                    logits=row if want_logits else None, top=top_probabilities(row, top) if top else None,
                    executed_layers=layers, bytes_read=nbytes, seconds=seconds,
                    proposed=tuple(props), accepted=tuple(emitted[:-1]), calls=calls)
        if observe is not None:
            observe(step)
        yield step
        if stop or produced >= max_tokens:
            return
        drafter.accept(emitted)
        index += 1


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
