"""VERIFY (re-hash the bound container), PLAN (admission of a checkpoint) and ENCODE."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

from .. import planner
from .. import results as R
from ..binding import jsonable, vindex3
from . import command


def verify_result(rep, *, default_path: str | None = None, show_path: bool = False) -> R.VerifyResult:
    """A vindex3 VerifyReport as a result (also used by the vindex3 command's printer)."""
    return R.VerifyResult(path=str(rep.path), ok=rep.ok, checked=rep.checked,
                          problems=list(rep.problems), show_path=show_path)


def plan_result(p) -> R.PlanResult:
    """A vindex3 AdmissionPlan as a result (also used by the vindex3 command's printer)."""
    mix = p.operator_mix
    return R.PlanResult(
        source=str(p.source), source_kind=p.source_kind, model_type=p.model_type,
        family=p.family, admissible=p.admissible, layers=p.layers,
        operator_mix=[R.MixEntry(label=label, count=n) for label, n in mix] if mix else None,
        tensors=p.tensors, parameters=p.parameters,
        findings=[R.FindingRow(category=f.category, key=f.key, value=jsonable(f.value),
                               message=f.message, blocks=f.blocks) for f in p.findings],
    )


@command(planner.Verify)
def verify(session, node: planner.Verify) -> R.VerifyResult:
    return verify_result(session.container.verify(), default_path=str(session.container.path))


@command(planner.Admit)
def admit(session, node: planner.Admit) -> R.PlanResult:
    return plan_result(vindex3().admit(node.path))


@command(planner.Encode)
def encode(session, node: planner.Encode) -> R.EncodeResult:
    v = vindex3()
    t0 = time.perf_counter()
    if node.replaces:
        out = _encode_replacing(v, node, session.on_progress)
    else:
        out = v.encode(node.checkpoint, node.into, progress=session.on_progress)
    secs = time.perf_counter() - t0
    c = v.open(out)
    return R.EncodeResult(
        source=node.checkpoint, path=str(out), name=c.name, layers=c.graph.num_layers,
        operator_mix=[R.MixEntry(label=label, count=n) for label, n in c.graph.operator_mix()],
        bytes=sum(o["bytes"] for o in c.objects()), seconds=secs,
    )


def _encode_replacing(v, node: planner.Encode, progress) -> Path:
    """ENCODE ... OVERWRITE over an existing container: encode beside it, and only when the new
    container is complete move the old one aside, the new one in, and remove the old one. A
    failed encode leaves the old container as it was."""
    target = Path(node.into)
    from vindex3.paths import hidden_sibling

    fresh = hidden_sibling(target, f".replacing-{os.getpid()}")
    old = hidden_sibling(target, f".replaced-{os.getpid()}")
    v.encode(node.checkpoint, fresh, progress=progress)
    try:
        target.rename(old)
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    fresh.rename(target)
    shutil.rmtree(old, ignore_errors=True)
    return target
