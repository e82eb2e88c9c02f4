"""Interventions: changes to what a run computes, named and recorded.

`FeatureAblation` zeroes named FFN features (``layer:feature`` pairs) for every pass of an
executor. An FFN operator supports it by opting into `vindex3.operators.FeatureFfn`; anything else
is refused by name when the executor is prepared, never approximated.

`Patch` and `Steer` act on the residual stream at named, operator-neutral sites (`SITES`): they are
values built before the run and given to a stream (``ex.start(interventions=[...])``,
``ex.forward(ids, interventions=[...])``, ``ex.run_with_cache(...)``), so an executor is never
rebound for them and a clean stream of the same executor runs the same bytes as before. A site a
layer lacks is refused by name, naming the layer and its operator.

A run that carries an intervention says so wherever its output goes (dump sidecars, record
headers, results), through ``record()``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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



# ---- sites, patching and steering ------------------------------------------------------------

# Per layer: the residual entering it, the residual leaving it, the mixer's write, the FFN's write
# (each exactly what is added to the residual: after any post-norm and the residual multiplier),
# and, on softmax / MLA layers, each head's output before the output projection.
SITES = ("residual", "residual_post", "mixer", "ffn", "heads")
ATTENTION_OPERATORS = ("softmax", "mla")
_KEY = re.compile(r"^L(\d+)\.([a-z_]+)$")


def site_key(layer: int, site: str) -> str:
    """The stable name of a site: ``L12.residual``."""
    return f"L{int(layer)}.{site}"


def parse_site_key(key: str) -> tuple[int, str]:
    """``"L12.residual"`` -> (12, "residual"); anything else is refused by name."""
    m = _KEY.match(str(key).strip())
    if m is None or m.group(2) not in SITES:
        raise QueryRefused(f"{key!r} is not a site (write L<layer>.<site>, site one of {', '.join(SITES)})")
    return int(m.group(1)), m.group(2)


def check_site(plan, layer: int, site: str, what: str) -> None:
    """Refuse by name a site that the model or the layer does not have."""
    if site not in SITES:
        raise QueryRefused(f"{what}: unknown site {site!r} (sites: {', '.join(SITES)})")
    n = len(plan.layers)
    if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or not 0 <= layer < n:
        raise QueryRefused(f"{what} names layer {layer}, but the model has {n} layers (0..{n - 1})")
    lo = plan.layers[int(layer)]
    roles = [op.role for op in lo.slot_ops()]
    if site in ("mixer", "ffn") and site not in roles:
        have = [i for i, x in enumerate(plan.layers) if any(o.role == site for o in x.slot_ops())]
        raise QueryRefused(f"{what}: layer {layer} is a {lo.operator} layer with no {site.upper()} "
                           f"(layers with one: {runs(have) or 'none'})")
    if site == "heads" and lo.operator not in ATTENTION_OPERATORS:
        have = [i for i, x in enumerate(plan.layers) if x.operator in ATTENTION_OPERATORS]
        raise QueryRefused(f"{what}: layer {layer} is a {lo.operator} layer, which has no attention heads "
                           f"(HEADS exists on softmax and MLA layers: {runs(have) or 'none'})")


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _frozen_f32(a, what: str, ndim: int) -> np.ndarray:
    arr = np.asarray(a)
    if arr.dtype != np.float32 or arr.ndim != ndim:
        raise QueryRefused(f"{what} must be float32 with {ndim} dimension(s); got {arr.dtype} {list(arr.shape)}")
    if not np.isfinite(arr).all():
        raise QueryRefused(f"{what} holds a value that is not finite")
    arr = arr.copy()
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Patch:
    """Replace a site's values at absolute positions with ``source_values`` [len(positions),
    hidden] (float32), typically another prompt's values there (activation patching). Equal
    patches (same site, layer, positions, heads and value bytes) compare and hash equal.

    On the ``heads`` site the patch names ``heads`` and its values are [len(positions),
    len(heads), head_dim]: those heads' outputs before the output projection, which then
    projects the patched heads with the others (the layer's post-norm, if any, follows).

    A patch applies in whichever pass of its stream covers its positions: a position past the
    prompt applies when decoding reaches it. A lone prefill (``ex.forward``,
    ``ex.run_with_cache``) has no later pass, so a position past its prompt is refused there by
    name (`StreamEdits.check_within`) rather than silently never applied."""

    site: str
    layer: int
    positions: tuple[int, ...]
    source_values: np.ndarray
    source: str | None = None  # what the values came from, in words (a prompt), for the record
    heads: tuple[int, ...] | None = None  # the heads patched (site "heads" only)
    kind: str = field(default="patch", init=False)

    def __post_init__(self):
        if self.site not in SITES:
            raise QueryRefused(f"PATCH: unknown site {self.site!r} (sites: {', '.join(SITES)})")
        pos = tuple(int(p) for p in self.positions)
        if not pos or any(p < 0 for p in pos) or len(set(pos)) != len(pos):
            raise QueryRefused(f"PATCH: positions {list(self.positions)} must be distinct non-negative integers, at least one")
        heads = None
        if self.site == "heads":
            if self.heads is None:
                raise QueryRefused("PATCH HEADS names the heads it patches (e.g. HEADS 4, 7)")
            heads = tuple(int(h) for h in self.heads)
            if not heads or any(h < 0 for h in heads) or len(set(heads)) != len(heads):
                raise QueryRefused(f"PATCH HEADS: heads {list(self.heads)} must be distinct non-negative integers, "
                                   "at least one")
            vals = _frozen_f32(self.source_values, "PATCH HEADS source values", 3)
            if vals.shape[1] != len(heads):
                raise QueryRefused(f"PATCH HEADS: values for {vals.shape[1]} head(s), {len(heads)} named")
        else:
            if self.heads is not None:
                raise QueryRefused(f"PATCH {self.site.upper()}: only the HEADS site names heads")
            vals = _frozen_f32(self.source_values, "PATCH source values", 2)
        if vals.shape[0] != len(pos):
            raise QueryRefused(f"PATCH: {vals.shape[0]} rows of source values for {len(pos)} position(s)")
        object.__setattr__(self, "positions", pos)
        object.__setattr__(self, "heads", heads)
        object.__setattr__(self, "source_values", vals)
        object.__setattr__(self, "_digest", _digest(vals))

    def _id(self):
        return ("patch", self.site, int(self.layer), self.positions, self.heads, self._digest)

    def __eq__(self, other):
        return isinstance(other, Patch) and self._id() == other._id()

    def __hash__(self):
        return hash(self._id())

    def describe(self) -> str:
        where = "POSITION" + ("S " if len(self.positions) > 1 else " ") + runs(self.positions)
        src = f"'{self.source}'" if self.source is not None else f"values sha256:{self._digest[:12]}"
        site = self.site.upper().replace("_", " ")
        if self.heads is not None:
            site += " " + ", ".join(map(str, self.heads))
        return f"PATCH {site} AT LAYER {self.layer} {where} FROM {src}"

    def record(self) -> dict:
        rec = {"kind": self.kind, "site": self.site, "layer": int(self.layer), "positions": list(self.positions),
               "source": self.source, "values_sha256": self._digest, "text": self.describe()}
        if self.heads is not None:
            rec["heads"] = list(self.heads)
        return rec


@dataclass(frozen=True, eq=False)
class Steer:
    """Add ``scale * vector`` ([hidden], float32) to the residual entering ``layer`` at every
    position of every pass (activation addition)."""

    layer: int
    vector: np.ndarray
    scale: float
    source: str | None = None  # what the vector came from, in words ('Love' MINUS 'Hate', a file)
    kind: str = field(default="steer", init=False)

    def __post_init__(self):
        vec = _frozen_f32(self.vector, "STEER vector", 1)
        if isinstance(self.scale, bool) or not np.isfinite(float(self.scale)):
            raise QueryRefused(f"STEER: scale {self.scale!r} is not a finite number")
        object.__setattr__(self, "vector", vec)
        object.__setattr__(self, "_digest", _digest(vec))
        # the addend is formed once, in float32, so every pass adds the same bytes
        add = (vec * np.float32(self.scale)).astype(np.float32)
        add.setflags(write=False)
        object.__setattr__(self, "addend", add)

    site = "residual"

    def _id(self):
        return ("steer", int(self.layer), float(self.scale), self._digest)

    def __eq__(self, other):
        return isinstance(other, Steer) and self._id() == other._id()

    def __hash__(self):
        return hash(self._id())

    def describe(self) -> str:
        src = self.source if self.source is not None else f"VECTOR sha256:{self._digest[:12]}"
        return f"STEER AT LAYER {self.layer} WITH {src} SCALE {self.scale:g}"

    def record(self) -> dict:
        return {"kind": self.kind, "layer": int(self.layer), "scale": float(self.scale), "source": self.source,
                "vector_sha256": self._digest, "text": self.describe()}


StreamIntervention = Patch | Steer
Edit = Callable[[int, np.ndarray], np.ndarray]  # (p0, [T, hidden]) -> [T, hidden], a new array or the same


def _patcher(p: Patch) -> Edit:
    pos = np.asarray(p.positions, dtype=np.int64)
    vals = p.source_values

    def edit(p0: int, a: np.ndarray) -> np.ndarray:
        hit = (pos >= p0) & (pos < p0 + a.shape[0])
        if not hit.any():
            return a
        out = a.copy()
        out[pos[hit] - p0] = vals[hit]
        return out

    return edit


def _steerer(s: Steer) -> Edit:
    add = s.addend
    return lambda p0, a: a + add


class StreamEdits:
    """Resolved stream interventions: per (layer, site), the edits in the order given, and per
    (layer, slot) a slot that a HEADS patch runs itself (`run_slot`)."""

    def __init__(self, edits: dict[tuple[int, str], list[Edit]], interventions: tuple,
                 slots: dict[tuple[int, str], Callable] | None = None):
        self._edits = edits
        self._slots = slots or {}
        self.interventions = interventions

    def runs_slot(self, layer: int, site: str) -> bool:
        return (layer, site) in self._slots

    def run_slot(self, layer: int, site: str, h, x, ls, p0: int, one: bool, tr):
        """Run the slot op of (layer, site) as the executor would, with the heads patched: an
        `OpFn`'s (h, write, operand bytes)."""
        return self._slots[(layer, site)](h, x, ls, p0, one, tr)

    def check_within(self, positions: int, what: str) -> None:
        """Refuse by name a patch position at or past ``positions``, for a run that is one
        prefill of that many positions (no later pass would ever reach it)."""
        for iv in self.interventions:
            if isinstance(iv, Patch) and max(iv.positions) >= positions:
                past = [p for p in iv.positions if p >= positions]
                raise QueryRefused(f"{iv.describe()}: position {past[0]} is past the {positions}-position prompt "
                                   f"of {what}, a single prefill (positions 0..{positions - 1}); a patch there "
                                   "would never apply (give it to a stream that decodes that far)")

    def apply(self, layer: int, site: str, p0: int, a: np.ndarray) -> np.ndarray:
        for e in self._edits.get((layer, site), ()):
            a = e(p0, a)
        return a

    def has(self, layer: int, site: str) -> bool:
        return (layer, site) in self._edits

    def records(self) -> list[dict]:
        return [i.record() for i in self.interventions]


def heads_op(plan, layer: int, what: str):
    """The softmax mixer op of ``layer`` whose heads are read or patched; a layer without heads,
    and an attention operator whose heads have no executor (MLA), refused by name."""
    check_site(plan, layer, "heads", what)
    op = next(o for o in plan.layers[layer].slot_ops() if o.role == "mixer")
    if op.kind != "softmax":
        raise UnsupportedOperator(f"{what}: layer {layer}'s mixer is {op.kind!r}; its heads have no executor "
                                  "in this build (softmax layers have one)")
    return op


def _heads_slot(op, prepared, patches: list[Patch]) -> Callable:
    """The layer's attention kernel bound with a tap that keeps the heads' output; where a pass
    covers a patched position, the output projection runs again on the heads with the patch in
    (the same arithmetic the kernel does: o_proj, then its bias)."""
    from ..operators import distinct_bytes
    from .engine import slot_operands
    from .ops.softmax import make_attention

    p = op.params
    nh, hd = p.heads, p.head_dim
    w = slot_operands(op, prepared)
    Wo, ob = w["o_proj"], w.get("o_bias")
    got: dict = {}

    def tap(kind, *args):
        if kind == "heads":
            got["out"] = args[1]

    run = make_attention(p, w, tap=tap)
    nbytes = distinct_bytes(op.operands)
    todo = [(np.asarray(pt.positions, np.int64), np.asarray(pt.heads, np.int64), pt.source_values) for pt in patches]

    def slot(h, x, ls, p0, one, tr):
        y = run(x, ls.ops.get("mixer"), p0)
        T = x.shape[0]
        out = None
        for pos, heads, vals in todo:
            hit = (pos >= p0) & (pos < p0 + T)
            if not hit.any():
                continue
            if out is None:
                out = np.array(got["out"], dtype=np.float32, copy=True).reshape(T, nh, hd)
            for r in np.flatnonzero(hit):
                out[pos[r] - p0, heads] = vals[r]
        got.clear()
        if out is not None:
            y = Wo.mm(out.reshape(T, nh * hd))
            if ob is not None:
                y = y + ob
        return h, y, nbytes

    return slot


def resolve_stream(interventions: Sequence | None, plan, executed: list[int], slice_desc: str,
                   prepared=None) -> StreamEdits | None:
    """Check stream interventions against the plan and the slice (a site the layer lacks, a layer
    the slice does not run, a vector of the wrong width, a head the layer lacks: each refused by
    name) and bind them; a HEADS patch binds its layer's attention from ``prepared`` (the
    executor's operands)."""
    if not interventions:
        return None
    ran = set(executed)
    hidden = plan.hidden_size
    edits: dict[tuple[int, str], list[Edit]] = {}
    heads: dict[int, list[Patch]] = {}
    for iv in interventions:
        if isinstance(iv, FeatureAblation):
            raise QueryRefused("ABLATE FEATURES binds the FFN kernels: give it to the executor "
                               "(container.executor(intervention=...)), not to a stream")
        if not isinstance(iv, (Patch, Steer)):
            raise UnsupportedOperator(f"intervention {type(iv).__name__} has no executor (supported: Patch, Steer)")
        what = iv.describe()
        check_site(plan, iv.layer, iv.site, what)
        if iv.layer not in ran:
            raise QueryRefused(f"{what} names layer {iv.layer}, which {slice_desc} does not execute")
        if iv.site == "heads":
            op = heads_op(plan, int(iv.layer), what)
            nh, hd = op.params.heads, op.params.head_dim
            bad = [h for h in iv.heads if h >= nh]
            if bad:
                raise QueryRefused(f"{what}: layer {iv.layer} has {nh} heads (0..{nh - 1}); no head {bad[0]}")
            if iv.source_values.shape[2] != hd:
                raise QueryRefused(f"{what}: values are {iv.source_values.shape[2]} wide per head, layer {iv.layer}'s "
                                   f"heads are {hd}")
            if prepared is None:
                raise UnsupportedOperator(f"{what}: patching HEADS binds the layer's attention, which needs the "
                                          "executor's operands (give it to ex.start / ex.forward)")
            heads.setdefault(int(iv.layer), []).append(iv)
            continue
        width = (iv.source_values.shape[1] if isinstance(iv, Patch) else iv.vector.shape[0])
        if width != hidden:
            raise QueryRefused(f"{what}: values are {width} wide, the model's residual is {hidden}")
        edits.setdefault((int(iv.layer), iv.site), []).append(_patcher(iv) if isinstance(iv, Patch) else _steerer(iv))
    slots = {(layer, "mixer"): _heads_slot(heads_op(plan, layer, "PATCH HEADS"), prepared, ps)
             for layer, ps in heads.items()}
    return StreamEdits(edits, tuple(interventions), slots)
