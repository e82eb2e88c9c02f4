"""What an overlay changes, and the overlay that turns one container into another.

    changes(model)           # per tensor an EditedModel's patches change: layer, edits, |Δ|, rank
    patch_between(a, b, name)  # a Patch that, applied on a, serves b's tensor values exactly

`changes` compares the overlay's arrays with the base's (float32, as the executor reads them).
The rank it reports counts the delta's singular values above the float32 rounding bound
eps32 * (|W|_F + |W'|_F): an error of at most eps32 * |w| per element has a spectral norm below
that, so anything larger is a change, not the subtraction's rounding.

`patch_between` stores the replaced values whole (rows or columns, whichever is fewer values), not
their deltas: setting a row to b's float32 values is exact where adding a delta would round, so
the patched model reads b's tensors byte for byte and its logits are b's bit for bit. It refuses
by name containers that differ in anything but tensor values (graph, tensor shapes, capabilities
such as the tokenizer, encodings) and tensors a patch cannot write (outside the layers, 1-D, or
stored in an encoding other than f32)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydantic import BaseModel

from ..errors import QueryRefused
from .overlay import Edit, EditedModel, Patch, TensorWrite

F32 = np.float32


class TensorChange(BaseModel):
    """One tensor an overlay changes."""

    label: str  # object/tensor
    layer: int | None  # the op-plan layer that reads it (None: outside the layers)
    modes: list[str]  # the writing edits' modes, as labelled
    edits: list[str]  # "patch#id" of every edit that writes it
    shape: tuple[int, ...]
    rows: int  # rows holding a changed value
    cols: int  # columns holding a changed value
    frobenius: float  # |W' - W|_F
    relative: float  # |W' - W|_F / |W|_F
    max_abs: float
    rank: int  # singular values of the delta above the float32 rounding bound (module docstring)
    rank_bound: int  # what the writes allow: rows/columns set plus low-rank terms' ranks


def _layer_of(plan) -> dict[str, int]:
    return {r.label: lo.index for lo in plan.layers for r in lo.operands()}


def _rank(delta: np.ndarray, before: np.ndarray, after: np.ndarray) -> int:
    if not delta.any():
        return 0
    s = np.linalg.svd(delta, compute_uv=False)
    tol = np.finfo(F32).eps * (float(np.linalg.norm(before)) + float(np.linalg.norm(after)))
    return int(np.count_nonzero(s > tol))


def changes(model: EditedModel) -> list[TensorChange]:
    """Every tensor the overlay's patches change, in layer then label order."""
    arrays = model.overrides()
    plan = model.base.op_plan()
    refs = {r.label: r for lo in plan.layers for r in lo.operands()}
    layer = _layer_of(plan)
    src = model.base.tensor_source()
    writers: dict[str, list[tuple[str, Edit]]] = {}
    for p in model.patches:
        for e in p.edits:
            for w in e.writes:
                lst = writers.setdefault(w.label, [])
                if not any(x is e for _, x in lst):
                    lst.append((p.name, e))
    out = []
    for label, after in arrays.items():
        before = np.asarray(src.weight(refs[label]).dense(), dtype=F32)
        delta = after - before  # float32, as the executor's arrays are
        bound = 0
        for _, e in writers.get(label, []):
            for w in e.writes:
                if w.label == label:
                    bound += w.rank if w.op == "add_lowrank" else 1
        nb = float(np.linalg.norm(before))
        fro = float(np.linalg.norm(delta))
        changed = delta != 0
        out.append(TensorChange(
            label=label, layer=layer.get(label), modes=sorted({e.label for _, e in writers.get(label, [])}),
            edits=[f"{p}#{e.id}" for p, e in writers.get(label, [])], shape=tuple(after.shape),
            rows=int(changed.any(axis=1).sum()), cols=int(changed.any(axis=0).sum()), frobenius=fro,
            relative=fro / nb if nb else float("inf"), max_abs=float(np.abs(delta).max(initial=0.0)),
            rank=min(_rank(delta, before, after), min(delta.shape)), rank_bound=min(bound, min(delta.shape))))
    out.sort(key=lambda c: (c.layer if c.layer is not None else -1, c.label))
    return out


