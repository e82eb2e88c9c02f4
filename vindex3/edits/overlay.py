"""The overlay: patches of edits over a base container that is never modified.

    model = EditedModel(container, [patch, ...])
    model.executor()          # an Executor over the base plan, reading replaced tensors from memory
    model.overrides()         # {"decoder_stack/3.mlp.down_proj.weight": float32 array, ...}

Edits are data: each carries its tensor writes (a row or a column set, or a low-rank term
added) as float32 vectors, so a patch file holds vectors, not matrices, and the overlay's arrays
are the base's with every edit's writes applied in order."""

from __future__ import annotations

import base64
import hashlib
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from ..errors import QueryRefused, SliceError

F32 = np.float32
#: How a KNN edit is named wherever its output appears: it changes no weight.
KNN_LABEL = "retrieval overlay"
#: The logit every other token gets where a KNN key fires (the target keeps 0): probability 1.0
#: for the target in float32, and finite, so downstream checks of finiteness still hold.
KNN_FLOOR = F32(-1e4)


def enc(a: np.ndarray) -> str:
    """float32 little-endian bytes, base64 (how vectors travel in patch files)."""
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode("ascii")


def dec(s: str, shape: tuple[int, ...]) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s.encode("ascii"), validate=True), dtype="<f4")
    n = int(np.prod(shape)) if shape else 1
    if a.size != n:
        raise QueryRefused(f"a patch vector holds {a.size} values where its shape {list(shape)} needs {n}")
    return a.reshape(shape).astype(F32)


class TensorWrite(BaseModel):
    """One change to one tensor of the base, named by object and tensor (``label``):
    ``set_row`` / ``set_col`` replace row / column ``index`` with ``vector``; ``add_lowrank`` adds
    ``left @ right`` ([out, r] @ [r, in])."""

    model_config = ConfigDict(extra="forbid")

    object: str
    tensor: str
    op: Literal["set_row", "set_col", "add_lowrank"]
    shape: tuple[int, int]  # the tensor's
    index: int | None = None
    vector: str | None = None
    rank: int | None = None
    left: str | None = None
    right: str | None = None

    @property
    def label(self) -> str:
        return f"{self.object}/{self.tensor}"

    @classmethod
    def row(cls, obj: str, tensor: str, shape, index: int, v: np.ndarray) -> TensorWrite:
        return cls(object=obj, tensor=tensor, op="set_row", shape=tuple(shape), index=int(index), vector=enc(v))

    @classmethod
    def col(cls, obj: str, tensor: str, shape, index: int, v: np.ndarray) -> TensorWrite:
        return cls(object=obj, tensor=tensor, op="set_col", shape=tuple(shape), index=int(index), vector=enc(v))

    @classmethod
    def lowrank(cls, obj: str, tensor: str, shape, left: np.ndarray, right: np.ndarray) -> TensorWrite:
        return cls(object=obj, tensor=tensor, op="add_lowrank", shape=tuple(shape), rank=int(left.shape[1]),
                   left=enc(left), right=enc(right))

    def apply(self, a: np.ndarray) -> None:
        """Apply to ``a`` (the tensor as float32, modified in place)."""
        if tuple(a.shape) != tuple(self.shape):
            raise QueryRefused(f"an edit writes {self.label} as shape {list(self.shape)}, and the container's is "
                               f"{list(a.shape)}")
        out_, in_ = self.shape
        if self.op == "set_row":
            a[self.index] = dec(self.vector, (in_,))
        elif self.op == "set_col":
            a[:, self.index] = dec(self.vector, (out_,))
        else:
            a += dec(self.left, (out_, self.rank)) @ dec(self.right, (self.rank, in_))

    def describe(self) -> str:
        what = {"set_row": f"row {self.index} set", "set_col": f"column {self.index} set",
                "add_lowrank": f"rank-{self.rank} term added"}[self.op]
        return f"{self.label}: {what}"


class KnnKey(BaseModel):
    """A retrieval overlay's key: the residual leaving ``layer`` at the prompt's last token, less
    ``center`` (the mean residual there over the key corpus); where a position's centred residual
    has cosine > ``threshold`` with ``key``, the next token becomes ``token_id`` with probability 1."""

    model_config = ConfigDict(extra="forbid")

    layer: int
    hidden: int
    key: str
    center: str
    threshold: float
    token_id: int


