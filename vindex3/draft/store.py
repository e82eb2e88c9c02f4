"""Drafter components stored in the container: fitted exit adapters and vocabulary cuts written as
derived representations with their provenance, and read back when a drafter needs them.

A drafter is wired to the primary text model by a hidden-state edge: an exit adapter at depth d
reads the residual after layer d - 1 (what Draft(d) hands its final norm), a vocabulary cut reads
the same residual and keeps k head rows. On disk:

* ``derived/drafters/<key>.npz`` — the arrays (an adapter's ``W`` [hidden, hidden] and ``b``
  [hidden], float32; a cut's ``kept`` int64 [k]);
* index.json ``derived.<key>`` — kind, version, role ``drafter``, the edge, the source
  container's digest, the fit's parameters and figures (corpus name and digest, positions,
  ridge, fit residual; or the counted tokens and kept share), the method, the file's SHA-256
  and size. Written last, so a failed write leaves no entry that names a missing file.

Listing reads index.json only (`components`); `load_adapter` / `load_vocab_cut` read the file and
refuse by name what is absent, stale (fitted on another container, or by another method
version) or damaged (size or SHA-256 differs). The container's digest does not change.
"""

from __future__ import annotations

import hashlib
import io
import os
from typing import Any

import numpy as np

from ..errors import DerivedStale, OutputRefused, VindexError
from .adapter import AdapterFacts, ExitAdapter
from .slices import open_container
from .vocab import VocabCut

VERSION = 1
DIRECTORY = "derived/drafters"
ADAPTER = "exit_adapter"
VOCAB = "vocab_cut"


def adapter_key(depth: int) -> str:
    return f"drafter_adapter_d{int(depth)}"


def vocab_key(k: int) -> str:
    return f"drafter_vocab_top{int(k)}"


def components(container: Any) -> list[dict[str, Any]]:
    """The drafter components the container records (index.json only, no file read): key, kind,
    edge, parameters, summary, whether they were derived from this container as it is, the
    SHA-256 the index records for the component's file and the fit's method."""
    c = open_container(container)
    out = []
    for key, e in sorted((c.index.get("derived") or {}).items()):
        if isinstance(e, dict) and e.get("role") == "drafter":
            files = e.get("files") or {}
            meta = files.get(f"{DIRECTORY}/{key}.npz")
            out.append({"key": key, "kind": e.get("kind"), "edge": e.get("edge"), "params": e.get("params") or {},
                        "summary": e.get("summary"), "fresh": e.get("source_digest") == c.digest,
                        "sha256": meta.get("sha256") if isinstance(meta, dict) else None,
                        "method": e.get("method")})
    return out


def _write(c: Any, key: str, kind: str, arrays: dict[str, np.ndarray], *, edge: dict, params: dict, method: str,
           summary: str) -> dict:
    from ..container import read_index, rewrite_index
    from .machine import library_version

    root = c.path
    rel = f"{DIRECTORY}/{key}.npz"
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    tmp = root / f"{rel}.tmp-{os.getpid()}"
    try:
        (root / DIRECTORY).mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, root / rel)
        finally:
            tmp.unlink(missing_ok=True)
        entry = {"kind": kind, "version": VERSION, "authority": "derived", "role": "drafter", "edge": edge,
                 "source_digest": c.digest, "params": params, "method": method,
                 "built_by": f"vindex3 {library_version()}",
                 "files": {rel: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}}, "summary": summary}
        derived = dict(read_index(root).get("derived") or {})
        derived[key] = entry
        rewrite_index(root, derived=derived)  # last: the entry names a file that exists
    except OSError as e:
        raise OutputRefused(f"cannot store drafter component {key!r} in {root.name}: {type(e).__name__}: {e}",
                            hint="a read-only container keeps no derived data; copy it somewhere writable") from None
    c.index = read_index(root)
    return entry


def _edge(depth: int) -> dict:
    return {"kind": "hidden_state", "component": "primary_text", "after_layer": int(depth) - 1, "depth": int(depth)}


