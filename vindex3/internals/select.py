"""SELECT over FEATURES, and SHOW FEATURES.

The relation FEATURES has one row per feature of every FFN layer, with the columns

* ``layer``, ``feature``: where it is;
* ``token``: the token its down column writes most (its top feature-metadata token);
* ``score``: with ``NEAREST TO 'text'``, the feature's gate score against the text (the mean of
  its scaled token embeddings through the layer's pre-FFN norm, as DESCRIBE); without it, the
  logit of ``token`` in the feature's metadata.

Filters (all must hold): ``token = 'x'`` / ``token != 'x'`` compare the token's text with
surrounding whitespace removed, exactly; ``token LIKE 'P%'`` is SQL LIKE on the same text (``%``
any run, ``_`` one character), case-insensitive; ``layer``, ``feature`` and ``score`` compare
with =, !=, <, <=, >, >=. The default order is ``score`` descending with NEAREST TO, else layer
then feature; ties always fall back to layer, then feature. An unknown column, an operator a
column does not take, or a value of the wrong type is refused by name.
"""

from __future__ import annotations

import re
import time
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from ..errors import QueryRefused
from ..exec.engine import small_pass_threads
from .common import SkippedLayer, TokenLogit
from .metadata import FeatureTokens, MetadataNote
from .model import ModelView

COLUMNS = ("layer", "feature", "token", "score")
NUMERIC_OPS = ("=", "!=", "<", "<=", ">", ">=", "IN")
OPS = {"layer": NUMERIC_OPS, "feature": NUMERIC_OPS, "score": NUMERIC_OPS, "token": ("=", "!=", "LIKE", "IN")}
SCORE_NEAREST = "gate score against NEAREST TO (mean scaled embedding through each layer's pre-FFN norm)"
SCORE_LOGIT = "logit of the feature's top token in its feature metadata"


class Condition(BaseModel):
    column: str
    op: str
    value: str | int | float | list[str | int | float]  # a list for IN


class FeatureQuery(BaseModel):
    """A typed SELECT over FEATURES (see the module docstring)."""

    columns: list[str] = Field(default_factory=lambda: list(COLUMNS))
    layers: list[int] | None = None  # AT LAYER n / LAYERS a-b (None: every FFN layer)
    nearest_to: str | list[int] | None = None
    where: list[Condition] = Field(default_factory=list)
    order_by: str | None = None
    descending: bool = True
    limit: int | None = None

    def checked(self) -> FeatureQuery:
        """Refuse, by name, what this query cannot mean."""
        def known(col: str, where: str) -> None:
            if col not in COLUMNS:
                raise QueryRefused(f"SELECT ... FROM FEATURES: unknown column {col!r} in {where} "
                                   f"(columns: {', '.join(COLUMNS)})")

        if not self.columns:
            raise QueryRefused("SELECT ... FROM FEATURES: no columns")
        for c in self.columns:
            if c != "*":
                known(c, "the column list")
        for cond in self.where:
            known(cond.column, "WHERE")
            op = cond.op.upper() if isinstance(cond.op, str) else cond.op
            if op not in OPS[cond.column]:
                raise QueryRefused(f"SELECT ... FROM FEATURES: column {cond.column!r} does not take {cond.op!r} "
                                   f"(it takes {', '.join(OPS[cond.column])})")
            values = cond.value if isinstance(cond.value, list) else [cond.value]
            if (op == "IN") != isinstance(cond.value, list) or (op == "IN" and not values):
                raise QueryRefused(f"SELECT ... FROM FEATURES: {cond.column} {cond.op} takes "
                                   + ("a non-empty list of values" if op == "IN" else "one value") + f", got {cond.value!r}")
            if cond.column == "token":
                if not all(isinstance(v, str) for v in values):
                    raise QueryRefused(f"SELECT ... FROM FEATURES: token {cond.op} needs a text, got {cond.value!r}")
            elif any(isinstance(v, (str, bool)) for v in values):
                raise QueryRefused(f"SELECT ... FROM FEATURES: {cond.column} {cond.op} needs a number, got {cond.value!r}")
        if self.order_by is not None:
            known(self.order_by, "ORDER BY")
        if self.limit is not None and (isinstance(self.limit, bool) or self.limit < 0):
            raise QueryRefused(f"SELECT ... FROM FEATURES: LIMIT must be a non-negative integer, got {self.limit!r}")
        return self

    @property
    def shown(self) -> list[str]:
        return [c for x in self.columns for c in (COLUMNS if x == "*" else (x,))]


class FeatureRow(BaseModel):
    layer: int
    feature: int
    token: str | None
    token_id: int
    score: float


class SelectResult(BaseModel):
    kind: Literal["select_features"] = "select_features"
    query: FeatureQuery
    columns: list[str]  # the columns to show, in order
    score: str  # what the score column means in this query
    layers: list[int]  # FFN layers scanned
    skipped: list[SkippedLayer]
    total: int  # rows matching before LIMIT
    rows: list[FeatureRow]
    metadata: MetadataNote
    seconds: float


class FeatureTokensRow(BaseModel):
    feature: int
    tokens: list[TokenLogit]


class ShowFeaturesResult(BaseModel):
    kind: Literal["show_features"] = "show_features"
    layer: int
    mixer: str
    ffn: str
    features: int  # in the layer
    rows: list[FeatureTokensRow]
    metadata: MetadataNote