class Edit(BaseModel):
    """One edit: what was asked (prompt, target; entity and relation when given that way), the
    mode that fitted it, the layers it writes, the writes themselves and what the fit measured."""

    model_config = ConfigDict(extra="forbid")

    id: int
    mode: Literal["compose", "memit", "knn", "values"]  # values: tensor values copied whole (DIFF INTO PATCH)
    prompt: str | None = None  # None for a values edit: it answers no prompt
    target: str | None = None
    target_id: int | None = None  # the target's first token: the one efficacy and KNN speak about
    original: str | None = None  # the unedited model's top-1 token at the prompt, as text
    entity: str | None = None
    relation: str | None = None
    layers: list[int]
    writes: list[TensorWrite] = Field(default_factory=list)
    knn: KnnKey | None = None
    fit: dict = Field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"KNN ({KNN_LABEL})" if self.mode == "knn" else self.mode.upper()

    def vectors(self) -> int:
        return sum(1 if w.op != "add_lowrank" else 2 * (w.rank or 0) for w in self.writes) + (1 if self.knn else 0)


class Patch(BaseModel):
    """A named list of edits, bound to the container it was made on (``base_digest``)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["vindex3-patch"] = "vindex3-patch"
    version: Literal[1] = 1
    name: str
    base_digest: str
    base_name: str
    edits: list[Edit] = Field(default_factory=list)
    provenance: dict = Field(default_factory=dict)

    def next_id(self) -> int:
        return max((e.id for e in self.edits), default=0) + 1

    def digest(self) -> str:
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()


def check_base(patch: Patch, container, where: str = "") -> None:
    """Refuse by name a patch made on another container."""
    if patch.base_digest != container.digest:
        raise QueryRefused(
            f"patch {patch.name!r}{where} was made on container {patch.base_name!r} (digest {patch.base_digest[:16]}…), "
            f"and the open container {container.name!r} has digest {container.digest[:16]}…; a patch applies only "
            "to the container it was made on", hint="open the container the patch was made on")


class OverlaySource:
    """A tensor source serving ``arrays`` (label -> float32) in place of the base's tensors."""

    def __init__(self, base, arrays: dict[str, np.ndarray]):
        self._base = base
        self._arrays = arrays

    def weight(self, ref):
        a = self._arrays.get(ref.label)
        if a is None:
            return self._base.weight(ref)
        from ..codecs.f32 import DenseF32

        return DenseF32(a)

    def representation_key(self, obj: str) -> str:
        return self._base.representation_key(obj)


class EditedModel:
    """The base container seen through patches: every attribute is the container's except the
    tensor source, the executors (which read the replaced tensors) and `overrides`."""

    def __init__(self, base, patches: list[Patch]):
        for p in patches:
            check_base(p, base)
        self._base = base
        self.patches = list(patches)
        self._arrays: dict[str, np.ndarray] | None = None
        self._full = None

    def __getattr__(self, name):
        return getattr(self._base, name)

    @property
    def base(self):
        return self._base

    def edits(self) -> list[Edit]:
        return [e for p in self.patches for e in p.edits]

    def knn_keys(self) -> list[KnnKey]:
        return [e.knn for e in self.edits() if e.knn is not None]

    def overrides(self) -> dict[str, np.ndarray]:
        """Every tensor the patches change, whole, as float32 (label ``object/tensor`` ->
        array): the base's values with each edit's writes applied in order. Read-only arrays."""
        if self._arrays is None:
            arrays: dict[str, np.ndarray] = {}
            plan = self._base.op_plan()
            refs = {r.label: r for lo in plan.layers for op in lo.ops for r in op.operands.values()}
            src = self._base.tensor_source()
            for e in self.edits():
                for w in e.writes:
                    a = arrays.get(w.label)
                    if a is None:
                        ref = refs.get(w.label)
                        if ref is None:
                            raise QueryRefused(f"an edit writes {w.label}, which the container's plan does not read")
                        a = arrays[w.label] = np.array(src.weight(ref).dense(), dtype=F32, copy=True)
                    w.apply(a)
            for a in arrays.values():
                a.setflags(write=False)
            self._arrays = arrays
        return self._arrays

    def tensor_source(self) -> OverlaySource:
        return OverlaySource(self._base.tensor_source(), self.overrides())

    def executor(self, slice=None, intervention=None, *, shards=None, max_positions: int | None = None,
                 activations: str = "exact"):
        """Like `Container.executor`, over the overlay; with KNN keys, a `KnnExecutor`."""
        from ..exec.engine import Executor
        from ..exec.slice import Full

        if shards is not None:
            raise SliceError("an edit overlay cannot run over shards in this build (the actors run the container's "
                             "own weights)", hint="run it in one process (SET shards = 0)")
        plain = slice is None and intervention is None and max_positions is None and activations == "exact"
        if plain and self._full is not None:
            return self._full
        ex = Executor(self._base.op_plan(), self.tensor_source(), slice or Full(), intervention,
                      max_positions=max_positions, activations=activations)
        keys = self.knn_keys()
        if keys:
            ex = KnnExecutor(ex, keys)
        if plain:
            self._full = ex
        return ex

    def describe(self) -> str:
        modes = sorted({e.label for e in self.edits()})
        return f"{len(self.edits())} edit(s) in {len(self.patches)} patch(es): " + ", ".join(modes)