def store_adapter(container: Any, adapter: ExitAdapter) -> dict:
    """Write ``adapter`` (fitted on this container) as the drafter component at its depth,
    replacing any earlier one there. Returns the index entry."""
    c = open_container(container)
    adapter.check(c)
    f = adapter.facts
    params = {k: v for k, v in f.model_dump().items() if k not in ("container_digest", "method")}
    return _write(c, adapter_key(f.depth), ADAPTER, {"W": adapter.W, "b": adapter.b}, edge=_edge(f.depth),
                  params=params, method=f.method,
                  summary=(f"exit adapter at depth {f.depth}: ridge {f.ridge:g} on {f.positions} positions of "
                           f"{f.corpus!r}, fit residual {f.fit_residual:.4f} (identity {f.identity_residual:.4f})"))


def store_vocab_cut(container: Any, cut: VocabCut, depth: int | None = None) -> dict:
    """Write ``cut`` as a drafter component (one per k; the edge names ``depth`` when given)."""
    c = open_container(container)
    cut.check(c)
    params = {k: v for k, v in cut.model_dump().items() if k not in ("kept", "container_digest", "method")}
    edge = _edge(depth) if depth is not None else {"kind": "hidden_state", "component": "primary_text",
                                                   "after_layer": None, "depth": None}
    return _write(c, vocab_key(cut.k), VOCAB, {"kept": cut.ids()}, edge=edge, params=params, method=cut.method,
                  summary=(f"vocabulary cut: top {cut.k} of {cut.vocab} tokens by count over {cut.tokens_counted} "
                           f"tokens of {cut.corpus!r} (kept share {cut.kept_share:.3f})"))


def _read(c: Any, key: str, kind: str, what: str, hint: str) -> tuple[dict, dict[str, np.ndarray]]:
    e = (c.index.get("derived") or {}).get(key)
    if not isinstance(e, dict) or e.get("kind") != kind:
        have = ", ".join(x["key"] for x in components(c)) or "none"
        raise VindexError(f"{c.path.name} stores no {what} (derived {key!r}; drafter components stored: {have})",
                          hint=hint)
    if e.get("source_digest") != c.digest:
        raise DerivedStale(f"the stored {what} was derived from container {str(e.get('source_digest'))[:12]}…, not this "
                           f"one ({c.digest[:12]}…)", hint=hint)
    if e.get("version") != VERSION:
        raise DerivedStale(f"the stored {what} was written by format version {e.get('version')!r}; this build reads "
                           f"version {VERSION}", hint=hint)
    files = e.get("files") or {}
    rel = f"{DIRECTORY}/{key}.npz"
    meta = files.get(rel)
    fp = c.path / rel
    if not isinstance(meta, dict) or not fp.is_file():
        raise DerivedStale(f"the stored {what}'s file {rel} is missing", hint=hint)
    data = fp.read_bytes()
    if len(data) != meta.get("bytes") or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise DerivedStale(f"the stored {what}'s file {rel} differs from the SHA-256 and size the index records "
                           "(edited or damaged)", hint=hint)
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        return e, {k: z[k] for k in z.files}


def load_adapter(container: Any, depth: int) -> ExitAdapter:
    """The exit adapter stored at ``depth``, checked against this container."""
    c = open_container(container)
    e, a = _read(c, adapter_key(depth), ADAPTER, f"exit adapter at depth {depth}",
                 f"fit one: FIT ADAPTER AT DEPTH {depth}")
    facts = AdapterFacts(**{**e["params"], "container_digest": e["source_digest"], "method": e["method"]})
    H = int(c.graph.hidden_size)
    W, b = a.get("W"), a.get("b")
    if W is None or b is None or W.shape != (H, H) or b.shape != (H,) or W.dtype != np.float32 or b.dtype != np.float32:
        raise DerivedStale(f"the stored exit adapter at depth {depth} does not hold float32 W [{H}, {H}] and b [{H}]",
                           hint=f"fit it again: FIT ADAPTER AT DEPTH {depth}")
    return ExitAdapter(W, b, facts)


def load_vocab_cut(container: Any, k: int) -> VocabCut:
    """The vocabulary cut of the ``k`` most frequent tokens stored in the container."""
    c = open_container(container)
    e, a = _read(c, vocab_key(k), VOCAB, f"vocabulary cut of {k} tokens", f"count one: FIT VOCAB CUT TOP {k}")
    kept = a.get("kept")
    if kept is None or kept.ndim != 1 or kept.size != k:
        raise DerivedStale(f"the stored vocabulary cut of {k} tokens does not hold {k} kept ids")
    return VocabCut(**{**e["params"], "kept": [int(x) for x in kept], "container_digest": e["source_digest"],
                       "method": e["method"]})
