"""Self-speculative greedy decoding: a reduced-depth draft of the same container proposes
``k`` tokens, the full model checks them in one batch call, and the longest agreeing prefix is
kept together with the full model's own next token. The output is, by construction, the full
model's greedy continuation; only the number of full-model calls changes.

One round, with the full stream at position P and its pending (emitted, not yet consumed)
token ``x``::

    draft:  step(x) → p1, step(p1) → p2, … → pk            (k draft steps)
    full:   prefill([x, p1, …, pk]) → k+1 rows               (one full-model call)
    accept: j = longest prefix with argmax(row[i]) == p(i+1); emit p1..pj and y = argmax(row[j])
    roll back both streams to P+1+j (KV truncate, or snapshot/restore where state recurs)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel

from ..errors import SliceError, StateError, UnsupportedOperator, VindexError
from ..generate import Sampler, generate_step
from .slices import make_executor, open_container, recurrent_layers, resolve_slice


class PlainResult(BaseModel):
    tokens: list[int]
    seconds: float
    tokens_per_second: float
    prefill_seconds: float | None = None  # the prompt's prefill and first pick, within ``seconds``


class SpecResult(BaseModel):
    tokens: list[int]
    prompt_tokens: int
    n: int
    depth: int | None  # the draft slice's depth; None for a drafter without one (prompt lookup)
    lookahead: int
    drafter: str = "depth"  # "depth": a reduced-depth draft of the same container; "lookup": prompt lookup
    ngram: int | None = None  # prompt lookup: the longest n-gram matched
    policy: str | None = None  # prompt lookup: "adaptive" (drafts expected to pay) or "fixed"
    vocab_top: int | None = None  # the draft's head computed over this many most frequent tokens only
    adapter: bool = False  # the draft's head read its residual through a fitted exit adapter
    corpus: str | None = None  # prompt lookup: the corpus whose n-grams propose when the context has none
    corpus_sha256: str | None = None
    corpus_proposed: int | None = None  # of ``proposed``, tokens the corpus proposed
    corpus_accepted: int | None = None  # and of those, kept
    rollback: str  # "truncate" | "snapshot"
    rounds: int  # verification calls of the full model (with lookup: those that had proposals)
    proposed: int  # draft tokens offered for verification
    accepted: int  # of those, kept
    acceptance_rate: float  # accepted / proposed
    accepted_histogram: list[int]  # rounds that kept j draft tokens, j = 0..min(lookahead, n - 1)
    full_model_calls: int  # prompt prefill + verification calls (+ replays in snapshot mode)
    tokens_per_full_step: float  # n / full_model_calls; plain greedy is 1.0
    draft_steps: int
    prepare_seconds: float  # full + draft executors
    seconds: float  # prompt prefill through the last token
    tokens_per_second: float
    prefill_seconds: float | None = None  # the prompt's prefill and first pick, within ``seconds``
    verify_costs: list[float] | None = None  # lookup adaptive: cost(T) in steps, T = 1 .. lookahead + 1, as last read
    plain: PlainResult | None = None
    matches_plain: bool | None = None
    speedup: float | None = None  # plain seconds / speculative seconds
    decode_speedup: float | None = None  # the same after the prompt's prefill (which both run alike)


class DepthDrafter:
    """A reduced-depth draft of the same container as a `vindex3.generate.Drafter`: its own
    stream proposes ``lookahead`` greedy tokens a round (through its vocabulary cut's ids when
    it has one). Before proposing it brings its stream to the context minus the pending token,
    cutting back what the last round's rejected proposals left (truncate, or snapshot, restore
    and a replay of the kept tokens)."""

    name = "depth"

    def __init__(self, stream: Any, mode: str, lookahead: int, cut_ids: np.ndarray | None = None):
        self.st = stream
        self.mode = mode
        self.lookahead = lookahead
        self.cut_ids = cut_ids
        self.ctx: list[int] = []  # prompt and every generated token
        self.fed: list[int] = []  # what the draft stream has consumed
        self.steps = 0  # draft model calls: proposals, catch-ups and replays
        self._snap: Any = None
        self._snap_len = 0
        self._agreed = 0  # ctx and fed agree at least this far

    def begin(self, prompt: Sequence[int]) -> None:
        self.ctx = [int(t) for t in prompt]
        self.st.prefill(self.ctx)
        self.fed = list(self.ctx)
        self._agreed = len(self.fed)

    def accept(self, tokens: Sequence[int]) -> None:
        self.ctx.extend(int(t) for t in tokens)

    def _sync(self) -> None:
        want = len(self.ctx) - 1  # the pending token is stepped by the proposal itself
        common = self._agreed
        while common < min(len(self.fed), want) and self.fed[common] == self.ctx[common]:
            common += 1
        if common < len(self.fed):
            if self.mode == "truncate":
                self.st.truncate(common)
            else:
                self.st.restore(self._snap)
                if common > self._snap_len:
                    self.st.prefill(self.ctx[self._snap_len:common])
                    self.steps += 1
            if self.st.position != common:
                raise StateError(f"draft rollback reached position {self.st.position}, expected {common}")
            self.fed = self.fed[:common]
        if common < want:
            self.st.prefill(self.ctx[common:want])
            self.steps += 1
            self.fed = self.ctx[:want]
        self._agreed = want

    def propose(self, limit: int) -> list[int]:
        k = min(self.lookahead, limit)
        if k <= 0:
            return []
        self._sync()
        if self.mode == "snapshot":
            self._snap, self._snap_len = self.st.snapshot(), len(self.fed)
        tok = self.ctx[-1]
        props: list[int] = []
        for _ in range(k):
            i = _argmax(self.st.step(tok))
            tok = i if self.cut_ids is None else int(self.cut_ids[i])
            props.append(tok)
        self.steps += k
        self.fed = self.ctx + props[:-1]
        return props


def _rollback_mode(container: Any, slice_obj: Any, st: Any, role: str) -> str:
    """Decide how a stream forgets rejected tokens, or refuse by name before generating.

    A state whose parts all truncate (rows) is cut back. One whose executed layers keep a fixed
    recurrence rolls back by snapshot and restore; if its state refuses either, speculation is
    refused naming the first such layer and its operator."""
    recurrent = recurrent_layers(container, container.plan_slice(slice_obj).executed_layers)
    if not recurrent:
        return "truncate"
    try:
        st.restore(st.snapshot())
        return "snapshot"
    except (StateError, UnsupportedOperator) as e:
        reason = str(e)
    layer, op = recurrent[0]
    raise UnsupportedOperator(
        f"SPECULATE cannot roll back the {role} stream: layer {layer} ({op}) keeps recurrent state "
        f"and {reason}",
        hint="speculation needs KV truncation or a state snapshot for every executed layer",
    )


class _Tally:
    """What a speculative result counts, read off generate_step's records."""

    def __init__(self, lookahead: int, n: int):
        # a round proposes at most n - 1 tokens, so the histogram needs no more entries than
        # that, whatever LOOKAHEAD says (an unbounded lookahead must not size an allocation)
        self.hist = [0] * (min(lookahead, max(n - 1, 0)) + 1)
        self.rounds = self.proposed = self.accepted = self.calls = 0
        self.prefill_seconds: float | None = None

    def add(self, step: Any) -> None:
        if step.prompt:
            self.prefill_seconds = step.seconds
        self.calls += step.calls
        if step.proposed:
            self.rounds += 1
            self.proposed += len(step.proposed)
            self.accepted += len(step.accepted)
            self.hist[len(step.accepted)] += 1

    def facts(self, tokens: int) -> dict[str, Any]:
        return {"rounds": self.rounds, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "accepted_histogram": self.hist, "full_model_calls": self.calls,
                "tokens_per_full_step": tokens / self.calls if self.calls else 0.0}


