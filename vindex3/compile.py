"""COMPILE (issues 19 and 30, the reference dialect's COMPILE ... INTO VINDEX): a container
written again with an edit overlay folded in.

The overlay reaches this module as **overrides**: full replacement tensors, keyed by the
container tensor's label ``"<object>/<tensor>"`` — exactly `vindex3.opplan.OperandRef.label`,
the object as the graph and the index name it (``embedding``, ``decoder_stack``,
``final_norm``, ``output_head``, ...) and the tensor as its segment header names it, relative to
the object (``3.mlp.down_proj.weight``). E.g. ``{"decoder_stack/3.mlp.down_proj.weight":
w}`` with ``w`` a finite float32 array of the stored tensor's shape. `check_overrides` refuses
by name an unknown label, a wrong shape, a dtype other than float32 and NaN or infinity; a
tensor of a permuted expert bank (stored in another order than its logical one) is refused too.

What `compile` writes:

* every object no override touches: its segment copied byte for byte (checked against the hash
  the index records on the way) and its representation entry kept as it is;
* every edited object: a new segment holding its untouched tensors as their stored bytes
  (whatever their encoding, checked first) and each edited tensor **float32** — so the compiled
  container computes exactly what an executor over the source computes with the same overrides
  served by `OverriddenSource` (the same values in the same kernels: the acceptance is
  ``np.array_equal`` of logits); its representation key is ``object@<encoding holding most of
  its elements>``;
* the graph and the capability files byte for byte (the logical identity is unchanged);
* index.json rewritten by `vindex3.rewrite.rewritten` (unknown keys kept at every depth,
  generation + 1, sealed as the source was), with ``provenance.compiled`` recording the source
  (name, digest, generation), each edited tensor (label, shape, stored and written encoding,
  sha256 before and after) and the caller's ``provenance`` (e.g. the patch) under ``patches``;
  with edits the authority becomes ``derived`` (the weights are no longer the checkpoint's) and
  derived representations (feature metadata, ...) are left behind and listed under
  ``not_carried`` — they were computed from the unedited weights and would be stale;
* the write is atomic (`vindex3.rewrite.ContainerWriter`), nothing is written inside the
  source, and the result is opened and re-hashed before it is reported.

Without overrides COMPILE is a verified copy (issue 19's behaviour, `compile_copy`)."""

from __future__ import annotations

import datetime as _dt
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import __version__
from .compact import _copy, referenced, unreferenced
from .container import GRAPH, Container
from .errors import EncodeError
from .paths import confined
from .rewrite import ContainerWriter, rewritten
from .segments import Encoded, write_segment

EDIT_ENCODING = "f32"


class OverrideRefused(EncodeError):
    """An override that does not fit the container: the message names the label and why."""


@dataclass
class CompileResult:
    path: Path
    source: Path
    files: int  # files copied or written (the ones the index refers to)
    bytes: int
    generation: int
    verified: int  # files re-hashed in the written container
    left_behind: int  # files of the source the index does not refer to (not copied)
    edited: list[str] = field(default_factory=list)  # labels of the tensors written from overrides
    not_carried: list[str] = field(default_factory=list)  # derived representations left behind