def patch_between(a: str | Path, b: str | Path, name: str) -> tuple[Patch, list[TensorChange]]:
    """A patch bound to ``a`` whose overlay reads ``b``'s tensor values (see the module docstring)."""
    from ..container import Container
    from ..diff import diff

    report = diff(a, b)
    if report.logical:
        d = report.logical[0]
        raise QueryRefused(f"DIFF INTO PATCH: {a} and {b} differ in more than tensor values ({d.area}: {d.what}: "
                           f"{d.a!r} against {d.b!r}); a patch only replaces tensor values",
                           hint="DIFF 'a' 'b' lists every difference")
    enc = [d for d in report.physical if d.area == "encodings"]
    if enc:
        raise QueryRefused(f"DIFF INTO PATCH: {a} and {b} store tensors in other encodings ({enc[0].what}: "
                           f"{enc[0].a} against {enc[0].b}); the patch would not reproduce b's kernels bit for bit",
                           hint="diff containers in the same encoding (REPRESENT them alike first)")
    ca, cb = Container(a), Container(b)
    pa, pb = ca.op_plan(), cb.op_plan()
    sa, sb = ca.tensor_source(), cb.tensor_source()
    layer = _layer_of(pa)
    ends = {r.label: r for op in pa.end_ops for r in op.operands.values()}
    refs_b = {r.label: r for lo in pb.layers for r in lo.operands()}
    refs_b.update({r.label: r for op in pb.end_ops for r in op.operands.values()})
    patch = Patch(name=name, base_digest=ca.digest, base_name=ca.name,
                  provenance={"base": ca.name, "base_digest": ca.digest, "diffed_from": {"name": cb.name, "digest": cb.digest},
                              "how": "the tensors that differ, their values stored whole (rows or columns)"})
    seen: set[str] = set()
    refs_a = [r for lo in pa.layers for r in lo.operands()] + list(ends.values())
    for ref in refs_a:
        if ref.label in seen:
            continue
        seen.add(ref.label)
        x = np.asarray(sa.weight(ref).dense(), dtype=F32)
        y = np.asarray(sb.weight(refs_b[ref.label]).dense(), dtype=F32)
        if np.array_equal(x.view(np.uint32), y.view(np.uint32)):
            continue
        if ref.label in ends and ref.label not in layer:
            raise QueryRefused(f"DIFF INTO PATCH: {ref.label} differs, and a patch writes only the layers' tensors "
                               "(not the embedding, final norm or head)")
        if x.ndim != 2:
            raise QueryRefused(f"DIFF INTO PATCH: {ref.label} differs and is {x.ndim}-D; a patch writes rows and "
                               "columns of matrices")
        if ref.dtype != "f32":
            raise QueryRefused(f"DIFF INTO PATCH: {ref.label} differs and is stored as {ref.dtype}; a patch stores "
                               "float32 values, which reproduce only an f32 tensor bit for bit")
        ne = x.view(np.uint32) != y.view(np.uint32)
        rows, cols = np.nonzero(ne.any(axis=1))[0], np.nonzero(ne.any(axis=0))[0]
        obj, tensor = ref.object, ref.tensor
        if len(cols) * x.shape[0] < len(rows) * x.shape[1]:
            writes = [TensorWrite.col(obj, tensor, x.shape, int(j), y[:, j]) for j in cols]
        else:
            writes = [TensorWrite.row(obj, tensor, x.shape, int(i), y[i]) for i in rows]
        patch.edits.append(Edit(id=patch.next_id(), mode="values", layers=[layer[ref.label]], writes=writes,
                                fit={"from": cb.name, "from_digest": cb.digest, "tensor": ref.label,
                                     "rows": len(rows), "cols": len(cols)}))
    model = EditedModel(ca, [patch])
    return patch, changes(model) if patch.edits else []
