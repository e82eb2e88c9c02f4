"""Prompt-lookup speculation: a drafter with no weights. At each round it finds the longest
suffix of the context (prompt + emitted tokens, up to ``ngram`` tokens) that occurred earlier in
the context, and proposes the tokens that followed its most recent earlier occurrence. The full
model verifies them in one batch call exactly as in self-speculation (vindex3.draft.speculative),
so the output is the full model's greedy continuation; a round with no match is one plain step.

Costs nothing to draft, so it earns its keep wherever text repeats itself (code, long documents,
quoting the prompt) and costs one dictionary probe per token elsewhere.

What a proposal costs is not nothing: verifying k drafts is one call over k + 1 positions, and
what that costs depends on the kernels, the thread count and the machine, so the default
``adaptive`` policy reads the cost curve of this process (`vindex3.draft.costs`: cost(T) in
decode steps, measured once per process for the container and learned from the rounds the
generations run) and proposes only what it expects to pay for. How often a proposal is right
depends mostly on how long the matched suffix is (a one-token match is a guess, an eight-token
match a copy), so it keeps, per match length, how often the first proposed token was accepted
and, per length, how often a proposed token was accepted after the ones before it were — each a
Beta estimate whose prior is the rate measured on the greedy continuations of the seed list
(``vindex3.draft.seeds``; bench/draft_lookup_replay.py ``--fit``), never on the prompt bank,
updated by what this generation shows. With p the first rate and q the later one, proposing k
tokens is expected to emit E(k) = 1 + p (1 + q + … + q^(k-1)) tokens for cost(k + 1) steps; a
round proposes the k (0 .. ``lookahead``) that maximizes E(k) − λ·cost(k + 1), λ the tokens per
step this generation has earned so far (Dinkelbach's rule for the best long-run tokens per unit
cost; k = 0 is the plain step, E = cost = 1). So a short match whose first drafts keep failing
proposes nothing, a long copy proposes up to ``lookahead``, and a cheaper verification raises
the lookahead by itself. ``fixed`` proposes ``lookahead`` tokens at every match.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import VindexError
from .costs import PassCosts, pass_costs
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

DEFAULT_NGRAM = 8
# One more verified position, in decode steps, when a drafter is built without a measured curve
# (replays, tests): bench/speculative.py's pass costs on SmolLM2 after the multi-row kernels,
# about 0.3 a position at 2-5 positions on a quiet machine.
VERIFY_COST = 0.3
RATE_PRIOR = 8.0  # plain steps (one token each) the generation's earned rate starts from
POLICIES = ("adaptive", "fixed")
# Priors of the adaptive policy, fitted on the seed list's greedy continuations (SmolLM2, 96
# tokens each; bench/draft_lookup_replay.py --fit), never on the prompt bank: the chance that the
# first token proposed by a match of length n (index n - 1; the last entry for every longer
# match) is accepted, and that a proposed token is accepted after the ones before it were.
PRIOR_FIRST = (0.26, 0.54, 0.57, 0.78, 0.75, 0.83, 0.94, 0.96)
PRIOR_NEXT = (0.67, 0.71, 0.80, 0.82, 0.88, 0.91, 0.91, 0.97)
PRIOR_WEIGHT = 4.0  # pseudo-observations the prior counts for


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
        n, e = self.find()
        return (n, self.tokens[e:e + k]) if n and k > 0 else (0, [])

    def find(self) -> tuple[int, int]:
        """(n, e): the length of the longest recurring suffix (at most ``ngram``, at least
        ``min_ngram``) and the position just after its most recent earlier occurrence; (0, 0)
        when no suffix recurs."""
        t = self.tokens
        size = len(t)
        if size < 2:
            return 0, 0
        self._index_upto(size - 1)  # every n-gram that ends before the suffix's own end
        for n in range(min(self.ngram, size - 1), self.min_ngram - 1, -1):
            e = self._last[n].get(tuple(t[size - n:]))
            if e is not None:
                return n, e
        return 0, 0


# A corpus index (REST-style retrieval from text outside the context, e.g. the model's own
# generations): the most tokens it holds, refused by name before it is built (each token adds up
# to ``ngram`` n-gram entries: measured, 25k tokens of the model's text took 1.7 s and 43 MB at
# the peak, 200k tokens with no n-gram repeated 19 s and 530 MB, so the bound keeps the worst
# case near 10 s and 270 MB), and what a continuation must show to be proposed.
CORPUS_MAX_TOKENS = 100_000
# and the file's bytes, read and tokenized before the tokens can be counted: 100,000 tokens take
# ~0.7 MB as JSON ids and ~0.4 MB as English text, so 8 MiB keeps tokenizing short
CORPUS_MAX_BYTES = 8 << 20
CORPUS_MIN_NGRAM = 2  # a one-token suffix says too little about what follows
# How often a corpus proposal is right, by what the corpus shows of it: the length of the longest
# suffix of the context it holds (2, 3, 4, 5, 6 or more tokens), the share of that suffix's
# occurrences the proposed token followed (below 0.3, 0.5, 0.7, 0.9, or at least 0.9) and how often
# it followed (once, 2-3 times, 4 or more). The chance that the corpus's most frequent continuation
# is the full model's greedy next token, fitted on the model's own greedy text by cross-validation
# over the seed texts (`bench/draft_lookup_replay.py --fit-corpus`: each fifth of the seed list's
# texts held out against an index of the rest, so a proposal is judged on a topic the index has not
# seen, as the prompt bank's are), never on the prompt bank; a cell with few positions leans on its
# share-and-count average. Fitted on bench/results/lookup_greedy4.corpus.jsonl (SmolLM2's greedy
# text, 62,985 tokens; 12,144 held-out positions). A corpus's share alone claims too much: on
# held-out topics a continuation with a share of 0.9 or more is right 19-66 % of the time. The
# drafter updates each cell with what the generation shows (`PRIOR_WEIGHT` pseudo-observations
# for the table). The cells [n][3][0] (a share of 0.7-0.9 seen once) cannot occur: a continuation
# seen once has a share of 1, 1/2 or less; they hold the fit's empty-cell value, 0.5.
CORPUS_SHARE_EDGES = (0.3, 0.5, 0.7, 0.9)
CORPUS_PRIOR = (  # [suffix length 2..6+][share bin][count bin]
    ((0.1, 0.01, 0.07), (0.0, 0.07, 0.23), (0.15, 0.1, 0.39), (0.5, 0.11, 0.44), (0.19, 0.3, 0.42)),
    ((0.04, 0.03, 0.14), (0.03, 0.05, 0.33), (0.08, 0.18, 0.24), (0.5, 0.18, 0.27), (0.21, 0.36, 0.5)),
    ((0.06, 0.09, 0.02), (0.01, 0.13, 0.16), (0.17, 0.19, 0.11), (0.5, 0.27, 0.19), (0.25, 0.32, 0.45)),
    ((0.13, 0.03, 0.04), (0.01, 0.06, 0.31), (0.15, 0.16, 0.14), (0.5, 0.09, 0.27), (0.33, 0.31, 0.66)),
    ((0.1, 0.03, 0.07), (0.01, 0.14, 0.23), (0.19, 0.36, 0.42), (0.5, 0.16, 0.53), (0.37, 0.43, 0.54)),
)


def corpus_cell(n: int, count: int, total: int) -> tuple[int, int, int]:
    """The `CORPUS_PRIOR` cell of a corpus proposal: its suffix's length ``n`` (2..6+), the share
    ``count / total`` of the suffix's occurrences the token followed, and ``count``."""
    share = count / total
    sb = sum(share >= e for e in CORPUS_SHARE_EDGES)
    return min(n, CORPUS_MIN_NGRAM + len(CORPUS_PRIOR) - 1) - CORPUS_MIN_NGRAM, sb, 0 if count == 1 else 1 if count <= 3 else 2


