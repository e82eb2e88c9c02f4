"""Fitted exit adapters (the tuned lens): for a draft depth d, an affine map from the residual
after layer d-1 (what Draft(d) hands its final norm) to the residual the full model's final norm
sees, fitted in closed form by ridge least squares on hidden states of a named corpus (default:
the seed list in ``vindex3.draft.seeds``, never the frozen prompt bank).

    minimise  ||[X 1] M - Y||^2 + ridge * ||W||^2    with  M = [W; b]  (the bias is not penalised)
    M = ([X 1]^T [X 1] + ridge * diag(1..1, 0))^-1 [X 1]^T Y          (float64 normal equations)

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
from .vocab import corpus_digest

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
    Xa = np.hstack([X64, np.ones((X64.shape[0], 1))])
    G = Xa.T @ Xa
    reg = np.full(G.shape[0], float(ridge))
    reg[-1] = 0.0
    G[np.diag_indices_from(G)] += reg
    M = np.linalg.solve(G, Xa.T @ Y64)
    return M[:-1], M[-1]


def hidden_pairs(container: Any, depth: int, texts: Sequence[str | Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """X: the residual Draft(depth) hands its final norm, Y: the one Full hands it, at every
    position of every text (float32 [N, hidden] each)."""
    c = open_container(container)
    draft_ex, _ = make_executor(c, resolve_slice(c, depth)[0])
    full_ex, _ = make_executor(c, resolve_slice(c, None)[0])
    xs, ys = [], []
    for t in texts:
        ids = list(c.tokenizer.encode(t)) if isinstance(t, str) else [int(x) for x in t]
        if not ids:
            continue
        ds, fs = draft_ex.start(), full_ex.start()
        ds.prefill(ids)
        fs.prefill(ids)
        xs.append(np.array(ds.last_hidden, dtype=F32))
        ys.append(np.array(fs.last_hidden, dtype=F32))
    if not xs:
        raise VindexError("the adapter corpus has no tokens")
    return np.concatenate(xs), np.concatenate(ys)


def fit_adapter(container: Any, depth: int, texts: Sequence[str | Sequence[int]] | None = None, *,
                corpus: str | None = None, ridge: float = 1e-2) -> ExitAdapter:
    c = open_container(container)
    if texts is None:
        from .seeds import SEED_TEXTS

        texts, corpus = list(SEED_TEXTS), corpus or "seeds"
    X, Y = hidden_pairs(c, depth, texts)
    W, b = ridge_fit(X, Y, ridge)
    ny = float(np.linalg.norm(Y.astype(np.float64)))
    fit = float(np.linalg.norm(X.astype(np.float64) @ W + b - Y)) / ny if ny else 0.0
    ident = float(np.linalg.norm((X - Y).astype(np.float64))) / ny if ny else 0.0
    facts = AdapterFacts(depth=depth, hidden=int(X.shape[1]), ridge=float(ridge), positions=int(X.shape[0]),
                         corpus=corpus or "corpus", corpus_sha256=corpus_digest(texts), texts=len(texts),
                         fit_residual=fit, identity_residual=ident, container_digest=str(c.digest))
    return ExitAdapter(W, b, facts)


def read_corpus(path: str | Path, max_texts: int = 10_000) -> list[str | list[int]]:
    """A corpus file: JSON lines, each an object with ``text`` (a string) or ``token_ids`` (a
    list of ids); blank lines are skipped. Refused by name, with the line, when a line is not
    one of those, and when the file holds no text or more than ``max_texts`` lines."""
    p = Path(path)
    texts: list[str | list[int]] = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
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
