"""Fitted exit adapters (the tuned lens): for a draft depth d, an affine map from the residual
after layer d-1 (what Draft(d) hands its final norm) to the residual the full model's final norm
sees, fitted in closed form by ridge least squares on hidden states of a named corpus (default:
the seed list in ``vindex3.draft.seeds``, never the frozen prompt bank).

    minimise  ||[X 1] M - Y||^2 + ridge * ||W||^2    with  M = [W; b]  (the bias is not penalised)
    M = ([X 1]^T [X 1] + ridge * diag(1..1, 0))^-1 [X 1]^T Y          (float64 normal equations)

The ridge, unless given, is chosen by cross-validation on the corpus itself (`choose_ridge`:
folds of whole texts, the held-out positions' top-1 agreement with the full model), so the
prompt bank stays unread until the adapter is scored on it.

A draft with an adapter reads ``readout(h @ W + b)``; with the identity adapter that is exactly
the unadapted draft (so Draft(L) with it is bit-identical to Full). The adapter records its
provenance (container digest, corpus digest, positions, ridge, relative fit residual) and is
refused for another container.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from ..errors import DerivedStale, UnsupportedOperator, VindexError
from .slices import make_executor, open_container, resolve_slice
from .vocab import corpus_digest, corpus_ids

F32 = np.float32


class AdapterFacts(BaseModel):
    depth: int
    hidden: int
    ridge: float
    positions: int
    corpus: str
    corpus_sha256: str
    texts: int
    fit_residual: float  # ||[X 1] M - Y|| / ||Y|| on the fitting positions
    identity_residual: float  # ||X - Y|| / ||Y||: the same with no adapter
    container_digest: str
    method: str = "ridge least squares, closed form (float64 normal equations), bias unpenalised"
    ridge_choice: str = "given"  # or how the ridge was chosen (cross-validation over the corpus's texts)
    cv_top1: dict[str, float] | None = None  # ridge -> held-out top-1 agreement, when chosen by cross-validation


class ExitAdapter:
    """W [hidden, hidden] and b [hidden], float32, with their provenance."""

    def __init__(self, W: np.ndarray, b: np.ndarray, facts: AdapterFacts):
        self.W = np.ascontiguousarray(W, dtype=F32)
        self.b = np.ascontiguousarray(b, dtype=F32)
        self.facts = facts

    @classmethod
    def identity(cls, container: Any, depth: int) -> ExitAdapter:
        c = open_container(container)
        H = int(c.graph.hidden_size)
        facts = AdapterFacts(depth=depth, hidden=H, ridge=0.0, positions=0, corpus="identity", corpus_sha256="",
                             texts=0, fit_residual=float("nan"), identity_residual=float("nan"),
                             container_digest=str(c.digest))
        return cls(np.eye(H, dtype=F32), np.zeros(H, F32), facts)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return h @ self.W + self.b

    def check(self, container: Any) -> None:
        c = open_container(container)
        if self.facts.container_digest != c.digest:
            raise DerivedStale(f"exit adapter was fitted on container {self.facts.container_digest[:16]}, "
                               f"not this one ({str(c.digest)[:16]})", hint="fit the adapter again on this container")

    def save(self, path: str | Path) -> None:
        np.savez(path, W=self.W, b=self.b, facts=np.array(self.facts.model_dump_json()))

    @classmethod
    def load(cls, path: str | Path) -> ExitAdapter:
        with np.load(path) as z:
            return cls(z["W"], z["b"], AdapterFacts.model_validate(json.loads(str(z["facts"]))))


def ridge_fit(X: np.ndarray, Y: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """W [H_in, H_out], b [H_out] minimising ||X W + b - Y||^2 + ridge ||W||^2 (float64)."""
    X64, Y64 = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    if X64.ndim != 2 or Y64.ndim != 2 or X64.shape[0] != Y64.shape[0] or X64.shape[0] == 0:
        raise VindexError(f"an adapter fit needs X [N, H] and Y [N, H] with N ≥ 1; got {X64.shape} and {Y64.shape}")
    if not (ridge >= 0 and np.isfinite(ridge)):
        raise VindexError(f"ridge must be a finite number ≥ 0; got {ridge!r}")
    return _solve(*_normal(X64, Y64), float(ridge))


def _normal(X64: np.ndarray, Y64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[X 1]^T [X 1] and [X 1]^T Y (float64): the normal equations before the ridge."""
    Xa = np.hstack([X64, np.ones((X64.shape[0], 1))])
    return Xa.T @ Xa, Xa.T @ Y64


