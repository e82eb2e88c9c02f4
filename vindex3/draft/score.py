"""Scoring a draft's logits against the full model's: the pure math, and the file-level
function that first proves the two dumps are comparable.

Conventions (``docs/draft.md`` has the long form):

- Row ``i`` of a dump holds the logits after tokens ``0..i``, i.e. the prediction of token
  ``i+1``. The true next token therefore exists for rows ``0..n-2`` only.
- Everything is computed in float64 from a max-subtracted log-softmax.
- A *rank* is the count of strictly greater logits in the same row, so rank 0 means "this is
  (one of) the argmax", and ties never push a token down.
- Containment in top-k means that rank ``< k``.
- Percentiles use numpy's default linear interpolation.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict

from ..errors import IntegrityError, SliceError


class PositionScore(BaseModel):
    """One row of the comparison. ``next_*`` fields are None on the last row, which predicts a
    token the prompt does not contain."""

    model_config = ConfigDict(frozen=True)

    position: int
    kl: float  # KL(target || draft), nats
    top1: bool  # draft argmax == target argmax
    target_argmax: int
    draft_argmax: int
    target_rank_in_draft: int  # strictly greater draft logits than the draft's logit at target argmax
    in_top5: bool
    in_top20: bool
    next_token: int | None = None
    next_rank_draft: int | None = None
    next_rank_target: int | None = None


class ScoreSummary(BaseModel):
    """Pooled figures over a set of positions (one prompt, one category, or everything)."""

    model_config = ConfigDict(frozen=True)

    positions: int
    kl_mean: float
    kl_p50: float
    kl_p90: float
    kl_p99: float
    kl_max: float
    top1: float  # mean top-1 agreement
    median_target_rank: float  # of the target argmax in the draft
    top5: float  # containment rate of the target argmax in the draft's top 5
    top20: float
    next_positions: int  # rows with a true next token (0..n-2 of every prompt)
    median_next_rank_draft: float | None
    median_next_rank_target: float | None


class ArrayScore(BaseModel):
    """What :func:`score_arrays` returns: every position, and their summary."""

    positions: list[PositionScore]
    summary: ScoreSummary


class ScoreReport(BaseModel):
    """What :func:`score_files` returns: the comparison plus the provenance both arms shared."""

    draft_path: str
    target_path: str
    container_digest: str
    component: str | None
    model_layers: int
    draft_depth: int | None
    draft_executed_layers: list[int]
    token_ids: list[int]
    vocab: int
    draft_prepare_seconds: float | None
    draft_ms_per_position: float | None
    target_prepare_seconds: float | None
    target_ms_per_position: float | None
    positions: list[PositionScore]
    summary: ScoreSummary
    # What each arm's run was changed by (ABLATE FEATURES ...), None for a clean run: a score
    # between an ablated and a clean dump says so rather than passing for a draft comparison.
    draft_intervention: dict | None = None
    target_intervention: dict | None = None
    draft_adapter: dict | None = None  # the exit adapter the draft's residual was read through (its sidecar's)


# ---------------------------------------------------------------------------------------------
# the math


def _log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64, max-subtracted so that exp never overflows."""
    x = x.astype(np.float64, copy=True)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def _ranks_of(logits: np.ndarray, cols: np.ndarray) -> np.ndarray:
    """For each row r, the count of entries strictly greater than logits[r, cols[r]]."""
    rows = np.arange(len(cols))
    ref = logits[rows, cols][:, None]
    return (logits > ref).sum(axis=1).astype(np.int64)


def _check_arrays(draft: np.ndarray, target: np.ndarray, token_ids: Sequence[int]) -> None:
    if draft.ndim != 2 or target.ndim != 2:
        raise IntegrityError(
            f"logits must be 2-D [positions, vocab]; got draft {draft.shape} and target {target.shape}"
        )
    if draft.shape != target.shape:
        raise IntegrityError(
            f"draft and target logits differ in shape: draft {draft.shape}, target {target.shape}"
        )
    if draft.shape[0] != len(token_ids):
        raise IntegrityError(
            f"{draft.shape[0]} logit rows for {len(token_ids)} token ids; a dump holds one row per token"
        )
    vocab = draft.shape[1]
    bad = [t for t in token_ids if not 0 <= int(t) < vocab]
    if bad:
        raise IntegrityError(f"token ids {bad[:5]} fall outside the vocabulary of {vocab}")
    for name, arr in (("draft", draft), ("target", target)):
        # -inf is a legitimate "impossible token"; NaN and +inf mean the run itself broke.
        bad_rows = np.flatnonzero((np.isnan(arr) | np.isposinf(arr)).any(axis=1))
        if bad_rows.size:
            raise IntegrityError(f"{name} logits hold NaN or +inf at positions {bad_rows[:5].tolist()}")