def check_overrides(container: Container, overrides: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """``overrides`` checked against ``container``: label -> C-contiguous float32 array. Refuses
    (`OverrideRefused`) by name an unknown label, a shape other than the stored tensor's, a dtype
    other than float32, NaN or infinity, and a tensor of a permuted expert bank."""
    out: dict[str, np.ndarray] = {}
    perms = {rep.object: set(rep.permutation or {}) for rep in container.manifest.representations.values()}
    for label, arr in (overrides or {}).items():
        obj, sep, name = label.partition("/") if isinstance(label, str) else ("", "", "")
        seg = container.segments.get(obj) if sep else None
        if seg is None or name not in seg.entries:
            known = ", ".join(sorted(container.segments))
            why = (f"object {obj!r} is not in the container (objects: {known})" if sep and seg is None
                   else f"{obj} has no tensor {name!r}" if sep else "a label is '<object>/<tensor>'")
            raise OverrideRefused(f"override {label!r} names no tensor of {container.path.name}: {why}",
                                  hint="keys are OperandRef labels, e.g. 'decoder_stack/3.mlp.down_proj.weight'")
        e = seg.entries[name]
        if not isinstance(arr, np.ndarray):
            raise OverrideRefused(f"override {label!r} is a {type(arr).__name__}, not a numpy array")
        if arr.dtype != np.float32:
            raise OverrideRefused(f"override {label!r} is {arr.dtype}, not float32 (weights are float32 end to end; "
                                  "cast it yourself if that is what you mean)")
        if tuple(arr.shape) != tuple(e.shape):
            raise OverrideRefused(f"override {label!r} has shape {list(arr.shape)}; the stored tensor is {list(e.shape)}")
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        if bad:
            raise OverrideRefused(f"override {label!r} holds {bad} NaN or infinite value(s); refusing weights that "
                                  "compute NaN")
        if name in perms.get(obj, ()):
            raise OverrideRefused(f"override {label!r} is a permuted expert bank (stored in another order than its "
                                  "logical one); overriding it is not supported in this build")
        out[label] = np.ascontiguousarray(arr)
    return out


class OverriddenSource:
    """A container's operands with some tensors replaced: ``weight(ref)`` serves the override of
    ``ref.label`` as a float32 weight (the same codec a compiled container reads it with) and
    every other operand from the container. What an executor over the base with an edit overlay
    reads; `compile` bakes the same overrides into a container that computes the same bytes::

        src = OverriddenSource(c, {"decoder_stack/1.mlp.down_proj.weight": w})
        ex = Executor(c.op_plan(), src, Full())      # or overridden_executor(c, overrides)
    """

    def __init__(self, container: Container, overrides: Mapping[str, np.ndarray]):
        from . import codecs

        self.container = container
        self.overrides = check_overrides(container, overrides)
        self._base = container.tensor_source()
        f32 = codecs.get(EDIT_ENCODING)
        self._weights = {k: f32.weight(a.reshape(-1).view(np.uint8), a.shape) for k, a in self.overrides.items()}

    def weight(self, ref):
        w = self._weights.get(ref.label)
        return w if w is not None else self._base.weight(ref)

    def representation_key(self, obj: str) -> str:
        return self._base.representation_key(obj)


def overridden_executor(container: Container, overrides: Mapping[str, np.ndarray], slice=None, intervention=None, *,
                        max_positions: int | None = None, activations: str = "exact"):
    """An executor over ``container`` whose operands are served by `OverriddenSource`."""
    from .exec.engine import Executor
    from .exec.slice import Full

    return Executor(container.op_plan(), OverriddenSource(container, overrides), slice or Full(), intervention,
                    max_positions=max_positions, activations=activations)


def _jsonable(provenance: Mapping[str, Any] | None) -> dict:
    if provenance is None:
        return {}
    if not isinstance(provenance, Mapping):
        raise EncodeError(f"COMPILE provenance must be a JSON object, got {type(provenance).__name__}")
    try:
        return json.loads(json.dumps(dict(provenance), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise EncodeError(f"COMPILE provenance is not JSON (strict, finite numbers): {e}") from None


def compile(src: str | Path | Container, out: str | Path, *, overrides: Mapping[str, np.ndarray] | None = None,
            provenance: Mapping[str, Any] | None = None) -> CompileResult:
    """Write ``out``: the container at ``src`` with ``overrides`` (labels ``"object/tensor"``,
    see the module docstring) baked in as float32 tensors of new segments of the edited objects,
    every other file carried byte for byte, generation + 1, ``provenance`` recorded under
    ``provenance.compiled.patches``. ``src`` is a path or an open `Container` (checked unchanged
    on disk since it was opened). Verified (opened and re-hashed) before it returns."""
    if isinstance(src, Container):
        src.check_unchanged()
        source = src
    else:
        source = Container(src)
    edits = check_overrides(source, overrides)
    patch = _jsonable(provenance)
    by_obj: dict[str, dict[str, np.ndarray]] = {}
    for label, arr in edits.items():
        obj, _, name = label.partition("/")
        by_obj.setdefault(obj, {})[name] = arr
    refs = referenced(source)
    derived = source.index.get("derived")
    dropped_derived = sorted(derived) if edits and isinstance(derived, dict) else []
    if dropped_derived:  # computed from the unedited weights: not carried
        keep = referenced_without_derived(source)
        refs = {k: v for k, v in refs.items() if k in keep}
    left = unreferenced(source.path, set(referenced(source)))
    reps = {k: r for k, r in source.index["representations"].items()}
    edited_records: list[dict] = []
    with ContainerWriter(out, "COMPILE output", forbid_inside=[source.path]) as w:
        total = 0
        rewritten_segments: dict[str, dict] = {}
        for obj, names in sorted(by_obj.items()):
            key_old = next(k for k, r in reps.items() if r["object"] == obj)
            rep_old = reps.pop(key_old)
            seg = source.segments[obj]
            specs: dict = {}
            counts: dict[str, int] = {}
            for name, e in seg.entries.items():
                enc = EDIT_ENCODING if name in names else e.dtype
                specs[name] = (enc, e.shape) if name in names else (e.dtype, e.shape, e.nbytes)
                counts[enc] = counts.get(enc, 0) + math.prod(e.shape)
            major = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0]
            key = f"{obj}@{major}"

            def load(name: str, obj=obj, seg=seg, names=names):
                if name in names:
                    return names[name]
                source.check_tensor(obj, name)  # the source's bytes against its index, first
                return Encoded(seg.raw(name))

            rel = rep_old["segment"]
            info = write_segment(w.tmp / rel, key, specs, load)
            total += info.segment_bytes
            rep = {k: v for k, v in rep_old.items() if k not in (
                "encoding", "tensors", "payload_bytes", "payload_sha256", "segment_sha256", "segment_bytes",
                "header_sha256", "tensor_sha256")}  # unknown keys of the entry (a permutation, ...) kept
            rep.update({"object": obj, "encoding": major, "segment": rel, "tensors": info.tensors,
                        "payload_bytes": info.payload_bytes, "payload_sha256": info.payload_sha256,
                        "segment_sha256": info.segment_sha256, "segment_bytes": info.segment_bytes,
                        "header_sha256": info.header_sha256, "tensor_sha256": info.tensor_sha256})
            reps[key] = rep
            rewritten_segments[rel] = {"path": rel, "bytes": info.segment_bytes, "sha256": info.segment_sha256}
            for name in sorted(names):
                e = seg.entries[name]
                edited_records.append({
                    "tensor": f"{obj}/{name}", "shape": list(e.shape), "source_encoding": e.dtype,
                    "encoding": EDIT_ENCODING, "source_sha256": seg.tensor_sha256(name),
                    "sha256": info.tensor_sha256[name],
                })
        for rel, sha in sorted(refs.items()):
            if rel in rewritten_segments:
                continue
            total += _copy(confined(source.path, rel, rel), w.tmp / rel, sha, rel)
        segs = [rewritten_segments.get(s.get("path"), s) if isinstance(s, dict) else s
                for s in source.index.get("segments", [])]
        record: dict[str, Any] = {
            "method": "vindex3 compile", "writer": f"vindex3 {__version__}",
            "written_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "source": {"name": source.path.name, "digest": source.digest, "generation": source.generation,
                       "index_sha256": source.index.get("index_sha256")},
            "edited": edited_records,
            "patches": [patch] if patch else [],
        }
        if dropped_derived:
            record["not_carried"] = [{"derived": k, "why": "computed from the unedited weights; rebuild it from this "
                                      "container"} for k in dropped_derived]
        prev = source.provenance.get("compiled")
        if prev is not None:
            record["previous"] = prev
        replace: dict[str, Any] = {}
        if edits:
            replace = {"representations": reps, "segments": segs, "authority": "derived"}
        index = rewritten(source.index, replace=replace, drop=["derived"] if dropped_derived else [],
                          provenance={"compiled": record})
        path = w.finish(index)
    report = Container(path).verify()
    if not report.ok:  # pragma: no cover - a copy checked file by file does not come out damaged
        from .errors import IntegrityError

        raise IntegrityError(f"COMPILE wrote {path}, and it does not verify: {report.problems[:3]}")
    return CompileResult(path=Path(path), source=source.path, files=len(refs), bytes=total,
                         generation=int(index["generation"]), verified=report.checked, left_behind=len(left),
                         edited=[r["tensor"] for r in edited_records], not_carried=dropped_derived)


def referenced_without_derived(c: Container) -> set[str]:
    """The files the index refers to other than those of derived representations."""
    keep = {GRAPH}
    for rep in c.manifest.representations.values():
        keep.add(rep.segment)
    keep.update(c.manifest.capabilities)
    return keep


def compile_copy(src: str | Path, out: str | Path) -> CompileResult:
    """Write ``out``: ``src`` compiled with no patches (a verified copy), and verify it."""
    return compile(src, out)