def _argmax(row: np.ndarray) -> int:
    return int(np.argmax(row))


def greedy_generate(container: Any, token_ids: Sequence[int], n: int, *, ex: Any = None,
                    on_token: Callable[[int], None] | None = None) -> PlainResult:
    """Plain greedy decoding with the full model: prefill the prompt, then one step per token."""
    c = open_container(container)
    if ex is None:
        ex, _ = make_executor(c, resolve_slice(c, None)[0])
    prompt = _check_prompt(token_ids)
    out: list[int] = []
    first = None
    t0 = time.perf_counter()
    if n > 0:
        for step in generate_step(ex.start(), prompt, sampler=Sampler.greedy(), max_tokens=n):
            if first is None:
                first = step.seconds
            out.append(step.token)
            if on_token:
                on_token(step.token)
    secs = time.perf_counter() - t0
    return PlainResult(tokens=out, seconds=secs, tokens_per_second=len(out) / secs if secs > 0 else 0.0,
                       prefill_seconds=first)


def _check_prompt(token_ids: Sequence[int]) -> list[int]:
    prompt = [int(t) for t in token_ids]
    if not prompt:
        raise VindexError("generation needs at least one prompt token")
    return prompt


def _check_counts(n: Any, lookahead: Any) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise VindexError(f"GENERATE count must be a non-negative integer; got {n!r}")
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
        raise VindexError(f"LOOKAHEAD must be an integer ≥ 1; got {lookahead!r}")


def _drafted(fst: Any, prompt: list[int], n: int, drafter: Any, mode: str, stats: _Tally,
             on_token: Callable[[int], None] | None) -> list[int]:
    """The greedy tokens ``drafter`` and the full stream ``fst`` emit together (generate_step),
    each counted into ``stats`` and handed to ``on_token`` as it is emitted."""
    out: list[int] = []
    learn = getattr(drafter, "observe_pass", None)  # a drafter that learns what passes cost here
    for step in generate_step(fst, prompt, sampler=Sampler.greedy(), max_tokens=n, drafter=drafter, rollback=mode):
        stats.add(step)
        if learn is not None and not step.prompt and step.calls == 1:
            learn(len(step.fed), step.seconds)
        for t in step.emitted:
            out.append(t)
            if on_token:
                on_token(t)
    return out


