"""Logit dumps with provenance.

A dump is two files: ``name.f32`` — raw little-endian float32, row-major ``[positions, vocab]``,
row i predicting token i+1 — and its sidecar ``name.meta.json`` (``Path(path).with_suffix(
".meta.json")``) saying where the numbers came from. The sidecar is written last, through a
temporary file and a rename, so its presence means the dump is complete; any stale sidecar is
removed before the data is touched. An existing dump is replaced only when the caller says
``overwrite=True``; a sidecar of another dump, or a file that is not a sidecar, is never replaced
or removed; nothing is written inside the open container.

The sidecar names the intervention the run carried (``intervention``: null for a clean run, else
what ``ABLATE FEATURES`` zeroed). A sidecar written before interventions existed has no such key
and comes from a clean run.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import jsonio
from ..errors import ConfigError, IntegrityError, PathRefused, VindexError
from ..paths import check_text, existing_file, hidden_sibling, output_file, read_regular
from .machine import blas_identity, library_version
from .slices import container_facts, decode_thread_count, make_executor, resolve_slice

FORMAT = "vindex3-logit-dump"
FORMAT_VERSION = 1
ENGINE = "vindex3"
BACKEND = "numpy"
LAYOUT = "float32 little-endian, row-major [positions, vocab]; row i predicts token i+1"

# Keys a sidecar must carry for a dump to be read or scored.
REQUIRED_KEYS = (
    "format", "format_version", "engine", "backend", "library_version", "container_digest",
    "component", "draft_depth", "executed_layers", "model_layers", "token_ids", "positions",
    "vocab", "prepare_seconds", "step_seconds", "ms_per_position", "numpy", "blas",
    "thread_count", "data_sha256",
)


def sidecar_path(path: str | os.PathLike) -> Path:
    """``file.f32`` → ``file.meta.json`` (the path is checked first: an empty name is refused by
    name, not by ``with_suffix``'s ValueError)."""
    p = check_text(path, "logit dump")
    if p.name in ("", ".", ".."):
        raise PathRefused(f"logit dump {str(path)!r}: names a directory, not a file", reason="not_a_file_name",
                          path=str(path))
    return p.with_suffix(".meta.json")


def decode_logits(st: Any, token_ids: Sequence[int]) -> np.ndarray:
    """Run ``token_ids`` through a fresh continuation state the way decoding does: a one-token
    prefill, then one step per further token. Returns float32 ``[positions, vocab]``."""
    first = np.asarray(st.prefill([int(token_ids[0])]))[-1]
    out = np.empty((len(token_ids), first.shape[-1]), dtype=np.float32)
    out[0] = first
    for i, tok in enumerate(token_ids[1:], start=1):
        out[i] = st.step(int(tok))
    return out


def _write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = hidden_sibling(path, f".tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the temporary file behind
        raise


def check_target(path: str | os.PathLike, *, overwrite: bool = False,
                 forbid_inside: Sequence[str | os.PathLike] = ()) -> tuple[Path, Path]:
    """Where a dump may be written, checked before any work: the data file and its sidecar are
    file names under an existing directory, outside every directory in ``forbid_inside`` (the
    open container), regular files if they exist, and replaced only with ``overwrite``. A sidecar
    that belongs to another dump (two data files can share one: ``a.f32`` and ``a.bin`` both
    have ``a.meta.json``) or is not a dump sidecar at all is never replaced. Returns (data, sidecar)."""
    p = output_file(path, "logit dump", overwrite=overwrite, forbid_inside=forbid_inside)
    side = sidecar_path(p)
    if side.exists() or side.is_symlink():
        owner = None
        try:
            meta = jsonio.load(side)
            if isinstance(meta, dict) and meta.get("format") == FORMAT:
                owner = meta.get("data_file")
        except ConfigError:
            pass
        if owner is None:
            raise PathRefused(f"the dump's sidecar {side} exists and is not a logit-dump sidecar; refusing to replace "
                              "an unrelated file", reason="exists", path=str(side), hint="choose another dump name")
        if owner != p.name:
            raise PathRefused(f"the dump's sidecar {side} belongs to another dump ({owner}); refusing to replace it",
                              reason="exists", path=str(side), hint="choose a dump name with another stem")
    output_file(side, "logit dump sidecar", overwrite=overwrite, forbid_inside=forbid_inside)
    return p, side


def write_dump(path: str | os.PathLike, logits: np.ndarray, meta: dict[str, Any], *, overwrite: bool = False,
               forbid_inside: Sequence[str | os.PathLike] = ()) -> dict[str, Any]:
    """Write the data, then the sidecar (last, atomically). Returns the sidecar as written.
    The target is checked first (`check_target`): an existing dump is replaced only with
    ``overwrite``, and its old sidecar is removed only then, so a stale sidecar never vouches
    for new data."""
    p, side = check_target(path, overwrite=overwrite, forbid_inside=forbid_inside)
    data = np.ascontiguousarray(logits, dtype="<f4").tobytes()
    side.unlink(missing_ok=True)
    _write_bytes_atomic(p, data)
    meta = dict(meta)
    meta["data_file"] = p.name
    meta["data_bytes"] = len(data)
    meta["data_sha256"] = hashlib.sha256(data).hexdigest()
    jsonio.write_atomic(side, meta)
    return meta


def dump_with(ex: Any, container: Any, token_ids: Sequence[int], path: str | os.PathLike, *,
              prepare_seconds: float, draft_depth: int | None, overwrite: bool = False,
              interventions: Sequence = (), adapter: dict | None = None) -> dict[str, Any]:
    """Dump through an already prepared executor (the ladder reuses one per depth). Nothing is
    written inside ``container``. ``interventions`` (`vindex3.exec.intervention.Patch`,
    `Steer`) change the run and are named in the sidecar (``interventions``, a key present only
    when there are some, so a clean dump's sidecar is as before)."""
    forbid = [container.path] if getattr(container, "path", None) is not None else []
    ids = [int(t) for t in token_ids]
    if not ids:
        raise VindexError("nothing to dump: the token id list is empty")
    check_target(path, overwrite=overwrite, forbid_inside=forbid)
    ex.check_positions(len(ids), f"a dump of {len(ids)} tokens")
    st = ex.start(interventions=interventions) if interventions else ex.start()
    t0 = time.perf_counter()
    logits = decode_logits(st, ids)
    step_seconds = time.perf_counter() - t0
    facts = container_facts(container)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "layout": LAYOUT,
        "engine": ENGINE,
        "backend": BACKEND,
        "library_version": library_version(),
        "container_digest": facts["digest"],
        "component": facts["component"],
        "draft_depth": draft_depth,
        "executed_layers": [int(i) for i in ex.trace.executed_layers],
        "model_layers": facts["num_layers"],
        "token_ids": ids,
        "positions": len(ids),
        "vocab": int(logits.shape[1]),
        "prepare_seconds": float(prepare_seconds),
        "step_seconds": step_seconds,
        "ms_per_position": step_seconds * 1000.0 / len(ids),
        "numpy": np.__version__,
        "blas": blas_identity(),
        "thread_count": decode_thread_count(),  # threads the decode passes ran with
        "intervention": ex.intervention.record() if ex.intervention is not None else None,
        "activations": getattr(ex, "activations", "exact"),  # how products treated activations
    }
    if interventions:
        meta["interventions"] = st.interventions
    if adapter is not None:  # a key present only with an adapter: a plain dump's sidecar is as before
        meta["adapter"] = adapter
    return write_dump(path, logits, meta, overwrite=overwrite, forbid_inside=forbid)


def dump_logits(container: Any, token_ids: Sequence[int], slice: Any, path: str | os.PathLike,
                intervention: Any = None, *, overwrite: bool = False, max_positions: int | None = None,
                activations: str = "exact", interventions: Sequence = (), adapter: Any = None) -> dict:
    """Dump the logits of ``token_ids`` under ``slice`` (``vindex3.Full()``, ``vindex3.Draft(n)``,
    or None for full) into ``path`` and its ``.meta.json`` sidecar; return the sidecar dict.
    ``intervention`` (a `vindex3.exec.intervention.FeatureAblation`) changes the run and is
    named in the sidecar, and so is ``activations`` ('exact' | 'q8', how int8 and q4 products
    treat activations). ``adapter`` (an `ExitAdapter` fitted at the draft's depth, or "stored":
    the one the container stores there, vindex3.draft.store) reads the draft's residual through
    the fitted exit adapter; the sidecar names it (``adapter``).

    The rows are computed through the incremental decode path (one-token prefill, then a step
    per token), which is what a drafter actually runs. The target is checked before anything
    runs: an existing file is replaced only with ``overwrite``, and nothing is written inside
    the container. Positions are limited to the model's context length unless ``max_positions``
    says otherwise.
    """
    forbid = [container.path] if getattr(container, "path", None) is not None else []
    check_target(path, overwrite=overwrite, forbid_inside=forbid)
    slice_obj, depth = resolve_slice(container, slice)
    ex, prepare_seconds = make_executor(container, slice_obj, intervention, max_positions, activations)
    record = None
    if adapter is not None:
        from .adapter import AdaptedReadout, check_adapter

        if depth is None:
            raise VindexError("an exit adapter reads a draft's residual; the full model has no adapter",
                              hint="dump a draft: DRAFT DEPTH d WITH ADAPTER")
        if isinstance(adapter, str):
            if adapter != "stored":
                raise VindexError(f"adapter must be an ExitAdapter or 'stored'; got {adapter!r}")
            from .store import load_adapter

            adapter = load_adapter(container, depth)
        check_adapter(container, depth, adapter)
        ex.readout = AdaptedReadout(ex.readout, adapter)
        f = adapter.facts
        record = {"key": f"drafter_adapter_d{f.depth}", "depth": f.depth, "ridge": f.ridge, "positions": f.positions,
                  "corpus": f.corpus, "corpus_sha256": f.corpus_sha256, "container_digest": f.container_digest,
                  "method": f.method}
    return dump_with(ex, container, token_ids, path, prepare_seconds=prepare_seconds, draft_depth=depth,
                     overwrite=overwrite, interventions=interventions, adapter=record)


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Read and check the sidecar of the dump at ``path``; refuse when it is absent or partial."""
    p = check_text(path, "logit dump")
    side = sidecar_path(p)
    if not side.is_file():
        raise IntegrityError(
            f"{p.name}: no sidecar {side.name} beside it, so the dump is incomplete or was not "
            f"written by DUMP LOGITS",
            hint="re-run DUMP LOGITS; the sidecar is written only after the data is complete",
        )
    try:
        meta = jsonio.load(side)
    except ConfigError as e:
        raise IntegrityError(f"{side.name}: unreadable sidecar: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise IntegrityError(f"{side.name}: not a logit-dump sidecar (format {found!r}, expected {FORMAT!r})")
    if meta.get("format_version") != FORMAT_VERSION:
        raise IntegrityError(
            f"{side.name}: logit-dump format version {meta.get('format_version')!r}; "
            f"this build reads version {FORMAT_VERSION}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in meta]
    if missing:
        raise IntegrityError(f"{side.name}: sidecar lacks {', '.join(missing)}")
    return meta


def read_dump(path: str | os.PathLike, *, meta: dict[str, Any] | None = None) -> tuple[dict, np.ndarray]:
    """Read a dump and its sidecar; the data must have exactly the size and SHA-256 the sidecar
    records. Returns ``(meta, logits [positions, vocab] float32)``."""
    p = check_text(path, "logit dump")
    meta = read_meta(p) if meta is None else meta
    try:
        existing_file(p, "logit dump")
    except PathRefused as e:
        if e.reason == "missing":
            raise IntegrityError(f"{p.name}: the data file named by {sidecar_path(p).name} is missing") from None
        raise
    rows, vocab = meta["positions"], meta["vocab"]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (rows, vocab)):
        raise IntegrityError(f"{sidecar_path(p).name}: positions and vocab must be non-negative integers, "
                             f"found {rows!r} and {vocab!r}")
    size = p.stat().st_size
    if size == rows * vocab * 4:
        data = read_regular(p, "logit dump", max_bytes=rows * vocab * 4)
        size = len(data)
    if size != rows * vocab * 4:
        raise IntegrityError(
            f"{p.name}: {size} bytes, but the sidecar declares {rows} positions × {vocab} vocab "
            f"× 4 = {rows * vocab * 4}"
        )
    digest = hashlib.sha256(data).hexdigest()
    if digest != meta["data_sha256"]:
        raise IntegrityError(
            f"{p.name}: data SHA-256 {digest[:16]}… differs from the sidecar's {str(meta['data_sha256'])[:16]}…"
        )
    return meta, np.frombuffer(data, dtype="<f4").reshape(rows, vocab)
