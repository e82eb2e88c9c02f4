"""Run with cache: one prefill whose values at named sites (`vindex3.exec.intervention.SITES`)
are kept and returned keyed ``"L12.residual"``. The values come from the executor's `Observer`
hook, so a cached run is the run itself: the same bytes as an unobserved one."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..errors import QueryRefused
from .engine import Observer
from .intervention import SITES, Patch, check_site, heads_op, parse_site_key, site_key


def wanted_sites(plan, executed: list[int], sites: Iterable[str], slice_desc: str,
                 what: str = "CAPTURE") -> list[tuple[int, str]]:
    """(layer, site) pairs in layer order: a key names one (refused by name when the layer lacks
    it or the slice does not run it), a bare site name every executed layer that has it."""
    if isinstance(sites, str):
        sites = [sites]
    out: list[tuple[int, str]] = []
    ran = set(executed)
    for s in sites:
        name = str(s).strip().lower().replace(" ", "_")
        if name in SITES:
            pairs = []
            for i in executed:
                try:
                    check_site(plan, i, name, what)
                except QueryRefused:
                    continue
                pairs.append((i, name))
            if not pairs:
                ops = sorted({plan.layers[i].operator for i in executed})
                raise QueryRefused(f"{what}: no layer that the {slice_desc} executes has a {name.upper()} site "
                                   f"(its layers are {', '.join(ops)} layers)")
            out += pairs
            continue
        layer, name = parse_site_key(s)
        check_site(plan, layer, name, f"{what} {s}")
        if layer not in ran:
            raise QueryRefused(f"{what} {s} names layer {layer}, which {slice_desc} does not execute")
        out.append((layer, name))
    for layer, name in out:
        if name == "heads":
            heads_op(plan, layer, f"{what} L{layer}.heads")
    return sorted(set(out), key=lambda p: (p[0], SITES.index(p[1])))


class _Keep(Observer):
    """An observer keeping the asked-for sites."""

    def __init__(self, want: list[tuple[int, str]]):
        self.want = set(want)
        self.values: dict[str, np.ndarray] = {}

    def _keep(self, layer, site, a):
        if (layer, site) in self.want:
            self.values[site_key(layer, site)] = np.array(a, dtype=np.float32, copy=True)

    def enter(self, layer, p0, h):
        self._keep(layer, "residual", h)

    def leave(self, layer, p0, h):
        self._keep(layer, "residual_post", h)

    def write(self, layer, site, p0, write, residual):
        self._keep(layer, site, write)

    def slot_input(self, layer, site, p0, x):
        if site == "mixer" and (layer, "heads") in self.want:
            self.values[f"L{layer}.mixer_input"] = x


def cache_run(ex, token_ids, sites, interventions=()) -> dict[str, np.ndarray]:
    want = wanted_sites(ex.plan, ex.layers, sites, ex.slice.describe())
    keep = _Keep(want)
    st = ex.start(observer=keep, interventions=interventions)
    if st.edits is not None:  # one prefill: a patch past the prompt would never apply
        st.edits.check_within(len(token_ids), "run_with_cache()")
    logits = st.prefill(token_ids)
    if any(s == "heads" for _, s in want):
        from ..internals.attention import replay_attention

        for layer, s in want:
            if s == "heads":  # [T, heads, head_dim]: the layer's own kernel on the input the run gave it
                x = keep.values.pop(f"L{layer}.mixer_input")
                heads = replay_attention(ex, layer, x, "CAPTURE")[1]
                for iv in interventions or ():  # a HEADS patch there: the values the projection read
                    if isinstance(iv, Patch) and iv.site == "heads" and iv.layer == layer:
                        for r, pos in enumerate(iv.positions):
                            heads[pos, list(iv.heads)] = iv.source_values[r]
                keep.values[site_key(layer, s)] = heads
    out = {site_key(layer, s): keep.values[site_key(layer, s)] for layer, s in want}
    out["logits"] = np.asarray(logits)
    return out
