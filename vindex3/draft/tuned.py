"""The tuned lens: the residual after layer l read through the exit adapter stored for depth
l + 1 (vindex3.draft.store), then the model's own final norm and head. Where the logit lens
asks "what would the head say of this residual as it is", the tuned lens asks "what does this
residual predict once mapped, by the fitted affine translator, to where the final norm reads".

One full-model prefill gives every residual (an observer keeps the ones leaving the chosen
layers; Full's prefix is bit-identical to Draft(l + 1), the residual the adapter was fitted
on); each chosen layer needs a stored, fresh adapter, and a layer without one is refused by
name."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel

from ..errors import QueryRefused
from .slices import make_executor, open_container, resolve_slice
from .store import ADAPTER, components, load_adapter


class TunedRow(BaseModel):
    layer: int
    operator: str
    position: int
    rank: int  # of the target: how many tokens have a strictly greater logit
    prob: float
    logit: float
    top_id: int
    top_prob: float
    adapter: str  # the drafter component read


def adapter_layers(container: Any) -> list[int]:
    """Layers l whose residual has a stored, fresh exit adapter (depth l + 1), ascending."""
    return sorted(int(x["edge"]["after_layer"]) for x in components(container)
                  if x["kind"] == ADAPTER and x["fresh"] and isinstance(x.get("edge"), dict))


def tuned_lens(container: Any, ids: Sequence[int], target: int, *, layers: Iterable[int] | None = None,
               positions: Literal["last", "all"] = "last") -> list[TunedRow]:
    """Tuned-lens rows for ``target`` at the chosen layers (default: every layer with a stored
    adapter) and positions."""
    from ..exec.engine import Observer

    c = open_container(container)
    have = adapter_layers(c)
    chosen = sorted(set(have if layers is None else (int(i) for i in layers)))
    if not chosen:
        raise QueryRefused(f"{c.path.name} stores no exit adapter, so there is no tuned lens to read",
                           hint="fit one: FIT ADAPTER AT DEPTH d (it reads the residual after layer d-1)")
    missing = [i for i in chosen if i not in have]
    if missing:
        raise QueryRefused(f"layer {missing[0]} has no stored exit adapter (depth {missing[0] + 1}); the tuned lens "
                           f"reads layers {', '.join(map(str, have)) or 'none'}",
                           hint=f"fit one: FIT ADAPTER AT DEPTH {missing[0] + 1}")
    adapters = {i: load_adapter(c, i + 1) for i in chosen}
    ex, _ = make_executor(c, resolve_slice(c, None)[0])
    kept: dict[int, np.ndarray] = {}

    class _Keep(Observer):
        def leave(self, layer: int, p0: int, h: np.ndarray) -> None:
            if layer in adapters:
                kept[layer] = h

    ex.start(observer=_Keep()).prefill(list(ids))
    T = len(ids)
    pos = [T - 1] if positions == "last" else list(range(T))
    labels = {lo.index: lo.operator for lo in ex.plan.layers}
    rows = []
    for i in chosen:
        logits = ex.readout(adapters[i](kept[i][pos]))
        for r, p in zip(logits, pos, strict=True):
            e = np.exp(r - r.max())
            z = e.sum(dtype=np.float32)
            top = int(np.argmax(r))
            rows.append(TunedRow(layer=i, operator=labels[i], position=p, rank=int(np.count_nonzero(r > r[target])),
                                 prob=float(e[target] / z), logit=float(r[target]), top_id=top,
                                 top_prob=float(e[top] / z), adapter=f"drafter_adapter_d{i + 1}"))
    return rows