def score_arrays(
    draft_logits: np.ndarray, target_logits: np.ndarray, token_ids: Sequence[int]
) -> ArrayScore:
    """Compare draft logits with target logits, row by row (row i predicts token i+1).

    Both arrays are ``[positions, vocab]``; ``token_ids`` are the tokens the rows were computed
    on. Returns per-position KL(target‖draft) in nats, top-1 agreement, the rank of the target
    argmax in the draft, top-5/top-20 containment and, on rows 0..n-2, the rank of the true next
    token in draft and target; plus their summary.
    """
    draft = np.asarray(draft_logits)
    target = np.asarray(target_logits)
    token_ids = [int(t) for t in token_ids]
    _check_arrays(draft, target, token_ids)
    n = draft.shape[0]

    ld = _log_softmax(draft)
    lt = _log_softmax(target)
    with np.errstate(invalid="ignore", divide="ignore"):
        pt = np.exp(lt)
        # A target token of probability exactly 0 contributes nothing (0·log 0 := 0).
        kl = np.where(pt > 0, pt * (lt - ld), 0.0).sum(axis=1)

    t_arg = target.argmax(axis=1)
    d_arg = draft.argmax(axis=1)
    rank = _ranks_of(draft, t_arg)

    nxt = np.asarray(token_ids[1:], dtype=np.int64)
    next_d = _ranks_of(draft[: n - 1], nxt) if n > 1 else np.zeros(0, np.int64)
    next_t = _ranks_of(target[: n - 1], nxt) if n > 1 else np.zeros(0, np.int64)

    positions = []
    for i in range(n):
        has_next = i < n - 1
        positions.append(
            PositionScore(
                position=i,
                kl=float(kl[i]),
                top1=bool(t_arg[i] == d_arg[i]),
                target_argmax=int(t_arg[i]),
                draft_argmax=int(d_arg[i]),
                target_rank_in_draft=int(rank[i]),
                in_top5=bool(rank[i] < 5),
                in_top20=bool(rank[i] < 20),
                next_token=int(nxt[i]) if has_next else None,
                next_rank_draft=int(next_d[i]) if has_next else None,
                next_rank_target=int(next_t[i]) if has_next else None,
            )
        )
    return ArrayScore(positions=positions, summary=summarize(positions))


def _percentile(values: np.ndarray, q: float) -> float:
    """numpy's default (linear) percentile, except that a bracket reaching an infinite KL gives
    inf instead of NaN (numpy computes inf - inf there)."""
    x = np.sort(values)
    h = (len(x) - 1) * q / 100.0
    lo = int(np.floor(h))
    hi = min(lo + 1, len(x) - 1)
    frac = h - lo
    if frac == 0.0 or x[hi] == x[lo]:
        return float(x[lo])
    if np.isinf(x[hi]):
        return float(x[hi])
    return float(x[lo] + frac * (x[hi] - x[lo]))


def summarize(positions: Sequence[PositionScore]) -> ScoreSummary:
    """Pool any set of positions (one prompt, a category, everything) into one summary."""
    if not positions:
        raise IntegrityError("nothing to summarise: no positions were scored")
    kl = np.array([p.kl for p in positions], dtype=np.float64)
    rank = np.array([p.target_rank_in_draft for p in positions], dtype=np.float64)
    nd = np.array([p.next_rank_draft for p in positions if p.next_rank_draft is not None], np.float64)
    nt = np.array([p.next_rank_target for p in positions if p.next_rank_target is not None], np.float64)
    p50, p90, p99 = (_percentile(kl, q) for q in (50, 90, 99))
    return ScoreSummary(
        positions=len(positions),
        kl_mean=float(kl.mean()),
        kl_p50=float(p50),
        kl_p90=float(p90),
        kl_p99=float(p99),
        kl_max=float(kl.max()),
        top1=float(np.mean([p.top1 for p in positions])),
        median_target_rank=float(np.median(rank)),
        top5=float(np.mean([p.in_top5 for p in positions])),
        top20=float(np.mean([p.in_top20 for p in positions])),
        next_positions=int(nd.size),
        median_next_rank_draft=float(np.median(nd)) if nd.size else None,
        median_next_rank_target=float(np.median(nt)) if nt.size else None,
    )