class CorpusIndex:
    """The n-grams (n = ``CORPUS_MIN_NGRAM``..``ngram``) of a corpus of token lists, each mapped to
    the token that most often followed it (ties: the one seen first), how often, and how often
    the n-gram was followed at all. Built once; read-only while drafting."""

    def __init__(self, seqs: Sequence[Sequence[int]], ngram: int = DEFAULT_NGRAM, *, source: str = "corpus",
                 digest: str = ""):
        total = sum(len(s) for s in seqs)
        if total > CORPUS_MAX_TOKENS:
            raise VindexError(f"lookup corpus {source} holds {total} tokens; a corpus index holds at most "
                              f"{CORPUS_MAX_TOKENS}", hint="name a smaller corpus")
        self.ngram, self.source, self.digest, self.tokens = ngram, source, digest, total
        counts: dict[tuple[int, ...], dict[int, int]] = {}
        for s in seqs:
            t = [int(x) for x in s]
            for e in range(CORPUS_MIN_NGRAM, len(t)):
                nxt = t[e]
                for n in range(CORPUS_MIN_NGRAM, min(ngram, e) + 1):
                    d = counts.setdefault(tuple(t[e - n:e]), {})
                    d[nxt] = d.get(nxt, 0) + 1
        self._best: dict[tuple[int, ...], tuple[int, int, int]] = {}
        while counts:  # each n-gram's counts are freed as its entry is made: the peak stays near the counts'
            key, d = counts.popitem()
            tok, c = max(d.items(), key=lambda kv: kv[1])  # the first seen among equal counts
            self._best[key] = (tok, c, sum(d.values()))

    def next(self, ctx: Sequence[int]) -> tuple[int, int, int, int] | None:
        """(token, n, count, total): the longest suffix of ``ctx`` the corpus holds (n tokens,
        at least `CORPUS_MIN_NGRAM`), the token that most often followed it, how often, and how
        often the suffix was followed at all; None when the corpus holds no suffix of ``ctx``."""
        t = ctx[-self.ngram:]
        for n in range(min(self.ngram, len(t)), CORPUS_MIN_NGRAM - 1, -1):
            got = self._best.get(tuple(int(x) for x in t[len(t) - n:]))
            if got is not None:
                return got[0], n, got[1], got[2]
        return None

    def chain(self, ctx: Sequence[int], k: int) -> list[tuple[int, tuple[int, int, int]]]:
        """Up to ``k`` (token, cell) pairs: the corpus's continuation of ``ctx`` (`next`), then of
        ``ctx`` plus that token, and so on, each with its `corpus_cell`; stops where the corpus
        holds no suffix."""
        t = [int(x) for x in ctx[-self.ngram:]]
        out: list[tuple[int, tuple[int, int, int]]] = []
        while len(out) < k:
            got = self.next(t)
            if got is None:
                break
            tok, n, c, total = got
            out.append((tok, corpus_cell(n, c, total)))
            t = (t + [tok])[-self.ngram:]
        return out


