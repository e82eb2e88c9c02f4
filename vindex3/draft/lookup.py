"""Prompt-lookup speculation: a drafter with no weights. At each round it finds the longest
suffix of the context (prompt + emitted tokens, up to ``ngram`` tokens) that occurred earlier in
the context, and proposes the tokens that followed its most recent earlier occurrence. The full
model verifies them in one batch call exactly as in self-speculation (vindex3.draft.speculative),
so the output is the full model's greedy continuation; a round with no match is one plain step.

Costs nothing to draft, so it earns its keep wherever text repeats itself (code, long documents,
quoting the prompt) and costs one dictionary probe per token elsewhere.

What a proposal costs is not nothing: verifying k drafts is one call over k + 1 positions, and
on SmolLM2 each position beyond the first costs about ``VERIFY_COST`` of a decode step (the
rows kernels stream the weights once but multiply every position; bench/speculative.py
measures it). The default ``adaptive`` policy therefore proposes only where it expects to gain:
it keeps, per match length n, how often the first proposed token was accepted (a Beta(1, 1)
prior, counted within the generation, never fitted on the prompt bank) and proposes only while
that estimate is above the cost of verifying one more position; how many it proposes follows
the last round (double after a round that kept every draft, one past the kept ones after a
rejection, up to ``lookahead``), as copying runs long once it starts. A match length whose
first drafts are rejected stops proposing, so text that does not repeat itself decodes at
greedy speed. ``fixed`` proposes ``lookahead`` tokens at every match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import VindexError
from .slices import make_executor, open_container, resolve_slice
from .speculative import (
    SpecResult,
    _check_counts,
    _check_prompt,
    _compared,
    _drafted,
    _rollback_mode,
    _Tally,
)

DEFAULT_NGRAM = 3
# One more verified position, in decode steps: SmolLM2 f32, 1 BLAS thread, quiet machine,
# best of 7 (bench/speculative.py pass costs): 2, 3, 4, 5 positions cost 1.50, 1.89, 2.31,
# 2.48 steps, i.e. 0.37-0.50 a position.
VERIFY_COST = 0.45
POLICIES = ("adaptive", "fixed")


class LookupIndex:
    """The n-grams (n = 1..``ngram``) of a growing token list, each mapped to the position just
    after its most recent occurrence that is not the list's own suffix."""

    def __init__(self, ngram: int, min_ngram: int = 1):
        self.ngram = ngram
        self.min_ngram = min_ngram  # shorter matches propose nothing
        self.tokens: list[int] = []
        self._last: list[dict[tuple[int, ...], int]] = [{} for _ in range(ngram + 1)]
        self._indexed = 0  # n-grams ending before this position are in the index

    def extend(self, toks: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in toks)

    def _index_upto(self, end: int) -> None:
        t = self.tokens
        for e in range(self._indexed + 1, end + 1):  # n-grams ending at e (exclusive)
            for n in range(1, min(self.ngram, e) + 1):
                self._last[n][tuple(t[e - n:e])] = e
        self._indexed = max(self._indexed, end)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest earlier occurrence of the current suffix
        (longest n first, then the most recent occurrence); [] when no suffix recurs."""
        return self.match(k)[1]

    def match(self, k: int) -> tuple[int, list[int]]:
        """(n, proposal): the length of the longest recurring suffix and up to ``k`` tokens that
        followed its most recent earlier occurrence; (0, []) when no suffix recurs."""
        t = self.tokens
        size = len(t)
        if k <= 0 or size < 2:
            return 0, []
        self._index_upto(size - 1)  # every n-gram that ends before the suffix's own end
        for n in range(min(self.ngram, size - 1), self.min_ngram - 1, -1):
            e = self._last[n].get(tuple(t[size - n:]))
            if e is not None:
                return n, t[e:e + k]
        return 0, []


class LookupDrafter:
    """Prompt lookup as a `vindex3.generate.Drafter`: proposes up to ``lookahead`` tokens that
    followed the longest earlier occurrence of the context's suffix; nothing when no suffix of
    at least ``min_ngram`` tokens recurs (the round is then a plain step and costs one probe)."""

    name = "lookup"

    def __init__(self, ngram: int = DEFAULT_NGRAM, lookahead: int = 4, min_ngram: int = 1, *,
                 policy: str = "adaptive", verify_cost: float = VERIFY_COST):
        if policy not in POLICIES:
            raise VindexError(f"lookup policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if isinstance(verify_cost, bool) or not isinstance(verify_cost, (int, float)) or not 0 < verify_cost < 1:
            raise VindexError(f"lookup verify_cost must be a number in (0, 1) (decode steps per position); got {verify_cost!r}")
        self.index = LookupIndex(ngram, min_ngram)
        self.lookahead = lookahead
        self.policy = policy
        self.verify_cost = float(verify_cost)
        self.tried = [0] * (ngram + 1)  # per match length: rounds that verified a proposal
        self.kept = [0] * (ngram + 1)  # of those, rounds whose first proposed token was accepted
        self.run = 1  # how many to propose next (adaptive)
        self._last: tuple[int, list[int]] | None = None

    def begin(self, prompt: Sequence[int]) -> None:
        self.index.extend(prompt)

    def accept(self, tokens: Sequence[int]) -> None:
        if self._last is not None:  # score the proposal these tokens answer
            n, props = self._last
            j = 0
            while j < len(props) and j < len(tokens) - 1 and tokens[j] == props[j]:
                j += 1
            self.tried[n] += 1
            self.kept[n] += j > 0
            self.run = min(self.lookahead, 2 * len(props)) if j == len(props) else j + 1
            self._last = None
        self.index.extend(tokens)

    def acceptance(self, n: int) -> float:
        """The estimated chance that the first token proposed by a match of length ``n`` is
        accepted (Beta(1, 1) prior)."""
        return (self.kept[n] + 1) / (self.tried[n] + 2)

    def propose(self, limit: int) -> list[int]:
        adaptive = self.policy == "adaptive"
        n, props = self.index.match(min(self.run if adaptive else self.lookahead, limit))
        if props and adaptive and self.acceptance(n) <= self.verify_cost:
            props = []
        if props:
            self._last = (n, props)
        return props


def lookup_generate(container: Any, token_ids: Sequence[int], n: int, lookahead: int = 4,
                    ngram: int = DEFAULT_NGRAM, on_token: Callable[[int], None] | None = None, *, min_ngram: int = 1,
                    compare_plain: bool = False, max_positions: int | None = None, ex: Any = None,
                    policy: str = "adaptive", verify_cost: float = VERIFY_COST) -> SpecResult:
    """Generate ``n`` greedy tokens after ``token_ids`` with the full model, proposing up to
    ``lookahead`` tokens per full-model call by prompt lookup over n-grams of at most ``ngram``
    tokens. The result's ``drafter`` is ``"lookup"`` and its ``depth`` is None (no draft slice).
    A match shorter than ``min_ngram`` tokens proposes nothing (a plain step instead).
    ``ex`` is a full-model executor to reuse (benches); None prepares one. ``policy``: "adaptive"
    (propose only the drafts expected to pay for their verification, see the module docstring;
    ``lookahead`` is the cap) or "fixed" (``lookahead`` at every match)."""
    c = open_container(container)
    prompt = _check_prompt(token_ids)
    _check_counts(n, lookahead)
    if isinstance(ngram, bool) or not isinstance(ngram, int) or ngram < 1:
        raise VindexError(f"NGRAM must be an integer ≥ 1; got {ngram!r}")
    full_slice, _ = resolve_slice(c, None)
    if ex is None:
        full_ex, prep_full = make_executor(c, full_slice, max_positions=max_positions)
    else:
        full_ex, prep_full = ex, 0.0
    if n > 0:
        full_ex.check_positions(len(prompt) + n - 1, f"SPECULATE ({len(prompt)} prompt tokens, {n} generated)")

    out: list[int] = []
    if isinstance(min_ngram, bool) or not isinstance(min_ngram, int) or not 1 <= min_ngram <= ngram:
        raise VindexError(f"the shortest lookup match must be an integer in 1..NGRAM ({ngram}); got {min_ngram!r}")
    drafter = LookupDrafter(ngram, lookahead, min_ngram, policy=policy, verify_cost=verify_cost)
    stats = _Tally(lookahead, n)
    mode = "truncate"
    t0 = time.perf_counter()
    if n > 0:
        fst = full_ex.start()
        mode = _rollback_mode(c, full_slice, fst, "full")
        out = _drafted(fst, prompt, n, drafter, mode, stats, on_token)
    secs = time.perf_counter() - t0

    result = SpecResult(
        tokens=out, prompt_tokens=len(prompt), n=n, depth=None, drafter="lookup", ngram=ngram, lookahead=lookahead,
        policy=policy,
        rollback=mode, **stats.facts(len(out)), draft_steps=0, prepare_seconds=prep_full, seconds=secs,
        tokens_per_second=len(out) / secs if secs > 0 else 0.0,
    )
    return _compared(result, compare_plain, c, prompt, n, full_ex, secs)