def like(pattern: str) -> re.Pattern:
    """SQL LIKE (``%``, ``_``) as an anchored, case-insensitive regular expression."""
    out = "".join(".*" if ch == "%" else "." if ch == "_" else re.escape(ch) for ch in pattern)
    return re.compile(f"^{out}$", re.IGNORECASE | re.DOTALL)


_CMP = {"=": np.equal, "!=": np.not_equal, "<": np.less, "<=": np.less_equal, ">": np.greater, ">=": np.greater_equal}


def select(view: ModelView, meta: FeatureTokens, query: FeatureQuery) -> SelectResult:
    t0 = time.perf_counter()
    q = query.checked()
    ffns, skipped = view.ffn_layers(q.layers, "SELECT ... FROM FEATURES")
    note = meta.ensure([f.layer for f in ffns])
    if any(c.column == "token" for c in q.where) and not view.has_tokenizer:
        raise QueryRefused("SELECT ... FROM FEATURES: the container carries no tokenizer, so token text cannot be compared")
    qv = None
    if q.nearest_to is not None:
        p = view.prompt(q.nearest_to, "NEAREST TO", special=False)
        qv = np.mean(view.embed(p.ids), axis=0, keepdims=True, dtype=np.float32)
    L, F, T, S = [], [], [], []
    with small_pass_threads():
        for f in ffns:
            ids, lg = meta.top(f.layer, 1)
            L.append(np.full(f.count, f.layer, dtype=np.int64))
            F.append(np.arange(f.count, dtype=np.int64))
            T.append(ids[:, 0].astype(np.int64))
            S.append(f.gate_scores(qv)[0] if qv is not None else lg[:, 0])
    layer, feat = np.concatenate(L) if L else np.zeros(0, np.int64), np.concatenate(F) if F else np.zeros(0, np.int64)
    tok = np.concatenate(T) if T else np.zeros(0, np.int64)
    score = np.concatenate(S).astype(np.float32) if S else np.zeros(0, np.float32)
    keep = np.ones(layer.shape[0], dtype=bool)
    for c in q.where:
        op = c.op.upper()
        if c.column == "token":
            uniq = np.unique(tok[keep])
            if op == "LIKE":
                rx = like(c.value)
                ok = {int(t) for t in uniq if rx.match((view.text(int(t)) or "").strip())}
            elif op == "IN":
                wanted = set(c.value)
                ok = {int(t) for t in uniq if (view.text(int(t)) or "").strip() in wanted}
            else:
                ok = {int(t) for t in uniq if (view.text(int(t)) or "").strip() == c.value}
                if op == "!=":
                    ok = {int(t) for t in uniq} - ok
            keep &= np.isin(tok, np.fromiter(ok, dtype=np.int64, count=len(ok)))
        else:
            col = {"layer": layer, "feature": feat, "score": score}[c.column]
            if op == "IN":
                vals = np.asarray(c.value, dtype=np.float32 if c.column == "score" else np.float64)
                keep &= np.isin(col, vals)
            else:
                val = np.float32(c.value) if c.column == "score" else c.value
                keep &= _CMP[op](col, val)
    idx = np.nonzero(keep)[0]
    order_by = q.order_by or ("score" if qv is not None else None)
    if order_by is None:
        order = idx  # already layer, feature
    else:
        if order_by == "token":
            texts = np.array([(view.text(int(t)) or "").strip() for t in tok[idx]], dtype=object)
            rank = np.unique(texts, return_inverse=True)[1]
        else:
            rank = {"layer": layer, "feature": feat, "score": score}[order_by][idx]
        desc = q.descending if q.order_by is not None else True
        key = -rank.astype(np.float64) if desc else rank
        order = idx[np.lexsort((feat[idx], layer[idx], key))]
    total = int(order.shape[0])
    if q.limit is not None:
        order = order[: q.limit]
    rows = [FeatureRow(layer=int(layer[i]), feature=int(feat[i]), token=view.text(int(tok[i])), token_id=int(tok[i]),
                       score=float(score[i])) for i in order]
    return SelectResult(query=q, columns=q.shown, score=SCORE_NEAREST if qv is not None else SCORE_LOGIT,
                        layers=[f.layer for f in ffns], skipped=skipped, total=total, rows=rows, metadata=note,
                        seconds=time.perf_counter() - t0)


def show_features(view: ModelView, meta: FeatureTokens, layer: int, *, limit: int | None = None,
                  tokens: int = 5) -> ShowFeaturesResult:
    """A layer's features in order, each with the top tokens its down column writes. A layer
    without features is refused by name (it is one layer, asked for by name)."""
    from .common import layer_list

    (layer,) = layer_list([layer], view.num_layers, "SHOW FEATURES")
    f = view.ffn_layer(layer)
    if isinstance(f, SkippedLayer):
        raise QueryRefused(f"SHOW FEATURES AT LAYER {layer}: {f.reason}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise QueryRefused(f"SHOW FEATURES: LIMIT must be a non-negative integer, got {limit!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= meta.k:
        raise QueryRefused(f"SHOW FEATURES shows 1..{meta.k} tokens per feature (the metadata's k), asked {tokens!r}")
    note = meta.ensure([layer])
    ids, lg = meta.top(layer, tokens)
    n = f.count if limit is None else min(limit, f.count)
    rows = [FeatureTokensRow(feature=i, tokens=[TokenLogit(id=int(t), text=view.text(int(t)), logit=float(v))
                                                for t, v in zip(ids[i], lg[i])]) for i in range(n)]
    return ShowFeaturesResult(layer=layer, mixer=f.mixer, ffn=f.operator, features=f.count, rows=rows, metadata=note)