class LookupDrafter:
    """Prompt lookup as a `vindex3.generate.Drafter`: proposes up to ``lookahead`` tokens that
    followed the longest earlier occurrence of the context's suffix; nothing when no suffix of
    at least ``min_ngram`` tokens recurs (the round is then a plain step and costs one probe).
    The ``adaptive`` policy proposes as many of them as it expects to be worth verifying at the
    pass costs ``verify_cost`` gives (see the module docstring): a `PassCosts` curve, a number c
    (every verified position beyond the first costs c steps) or cost(T) for T = 1, 2, ...

    With a ``corpus`` (a `CorpusIndex`), the corpus's chain (`CorpusIndex.chain`) competes with
    the context's copy: under ``adaptive`` each gets the k maximizing E(k) − λ·cost(k + 1) — for
    the chain E(k) = 1 + s1 + s1·s2 + …, each s the estimated chance of that link
    (`corpus_chance`: the `CORPUS_PRIOR` cell of its suffix length, share and count, updated by
    this generation's outcomes in that cell) — and the round proposes the one whose maximum is
    larger (the context's on a tie), nothing when neither beats a plain step; under ``fixed``
    the context's copy up to the lookahead, else the whole chain."""

    name = "lookup"

    def __init__(self, ngram: int = DEFAULT_NGRAM, lookahead: int = 4, min_ngram: int = 1, *,
                 policy: str = "adaptive", verify_cost: Any = VERIFY_COST, corpus: CorpusIndex | None = None):
        if policy not in POLICIES:
            raise VindexError(f"lookup policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        self.costs = PassCosts.of(verify_cost)
        self.index = LookupIndex(ngram, min_ngram)
        self.lookahead = lookahead
        self.policy = policy
        self.tried = [0] * (ngram + 1)  # per match length: rounds that verified a proposal
        self.kept = [0] * (ngram + 1)  # of those, rounds whose first proposed token was accepted
        self.next_tried = [0] * (ngram + 1)  # per match length: later tokens verified after accepted ones
        self.next_kept = [0] * (ngram + 1)  # of those, accepted
        self.earned = RATE_PRIOR  # tokens the rounds so far emitted (with the prior's plain steps)
        self.spent = RATE_PRIOR  # and what their passes cost, in steps
        self._last: tuple[int, list[int]] | None = None
        self._asked = 0  # tokens proposed by the round the next accept answers
        self._first = True  # the next accept is the prefill's pick, not a round's
        self.corpus = corpus
        # the corpus's proposal the next accept answers: its tokens and their `corpus_cell`s
        self._from_corpus: list[tuple[int, tuple[int, int, int]]] | None = None
        self.corpus_proposed = self.corpus_accepted = 0
        self.corpus_tried: dict[tuple[int, int, int], int] = {}  # per cell: proposals verified
        self.corpus_kept: dict[tuple[int, int, int], int] = {}  # of those, accepted

    def begin(self, prompt: Sequence[int]) -> None:
        self.index.extend(prompt)
        self._first = True

    @staticmethod
    def _kept(props: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of a round's proposals its emitted ``tokens`` kept (the last token is the
        full model's own pick)."""
        j = 0
        while j < len(props) and j < len(tokens) - 1 and tokens[j] == props[j]:
            j += 1
        return j

    def accept(self, tokens: Sequence[int]) -> None:
        if self._from_corpus is not None:
            props = [t for t, _ in self._from_corpus]
            j = self._kept(props, tokens)
            self.corpus_proposed += len(props)
            self.corpus_accepted += j
            for i, (_, cell) in enumerate(self._from_corpus[:j + 1]):  # verified: the kept and the first miss
                self.corpus_tried[cell] = self.corpus_tried.get(cell, 0) + 1
                self.corpus_kept[cell] = self.corpus_kept.get(cell, 0) + (i < j)
            self._from_corpus = None
        if self._last is not None:  # score the proposal these tokens answer
            n, props = self._last
            j = self._kept(props, tokens)
            self.tried[n] += 1
            self.kept[n] += j > 0
            if j > 0:  # tokens 2..: each verified after the ones before it were accepted
                later = min(len(props), j + 1) - 1
                self.next_tried[n] += later
                self.next_kept[n] += j - 1
            self._last = None
        if not self._first:  # the first pick came with the prompt's prefill, not a round
            self.earned += len(tokens)
            self.spent += self.costs.cost(self._asked + 1)
        self._first = False
        self._asked = 0
        self.index.extend(tokens)

    @property
    def rate(self) -> float:
        """Tokens per step this generation has earned so far (λ; plain decoding earns 1)."""
        return self.earned / self.spent

    @staticmethod
    def _prior(table: tuple[float, ...], n: int) -> float:
        return table[min(n, len(table)) - 1]

    def acceptance(self, n: int) -> float:
        """The estimated chance that the first token proposed by a match of length ``n`` is
        accepted (the seed list's rate as a prior of ``PRIOR_WEIGHT`` observations)."""
        return (self.kept[n] + PRIOR_WEIGHT * self._prior(PRIOR_FIRST, n)) / (self.tried[n] + PRIOR_WEIGHT)

    def continuation(self, n: int) -> float:
        """The estimated chance that a token a match of length ``n`` proposes is accepted once
        the ones before it were."""
        return ((self.next_kept[n] + PRIOR_WEIGHT * self._prior(PRIOR_NEXT, n))
                / (self.next_tried[n] + PRIOR_WEIGHT))

    def corpus_chance(self, cell: tuple[int, int, int]) -> float:
        """The estimated chance that a corpus proposal of this `corpus_cell` is accepted (the
        `CORPUS_PRIOR` table's rate as a prior of ``PRIOR_WEIGHT`` observations)."""
        a, b, c = cell
        return ((self.corpus_kept.get(cell, 0) + PRIOR_WEIGHT * CORPUS_PRIOR[a][b][c])
                / (self.corpus_tried.get(cell, 0) + PRIOR_WEIGHT))

    def worth(self, n: int, cap: int) -> int:
        """How many tokens (0 .. ``cap``) a match of length ``n`` should propose: the k that
        maximizes E(k) − λ·cost(k + 1) (module docstring); 0 when none beats a plain step."""
        return self._best(self._context_reach(n, cap))[0]

    def _context_reach(self, n: int, length: int) -> list[float]:
        """The chance that the first 1, 2, … ``length`` tokens a match of length ``n`` proposes
        are all accepted."""
        p, q = self.acceptance(n), self.continuation(n)
        reach, r = [], p
        for _ in range(length):
            reach.append(r)
            r *= q
        return reach

    def _corpus_reach(self, chain: Sequence[tuple[int, tuple[int, int, int]]]) -> list[float]:
        """The same for a corpus chain: each link is a next-token guess on the context plus the
        links before it, so its chance given theirs is its cell's (`corpus_chance`)."""
        reach, r = [], 1.0
        for _, cell in chain:
            r *= self.corpus_chance(cell)
            reach.append(r)
        return reach

    def _best(self, reach: Sequence[float]) -> tuple[int, float]:
        """(k, value): the k (0 .. len(reach)) maximizing E(k) − λ·cost(k + 1), E(k) = 1 +
        reach[0] + … + reach[k - 1] with reach[j] the chance that the first j + 1 proposals are
        all accepted, and that maximum; k = 0 (the plain step: one token for one step) when none
        beats it."""
        lam = self.rate
        best_k, best = 0, 1.0 - lam
        expected = 1.0
        for k, r in enumerate(reach, start=1):
            expected += r
            v = expected - lam * self.costs.cost(k + 1)
            if v > best:
                best_k, best = k, v
        return best_k, best

    def observe_pass(self, positions: int, seconds: float) -> None:
        """A round's one pass over ``positions`` took ``seconds`` (the cost curve may learn it)."""
        self.costs.observe(positions, seconds)

    def propose(self, limit: int) -> list[int]:
        cap = min(self.lookahead, limit)
        if cap <= 0:
            return []
        n, e = self.index.find()
        copy = self.index.tokens[e:e + cap] if n else []  # what the context's match would copy
        chain = self.corpus.chain(self.index.tokens, cap) if self.corpus is not None else []
        if self.policy == "adaptive":  # the proposal with the larger expected gain, if either pays
            k, v = self._best(self._context_reach(n, len(copy))) if copy else (0, 0.0)
            kc, vc = self._best(self._corpus_reach(chain)) if chain else (0, 0.0)
            if kc and (not k or vc > v):
                copy, chain = [], chain[:kc]
            else:
                copy, chain = copy[:k], []
        elif copy:  # fixed: the context's copy, else the corpus's chain
            chain = []
        if copy:
            self._last = (n, copy)
        if chain:
            self._from_corpus = chain
        props = copy or [t for t, _ in chain]
        self._asked = len(props)
        return props


def corpus_index(container: Any, path: str, ngram: int = DEFAULT_NGRAM) -> CorpusIndex:
    """The `CorpusIndex` of a corpus file (JSON lines of ``{"text": ...}`` or ``{"token_ids": [...]}``,
    `vindex3.draft.adapter.read_corpus`), texts tokenized by the container's tokenizer; refused by
    name when a text needs a tokenizer the container lacks, an id is outside the vocabulary, or
    the corpus holds more than `CORPUS_MAX_TOKENS` tokens (or its file more than
    `CORPUS_MAX_BYTES`, before anything is read)."""
    from pathlib import Path

    from .adapter import read_corpus
    from .vocab import corpus_digest, corpus_ids

    c = open_container(container)
    texts = read_corpus(path, max_bytes=CORPUS_MAX_BYTES)
    seqs, total = [], 0
    for t in texts:
        ids = corpus_ids(c, t, f"corpus {Path(path).name}:")
        total += len(ids)
        if total > CORPUS_MAX_TOKENS:
            raise VindexError(f"lookup corpus {Path(path).name} holds more than {CORPUS_MAX_TOKENS} tokens",
                              hint="name a smaller corpus")
        seqs.append(ids)
    return CorpusIndex(seqs, ngram, source=Path(path).name, digest=corpus_digest(texts))


def lookup_generate(container: Any, token_ids: Sequence[int], n: int, lookahead: int = 4,
                    ngram: int = DEFAULT_NGRAM, on_token: Callable[[int], None] | None = None, *, min_ngram: int = 1,
                    compare_plain: bool = False, max_positions: int | None = None, ex: Any = None,
                    policy: str = "adaptive", verify_cost: Any = None, corpus: CorpusIndex | None = None) -> SpecResult:
    """Generate ``n`` greedy tokens after ``token_ids`` with the full model, proposing up to
    ``lookahead`` tokens per full-model call by prompt lookup over n-grams of at most ``ngram``
    tokens. The result's ``drafter`` is ``"lookup"`` and its ``depth`` is None (no draft slice).
    A match shorter than ``min_ngram`` tokens proposes nothing (a plain step instead).
    ``ex`` is a full-model executor to reuse (benches); None prepares one. ``policy``: "adaptive"
    (propose only the drafts expected to pay for their verification, see the module docstring;
    ``lookahead`` is the cap) or "fixed" (``lookahead`` at every match). ``verify_cost``: what
    the adaptive policy charges a verifying pass — None, this process's measured and learned
    curve for the container (`vindex3.draft.costs.pass_costs`; measured on first use); a number
    c (1 + c (T - 1) steps for T positions) or cost(T) for T = 1, 2, ... fixes it. ``corpus``: a
    `CorpusIndex` (`corpus_index`) that proposes when the context has nothing to copy; the result
    names it and counts its proposals."""
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
    costs = None
    if verify_cost is None and policy == "adaptive" and n > 1:  # measured once per process, then cached
        t_cost = time.perf_counter()
        costs = pass_costs(c, full_ex, min(lookahead, n - 1) + 1)
        prep_full += time.perf_counter() - t_cost
    drafter = LookupDrafter(ngram, lookahead, min_ngram, policy=policy,
                            verify_cost=costs if costs is not None else VERIFY_COST if verify_cost is None else verify_cost,
                            corpus=corpus)
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
        prefill_seconds=stats.prefill_seconds,
        verify_costs=drafter.costs.curve(lookahead + 1) if policy == "adaptive" else None,
        **({} if corpus is None else {"corpus": corpus.source, "corpus_sha256": corpus.digest,
                                      "corpus_proposed": drafter.corpus_proposed,
                                      "corpus_accepted": drafter.corpus_accepted}),
        tokens_per_second=len(out) / secs if secs > 0 else 0.0,
    )
    return _compared(result, compare_plain, c, prompt, n, full_ex, secs)
