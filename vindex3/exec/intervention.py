"""Interventions: changes to what a run computes, named and recorded.

Today there is one: `FeatureAblation`, which zeroes named FFN features (``layer:feature`` pairs)
for every pass of an executor. An FFN operator supports it by opting into
`vindex3.operators.FeatureFfn`; anything else is refused by name when the executor is prepared,
never approximated. A run that carries an intervention says so wherever its output goes (dump
sidecars, record headers, results), through ``record()``.
"""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, field_validator

from ..errors import QueryRefused, UnsupportedOperator
from ..text import runs

_PAIR = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


class FeatureAblation(BaseModel):
    """Zero the activations of FFN features, given as (layer, feature) pairs. Stored sorted and
    without repeats, so equal ablations compare and print equal."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["ablate_features"] = "ablate_features"
    features: tuple[tuple[int, int], ...]

    @field_validator("features")
    @classmethod
    def _canonical(cls, v: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        if not v:
            raise ValueError("ABLATE FEATURES needs at least one layer:feature pair")
        for pair in v:
            if len(pair) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in pair):
                raise ValueError(f"{pair!r} is not a layer:feature pair of non-negative integers")
        return tuple(sorted({(int(a), int(b)) for a, b in v}))

    @classmethod
    def of(cls, pairs) -> FeatureAblation:
        """From (layer, feature) pairs; a bad pair is a named refusal."""
        try:
            return cls(features=tuple(tuple(p) for p in pairs))
        except (ValueError, TypeError) as e:
            msg = e.errors()[0]["msg"] if hasattr(e, "errors") else str(e)
            raise QueryRefused(f"ABLATE FEATURES: {msg.removeprefix('Value error, ')}") from None

    @classmethod
    def parse(cls, text: str) -> FeatureAblation:
        """``"3:17, 5:2"`` or ``"(3:17, 5:2)"``."""
        body = text.strip()
        if body.startswith("(") and body.endswith(")"):
            body = body[1:-1]
        pairs = []
        for part in body.split(","):
            m = _PAIR.match(part)
            if m is None:
                raise QueryRefused(f"ABLATE FEATURES: {part.strip()!r} is not a layer:feature pair (write e.g. 3:17)")
            pairs.append((int(m.group(1)), int(m.group(2))))
        return cls.of(pairs)

    def by_layer(self) -> dict[int, np.ndarray]:
        out: dict[int, list[int]] = {}
        for layer, f in self.features:
            out.setdefault(layer, []).append(f)
        return {k: np.asarray(v, dtype=np.int64) for k, v in out.items()}

    def describe(self) -> str:
        return "ABLATE FEATURES (" + ", ".join(f"{a}:{b}" for a, b in self.features) + ")"

    def record(self) -> dict:
        """What dumps and records carry to name the intervention."""
        return {"kind": self.kind, "features": [list(p) for p in self.features], "text": self.describe()}


Intervention = FeatureAblation


def from_record(rec: dict | None) -> Intervention | None:
    """The inverse of ``record()`` (None stays None)."""
    if rec is None:
        return None
    if not isinstance(rec, dict) or rec.get("kind") != "ablate_features":
        raise QueryRefused(f"unknown intervention record {rec!r} (known: ablate_features)")
    return FeatureAblation.of(rec.get("features") or ())


def resolve(intervention: Intervention | None, plan, executed: list[int], slice_desc: str) -> dict[int, np.ndarray]:
    """Per executed layer, the features to zero; refuses by name a layer the slice does not run,
    a layer without an FFN, an FFN operator that has not opted into features, and a feature
    index outside the layer's features."""
    if intervention is None:
        return {}
    if not isinstance(intervention, FeatureAblation):
        raise UnsupportedOperator(f"intervention {type(intervention).__name__} has no executor (supported: ABLATE FEATURES)")
    from ..operators import FFN, FeatureFfn

    n = len(plan.layers)
    ran = set(executed)
    out: dict[int, np.ndarray] = {}
    for layer, feats in intervention.by_layer().items():
        if layer >= n:
            raise QueryRefused(f"ABLATE FEATURES names layer {layer}, but the model has {n} layers (0..{n - 1})")
        if layer not in ran:
            raise QueryRefused(f"ABLATE FEATURES names layer {layer}, which {slice_desc} does not execute")
        lo = plan.layers[layer]
        ffn = next((op for op in lo.slot_ops() if op.role == FFN), None)
        if ffn is None:
            have = [i for i, x in enumerate(plan.layers) if any(o.role == FFN for o in x.slot_ops())]
            raise QueryRefused(
                f"ABLATE FEATURES names layer {layer}, a {lo.operator} layer with no FFN, so it has no features "
                f"(layers with an FFN: {runs(have) or 'none'})"
            )
        if ffn.operator is None or not isinstance(ffn.operator, FeatureFfn):
            raise UnsupportedOperator(
                f"ABLATE FEATURES: layer {layer}'s FFN operator {ffn.kind!r} does not support ablating features "
                "(an FFN operator opts in through vindex3.operators.FeatureFfn)"
            )
        count = ffn.operator.feature_count(ffn.params)
        bad = feats[feats >= count]
        if bad.size:
            raise QueryRefused(f"ABLATE FEATURES names feature {layer}:{int(bad[0])}, but layer {layer} has "
                               f"{count} features (0..{count - 1})")
        out[layer] = feats
    return out

