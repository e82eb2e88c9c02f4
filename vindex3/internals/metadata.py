"""Feature metadata: for every feature of an FFN layer, the top-k vocabulary entries its value
(down column) writes, with their logits. A derived representation of the container, built on
demand one layer at a time (one GEMM per layer), cached inside the container with its
provenance, and never served stale.

What "the tokens a down column writes" means here: the model's own final readout applied to the
column as if it were the whole residual direction, with the final norm's per-channel weight and
the head (and its multiplier),

    logits_f = head_multiplier · W_head · (final_norm_weight ⊙ down[:, f])

leaving out the final norm's RMS scale (a positive factor per position: it changes no ranking)
and any logit softcap (monotone: it changes no ranking either). It is the same linear map
through which `vindex3.internals.lens.decompose` attributes a write to a token's logit (there
scaled by the frozen 1/RMS of the final residual), so a feature's metadata logit times its
activation, the residual multiplier and that scale is its direct effect on a token's logit.

On disk: ``derived/feature_tokens/layer_NNNN.npz`` (``ids`` int32 [features, k], ``logits``
float32 [features, k], each row sorted by logit, ties by lower id), recorded in index.json
under ``derived.feature_tokens`` with the source container's digest, k, the method, this
build's version and each file's SHA-256 and size. The container digest (graph and payload
hashes) does not change. An entry whose source digest, method version or k no longer fits is
rebuilt (``on_stale="rebuild"``, and the result says so) or refused by name
(``on_stale="refuse"``); a layer file that is missing or whose hash differs likewise.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import time
from collections.abc import Callable
from typing import Literal

import numba
import numpy as np
from pydantic import BaseModel

from ..errors import DerivedStale, QueryRefused
from ..progress import Progress
from .common import SkippedLayer, span_text
from .model import ModelView

KIND = "feature_tokens"
VERSION = 1
DEFAULT_K = 10
MAX_K = 256
DIRECTORY = "derived/feature_tokens"
METHOD = ("top-k over the vocabulary of head_multiplier * W_head @ (final_norm_weight * down[:, f]): the final readout "
          "of down column f with the final norm's weight, without its RMS scale or softcap; ties to the lower id")
# A LayerNorm readout (GPT-2, GPT-NeoX, Phi): its linear part is the weight times the centred
# column; its per-position 1/std (positive) and its bias and the head's bias (the same for every
# feature) change no ranking, so they are left out as the RMS scale is.
METHOD_LAYER_NORM = ("top-k over the vocabulary of head_multiplier * W_head @ (final_norm_weight * (down[:, f] - "
                     "mean(down[:, f]))): the final LayerNorm's linear part applied to down column f, without its "
                     "1/std, its bias, the head's bias or softcap; ties to the lower id")


def _layers(layers: list[int]) -> str:
    return f"layer {layers[0]}" if len(layers) == 1 else f"layers {span_text(layers)}"


def method(ro) -> str:
    """The method text of a readout: the RMS one, or the LayerNorm one."""
    return METHOD_LAYER_NORM if ro.norm_kind == "layer" else METHOD


CHUNK = 256  # features per GEMM block: [CHUNK, vocab] float32 at a time

OnStale = Literal["rebuild", "refuse"]


class MetadataNote(BaseModel):
    """What a query's use of feature metadata involved: built now, rebuilt (and why), or read."""

    kind: Literal["feature_tokens"] = "feature_tokens"
    k: int
    source_digest: str
    layers: list[int]  # the layers the query read
    built_layers: list[int]  # built by this call
    build_seconds: float
    rebuilt: str | None = None  # why an existing entry was not used
    cached: bool = True  # False: could not be written into the container (kept in memory only)
    note: str | None = None

    def describe(self) -> str:
        parts = []
        if self.built_layers:
            parts.append(f"feature metadata built for layers {span_text(self.built_layers)} in {self.build_seconds:.2f}s")
        if self.rebuilt:
            parts.append(f"rebuilt: {self.rebuilt}")
        if not self.cached:
            parts.append(f"not cached in the container: {self.note}")
        return "; ".join(parts)


@numba.njit(cache=True)
def _topk_rows(y, k, ids, vals):  # pragma: no cover - compiled
    """Per row of y [n, V]: the k largest values, descending, ties to the lower column."""
    n, V = y.shape
    for r in range(n):
        cnt = 0
        for j in range(V):
            v = y[r, j]
            if cnt < k:
                p = cnt
                cnt += 1
            elif v > vals[r, k - 1]:
                p = k - 1
            else:
                continue
            while p > 0 and vals[r, p - 1] < v:
                vals[r, p] = vals[r, p - 1]
                ids[r, p] = ids[r, p - 1]
                p -= 1
            vals[r, p] = v
            ids[r, p] = j


