"""Scoring edits the way the editing literature does (CounterFact's metrics, ROME / MEMIT):

* efficacy: P(target) > P(original) at the edit's prompt;
* paraphrase: the same on each paraphrase (the fraction that holds);
* neighborhood: P(answer) > P(target) on each neighbor prompt (a fact the edit must not touch).
  A neighbor whose prompt the scored overlay itself edits (edits fitted together, where one
  edit's neighbor is another's subject) expects that edit's target, not the file's unedited
  answer: the overlay was asked to change it, so the file's answer contradicts the batch. Such
  neighbors are counted (``neighbors_edited``); one whose expected target begins with the same
  token as the case's own target cannot tell them apart and is left out, counted too
  (``neighbors_undecidable``);
* the target's probability and rank at the prompt (rank 0: the top token);
* KL(unedited || edited) of the next-token distributions over every position of the frozen prompt
  bank, averaged: what the edits cost text unrelated to them.

Probabilities are of a word's first token (the token INSERT's target writes and KNN overrides)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from .. import jsonio
from ..errors import ConfigError, PathRefused
from ..paths import existing_file, read_regular

MAX_CASES_BYTES = 16 << 20


class Neighbor(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str
    answer: str


class Case(BaseModel):
    """One line of an edits file."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    target: str
    original: str
    subject: str | None = None  # the entity in the prompt (MODE MEMIT keys at its last token)
    paraphrases: list[str] = []
    neighbors: list[Neighbor] = []