def _solve(G: np.ndarray, XtY: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    G = G.copy()
    reg = np.full(G.shape[0], ridge)
    reg[-1] = 0.0
    G[np.diag_indices_from(G)] += reg
    M = np.linalg.solve(G, XtY)
    return M[:-1], M[-1]


# The ridges cross-validation chooses from, and how. With few fitting positions per coefficient
# (656 seed positions against 577 coefficients an output) a small ridge over-fits: on SmolLM2 at
# depth 16, ridge 1 took held-out top-1 from 0.122 to 0.202 and ridge 1e4 to 0.343 (docs/draft.md).
RIDGE_GRID = (1.0, 10.0, 100.0, 1e3, 1e4, 1e5, 1e6)
CV_FOLDS = 5  # texts i, i + 5, i + 10, ... form fold i: a text's positions never straddle folds
CV_MAX_EVAL = 4096  # held-out positions read through the head per ridge (every k-th), bounding the head's cost
CORPUS_MAX_BYTES = 64 << 20  # a corpus file read whole (10,000 texts of a few thousand characters fit)


def choose_ridge(X: np.ndarray, Y: np.ndarray, text_of: np.ndarray, readout: Any,
                 grid: Sequence[float] = RIDGE_GRID, folds: int = CV_FOLDS,
                 max_eval: int = CV_MAX_EVAL) -> tuple[float, dict[str, float]]:
    """The ridge of ``grid`` whose adapters, fitted with one fold of texts held out in turn, agree
    best with the full model's top-1 (``readout(Y)``'s argmax) on the held-out positions; a tie
    goes to the larger ridge. ``text_of[i]`` is the text position i comes from. Refused by name
    when the corpus has fewer texts than folds."""
    texts = np.unique(text_of)
    if len(texts) < folds:
        raise VindexError(f"choosing the ridge by {folds}-fold cross-validation needs at least {folds} texts in the "
                          f"corpus; it holds {len(texts)}", hint="name a larger corpus, or give RIDGE r")
    fold_of_text = {int(t): k % folds for k, t in enumerate(texts)}
    fold = np.array([fold_of_text[int(t)] for t in text_of])
    X64, Y64 = np.asarray(X, np.float64), np.asarray(Y, np.float64)
    step = max(1, -(-len(X64) // max_eval))
    evals = np.arange(0, len(X64), step)
    want = np.asarray(readout(np.ascontiguousarray(Y[evals], dtype=F32))).argmax(-1)
    hits = {float(r): 0 for r in grid}
    for k in range(folds):
        train, held = fold != k, fold[evals] == k
        if not held.any():
            continue
        Xh = np.ascontiguousarray(X[evals[held]], dtype=F32)
        normal = _normal(X64[train], Y64[train])
        for r in grid:
            W, b = _solve(*normal, float(r))
            got = np.asarray(readout(Xh @ W.astype(F32) + b.astype(F32))).argmax(-1)
            hits[float(r)] += int((got == want[held]).sum())
    n = len(evals)
    scores = {f"{r:g}": hits[r] / n for r in hits}
    best = max(hits, key=lambda r: (hits[r], r))
    return best, scores


def hidden_pairs(container: Any, depth: int, texts: Sequence[str | Sequence[int]],
                 with_text: bool = False) -> tuple[np.ndarray, ...]:
    """X: the residual Draft(depth) hands its final norm, Y: the one Full hands it, at every
    position of every text (float32 [N, hidden] each); ``with_text``: also the index of the text
    each position comes from."""
    c = open_container(container)
    draft_ex, _ = make_executor(c, resolve_slice(c, depth)[0])
    full_ex, _ = make_executor(c, resolve_slice(c, None)[0])
    xs, ys, owner = [], [], []
    for i, t in enumerate(texts):
        ids = corpus_ids(c, t)
        if not ids:
            continue
        ds, fs = draft_ex.start(), full_ex.start()
        ds.prefill(ids)
        fs.prefill(ids)
        xs.append(np.array(ds.last_hidden, dtype=F32))
        ys.append(np.array(fs.last_hidden, dtype=F32))
        owner.append(np.full(len(ids), i, np.int64))
    if not xs:
        raise VindexError("the adapter corpus has no tokens")
    if with_text:
        return np.concatenate(xs), np.concatenate(ys), np.concatenate(owner)
    return np.concatenate(xs), np.concatenate(ys)


def fit_adapter(container: Any, depth: int, texts: Sequence[str | Sequence[int]] | None = None, *,
                corpus: str | None = None, ridge: float | None = None) -> ExitAdapter:
    """The adapter for Draft(depth) fitted on ``texts`` (default: the seed list). ``ridge`` None:
    chosen from `RIDGE_GRID` by `choose_ridge` on the corpus itself (the prompt bank is never
    read), and the choice and its table recorded in the facts."""
    c = open_container(container)
    if texts is None:
        from .seeds import SEED_TEXTS

        texts, corpus = list(SEED_TEXTS), corpus or "seeds"
    X, Y, text_of = hidden_pairs(c, depth, texts, with_text=True)
    choice, table = "given", None
    if ridge is None:
        full_ex, _ = make_executor(c, resolve_slice(c, None)[0])
        if full_ex.readout is None:
            raise UnsupportedOperator("choosing an adapter's ridge reads the full model's head; this model has none")
        ridge, table = choose_ridge(X, Y, text_of, full_ex.readout)
        choice = (f"{CV_FOLDS}-fold cross-validation over the corpus's texts: held-out top-1 agreement with the "
                  f"full model, ridges {', '.join(f'{r:g}' for r in RIDGE_GRID)}, ties to the larger")
    W, b = ridge_fit(X, Y, ridge)
    ny = float(np.linalg.norm(Y.astype(np.float64)))
    fit = float(np.linalg.norm(X.astype(np.float64) @ W + b - Y)) / ny if ny else 0.0
    ident = float(np.linalg.norm((X - Y).astype(np.float64))) / ny if ny else 0.0
    facts = AdapterFacts(depth=depth, hidden=int(X.shape[1]), ridge=float(ridge), positions=int(X.shape[0]),
                         corpus=corpus or "corpus", corpus_sha256=corpus_digest(texts), texts=len(texts),
                         fit_residual=fit, identity_residual=ident, container_digest=str(c.digest),
                         ridge_choice=choice, cv_top1=table)
    return ExitAdapter(W, b, facts)


def read_corpus(path: str | Path, max_texts: int = 10_000, max_bytes: int | None = None) -> list[str | list[int]]:
    """A corpus file: JSON lines, each an object with ``text`` (a string) or ``token_ids`` (a
    list of ids); blank lines are skipped. Refused by name, with the line, when a line is not
    one of those, and when the file holds no text or more than ``max_texts`` lines; refused
    before it is read when it is not a regular file (a FIFO, a device) or holds more than
    ``max_bytes`` (default `CORPUS_MAX_BYTES`) bytes."""
    from ..paths import read_regular

    p = Path(path)
    texts: list[str | list[int]] = []
    try:
        lines = read_regular(p, "corpus", max_bytes=CORPUS_MAX_BYTES if max_bytes is None else max_bytes).decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise VindexError(f"cannot read the corpus {p.name}: {e}") from None
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise VindexError(f"corpus {p.name} line {n} is not JSON: {e.msg}",
                              hint='each line is {"text": "..."} or {"token_ids": [...]}') from None
        text = obj.get("text") if isinstance(obj, dict) else None
        ids = obj.get("token_ids") if isinstance(obj, dict) else None
        if isinstance(text, str) and ids is None:
            texts.append(text)
        elif text is None and isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool)
                                                                    for t in ids):
            texts.append([int(t) for t in ids])
        else:
            raise VindexError(f"corpus {p.name} line {n} holds neither a string \"text\" nor a non-empty list of "
                              "integer \"token_ids\"", hint='each line is {"text": "..."} or {"token_ids": [...]}')
        if len(texts) > max_texts:
            raise VindexError(f"corpus {p.name} holds more than {max_texts} texts")
    if not texts:
        raise VindexError(f"corpus {p.name} holds no text")
    return texts


class AdaptedReadout:
    """readout(adapter(h)): the draft's final norm and head read the adapted residual."""

    def __init__(self, readout: Any, adapter: ExitAdapter):
        self.inner = readout
        self.adapter = adapter
        self.head = readout.head

    def __call__(self, h: np.ndarray) -> np.ndarray:
        return self.inner(self.adapter(h))


def check_adapter(container: Any, depth: int, adapter: ExitAdapter) -> None:
    adapter.check(container)
    if adapter.facts.depth != depth:
        raise VindexError(f"the adapter was fitted at depth {adapter.facts.depth}, not {depth}")


def adapter_executor(container: Any, depth: int, adapter: ExitAdapter, max_positions: int | None = None) -> tuple[Any, float]:
    """An executor of Draft(depth) whose logits are read through the adapter."""
    c = open_container(container)
    check_adapter(c, depth, adapter)
    ex, secs = make_executor(c, resolve_slice(c, depth)[0], max_positions=max_positions)
    if ex.readout is None:
        raise UnsupportedOperator("an exit adapter needs a slice with a head")
    ex.readout = AdaptedReadout(ex.readout, adapter)
    return ex, secs