def top_tokens(view: ModelView, values: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """values [hidden, n] -> (ids int32 [n, k], logits float32 [n, k]) through the readout
    described in the module docstring."""
    ro = view.readout
    centre = ro.norm_kind == "layer"
    n = values.shape[1]
    ids = np.zeros((n, k), dtype=np.int32)
    vals = np.zeros((n, k), dtype=np.float32)
    g = ro.norm_weight[:, None]
    for c0 in range(0, n, CHUNK):
        c1 = min(n, c0 + CHUNK)
        v = values[:, c0:c1]
        if centre:
            v = v - v.mean(axis=0, keepdims=True, dtype=np.float32)
        y = ro.head.mm(np.ascontiguousarray((v * g).T))  # [c, vocab]
        if ro.multiplier != 1:
            y = y * ro.multiplier
        _topk_rows(y, k, ids[c0:c1], vals[c0:c1])
    return ids, vals


class FeatureTokens:
    """A container's feature metadata, read from its sidecar or built when absent or stale."""

    def __init__(self, view: ModelView, *, k: int = DEFAULT_K, on_stale: OnStale = "rebuild",
                 progress: Progress | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_K:
            raise QueryRefused(f"feature metadata k must be an integer in 1..{MAX_K}, got {k!r}")
        if on_stale not in ("rebuild", "refuse"):
            raise QueryRefused(f"feature metadata on_stale must be 'rebuild' or 'refuse', got {on_stale!r}")
        self.view = view
        self.container = view.container
        self.k = k
        self.on_stale = on_stale
        self.progress = progress  # called (done, total, "layer i") as layers are built
        self.notice: Callable[[str], None] | None = None  # told in words when a build starts and when one is interrupted
        self.persist = True  # False: never write into the container (a read-only server), keep in memory
        self._mem: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # layer -> (ids, logits) at >= k
        self._cached = True
        self._note: str | None = None

    # -- the index entry -----------------------------------------------------------------------
    def entry(self) -> dict | None:
        from ..container import read_index

        e = read_index(self.container.path).get("derived", {}).get(KIND)
        return e if isinstance(e, dict) else None

    def _why_stale(self, e: dict) -> str | None:
        """Why an existing entry cannot serve this container at this k (None: it can)."""
        digest = self.container.digest
        if e.get("source_digest") != digest:
            return (f"the container changed since the feature metadata was built (source digest "
                    f"{str(e.get('source_digest'))[:12]}…, container now {digest[:12]}…)")
        if e.get("version") != VERSION or e.get("method") != method(self.view.readout):
            return f"it was built by method version {e.get('version')!r}; this build computes version {VERSION}"
        ek = (e.get("params") or {}).get("k")
        if not isinstance(ek, int) or ek < self.k:
            return f"it keeps the top {ek!r} tokens per feature and {self.k} were asked for"
        return None

    def status(self) -> dict:
        """A summary for SHOW-style statements: absent / fresh / stale, and which layers exist."""
        e = self.entry()
        if e is None:
            return {"kind": KIND, "state": "absent", "k": self.k}
        why = self._why_stale(e)
        return {"kind": KIND, "state": "stale" if why else "fresh", "why": why, "k": (e.get("params") or {}).get("k"),
                "layers": sorted(int(x) for x in (e.get("layers") or {})), "source_digest": e.get("source_digest")}

    # -- reading -------------------------------------------------------------------------------
    def ensure(self, layers: list[int]) -> MetadataNote:
        """Make the metadata of ``layers`` (FFN layers) available, building what is absent or
        stale; the note says what happened."""
        e = self.entry()
        rebuilt = None
        if e is not None:
            why = self._why_stale(e)
            if why is not None:
                if self.on_stale == "refuse":
                    raise DerivedStale(f"feature metadata in {self.container.path.name} is stale: {why}",
                                       hint="rebuild it (on_stale='rebuild'), which replaces derived/feature_tokens")
                rebuilt, e = why, None
                self._mem.clear()
        want = [i for i in layers if i not in self._mem]
        missing: list[int] = []
        unusable: dict[str, list[int]] = {}
        for i in want:
            got = self._read_layer(e, i) if e is not None else None
            if isinstance(got, str):  # present but unusable
                if self.on_stale == "refuse":
                    raise DerivedStale(f"feature metadata of layer {i} in {self.container.path.name}: "
                                       f"{got.replace('its file', f'{DIRECTORY}/layer_{i:04d}.npz')}",
                                       hint="rebuild it (on_stale='rebuild')")
                unusable.setdefault(got, []).append(i)
                missing.append(i)
            elif got is None:
                missing.append(i)
            else:
                self._mem[i] = got
        for why, ls in unusable.items():
            what = f"layer {ls[0]}" if len(ls) == 1 else f"layers {span_text(ls)}"
            rebuilt = (rebuilt + "; " if rebuilt else "") + f"{what}: {why}"
        seconds = 0.0
        # a kept entry may keep more than k tokens per feature; new layers join it at its k
        build_k = max(self.k, (e.get("params") or {}).get("k", 0)) if e is not None else self.k
        if missing:
            if self.notice is not None:
                self.notice(self._building_text(missing, rebuilt))
            t0 = time.perf_counter()
            built = {}
            try:
                for n, i in enumerate(missing, start=1):
                    t1 = time.perf_counter()
                    ffn = self.view.ffn_layer(i)
                    ids, logits = top_tokens(self.view, ffn.view.values, build_k)
                    built[i] = (ids, logits, time.perf_counter() - t1)
                    self._mem[i] = (ids, logits)
                    if self.progress is not None:
                        self.progress(n, len(missing), f"layer {i}")
            except BaseException:  # Ctrl-C (or a failure): the layers finished are kept, not thrown away
                if built and self.persist:
                    self._write(built, keep=e, k=build_k)
                    if self.notice is not None and self._cached:
                        self.notice(f"stopped: the feature metadata of {_layers(sorted(built))} built before it "
                                    f"is kept in {self.container.path.name}; the next statement builds the rest")
                raise
            seconds = time.perf_counter() - t0
            if self.persist:
                self._write(built, keep=e, k=build_k)
            else:
                self._cached, self._note = False, "this session does not write into the container (read-only)"
        return MetadataNote(k=self.k, source_digest=self.container.digest, layers=list(layers), built_layers=missing,
                            build_seconds=seconds, rebuilt=rebuilt, cached=self._cached, note=self._note)

    def _building_text(self, missing: list[int], rebuilt: str | None) -> str:
        why = f"rebuilt because {rebuilt}" if rebuilt else "first use"
        where = (f"kept in {self.container.path.name} for later statements" if self.persist
                 else "kept in memory only")
        return (f"building the feature metadata of {_layers(missing)} ({len(missing)} FFN "
                f"layer{'s' if len(missing) != 1 else ''}, {why}; {where})")

    def top(self, layer: int, k: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids [features, k], logits [features, k]) of an ensured layer."""
        ids, logits = self._mem[layer]
        k = self.k if k is None else k
        return ids[:, :k], logits[:, :k]

    def _read_layer(self, e: dict, i: int):
        """The layer's arrays, None when the entry has no such layer, or the reason it cannot be used."""
        rec = (e.get("layers") or {}).get(str(i))
        if rec is None:
            return None
        rel = rec.get("file")
        meta = (e.get("files") or {}).get(rel) if isinstance(rel, str) else None
        if meta is None:
            return "its index entry names no file"
        fp = self.container.path / rel
        if not fp.is_file():
            return "its file is missing"
        data = fp.read_bytes()
        if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            return "its file differs from the SHA-256 and size the index records (edited or damaged)"
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            ids, logits = z["ids"], z["logits"]
        ffn = self.view.ffn_layer(i)
        if ids.shape != logits.shape or ids.shape[0] != ffn.count or ids.shape[1] < self.k:
            return f"its file holds arrays of shape {list(ids.shape)}, not [{ffn.count}, >= {self.k}]"
        return ids, logits

    # -- writing -------------------------------------------------------------------------------
    def _write(self, built: dict[int, tuple[np.ndarray, np.ndarray, float]], keep: dict | None, k: int) -> None:
        """Write the layer files, then the index entry (last). A container that cannot be written
        keeps the metadata in memory only, and the note says so."""
        from ..container import read_index, rewrite_index
        from ..draft.machine import library_version

        root = self.container.path
        d = root / DIRECTORY
        try:
            if keep is None and d.exists():
                shutil.rmtree(d)  # a stale or absent entry: nothing in there is vouched for
            d.mkdir(parents=True, exist_ok=True)
            entry = dict(keep) if keep is not None else {}
            files = dict(entry.get("files") or {})
            layers = dict(entry.get("layers") or {})
            for i, (ids, logits, secs) in sorted(built.items()):
                rel = f"{DIRECTORY}/layer_{i:04d}.npz"
                buf = io.BytesIO()
                np.savez(buf, ids=ids, logits=logits)
                data = buf.getvalue()
                tmp = root / f"{rel}.tmp-{os.getpid()}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, root / rel)
                finally:
                    tmp.unlink(missing_ok=True)
                files[rel] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
                layers[str(i)] = {"file": rel, "features": int(ids.shape[0]), "seconds": round(secs, 4)}
            n_ffn = sum(1 for i in range(self.view.num_layers) if not isinstance(self.view.ffn_layer(i), SkippedLayer))
            built_layers = sorted(int(x) for x in layers)
            entry.update({
                "kind": KIND, "version": VERSION, "authority": "derived", "source_digest": self.container.digest,
                "params": {"k": k}, "method": method(self.view.readout), "built_by": f"vindex3 {library_version()}",
                "files": files, "layers": layers,
                "summary": f"top {k} tokens per feature, layers {span_text(built_layers)} ({len(built_layers)} of {n_ffn} FFN layers)",
            })
            derived = dict(read_index(root).get("derived") or {})
            derived[KIND] = entry
            rewrite_index(root, derived=derived)
            self.container.index = read_index(root)
        except OSError as e:
            self._cached, self._note = False, f"{type(e).__name__}: {e}"
            for empty in (d, d.parent):  # leave no empty directory behind
                try:
                    empty.rmdir()
                except OSError:
                    break