def load_cases(path: str | Path) -> list[Case]:
    """An edits file: one JSON object a line (blank lines skipped); a bad line is refused by
    number and field."""
    try:
        data = read_regular(existing_file(path, "edits file"), "edits file", max_bytes=MAX_CASES_BYTES)
    except PathRefused as e:
        raise ConfigError(e.message) from None
    name = Path(path).name
    out = []
    for n, line in enumerate(jsonio.decode_text(data, name).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append(Case.model_validate(jsonio.loads(line, source=f"{name} line {n}")))
        except ValidationError as e:
            first = e.errors()[0]
            raise ConfigError(f"{name} line {n}: {'.'.join(str(x) for x in first['loc']) or 'line'}: {first['msg']}") from None
    if not out:
        raise ConfigError(f"{name}: the edits file holds no edits")
    return out


class CaseScore(BaseModel):
    prompt: str
    target: str
    original: str
    efficacy: bool
    paraphrase: float | None  # None: the case has no paraphrases
    neighborhood: float | None
    p_target: float
    p_original: float
    rank: int
    retrieval_hits: int = 0  # positions a retrieval overlay overrode while scoring this case
    neighbors_edited: int = 0  # neighbors whose prompt the overlay edits: scored against that edit's target
    neighbors_undecidable: int = 0  # of those, left out: the edit's target shares this case's target's first token


class ScoreReport(BaseModel):
    overlay: str  # what was scored, in words (KNN named a retrieval overlay)
    cases: list[CaseScore]
    efficacy: float
    paraphrase: float | None
    neighborhood: float | None
    p_target: float
    kl: float | None  # mean KL(unedited || edited) over the prompt bank's positions
    kl_positions: int
    bank: str | None
    neighbors_edited: int = 0  # over all cases (see `CaseScore`)
    neighbors_undecidable: int = 0


def _first(tok, word: str) -> int:
    ids = tok.encode(word, special=False)
    if not ids:
        raise ConfigError(f"{word!r} tokenizes to nothing")
    return int(ids[0])


def _probs(ex, tok, prompt: str) -> tuple[np.ndarray, int]:
    st = ex.start()
    logits = st.prefill(tok.encode(prompt), last_only=True)[-1].astype(np.float64)
    z = np.exp(logits - logits.max())
    return z / z.sum(), len(getattr(st, "retrieval_hits", ()))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


_BASE_LOGP: dict = {}  # (base executor id, text) -> the unedited log-probabilities, computed once


def bank_kl(base_ex, edited_ex, tok, texts: list[str]) -> tuple[float, int]:
    """Mean KL(unedited || edited) over every position of ``texts``."""
    total, n = 0.0, 0
    limit = base_ex.max_positions
    for t in texts:
        ids = tok.encode(t)
        if limit is not None:
            ids = ids[:limit]  # a bank text longer than the context is scored on its first positions
        key = (id(base_ex), t)
        if key not in _BASE_LOGP:
            _BASE_LOGP[key] = (base_ex, _log_softmax(base_ex.forward(ids)))  # the executor kept: its id stays its own
        a = _BASE_LOGP[key][1]
        b = _log_softmax(edited_ex.forward(ids))
        total += float((np.exp(a) * (a - b)).sum())
        n += len(ids)
    return total / max(n, 1), n


def score(base, edited, cases: list[Case], *, bank: str | Path | None = None, kl: bool = True,
          executor=None, base_executor=None) -> ScoreReport:
    """Score ``edited`` (an `EditedModel`, or any model with ``executor()``) against ``base`` on
    ``cases``; with ``kl``, also KL over the prompt bank (``bank``, default the frozen one)."""
    from ..draft.bank import default_bank, load_prompts

    tok = base.tokenizer
    ex = executor or edited.executor()
    edits = getattr(edited, "edits", None)
    # the prompts the overlay itself edits, and the target each was given (the last edit of a prompt wins)
    rewritten = {e.prompt: e.target for e in (edits() if callable(edits) else []) if e.prompt and e.target}
    out: list[CaseScore] = []
    for c in cases:
        t, o = _first(tok, c.target), _first(tok, c.original)
        if t == o:
            raise ConfigError(f"edit {c.prompt!r}: target {c.target!r} and original {c.original!r} begin with the same "
                              f"token ({tok.decode([t])!r}), so their first-token probabilities cannot tell them apart")
        p, hits = _probs(ex, tok, c.prompt)
        para = []
        for q in c.paraphrases:
            pq, h = _probs(ex, tok, q)
            para.append(pq[t] > pq[o])
            hits += h
        nb = []
        n_edited = n_undecided = 0
        for n in c.neighbors:
            answer = n.answer
            if n.prompt in rewritten and n.prompt != c.prompt:
                n_edited += 1
                answer = rewritten[n.prompt]
                if _first(tok, answer) == t:
                    n_undecided += 1
                    continue
            pn, h = _probs(ex, tok, n.prompt)
            nb.append(pn[_first(tok, answer)] > pn[t])
            hits += h
        out.append(CaseScore(prompt=c.prompt, target=c.target, original=c.original, efficacy=bool(p[t] > p[o]),
                             paraphrase=float(np.mean(para)) if para else None,
                             neighborhood=float(np.mean(nb)) if nb else None, p_target=float(p[t]),
                             p_original=float(p[o]), rank=int((p > p[t]).sum()), retrieval_hits=hits,
                             neighbors_edited=n_edited, neighbors_undecidable=n_undecided))
    kl_value, kl_n, bank_name = None, 0, None
    if kl:
        from . import fit

        path = Path(bank) if bank is not None else Path(fit.DEFAULT_CORPUS) if fit.DEFAULT_CORPUS else default_bank()
        texts = [p.text for p in load_prompts(path) if p.text is not None]
        kl_value, kl_n = bank_kl(base_executor or base.executor(), ex, tok, texts)
        bank_name = path.name

    def mean(xs):
        xs = [x for x in xs if x is not None]
        return float(np.mean(xs)) if xs else None

    describe = getattr(edited, "describe", None)
    return ScoreReport(overlay=describe() if callable(describe) else "the unedited model", cases=out,
                       efficacy=float(np.mean([c.efficacy for c in out])),
                       paraphrase=mean([c.paraphrase for c in out]), neighborhood=mean([c.neighborhood for c in out]),
                       p_target=float(np.mean([c.p_target for c in out])), kl=kl_value, kl_positions=kl_n,
                       bank=bank_name, neighbors_edited=sum(c.neighbors_edited for c in out),
                       neighbors_undecidable=sum(c.neighbors_undecidable for c in out))
