"""DIFF: how two containers differ, split into what changes the model and what does not.

* **logical** — what the model computes and how it is addressed: the graph (components,
  objects, per-layer operators and their facts, the execution surface), the objects' tensors
  (names and shapes) and the capability files (a different tokenizer is a different model to a
  user). Two containers that differ here are different models.
* **physical** — how the same logical tensors are stored: each object's representation and each
  tensor's encoding, the bytes of tensors stored in the same encoding, segment files and sizes.
  An f32 container and its int8 representation differ only here: logically identical.
* **metadata** — what describes the container without changing either: generation, model name,
  authority, provenance, derived representations, keys this build does not know.

It reads indexes, graphs and segment headers only (no tensor data); tensor bytes are compared
through the per-tensor hashes the indexes record (through payload hashes for containers written
before those existed). `relation` says when one container's provenance records the other as its
source (a REPRESENT or COMPACT of it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .container import Container
from .text import runs


class Difference(BaseModel):
    area: str  # graph, operators, objects, capabilities | encodings, values, segments | generation, model, ...
    what: str
    a: Any = None
    b: Any = None


class DiffReport(BaseModel):
    a: str
    b: str
    logical: list[Difference]
    physical: list[Difference]
    metadata: list[Difference]
    relation: str | None = None

    @property
    def logically_identical(self) -> bool:
        return not self.logical

    @property
    def physically_identical(self) -> bool:
        return not self.physical

    @property
    def verdict(self) -> str:
        if self.logical:
            return "logically different"
        if self.physical:
            return "logically identical, physically different"
        return "identical" if not self.metadata else "identical but for metadata"


def _short(v: Any, n: int = 80) -> Any:
    s = repr(v)
    return v if len(s) <= n else s[: n - 1] + "…"



def _dict_diff(a: dict, b: dict, prefix: str, area: str, out: list[Difference]) -> None:
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k, "<absent>"), b.get(k, "<absent>")
        if va != vb:
            if isinstance(va, dict) and isinstance(vb, dict):
                _dict_diff(va, vb, f"{prefix}{k}.", area, out)
            else:
                out.append(Difference(area=area, what=f"{prefix}{k}", a=_short(va), b=_short(vb)))


LAYER_OPERATOR_KEYS = ("operator", "ffn")


def _graph(ga: dict, gb: dict, out: list[Difference]) -> None:
    for k in sorted(set(ga) | set(gb)):
        if k == "layers" or ga.get(k) == gb.get(k):
            continue
        area = "objects" if k == "objects" else "graph"
        va, vb = ga.get(k), gb.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            _dict_diff(va, vb, f"{k}.", area, out)
        else:
            out.append(Difference(area=area, what=k, a=_short(va), b=_short(vb)))
    la, lb = ga.get("layers") or [], gb.get("layers") or []
    if len(la) != len(lb):
        out.append(Difference(area="graph", what="layers", a=len(la), b=len(lb)))
    # per field, the layers where it differs, grouped by (old, new)
    groups: dict[tuple[str, str, str], list[int]] = {}
    for i, (x, y) in enumerate(zip(la, lb)):
        for k in sorted(set(x) | set(y)):
            if x.get(k) != y.get(k):
                groups.setdefault((k, repr(x.get(k)), repr(y.get(k))), []).append(i)
    for (k, va, vb), idx in sorted(groups.items(), key=lambda kv: (kv[1][0], kv[0][0])):
        area = "operators" if k in LAYER_OPERATOR_KEYS else "graph"
        out.append(Difference(area=area, what=f"layers {runs(idx)}: {k}", a=_short(va), b=_short(vb)))


def diff(a: str | Path, b: str | Path) -> DiffReport:
    """Compare the containers at ``a`` and ``b`` (both opened, so both must be valid)."""
    ca, cb = Container(a), Container(b)
    logical: list[Difference] = []
    physical: list[Difference] = []
    meta: list[Difference] = []

    # -- logical ------------------------------------------------------------------------------
    if ca.manifest.graph.sha256 != cb.manifest.graph.sha256:
        _graph(ca.graph.raw, cb.graph.raw, logical)
        if not logical:  # the same values written differently: still a different file
            logical.append(Difference(area="graph", what="system_graph.json bytes", a=ca.manifest.graph.sha256[:16],
                                      b=cb.manifest.graph.sha256[:16]))
    oa, ob = set(ca.segments), set(cb.segments)
    for o in sorted(oa ^ ob):
        logical.append(Difference(area="objects", what=f"object {o}", a="present" if o in oa else "absent",
                                  b="present" if o in ob else "absent"))
    for o in sorted(oa & ob):
        ea, eb = ca.segments[o].entries, cb.segments[o].entries
        for t in sorted(set(ea) ^ set(eb)):
            logical.append(Difference(area="objects", what=f"tensor {o}/{t}", a="present" if t in ea else "absent",
                                      b="present" if t in eb else "absent"))
        for t in sorted(set(ea) & set(eb)):
            if ea[t].shape != eb[t].shape:
                logical.append(Difference(area="objects", what=f"tensor {o}/{t} shape", a=list(ea[t].shape),
                                          b=list(eb[t].shape)))
    capa, capb = ca.manifest.capabilities, cb.manifest.capabilities
    for name in sorted(set(capa) | set(capb)):
        x, y = capa.get(name), capb.get(name)
        if x is None or y is None or x.sha256 != y.sha256:
            logical.append(Difference(area="capabilities", what=name, a=x.sha256[:16] if x else "absent",
                                      b=y.sha256[:16] if y else "absent"))

    # -- physical -----------------------------------------------------------------------------
    for o in sorted(oa & ob):
        ra, rb = ca._reps[o], cb._reps[o]
        key_a, key_b = f"{o}@{ra.encoding}", f"{o}@{rb.encoding}"
        if key_a != key_b:
            physical.append(Difference(area="encodings", what=f"{o} representation", a=key_a, b=key_b))
        ea, eb = ca.segments[o].entries, cb.segments[o].entries
        changes: dict[tuple[str, str], int] = {}
        same_enc_differs = 0
        for t in sorted(set(ea) & set(eb)):
            if ea[t].dtype != eb[t].dtype:
                changes[(ea[t].dtype, eb[t].dtype)] = changes.get((ea[t].dtype, eb[t].dtype), 0) + 1
            elif ra.tensor_sha256 is not None and rb.tensor_sha256 is not None:
                same_enc_differs += ra.tensor_sha256.get(t) != rb.tensor_sha256.get(t)
        for (x, y), n in sorted(changes.items()):
            physical.append(Difference(area="encodings", what=f"{o}: {n} tensor(s)", a=x, b=y))
        if same_enc_differs:
            physical.append(Difference(area="values", what=f"{o}: {same_enc_differs} tensor(s) hold other bytes in "
                                                            "the same encoding", a="", b=""))
        elif not changes and (ra.tensor_sha256 is None or rb.tensor_sha256 is None) and ra.payload_sha256 != rb.payload_sha256:
            physical.append(Difference(area="values", what=f"{o}: payload bytes", a=ra.payload_sha256[:16],
                                       b=rb.payload_sha256[:16]))
        if ra.segment != rb.segment:
            physical.append(Difference(area="segments", what=f"{o} segment file", a=ra.segment, b=rb.segment))
        if ra.payload_bytes != rb.payload_bytes:
            physical.append(Difference(area="segments", what=f"{o} payload bytes", a=ra.payload_bytes, b=rb.payload_bytes))

    # -- metadata -----------------------------------------------------------------------------
    ia, ib = ca.index, cb.index
    for k in ("generation", "authority", "profiles"):
        if ia.get(k) != ib.get(k):
            meta.append(Difference(area=k, what=k, a=ia.get(k), b=ib.get(k)))
    _dict_diff(ia.get("model") or {}, ib.get("model") or {}, "model.", "model", meta)
    pa, pb = ia.get("provenance") or {}, ib.get("provenance") or {}
    for k in sorted(set(pa) | set(pb)):
        if pa.get(k) != pb.get(k):
            meta.append(Difference(area="provenance", what=f"provenance.{k}",
                                   a="absent" if k not in pa else "recorded", b="absent" if k not in pb else "recorded"))
    known = {"format", "version", "generation", "model", "authority", "profiles", "graph", "representations",
             "segments", "capabilities", "provenance", "index_sha256"}
    for k in sorted((set(ia) | set(ib)) - known):
        if ia.get(k) != ib.get(k):
            meta.append(Difference(area="other", what=k, a="absent" if k not in ia else "recorded",
                                   b="absent" if k not in ib else "recorded"))

    relation = None
    for x, y, nx, ny in ((ca, cb, "a", "b"), (cb, ca, "b", "a")):
        for step in ("representation", "compacted"):
            rec = y.provenance.get(step)
            src = rec.get("source") if isinstance(rec, dict) else None
            if isinstance(src, dict) and src.get("digest") == x.digest:
                what = "a representation" if step == "representation" else "a compacted copy"
                enc = f" ({rec.get('encoding')})" if step == "representation" else ""
                relation = f"{ny} is {what}{enc} of {nx}: its provenance records {nx}'s digest"
    return DiffReport(a=str(ca.path), b=str(cb.path), logical=logical, physical=physical, metadata=meta, relation=relation)
