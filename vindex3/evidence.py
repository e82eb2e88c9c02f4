"""SCORE REPRESENTATION: behavioural evidence that a representation computes the model it claims.

Bytes say how far each tensor moved (the fidelity REPRESENT records per tensor); this says what
that does to the model's behaviour, on a prompt bank, against a reference container of the same
model (normally the source it was represented from):

* per position of every prompt (one prefill per arm), KL(reference ‖ candidate) of the
  next-token distributions in nats (float64 log-softmax) and whether the two argmaxes agree;
* per prompt, greedy-N agreement: both arms continue the prompt greedily for N tokens (no stop
  at end-of-sequence) and the score is the length of the common prefix of the two continuations
  over N — 1.0 when the candidate reproduces the reference's N tokens, 0.5 when they part at the
  N/2-th.

The two containers must be logically identical (`vindex3.diff`: the same graph, objects, tensor
names and shapes, and capability files): otherwise the comparison is refused by name, never run.
The report names both containers' digests and the bank's SHA-256, and is stored in the
candidate's provenance (``provenance.evidence``, one entry per reference digest and bank; a
sealed rewrite of its index: generation + 1, unknown keys kept).
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from pydantic import BaseModel

from . import __version__
from .container import Container
from .draft.bank import _read_bank, load_prompts
from .errors import IntegrityError, TokenizerMissing, VindexError

METHOD = "vindex3 score-representation"
VERSION = 1
GREEDY = 32

Progress = Callable[[int, int, str], None]


class PromptEvidence(BaseModel):
    id: str
    category: str
    positions: int
    kl_mean: float
    kl_max: float
    top1: float
    greedy_agreement: float  # common prefix of the greedy continuations / greedy
    reference_continuation: list[int]
    candidate_continuation: list[int]


class RepresentationScore(BaseModel):
    candidate: str
    reference: str
    candidate_digest: str
    reference_digest: str
    candidate_encodings: dict[str, str]  # object -> representation key
    reference_encodings: dict[str, str]
    bank: str
    bank_sha256: str
    prompts: int
    positions: int
    greedy: int
    kl_mean: float
    kl_p50: float
    kl_p95: float
    kl_max: float
    top1: float
    greedy_agreement: float  # mean over prompts
    greedy_exact: float  # fraction of prompts whose N greedy tokens all agree
    seconds: float
    stored: bool = False
    per_prompt: list[PromptEvidence]

    def record(self) -> dict:
        """What goes into the candidate's provenance (no per-prompt continuations)."""
        return {
            "method": METHOD, "version": VERSION, "writer": f"vindex3 {__version__}",
            "scored_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "reference": {"name": Path(self.reference).name, "digest": self.reference_digest,
                          "encodings": self.reference_encodings},
            "bank": {"name": Path(self.bank).name, "sha256": self.bank_sha256, "prompts": self.prompts},
            "positions": self.positions, "greedy": self.greedy,
            "kl_mean": self.kl_mean, "kl_p50": self.kl_p50, "kl_p95": self.kl_p95, "kl_max": self.kl_max,
            "top1": self.top1, "greedy_agreement": self.greedy_agreement, "greedy_exact": self.greedy_exact,
            "per_prompt": {p.id: {"kl_mean": p.kl_mean, "top1": p.top1, "greedy": p.greedy_agreement}
                           for p in self.per_prompt},
        }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64, copy=True)
    x -= x.max(axis=-1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=-1, keepdims=True))
    return x


