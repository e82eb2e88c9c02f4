"""WALK and DESCRIBE: the FFN read as a key-value store, queried with a token's embedding.

The query vector. A token's *scaled embedding* is its embedding row times the embedding
multiplier: the residual the token starts as. Layer l's gate rows do not read the residual raw
but through the layer's pre-FFN norm, so the query at layer l is that norm applied to the scaled
embedding (for a layer without a pre-FFN norm, the scaled embedding itself), and a feature's
**gate score** is ``gate_f · query_l``: the gate pre-activation the feature would have if the
residual were that embedding (no gate bias). This makes scores comparable across layers and
models, which the raw embedding is not (its scale is arbitrary).

* WALK: the last token of the text; per layer, the top-n features by |gate score|.
* DESCRIBE: the mean of the entity's scaled token embeddings; across layers, the features whose
  gate score exceeds the threshold (default `DEFAULT_THRESHOLD`), grouped by the token each one
  writes most (its top metadata token), as edges entity → token.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np
from pydantic import BaseModel

from ..errors import QueryRefused
from ..exec.engine import small_pass_threads
from .common import Prompt, SkippedLayer, TokenLogit
from .metadata import FeatureTokens, MetadataNote
from .model import ModelView

QUERY = ("per layer, the gate rows against the layer's pre-FFN norm of the scaled embedding (embedding row × "
         "embedding multiplier): gate score = gate_f · norm_l(e), the gate pre-activation the feature would have if "
         "the residual were that embedding")
# A gate pre-activation of 3 opens a SiLU gate to 95% (sigmoid(3)); GELU likewise. Set per query.
DEFAULT_THRESHOLD = 3.0


class FeatureHit(BaseModel):
    layer: int
    feature: int
    score: float  # the gate score
    tokens: list[TokenLogit]  # the top tokens its down column writes (feature metadata)


class WalkLayer(BaseModel):
    layer: int
    mixer: str
    ffn: str
    features: list[FeatureHit]


class WalkResult(BaseModel):
    kind: Literal["walk"] = "walk"
    prompt: Prompt
    query_id: int  # the last token, whose embedding is the query
    query_token: str | None
    query: str = QUERY
    top: int
    layers: list[WalkLayer]
    skipped: list[SkippedLayer]
    metadata: MetadataNote
    seconds: float


class DescribeEdge(BaseModel):
    source: str
    target: str | None
    target_id: int
    best_score: float
    best_layer: int
    best_feature: int
    first_layer: int
    last_layer: int
    count: int  # features in the group
    features: list[tuple[int, int]]  # (layer, feature), by score descending
    also: list[str | None]  # other tokens these features write (most frequent first)
    also_ids: list[int]


class DescribeResult(BaseModel):
    kind: Literal["describe"] = "describe"
    entity: str
    prompt: Prompt
    query: str = QUERY
    threshold: float
    top: int
    layers: list[int]  # the FFN layers scanned
    skipped: list[SkippedLayer]
    passing: int  # features above the threshold
    excluded: int  # of those, features whose top token is one of the entity's own
    excluded_tokens: list[str | None]
    total_edges: int  # before TOP
    edges: list[DescribeEdge]
    metadata: MetadataNote
    seconds: float


def _positive(n, what: str) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise QueryRefused(f"{what} must be a positive integer, got {n!r}")
    return n


def _tokens(view: ModelView, ids: np.ndarray, logits: np.ndarray) -> list[TokenLogit]:
    return [TokenLogit(id=int(t), text=view.text(int(t)), logit=float(v)) for t, v in zip(ids, logits)]


def walk(view: ModelView, meta: FeatureTokens, text: str | Sequence[int], *, top: int = 5,
         layers: Iterable[int] | None = None, tokens: int = 3) -> WalkResult:
    """Per FFN layer, the ``top`` features by |gate score| against the text's last token."""
    t0 = time.perf_counter()
    _positive(top, "WALK TOP")
    _positive(tokens, "WALK tokens per feature")
    if tokens > meta.k:
        raise QueryRefused(f"WALK shows at most {meta.k} tokens per feature (the metadata's k), asked {tokens}")
    prompt = view.prompt(text, "WALK", special=False)
    last = prompt.ids[-1]
    q = view.embed([last])
    ffns, skipped = view.ffn_layers(layers, "WALK")
    note = meta.ensure([f.layer for f in ffns])
    out = []
    with small_pass_threads():  # matrix-vector work: one BLAS thread is as fast, and far faster when busy
        scores = [f.gate_scores(q)[0] for f in ffns]
    for f, s in zip(ffns, scores):
        idx = np.argsort(-np.abs(s), kind="stable")[:top]
        ids, lg = meta.top(f.layer, tokens)
        out.append(WalkLayer(layer=f.layer, mixer=f.mixer, ffn=f.operator, features=[
            FeatureHit(layer=f.layer, feature=int(i), score=float(s[i]), tokens=_tokens(view, ids[i], lg[i])) for i in idx]))
    return WalkResult(prompt=prompt, query_id=last, query_token=view.text(last), top=top, layers=out,
                      skipped=skipped, metadata=note, seconds=time.perf_counter() - t0)