# ---- the retrieval overlay ------------------------------------------------------------------------


class _Capture:
    """An observer that keeps the residual leaving the KNN layers and passes everything on."""

    def __init__(self, inner, layers: set[int]):
        from ..exec.engine import Observer

        self.inner = inner or Observer()
        self.layers = layers
        self.rows: dict[int, list[np.ndarray]] = {i: [] for i in layers}

    def begin(self, p0, h):
        self.inner.begin(p0, h)

    def slot_input(self, layer, site, p0, x):
        self.inner.slot_input(layer, site, p0, x)

    def write(self, layer, site, p0, w, r):
        self.inner.write(layer, site, p0, w, r)

    def enter(self, layer, p0, h):
        self.inner.enter(layer, p0, h)

    def leave(self, layer, p0, h):
        if layer in self.layers:
            self.rows[layer].append(h)
        self.inner.leave(layer, p0, h)


class _Key:
    def __init__(self, k: KnnKey):
        self.layer, self.threshold, self.token = k.layer, F32(k.threshold), int(k.token_id)
        key = dec(k.key, (k.hidden,))
        self.key = key / np.linalg.norm(key)
        self.center = dec(k.center, (k.hidden,))


def knn_hits(keys: list[_Key], h_by_layer: dict[int, np.ndarray]) -> list[tuple[int, int, float]]:
    """(row, token, cosine) for every row where a key fires (the most similar key wins)."""
    best: dict[int, tuple[float, int]] = {}
    for k in keys:
        h = h_by_layer[k.layer] - k.center
        cos = (h @ k.key) / np.maximum(np.linalg.norm(h, axis=1), F32(1e-12))
        for t in np.nonzero(cos > k.threshold)[0]:
            c = float(cos[t])
            if int(t) not in best or c > best[int(t)][0]:
                best[int(t)] = (c, k.token)
    return [(t, tok, c) for t, (c, tok) in sorted(best.items())]


class KnnExecutor:
    """An executor whose token streams override the next token where a KNN key fires. Every other
    attribute is the wrapped executor's; ``overlay`` names it a retrieval overlay."""

    overlay = KNN_LABEL

    def __init__(self, ex, keys: list[KnnKey]):
        self._ex = ex
        self._keys = [_Key(k) for k in keys]
        missing = sorted({k.layer for k in self._keys} - set(ex.layers))
        if missing:
            raise SliceError(f"the {KNN_LABEL} reads the residual at layer {missing[0]}, which "
                             f"{ex.slice.describe()} does not execute", hint="run a depth that reaches it")

    def __getattr__(self, name):
        return getattr(self._ex, name)

    def start(self, observer=None, interventions=()):
        from ..exec.intervention import resolve_stream

        ex = self._ex
        if not ex.has_ends:
            return ex.start(observer, interventions)
        edits = resolve_stream(interventions, ex.plan, ex.layers, ex.slice.describe())
        cap = _Capture(observer, {k.layer for k in self._keys})
        return KnnStream(ex, cap, edits, self._keys)

    def forward(self, token_ids, interventions=()):
        return self.start(interventions=interventions).prefill(token_ids)

    def run_with_cache(self, token_ids, sites=("residual",), interventions=()):
        from ..exec.cache import cache_run

        return cache_run(self, token_ids, sites, interventions)


def _knn_stream_class():
    from ..exec.engine import Stream

    class _KnnStream(Stream):
        """A token stream of a `KnnExecutor`: ``retrieval_hits`` lists (position, token, cosine)
        of every override made."""

        def __init__(self, ex, cap, edits, keys):
            super().__init__(ex, cap, edits)
            self._cap, self._keys = cap, keys
            self.retrieval_hits: list[tuple[int, int, float]] = []

        def prefill(self, token_ids, last_only: bool = False):
            p0 = self.state.position
            for rows in self._cap.rows.values():
                rows.clear()
            out = super().prefill(token_ids, last_only)
            h = {layer: np.concatenate(rows) for layer, rows in self._cap.rows.items()}
            T = next(iter(h.values())).shape[0]
            hits = knn_hits(self._keys, h)
            if hits:
                out = np.array(out, copy=True)
                for t, tok, c in hits:
                    r = t - (T - out.shape[0])
                    if r < 0:
                        continue
                    out[r] = KNN_FLOOR
                    out[r, tok] = F32(0)
                    self.retrieval_hits.append((p0 + t, tok, c))
            return out

    return _KnnStream


def KnnStream(ex, cap, edits, keys):  # a class made on first use (engine imports stay lazy)
    global _KNN_STREAM
    if _KNN_STREAM is None:
        _KNN_STREAM = _knn_stream_class()
    return _KNN_STREAM(ex, cap, edits, keys)


_KNN_STREAM = None