def kl_rows(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """KL(softmax(reference) ‖ softmax(candidate)) per row, in nats."""
    lr, lc = _log_softmax(reference), _log_softmax(candidate)
    pr = np.exp(lr)
    with np.errstate(invalid="ignore"):
        return np.where(pr > 0, pr * (lr - lc), 0.0).sum(axis=-1)


def _run(ex, ids: list[int], greedy: int) -> tuple[np.ndarray, list[int]]:
    """Prefill logits [n, vocab] and ``greedy`` greedy tokens after them."""
    st = ex.start()
    logits = st.prefill(ids)
    out = []
    tok = int(np.argmax(logits[-1]))
    for _ in range(greedy):
        out.append(tok)
        if len(out) == greedy:
            break
        tok = int(np.argmax(st.step(tok)))
    return logits, out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _percentile(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else float("nan")


def score_representation(candidate: str | Path | Container, reference: str | Path | Container,
                         prompts: str | Path, *, greedy: int = GREEDY, store: bool = True,
                         max_prompts: int | None = None, progress: Progress | None = None) -> RepresentationScore:
    """Score ``candidate`` against ``reference`` on the bank at ``prompts`` (see the module
    docstring); with ``store`` write the result into the candidate's provenance."""
    from .diff import diff

    if isinstance(greedy, bool) or not isinstance(greedy, int) or greedy < 1:
        raise VindexError(f"greedy agreement needs at least one token, got {greedy!r}")
    t0 = time.perf_counter()
    cand = candidate if isinstance(candidate, Container) else Container(candidate)
    ref = reference if isinstance(reference, Container) else Container(reference)
    if cand.path.resolve() == ref.path.resolve():
        raise IntegrityError(f"SCORE REPRESENTATION compares two containers; {cand.path.name} was given as both")
    d = diff(ref.path, cand.path)
    if d.logical:
        shown = "; ".join(f"{x.area}: {x.what} ({x.a} vs {x.b})" for x in d.logical[:4])
        more = f" and {len(d.logical) - 4} more" if len(d.logical) > 4 else ""
        raise IntegrityError(f"cannot score {cand.path.name} against {ref.path.name}: they are not the same model "
                             f"(logical differences: {shown}{more})",
                             hint="a representation is scored against a container of the same model, e.g. its source")
    bank = load_prompts(prompts, max_prompts=max_prompts)
    if not bank:
        raise IntegrityError(f"{Path(prompts).name} holds no prompts")
    bank_sha = hashlib.sha256(_read_bank(prompts)).hexdigest()
    if any(p.text is not None for p in bank) and not ref.has_tokenizer:
        raise TokenizerMissing(f"{ref.path.name} carries no tokenizer and the bank holds text prompts",
                               hint="give the bank's prompts as token_ids")
    ex_ref, ex_cand = ref.executor(), cand.executor()  # an encoding without a codec is refused here
    all_ids = {}
    for p in bank:  # every prompt tokenized and checked against the context length before any runs
        ids = list(p.token_ids) if p.token_ids is not None else [int(t) for t in ref.tokenizer.encode(p.text)]
        if not ids:
            raise VindexError(f"prompt {p.id!r} tokenizes to no tokens")
        ex_ref.check_positions(len(ids) + greedy, f"prompt {p.id!r} and {greedy} greedy tokens")
        all_ids[p.id] = ids
    kls, top1s, rows = [], [], []
    for i, p in enumerate(bank):
        ids = all_ids[p.id]
        lr, gr = _run(ex_ref, ids, greedy)
        lc, gc = _run(ex_cand, ids, greedy)
        kl = kl_rows(lr, lc)
        t1 = lr.argmax(axis=-1) == lc.argmax(axis=-1)
        kls.append(kl)
        top1s.append(t1)
        rows.append(PromptEvidence(id=p.id, category=p.category, positions=len(ids), kl_mean=float(kl.mean()),
                                   kl_max=float(kl.max()), top1=float(t1.mean()),
                                   greedy_agreement=_common_prefix(gr, gc) / greedy,
                                   reference_continuation=gr, candidate_continuation=gc))
        if progress is not None:
            progress(i + 1, len(bank), p.id)
    kl_all = np.concatenate(kls)
    t1_all = np.concatenate(top1s)
    score = RepresentationScore(
        candidate=str(cand.path), reference=str(ref.path), candidate_digest=cand.digest, reference_digest=ref.digest,
        candidate_encodings={x["object"]: x["representation"] for x in cand.objects()},
        reference_encodings={x["object"]: x["representation"] for x in ref.objects()},
        bank=str(prompts), bank_sha256=bank_sha, prompts=len(bank), positions=int(kl_all.size), greedy=greedy,
        kl_mean=float(kl_all.mean()), kl_p50=_percentile(kl_all, 50), kl_p95=_percentile(kl_all, 95),
        kl_max=float(kl_all.max()), top1=float(t1_all.mean()),
        greedy_agreement=float(np.mean([r.greedy_agreement for r in rows])),
        greedy_exact=float(np.mean([r.greedy_agreement == 1.0 for r in rows])),
        seconds=time.perf_counter() - t0, per_prompt=rows,
    )
    if store:
        store_evidence(cand, score)
        score.stored = True
    return score


def store_evidence(cand: Container, score: RepresentationScore) -> None:
    """Put ``score`` into the candidate's provenance: ``evidence`` keeps one entry per
    (reference digest, bank sha256), the newest replacing an older one of the same pair."""
    rec = score.record()
    old = cand.provenance.get("evidence")
    entries = [e for e in (old if isinstance(old, list) else [])
               if not (isinstance(e, dict) and (e.get("reference") or {}).get("digest") == score.reference_digest
                       and (e.get("bank") or {}).get("sha256") == score.bank_sha256)]
    entries.append(rec)
    cand.rewrite_index(provenance={"evidence": entries})
