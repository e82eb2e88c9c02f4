"""REPRESENT, COMPACT, DIFF and SCORE REPRESENTATION: weight encodings of a container, its
maintenance, and the behavioural evidence for a representation (vindex3.represent, .compact,
.diff, .evidence)."""

from __future__ import annotations

import time

from .. import planner
from .. import results as R
from . import command


def represent_result(r, worst: int = 5) -> R.RepresentResult:
    """A vindex3 RepresentResult as a result (also the vindex3 command's printer)."""
    from vindex3 import open as vopen

    rec = vopen(r.path).provenance.get("representation", {})
    tensors = rec.get("tensors", {}) if isinstance(rec, dict) else {}
    lossy = sorted(((k, v) for k, v in tensors.items() if isinstance(v, dict) and "rel_rms_error" in v),
                   key=lambda kv: -kv[1]["rel_rms_error"])
    return R.RepresentResult(
        source=str(r.source), path=str(r.path), encoding=r.encoding, tensors=r.tensors, bytes=r.bytes,
        source_bytes=r.source_bytes,
        encodings=[R.EncodingShare(encoding=e, tensors=s["tensors"], parameters=s["parameters"], bytes=s["bytes"],
                                   bits_per_weight=round(8 * s["bytes"] / s["parameters"], 3) if s["parameters"] else 0.0)
                   for e, s in sorted(r.by_encoding.items(), key=lambda kv: -kv[1]["bytes"])],
        kept=[R.KeptTensor(tensor=t, encoding=e, reason=why) for t, e, why in r.kept],
        not_carried=list(r.not_carried), exact=r.exact,
        worst=[{"tensor": k, "encoding": v["encoding"], "rel_rms_error": v["rel_rms_error"],
                "max_abs_error": v["max_abs_error"], "bits_per_weight": v["bits_per_weight"]} for k, v in lossy[:worst]],
        seconds=r.seconds,
    )


def compact_result(r) -> R.CompactResult:
    return R.CompactResult(source=str(r.source), path=str(r.path), generation=r.generation, copied=len(r.copied),
                           copied_bytes=r.copied_bytes,
                           left_behind=[R.LeftBehind(path=f.path, kind=f.kind, bytes=f.bytes) for f in r.left_behind])


def diff_result(d) -> R.DiffResult:
    rows = ([R.DiffRow(kind="logical", **x.model_dump()) for x in d.logical]
            + [R.DiffRow(kind="physical", **x.model_dump()) for x in d.physical]
            + [R.DiffRow(kind="metadata", **x.model_dump()) for x in d.metadata])
    return R.DiffResult(a=d.a, b=d.b, verdict=d.verdict, logically_identical=d.logically_identical,
                        physically_identical=d.physically_identical, relation=d.relation, differences=rows)


def score_result(s) -> R.RepresentationScoreResult:
    return R.RepresentationScoreResult(
        candidate=s.candidate, reference=s.reference, bank=s.bank, prompts=s.prompts, positions=s.positions,
        greedy=s.greedy, kl_mean=s.kl_mean, kl_p50=s.kl_p50, kl_p95=s.kl_p95, kl_max=s.kl_max, top1=s.top1,
        greedy_agreement=s.greedy_agreement, greedy_exact=s.greedy_exact, candidate_encodings=s.candidate_encodings,
        stored=s.stored, per_prompt=[p.model_dump(exclude={"reference_continuation", "candidate_continuation"})
                                     for p in s.per_prompt],
        seconds=s.seconds,
    )


@command(planner.Represent)
def represent(session, node: planner.Represent) -> R.RepresentResult:
    from vindex3.represent import represent as run

    return represent_result(run(node.source, node.into, node.encoding, progress=session.on_progress))


@command(planner.Compact)
def compact(session, node: planner.Compact) -> R.CompactResult:
    from vindex3.compact import compact as run

    return compact_result(run(node.source, node.into))


@command(planner.Diff)
def diff(session, node: planner.Diff) -> R.DiffResult:
    from vindex3.diff import diff as run

    out = diff_result(run(node.a, node.b))
    rows = out.differences
    if node.physical:  # PHYSICAL (the reference dialect): the physical differences only
        rows = [d for d in rows if d.kind == "physical"]
    if node.layer is not None:  # LAYER n: the differences that name layer n
        import re

        rows = [d for d in rows if node.layer in {int(x) for x in re.findall(r"layers?[._ \[]?(\d+)", f"{d.area} {d.what}")}]
    if node.limit is not None:
        rows = rows[: node.limit]
    out.differences = rows
    return out


@command(planner.ScoreRepresentation)
def score_representation(session, node: planner.ScoreRepresentation) -> R.RepresentationScoreResult:
    from vindex3.evidence import score_representation as run

    t0 = time.perf_counter()
    bound = session.base_container
    cand = bound if bound is not None and _same(bound.path, node.candidate) else node.candidate
    s = run(cand, node.reference, node.prompts, greedy=node.greedy, progress=session.on_progress)
    out = score_result(s)
    out.seconds = time.perf_counter() - t0
    return out


def _same(a, b) -> bool:
    import os

    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