def _norm(text: str | None) -> str | None:
    return None if text is None else text.strip().casefold()


def describe(view: ModelView, meta: FeatureTokens, entity: str, *, layers: Iterable[int] | None = None, top: int = 10,
             threshold: float = DEFAULT_THRESHOLD, also: int = 5) -> DescribeResult:
    """Edges entity → token: features whose gate score against the entity's mean scaled
    embedding exceeds ``threshold``, grouped by the token each writes most. The entity's own
    tokens (its ids, or a token whose text, stripped and case-folded, equals one of theirs or
    the entity's) are not targets."""
    t0 = time.perf_counter()
    _positive(top, "DESCRIBE TOP")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not np.isfinite(threshold):
        raise QueryRefused(f"DESCRIBE threshold must be a finite number, got {threshold!r}")
    if not isinstance(entity, str) or not entity.strip():
        raise QueryRefused("DESCRIBE needs a non-empty entity")
    prompt = view.prompt(entity, "DESCRIBE", special=False)
    q = np.mean(view.embed(prompt.ids), axis=0, keepdims=True, dtype=np.float32)
    ffns, skipped = view.ffn_layers(layers, "DESCRIBE")
    note = meta.ensure([f.layer for f in ffns])
    own_ids = set(prompt.ids)
    own_texts = {_norm(t) for t in prompt.tokens if t is not None} | {_norm(entity)}
    own_texts.discard("")

    def own(tid: int) -> bool:
        return tid in own_ids or _norm(view.text(tid)) in own_texts

    groups: dict[int, list[tuple[float, int, int, np.ndarray]]] = {}
    passing = excluded = 0
    excluded_ids: list[int] = []
    thr = np.float32(threshold)
    with small_pass_threads():
        scores = [f.gate_scores(q)[0] for f in ffns]
    for f, s in zip(ffns, scores):
        hits = np.nonzero(s > thr)[0]
        if not hits.size:
            continue
        ids, _ = meta.top(f.layer)
        for i in hits:
            passing += 1
            target = int(ids[i, 0])
            if own(target):
                excluded += 1
                if target not in excluded_ids:
                    excluded_ids.append(target)
                continue
            groups.setdefault(target, []).append((float(s[i]), f.layer, int(i), ids[i, 1:]))
    edges = []
    for target, members in groups.items():
        members.sort(key=lambda m: (-m[0], m[1], m[2]))
        counts: dict[int, int] = {}
        for _, _, _, rest in members:
            for t in rest:
                t = int(t)
                if t != target and not own(t):
                    counts[t] = counts.get(t, 0) + 1
        also_ids = [t for t, _ in sorted(counts.items(), key=lambda kv: -kv[1])][:also]  # stable: first seen first
        best = members[0]
        ls = [m[1] for m in members]
        edges.append(DescribeEdge(
            source=entity, target=view.text(target), target_id=target, best_score=best[0], best_layer=best[1],
            best_feature=best[2], first_layer=min(ls), last_layer=max(ls), count=len(members),
            features=[(m[1], m[2]) for m in members], also=[view.text(t) for t in also_ids], also_ids=also_ids))
    edges.sort(key=lambda e: (-e.best_score, e.target_id))
    return DescribeResult(entity=entity, prompt=prompt, threshold=float(threshold), top=top, layers=[f.layer for f in ffns],
                          skipped=skipped, passing=passing, excluded=excluded,
                          excluded_tokens=[view.text(t) for t in excluded_ids], total_edges=len(edges), edges=edges[:top],
                          metadata=note, seconds=time.perf_counter() - t0)
