"""Looking inside a model: the FFN read as a database of features, the logit lens, exact
attribution, execution records and feature ablation, over a VINDEX3 container.

`Internals` is the entry point: one per open container, holding its weights view, its feature
metadata and its executors. Every statement of the language is one call on it and returns a
pydantic model (plain data: a renderer shows it, JSON carries every field)::

    ix = Internals(container)
    ix.walk("The capital of France is", top=5)               # WALK            -> WalkResult
    ix.describe("France")                                   # DESCRIBE        -> DescribeResult
    ix.select(FeatureQuery(nearest_to="Paris", limit=10))   # SELECT ... FROM FEATURES -> SelectResult
    ix.show_features(3, limit=20)                           # SHOW FEATURES   -> ShowFeaturesResult
    ix.feature_activity("The capital of France is")         # EXPLAIN INFER ... FEATURES -> ActivityResult
    ix.trace("The capital of France is", " Paris", decompose=True, save="t.npz")   # TRACE ... FOR -> TraceResult
    ix.observe("Hello", "run.jsonl", generate=8)           # OBSERVE ... RECORD INTO -> ObserveResult
    verify_record("run.jsonl")                              # vindex3 record verify -> RecordVerifyReport

Every layer-wise statement is operator-aware: a layer without an FFN (a Mamba2 mixer-only layer)
is listed under ``skipped`` with the reason, never given features. Runs accept
``intervention=FeatureAblation.parse("3:17, 5:2")`` (ABLATE FEATURES) and a slice (``Draft(n)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Literal

from ..exec.intervention import FeatureAblation, Intervention
from .activity import ActiveFeature, ActivityLayer, ActivityResult, feature_activity
from .common import Prompt, SkippedLayer, TokenLogit
from .lens import Decomposition, LensRow, Part, SavedFile, TraceResult, lens
from .lens import decompose as _decompose
from .lens import save as _save
from .metadata import DEFAULT_K, FeatureTokens, MetadataNote
from .model import FfnLayer, ModelView
from .record import ObserveResult, RecordVerifyReport, observe, verify_record
from .select import (
    COLUMNS,
    Condition,
    FeatureQuery,
    FeatureRow,
    FeatureTokensRow,
    SelectResult,
    ShowFeaturesResult,
    select,
    show_features,
)
from .walk import (
    DEFAULT_THRESHOLD,
    DescribeEdge,
    DescribeResult,
    FeatureHit,
    WalkLayer,
    WalkResult,
    describe,
    walk,
)

__all__ = [
    "COLUMNS", "DEFAULT_K", "DEFAULT_THRESHOLD", "ActiveFeature", "ActivityLayer", "ActivityResult", "Condition",
    "Decomposition", "DescribeEdge", "DescribeResult", "FeatureAblation", "FeatureHit", "FeatureQuery", "FeatureRow",
    "FeatureTokens", "FeatureTokensRow", "FfnLayer", "Internals", "LensRow", "MetadataNote", "ModelView",
    "ObserveResult", "Part", "Prompt", "RecordVerifyReport", "SavedFile", "SelectResult", "ShowFeaturesResult",
    "SkippedLayer", "TokenLogit", "TraceResult", "WalkLayer", "WalkResult", "verify_record",
]


class Internals:
    """One container's internals queries (see the module docstring).

    ``k``: tokens kept per feature in the feature metadata (default `DEFAULT_K`);
    ``on_stale``: what to do with metadata built from another state of the container: "rebuild"
    (the result's ``metadata.rebuilt`` says why) or "refuse" (`vindex3.errors.DerivedStale`);
    ``progress``: a `vindex3.progress.Progress` callback told of each layer a statement builds
    (a whole-model build takes a while: one vocabulary-sized GEMM per FFN layer)."""

    def __init__(self, container, *, k: int = DEFAULT_K, on_stale: Literal["rebuild", "refuse"] = "rebuild",
                 progress=None):
        from ..draft.slices import open_container

        self.container = open_container(container)
        self.view = ModelView(self.container)
        self.metadata = FeatureTokens(self.view, k=k, on_stale=on_stale, progress=progress)
        self._executors: dict = {}

    # -- runs ----------------------------------------------------------------------------------
    def executor(self, slice=None, intervention: Intervention | None = None, activations: str = "exact"):
        """A prepared executor for ``slice`` (None: full; an int or ``Draft(n)``: a draft) with
        ``intervention`` and ``activations`` ('exact' | 'q8'); kept for reuse."""
        from ..errors import SliceError
        from ..exec.slice import Draft, Full

        if slice is None or isinstance(slice, Full):
            sl, depth = Full(), None
        elif isinstance(slice, int) and not isinstance(slice, bool):
            sl, depth = Draft(slice), slice
        elif isinstance(slice, Draft):
            sl, depth = slice, slice.end
        else:
            raise SliceError(f"looking inside runs the full model or a draft (Draft(n)); got {slice!r}",
                             hint="a layer range has no embedding or head to read tokens in and logits out")
        self.container.plan_slice(sl)  # a depth the model does not have is refused here, by name
        key = (sl, intervention, activations)
        ex = self._executors.get(key)
        if ex is None:
            ex = self._executors[key] = self.container.executor(sl, intervention, activations=activations)
        return ex, depth

    # -- feature metadata ----------------------------------------------------------------------
    def build_metadata(self, layers: Iterable[int] | None = None) -> MetadataNote:
        """Build (or check) the feature metadata of ``layers`` (every FFN layer when None)."""
        ffns, _ = self.view.ffn_layers(layers, "feature metadata")
        return self.metadata.ensure([f.layer for f in ffns])

    # -- the FFN as a database -----------------------------------------------------------------
    def walk(self, text: str | Sequence[int], *, top: int = 5, layers: Iterable[int] | None = None,
             tokens: int = 3) -> WalkResult:
        return walk(self.view, self.metadata, text, top=top, layers=layers, tokens=tokens)

    def describe(self, entity: str, *, layers: Iterable[int] | None = None, top: int = 10,
                 threshold: float = DEFAULT_THRESHOLD, also: int = 5) -> DescribeResult:
        return describe(self.view, self.metadata, entity, layers=layers, top=top, threshold=threshold, also=also)

    def select(self, query: FeatureQuery) -> SelectResult:
        return select(self.view, self.metadata, query)

    def show_features(self, layer: int, *, limit: int | None = None, tokens: int = 5) -> ShowFeaturesResult:
        return show_features(self.view, self.metadata, layer, limit=limit, tokens=tokens)

    def feature_activity(self, text: str | Sequence[int], *, top: int = 5, layers: Iterable[int] | None = None,
                         tokens: int = 3, slice=None, intervention: Intervention | None = None,
                         activations: str = "exact") -> ActivityResult:
        ex, _ = self.executor(slice, intervention, activations)
        prompt = self.view.prompt(text, "EXPLAIN INFER ... FEATURES")
        return feature_activity(self.view, self.metadata, ex, prompt, top=top, layers=layers, tokens=tokens)

    # -- tracing -------------------------------------------------------------------------------
    def trace(self, text: str | Sequence[int], token: str | int, *, layers: Iterable[int] | None = None,
              positions: Literal["last", "all"] = "last", decompose: bool | Literal["heads"] = False,
              save: str | None = None,
              overwrite: bool = False, slice=None, intervention: Intervention | None = None,
              activations: str = "exact") -> TraceResult:
        """TRACE 'text' FOR 'token' [LAYERS] [POSITIONS] [DECOMPOSE [HEADS]] [SAVE INTO]; with
        ``decompose="heads"`` each attention layer's part is split by head
        (`vindex3.internals.heads.split_heads`)."""
        from .capture import capture
        from .common import output_path

        t0 = time.perf_counter()
        ex, depth = self.executor(slice, intervention, activations)
        prompt = self.view.prompt(text, "TRACE")
        target = self.view.token(token, "TRACE ... FOR")
        if save is not None:  # refuse a bad path before running anything
            output_path(save, suffix=".npz", what="TRACE ... SAVE INTO", overwrite=overwrite)
        run = capture(ex, prompt.ids, inputs=decompose == "heads")
        rows, final = lens(self.view, ex, run, target, layers=layers, positions=positions)
        dec = _decompose(self.view, ex, run, target) if (decompose or save is not None) else None
        if decompose == "heads":
            from .heads import split_heads

            dec = split_heads(ex, run, dec)
        saved = None
        if save is not None:
            c = self.container
            prov = {"container": c.name, "container_digest": c.digest, "component": c.graph.component.name,
                    "slice": ex.slice.describe(), "draft_depth": depth, "executed_layers": run.executed,
                    "intervention": ex.intervention.record() if ex.intervention is not None else None,
                    "activations": ex.activations, "token_ids": prompt.ids, "target_id": target, "positions": positions}
            from .record import library_versions

            prov["library_versions"] = library_versions()
            saved = _save(save, ex=ex, run=run, target=target, rows=rows, dec=dec, provenance=prov, overwrite=overwrite)
        return TraceResult(prompt=prompt, target_id=target, target=self.view.text(target), positions=positions,
                           slice=ex.slice.describe(), executed_layers=run.executed,
                           intervention=ex.intervention.record() if ex.intervention is not None else None, rows=rows,
                           final=final, decomposition=dec if decompose else None, saved=saved,
                           seconds=time.perf_counter() - t0)

    # -- records -------------------------------------------------------------------------------
    def observe(self, text: str | Sequence[int], path, *, generate: int = 0, lens_tokens: Sequence[str | int] = (),
                overwrite: bool = False, slice=None, intervention: Intervention | None = None,
                activations: str = "exact") -> ObserveResult:
        """OBSERVE 'text' [GENERATE n] RECORD INTO 'run.jsonl'."""
        ex, depth = self.executor(slice, intervention, activations)
        prompt = self.view.prompt(text, "OBSERVE")
        ids = [self.view.token(t, "OBSERVE lens token") for t in lens_tokens]
        return observe(self.view, ex, prompt, path, generate=generate, lens_ids=ids, overwrite=overwrite, draft_depth=depth)
