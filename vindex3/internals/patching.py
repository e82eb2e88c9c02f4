"""Activation patching sweeps and captures to a file, over an executor's stream interventions
(`vindex3.exec.intervention.Patch`) and its run-with-cache.

    rows = patch_sweep(ex, clean_ids, corrupted_ids, target, "residual", layers=[0, 1, 2])
    write_capture(ex, ids, ["residual", "mixer"], "acts.npz", provenance={...})
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Sequence

import numpy as np
from pydantic import BaseModel

from ..errors import QueryRefused
from ..exec.cache import wanted_sites
from ..exec.intervention import Patch, site_key


class SweepCell(BaseModel):
    layer: int
    position: int
    token_id: int  # the corrupted prompt's token at that position
    logit: float  # the target's logit at the last position, with the patch
    recovered: float | None  # (patched - corrupted) / (clean - corrupted); None when clean == corrupted


class SweepResult(BaseModel):
    site: str
    target_id: int
    clean_logit: float
    corrupted_logit: float
    layers: list[int]
    positions: int
    cells: list[SweepCell]
    passes: int  # prefills run: two whole (clean, corrupted) and one per cell, from the cell's layer on
    layer_runs: int  # layer executions of the cells' passes (a whole prefill per cell would be cells x layers)
    seconds: float


def patch_sweep(ex, clean: Sequence[int], corrupted: Sequence[int], target: int, site: str,
                layers: Sequence[int] | None = None) -> SweepResult:
    """Patch ``site`` of the corrupted run with the clean run's values, one (layer, position) at
    a time, and read the target's logit at the last position. Both prompts must have the same
    length; ``layers`` (None: every executed layer with the site) must have the site, by name."""
    t0 = time.perf_counter()
    clean, corrupted = [int(t) for t in clean], [int(t) for t in corrupted]
    if len(clean) != len(corrupted):
        raise QueryRefused(f"PATCH SWEEP: the clean prompt is {len(clean)} tokens and the corrupted one "
                           f"{len(corrupted)}; patching position by position needs the same length")
    if layers is None:
        keys = wanted_sites(ex.plan, ex.layers, [site], ex.slice.describe(), "PATCH SWEEP")
    else:
        keys = wanted_sites(ex.plan, ex.layers, [site_key(i, site) for i in layers], ex.slice.describe(), "PATCH SWEEP")
    if site == "heads":
        raise QueryRefused(f"PATCH SWEEP ... SITE HEADS at layer {keys[0][0]}: a sweep cell is one layer and position, "
                           "and a HEADS patch names heads too; sweep RESIDUAL, RESIDUAL POST, MIXER or FFN, and patch "
                           "heads with INFER ... PATCH HEADS h, ... AT LAYER n ...")
    cache = ex.run_with_cache(clean, sites=[site_key(i, s) for i, s in keys])
    clean_logit = float(cache["logits"][-1, target])
    # the corrupted run, keeping the residual entering each swept layer: a patch at layer L changes
    # nothing before L, so each cell runs from L on, on the corrupted residual there
    entering = ex.run_with_cache(corrupted, sites=sorted({site_key(i, "residual") for i, _ in keys}))
    corrupted_logit = float(entering["logits"][-1, target])
    span = clean_logit - corrupted_logit
    cells = []
    runs = 0
    for layer, s in keys:
        vals = cache[site_key(layer, s)]
        rest = _from_layer(ex, layer)
        for p in range(len(corrupted)):
            patch = Patch(s, layer, (p,), vals[p:p + 1], source="clean")
            if rest is None:  # the slice's layers after this one are not one run of layers
                got = float(ex.start(interventions=[patch]).prefill(corrupted, last_only=True)[-1, target])
                runs += len(ex.layers)
            else:
                h = rest.start(interventions=[patch]).prefill_hidden(entering[site_key(layer, "residual")])
                got = float(ex.readout(h[-1:])[-1, target])
                runs += len(rest.layers)
            cells.append(SweepCell(layer=layer, position=p, token_id=corrupted[p], logit=got,
                                   recovered=(got - corrupted_logit) / span + 0.0 if span != 0 else None))  # + 0.0: never -0.0
    return SweepResult(site=site, target_id=int(target), clean_logit=clean_logit, corrupted_logit=corrupted_logit,
                       layers=[i for i, _ in keys], positions=len(corrupted), cells=cells, passes=2 + len(cells),
                       layer_runs=runs, seconds=time.perf_counter() - t0)


def _from_layer(ex, layer: int):
    """An executor over the same prepared operands running ``ex``'s layers from ``layer`` on
    (hidden states in and out, the same kernels, so the same bytes), or None when those layers
    are not one contiguous run."""
    from ..exec.engine import Executor
    from ..exec.slice import LayerRange

    k = ex.layers.index(layer)
    tail = list(ex.layers[k:])
    if tail != list(range(layer, tail[-1] + 1)) or not ex.has_ends:
        return None
    return Executor(ex.plan, ex.prepared, LayerRange(layer, tail[-1] + 1), ex.intervention, max_positions=ex.max_positions,
                    activations=ex.activations)


class CaptureResult(BaseModel):
    path: str
    sidecar: str
    arrays: list[str]
    bytes: int
    positions: int
    seconds: float


CAPTURE_FORMAT = "vindex3-capture"


def write_capture(ex, ids: Sequence[int], sites: Sequence[str], path: str | os.PathLike, *,
                  provenance: dict, overwrite: bool = False, forbid_inside=(), interventions=()) -> CaptureResult:
    """One prefill of ``ids`` with its values at ``sites`` (keys or bare site names) written to an
    ``.npz`` (``"L3.residual"`` -> [positions, hidden] float32, ``token_ids``) and a
    ``.meta.json`` sidecar naming the container, the run, its ``interventions`` (Patch, Steer:
    the run is made under them, and the sidecar's ``interventions`` names them: empty for a clean run) and the
    data's SHA-256. The sidecar is written last."""
    import hashlib

    from ..paths import hidden_sibling, output_file

    t0 = time.perf_counter()
    p = output_file(path, "CAPTURE INTO", overwrite=overwrite, forbid_inside=forbid_inside)
    side = p.with_suffix(".meta.json")
    output_file(side, "CAPTURE INTO sidecar", overwrite=overwrite, forbid_inside=forbid_inside)
    ids = [int(t) for t in ids]
    cache = ex.run_with_cache(ids, sites=sites, interventions=interventions)
    cache.pop("logits")
    arrays = {**cache, "token_ids": np.asarray(ids, dtype=np.int64)}
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    data = buf.getvalue()
    meta = {"format": CAPTURE_FORMAT, "format_version": 1, **provenance, "token_ids": ids,
            "slice": ex.slice.describe(), "executed_layers": [int(i) for i in ex.layers],
            "interventions": [iv.record() for iv in interventions],
            "sites": sorted(cache), "data_sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    for target, body in ((p, data), (side, json.dumps(meta, indent=1, sort_keys=True).encode())):
        tmp = hidden_sibling(target, f".tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return CaptureResult(path=str(p), sidecar=str(side), arrays=sorted(arrays), bytes=len(data), positions=len(ids),
                         seconds=time.perf_counter() - t0)
