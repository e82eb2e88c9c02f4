"""The residual-stream walk (EXPLAIN INFER ... FEATURES): run the model on the text and report,
per FFN layer, the features most active at the last position on the FFN's actual input (the
residual after everything before it, through the layer's pre-FFN norm), not on an embedding.

A feature's **activation** is the coefficient its down column is written with in that run,
act(gate_f · x + b) · (up_f · x + b); features are ranked by |activation|. Its gate
pre-activation (``gate``, no bias) is reported beside it. Under ``ABLATE FEATURES`` the ablated
features are flagged: the activation shown is what they computed before the run zeroed them."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Literal

import numpy as np
from pydantic import BaseModel

from ..errors import QueryRefused
from ..exec.engine import Executor
from .capture import capture
from .common import Prompt, SkippedLayer, TokenLogit, layer_list
from .metadata import FeatureTokens, MetadataNote
from .model import ModelView


class ActiveFeature(BaseModel):
    layer: int
    feature: int
    activation: float
    gate: float
    ablated: bool
    tokens: list[TokenLogit]


class ActivityLayer(BaseModel):
    layer: int
    mixer: str
    ffn: str
    features: list[ActiveFeature]


class ActivityResult(BaseModel):
    kind: Literal["infer_features"] = "infer_features"
    prompt: Prompt
    position: int
    slice: str
    executed_layers: list[int]
    intervention: dict | None
    next_id: int
    next_token: str | None
    top: int
    layers: list[ActivityLayer]
    skipped: list[SkippedLayer]
    metadata: MetadataNote
    seconds: float


def feature_activity(view: ModelView, meta: FeatureTokens, ex: Executor, prompt: Prompt, *, top: int = 5,
                     layers: Iterable[int] | None = None, tokens: int = 3) -> ActivityResult:
    t0 = time.perf_counter()
    if isinstance(top, bool) or not isinstance(top, int) or top < 1:
        raise QueryRefused(f"EXPLAIN INFER ... FEATURES TOP must be a positive integer, got {top!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= meta.k:
        raise QueryRefused(f"FEATURES shows 1..{meta.k} tokens per feature (the metadata's k), asked {tokens!r}")
    run = capture(ex, prompt.ids, inputs=True)
    if layers is None:
        chosen = list(run.executed)
    else:
        chosen = layer_list(layers, view.num_layers, "EXPLAIN INFER ... FEATURES LAYERS")
        not_run = [i for i in chosen if i not in run.executed]
        if not_run:
            raise QueryRefused(f"EXPLAIN INFER ... FEATURES: layer {not_run[0]} is not executed by {ex.slice.describe()}")
    ffns, skipped = view.ffn_layers(chosen, "EXPLAIN INFER ... FEATURES")
    note = meta.ensure([f.layer for f in ffns])
    ablated = ex.intervention.by_layer() if ex.intervention is not None else {}
    p = len(prompt.ids) - 1
    out = []
    for f in ffns:
        x = run.inputs[(f.layer, "ffn")][p:p + 1]
        a = f.view.activations(x)[0]
        g = f.view.scores(x)[0]
        idx = np.argsort(-np.abs(a), kind="stable")[:top]
        ids, lg = meta.top(f.layer, tokens)
        off = {int(i) for i in ablated.get(f.layer, ())}
        out.append(ActivityLayer(layer=f.layer, mixer=f.mixer, ffn=f.operator, features=[
            ActiveFeature(layer=f.layer, feature=int(i), activation=float(a[i]), gate=float(g[i]), ablated=int(i) in off,
                          tokens=[TokenLogit(id=int(t), text=view.text(int(t)), logit=float(v)) for t, v in zip(ids[i], lg[i])])
            for i in idx]))
    nxt = int(np.argmax(run.logits[-1]))
    return ActivityResult(prompt=prompt, position=p, slice=ex.slice.describe(), executed_layers=run.executed,
                          intervention=ex.intervention.record() if ex.intervention is not None else None, next_id=nxt,
                          next_token=view.text(nxt), top=top, layers=out, skipped=skipped, metadata=note,
                          seconds=time.perf_counter() - t0)