def _compared(result: SpecResult, compare_plain: bool, c: Any, prompt: list[int], n: int, full_ex: Any,
              secs: float) -> SpecResult:
    """``result`` with, when asked, plain greedy decoding beside it (its tokens and the speed-up)."""
    if compare_plain:
        plain = greedy_generate(c, prompt, n, ex=full_ex)
        result.plain = plain
        result.matches_plain = plain.tokens == result.tokens
        result.speedup = plain.seconds / secs if secs > 0 else None
        if plain.prefill_seconds is not None and result.prefill_seconds is not None and secs > result.prefill_seconds:
            result.decode_speedup = (plain.seconds - plain.prefill_seconds) / (secs - result.prefill_seconds)
    return result


def speculative_generate(container: Any, token_ids: Sequence[int], n: int, depth: int,
                         lookahead: int = 4, on_token: Callable[[int], None] | None = None, *,
                         compare_plain: bool = False, max_positions: int | None = None,
                         vocab_cut: Any = None, adapter: Any = None) -> SpecResult:
    """Generate ``n`` greedy tokens after ``token_ids`` with the full model, using the draft of
    ``depth`` layers to propose ``lookahead`` tokens per full-model call.

    The tokens equal plain greedy decoding of the full model (up to argmax ties that batch and
    step arithmetic round differently). ``on_token`` sees each token as it is emitted. With
    ``compare_plain`` the plain greedy decode is run too, timed, and compared.

    Both streams hold at most ``len(token_ids) + n - 1`` positions (a round never proposes more
    than can be used), so a run fits the context length when prompt + ``n`` does; the executors
    are limited to the model's context length, or to ``max_positions`` (an explicit override).

    ``vocab_cut`` (vindex3.draft.vocab.VocabCut): the draft's head computes logits over the kept
    tokens only, so it proposes only those; the full model is untouched. ``adapter``
    (vindex3.draft.adapter.ExitAdapter fitted at ``depth``): the draft's head reads the adapted
    residual. ``adapter="stored"`` reads the exit adapter stored in the container at ``depth``
    (`vindex3.draft.store`: the adapter at ``depth``), refused by name when absent or stale.
    """
    c = open_container(container)
    prompt = _check_prompt(token_ids)
    _check_counts(n, lookahead)
    draft_slice, draft_depth = resolve_slice(c, depth)
    if draft_depth is None:
        raise SliceError("SPECULATE needs a draft depth (1..L); the full model cannot draft for itself")
    full_slice, _ = resolve_slice(c, None)
    full_ex, prep_full = make_executor(c, full_slice, max_positions=max_positions)
    if adapter == "stored":
        from .store import load_adapter

        adapter = load_adapter(c, draft_depth)
    elif isinstance(adapter, str):
        raise VindexError(f"adapter must be an ExitAdapter or 'stored'; got {adapter!r}")
    cut_ids = None  # with a vocabulary cut: draft column i is token cut_ids[i]
    if vocab_cut is None:
        draft_ex, prep_draft = make_executor(c, draft_slice, max_positions=max_positions)
    else:
        from .vocab import cut_executor

        draft_ex, prep_draft = cut_executor(c, draft_depth, vocab_cut, max_positions=max_positions)
        cut_ids = vocab_cut.ids()
    if adapter is not None:
        from .adapter import AdaptedReadout, check_adapter

        check_adapter(c, draft_depth, adapter)
        draft_ex.readout = AdaptedReadout(draft_ex.readout, adapter)
    if n > 0:
        full_ex.check_positions(len(prompt) + n - 1, f"SPECULATE ({len(prompt)} prompt tokens, {n} generated)")

    out: list[int] = []
    mode = "truncate"
    t0 = time.perf_counter()
    stats = _Tally(lookahead, n)
    draft_steps = 0
    if n > 0:
        fst, dst = full_ex.start(), draft_ex.start()
        # Decide (or refuse) how each stream rolls back before computing anything.
        mode = _rollback_mode(c, full_slice, fst, "full")
        drafter = DepthDrafter(dst, _rollback_mode(c, draft_slice, dst, "draft"), lookahead, cut_ids)
        out = _drafted(fst, prompt, n, drafter, mode, stats, on_token)
        draft_steps = drafter.steps
    secs = time.perf_counter() - t0

    result = SpecResult(
        tokens=out, prompt_tokens=len(prompt), n=n, depth=draft_depth, lookahead=lookahead,
        vocab_top=vocab_cut.k if vocab_cut is not None else None, adapter=adapter is not None,
        rollback=mode, **stats.facts(len(out)), draft_steps=draft_steps, prepare_seconds=prep_full + prep_draft, seconds=secs,
        prefill_seconds=stats.prefill_seconds,
        tokens_per_second=len(out) / secs if secs > 0 else 0.0,
    )
    return _compared(result, compare_plain, c, prompt, n, full_ex, secs)
