"""INFER: the next-token distribution (TOP n), greedy generation (GENERATE n, stopping at
end-of-sequence unless EXACTLY), and self-speculative decoding (SPECULATE). Ctrl-C during a
generation keeps the tokens produced so far (the result is marked interrupted)."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from .. import planner
from .. import results as R
from ..binding import draft_module, expert_layers
from . import command
from .explain import prompt_info


@command(planner.Run)
def infer(session, node: planner.Run) -> R.InferResult:
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    ex, fresh = session.executor(node.slice.depth, node.intervention)
    st = ex.start()
    t0 = time.perf_counter()
    last = np.asarray(st.prefill(list(node.prompt.ids))[-1])
    prefill_s = time.perf_counter() - t0
    executed = [int(i) for i in ex.trace.executed_layers]
    top = None
    if node.top is not None:
        top = top_candidates(last, node.top, cat.token_text)
    gen_ids = gen_text = stopped = None
    interrupted = False
    timing = R.Timing(prepare_seconds=ex.trace.prepare_seconds if fresh else None, prefill_seconds=prefill_s)
    if node.generate is not None:
        gen_ids = []
        stop = set(node.stop_ids)
        t1 = time.perf_counter()
        logits = last
        try:
            for k in range(node.generate):
                tok = int(np.argmax(logits))
                gen_ids.append(tok)
                if session.on_token is not None:
                    session.on_token(tok, cat.token_text(tok))
                if tok in stop:
                    stopped = tok
                    break
                if k + 1 < node.generate:
                    logits = np.asarray(st.step(tok))
        except KeyboardInterrupt:  # Ctrl-C: keep what was generated
            interrupted = True
        decode_s = time.perf_counter() - t1
        gen_text = cat.decode(gen_ids)
        n = len(gen_ids)
        timing.decode_seconds = decode_s
        timing.ms_per_token = decode_s * 1000.0 / n if n else None
        timing.tokens_per_second = n / decode_s if decode_s > 0 and n else None
    steps = [int(n) for n in (getattr(st.trace, "step_bytes", None) or [])]
    result = R.InferResult(slice=node.slice.label, depth=node.slice.depth, executed_layers=executed,
                           prompt=prompt, top=top, generated_ids=gen_ids, generated_text=gen_text,
                           stopped_at=stopped, interrupted=interrupted,
                           prepared_reads=int(ex.trace.operand_reads), prepared_bytes=int(ex.trace.bytes_read),
                           intervention=node.intervention.record() if node.intervention is not None else None,
                           prefill_bytes=steps[0] if steps else None, decode_bytes=steps[1:] if steps else None,
                           expert_layers=expert_layers(session.catalog.op_plan, executed), timing=timing)
    result._logits = last
    return result


@command(planner.Speculate)
def speculate(session, node: planner.Speculate) -> R.SpeculateResult:
    draft = draft_module("INFER ... SPECULATE")
    c = session.container
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    produced: list[int] = []
    hook = session.on_token

    def on_token(tok: int) -> None:
        produced.append(int(tok))
        if hook is not None:
            hook(int(tok), cat.token_text(int(tok)))

    try:
        res = draft.speculative_generate(c, list(node.prompt.ids), node.generate, node.draft.depth, node.lookahead,
                                         on_token=on_token, compare_plain=node.compare,
                                         max_positions=session.settings.get("max_positions"))
    except KeyboardInterrupt:  # Ctrl-C: the tokens so far, no statistics
        return R.SpeculateResult(prompt=prompt, depth=node.draft.depth, lookahead=node.lookahead,
                                 generated_ids=produced, generated_text=cat.decode(produced), interrupted=True)
    plain = res.plain
    return R.SpeculateResult(
        prompt=prompt, depth=res.depth, lookahead=res.lookahead, generated_ids=list(res.tokens),
        generated_text=cat.decode(list(res.tokens)), rounds=res.rounds, proposed=res.proposed,
        accepted=res.accepted, acceptance_rate=res.acceptance_rate, tokens_per_full_step=res.tokens_per_full_step,
        full_model_calls=res.full_model_calls, rollback=res.rollback, matches_plain=res.matches_plain,
        timing=R.Timing(prepare_seconds=res.prepare_seconds, decode_seconds=res.seconds,
                        tokens_per_second=res.tokens_per_second),
        speedup=res.speedup,
        plain_tokens_per_second=plain.tokens_per_second if plain is not None else None,
    )


def top_candidates(logits: np.ndarray, n: int, token_text: Callable[[int], str | None]) -> list[R.Candidate]:
    x = logits.astype(np.float64)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    n = min(n, p.shape[0])
    # stable order: probability descending, then id ascending, so ties never depend on the sort
    order = np.lexsort((np.arange(p.shape[0]), -p))[:n]
    return [R.Candidate(rank=k + 1, token=token_text(int(i)), id=int(i), probability=float(p[i]))
            for k, i in enumerate(order)]