# ---------------------------------------------------------------------------------------------
# files


def check_comparable(draft: dict, target: dict, *, draft_name: str = "draft",
                     target_name: str = "target") -> int:
    """Refuse unless two dump sidecars describe comparable runs; return the draft's depth.

    Same container digest, same token ids and positions, same vocab, same model depth; the
    target ran every layer; the draft ran exactly layers ``[0, depth)``.
    """
    def same(key: str, what: str) -> None:
        if draft.get(key) != target.get(key):
            a, b = draft.get(key), target.get(key)
            if isinstance(a, list) and isinstance(b, list):
                first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                detail = f"lengths {len(a)} and {len(b)}, first difference at index {first}"
            else:
                detail = f"{draft_name} has {a!r}, {target_name} has {b!r}"
            raise IntegrityError(f"cannot score: the dumps differ in {what} ({detail})",
                                 hint="both dumps must come from the same container and tokens")

    same("container_digest", "container digest")
    same("component", "component")
    same("token_ids", "token ids")
    same("positions", "positions")
    same("vocab", "vocab")
    same("model_layers", "model layers")

    layers = target.get("model_layers")
    if not isinstance(layers, int) or layers < 1:
        raise IntegrityError(f"cannot score: {target_name} sidecar has no usable model_layers ({layers!r})")
    full = list(range(layers))
    t_depth = target.get("draft_depth")
    if t_depth not in (None, layers) or target.get("executed_layers") != full:
        raise SliceError(
            f"cannot score: the target is not full depth ({target_name} draft_depth={t_depth!r}, "
            f"executed {len(target.get('executed_layers') or [])} of {layers} layers)",
            hint="dump the target without DRAFT DEPTH",
        )
    if target.get("adapter") is not None:
        raise SliceError(f"cannot score: the target {target_name} was read through exit adapter "
                         f"{target['adapter'].get('key')!r}; a target is the full model as it is",
                         hint="dump the target without WITH ADAPTER")
    d_depth = draft.get("draft_depth")
    depth = layers if d_depth is None else d_depth
    if not isinstance(depth, int) or not 1 <= depth <= layers:
        raise SliceError(f"cannot score: {draft_name} draft_depth {d_depth!r} is not within 1..{layers}")
    ran = draft.get("executed_layers")
    if ran != list(range(depth)):
        shown = ran if not isinstance(ran, list) or len(ran) <= 8 else f"{ran[:8]}…"
        raise SliceError(
            f"cannot score: the {draft_name} declares depth {depth} but executed layers {shown}, "
            f"not exactly [0, {depth})"
        )
    return depth


def score_files(draft_path: str | Path, target_path: str | Path) -> ScoreReport:
    """Score a draft dump against a full-depth target dump, after proving from their sidecars
    that they are comparable (see :func:`check_comparable`). Refusals are typed vindex3 errors
    whose message names the mismatch."""
    from .dumps import read_dump, read_meta

    dmeta = read_meta(draft_path)
    tmeta = read_meta(target_path)
    depth = check_comparable(dmeta, tmeta)
    _, draft = read_dump(draft_path, meta=dmeta)
    _, target = read_dump(target_path, meta=tmeta)
    scored = score_arrays(draft, target, dmeta["token_ids"])
    return ScoreReport(
        draft_path=str(draft_path),
        target_path=str(target_path),
        container_digest=dmeta["container_digest"],
        component=dmeta.get("component"),
        model_layers=tmeta["model_layers"],
        draft_depth=depth if dmeta.get("draft_depth") is not None else None,
        draft_executed_layers=list(dmeta["executed_layers"]),
        token_ids=list(dmeta["token_ids"]),
        vocab=int(dmeta["vocab"]),
        draft_prepare_seconds=dmeta.get("prepare_seconds"),
        draft_ms_per_position=dmeta.get("ms_per_position"),
        target_prepare_seconds=tmeta.get("prepare_seconds"),
        target_ms_per_position=tmeta.get("ms_per_position"),
        draft_intervention=dmeta.get("intervention"),
        draft_adapter=dmeta.get("adapter"),
        target_intervention=tmeta.get("intervention"),
        positions=scored.positions,
        summary=scored.summary,
    )
