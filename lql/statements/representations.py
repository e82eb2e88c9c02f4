"""Representations and maintenance: REPRESENT (the bound container in another weight encoding),
COMPACT (its referenced files only), DIFF (how two containers differ), SCORE REPRESENTATION
(a representation's behaviour against the same model)."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from lark import Token
from pydantic import BaseModel, Field

from vindex3.codecs import targets as codec_targets

from .. import ast
from ..ast import dialect
from ..errors import NoContainer
from ..files import container_or_default, default_refusal
from ..layouts import shares
from ..planner import Context, Node, err, may_overwrite, positive
from ..registry import family
from ..results import EncodingShare, Result, dump
from ..syntax import Children, Clause
from ..text import fields, fmt_bpw, fmt_bytes, fmt_int, fmt_seconds, fmt_value, num, table

fam = family("representations", module=__name__, statements=("represent_stmt", "compact_stmt", "diff_stmt",
                                                              "diff_ref", "diff_current", "score_representation_stmt"),
             path_keywords=("INTO", "AGAINST", "ON"), grammar=r"""
represent_stmt: REPRESENT INTO STRING ENCODING STRING

compact_stmt: COMPACT INTO STRING

// a container operand: a path, or DEFAULT (the built-in default model, encoded on first use)
_container_ref: STRING | DEFAULT
diff_stmt: DIFF _container_ref [_container_ref | CURRENT]
diff_ref: DIFF _container_ref (_container_ref | CURRENT) diff_option+
diff_current: DIFF CURRENT diff_option*
?diff_option: diff_layer_clause
            | limit_clause
            | physical_clause
            | into_patch_clause
diff_layer_clause: LAYER INT
physical_clause: PHYSICAL
into_patch_clause: INTO PATCH STRING

score_representation_stmt: SCORE REPRESENTATION _container_ref AGAINST _container_ref ON STRING [GREEDY INT]
""")

fam.doc('REPRESENT',
        "REPRESENT INTO 'dir' ENCODING " + " | ".join(f"'{e}'" for e in codec_targets()),
        'write the bound container in another weight encoding: same graph and objects, new segments, fidelity per tensor in provenance',
        "REPRESENT INTO 'model-int8.vindex3' ENCODING 'int8';", order=260)
fam.doc('SCORE REPRESENTATION',
        "SCORE REPRESENTATION 'candidate' | DEFAULT AGAINST 'reference' | DEFAULT ON 'prompts.jsonl' [GREEDY n]",
        "a representation's behaviour against the same model: KL p50/p95, top-1, greedy-n agreement; stored in the candidate's provenance",
        "SCORE REPRESENTATION 'model-int8.vindex3' AGAINST 'model.vindex3' ON 'prompts.jsonl';", order=270)
fam.doc('COMPACT',
        "COMPACT INTO 'dir'",
        "copy the bound container's referenced files byte for byte; list every file left behind",
        "COMPACT INTO 'clean.vindex3';", order=280)
fam.doc('DIFF',
        "DIFF 'a' 'b' | DIFF 'b' [LAYER n] [LIMIT n] [PHYSICAL]",
        "how two containers differ: logically (graph, objects, operators), physically (encodings, segments), in metadata; DIFF 'b' compares the bound container with b; DEFAULT stands for a path: the built-in default model",
        "DIFF 'model.vindex3' 'model-int8.vindex3';", order=290)
fam.doc('DIFF CURRENT',
        "DIFF CURRENT [LAYER n] [LIMIT n] | DIFF 'a' 'b' INTO PATCH 'p.vlp'",
        "DIFF CURRENT: the tensors the session's patches change (per tensor: layer, edits and modes, rows and "
        "columns touched, |delta| Frobenius, relative and max, rank); INTO PATCH: a patch bound to a that makes "
        "it compute b's logits bit for bit (b must differ from a in tensor values only)",
        "DIFF CURRENT;", order=291, aliases=('DIFF INTO PATCH',))


@fam.rule
def represent_stmt(c: Children) -> Represent:
    return Represent(into=c.string("INTO"), encoding=c.string("ENCODING"))


@fam.rule
def compact_stmt(c: Children) -> Compact:
    return Compact(into=c.string("INTO"))


def _container_refs(c: Children) -> list[tuple[str | None, bool]]:
    """The rule's container operands in order (_container_ref: a path or DEFAULT), each as
    (path, is DEFAULT); a keyword labels the values after it, so DEFAULT is read by position."""
    return [(None, True) if t.type == "DEFAULT" else (c.string_of(t), False)
            for t in c.raw if isinstance(t, Token) and t.type in ("STRING", "DEFAULT")]


def _diff(c: Children, **kw) -> Diff:
    (a, a_default), (b, b_default) = (_container_refs(c) + [(None, False)])[:2]
    return Diff(a=a, b=b, a_default=a_default, b_default=b_default, **kw)


@fam.rule
def diff_stmt(c: Children) -> Diff:
    return _diff(c, b_current=c.has("CURRENT"))


@fam.rule
def diff_ref(c: Children) -> Diff:
    # DIFF _container_ref (_container_ref | CURRENT) diff_option+
    return _diff(c, b_current=c.has("CURRENT"), **c.options("DIFF"))


@fam.rule
def diff_current(c: Children) -> DiffCurrent:
    return DiffCurrent(**c.options("DIFF"))


@fam.rule
def diff_layer_clause(c: Children) -> Clause:
    return c.clause("layer", c.int("LAYER"))


@fam.rule
def physical_clause(c: Children) -> Clause:
    return c.clause("physical", True)


@fam.rule
def into_patch_clause(c: Children) -> Clause:
    return c.clause("into_patch", c.string("INTO", "PATCH"))


@fam.rule
def score_representation_stmt(c: Children) -> ScoreRepresentation:
    (cand, cand_default), (ref, ref_default) = _container_refs(c)[:2]  # the third operand is ON's prompt bank
    return ScoreRepresentation(candidate=cand, reference=ref, candidate_default=cand_default,
                               reference_default=ref_default, prompts=c.string("ON"), greedy=c.int("GREEDY"))


# ---- statements -------------------------------------------------------------------------


class Represent(ast.Statement):
    """REPRESENT INTO 'out' ENCODING 'int8': the bound container in another weight encoding."""

    keyword: ClassVar[str] = "REPRESENT"
    paths: ClassVar[tuple[str, ...]] = ("into",)  # the source is the bound model
    read_only: ClassVar[bool | str] = "it writes a container on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["represent"] = "represent"
    into: str
    encoding: str


class Compact(ast.Statement):
    """COMPACT INTO 'out': the bound container's referenced files only."""

    keyword: ClassVar[str] = "COMPACT"
    paths: ClassVar[tuple[str, ...]] = ("into",)
    read_only: ClassVar[bool | str] = "it writes a container on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["compact"] = "compact"
    into: str


class Diff(ast.Statement):
    """DIFF 'a' 'b' (or DIFF 'b': the bound container against b) [LAYER n] [LIMIT n] [PHYSICAL]
    [INTO PATCH 'p' (refused)]; b may be CURRENT, the bound container."""

    keyword: ClassVar[str] = "DIFF"
    paths: ClassVar[tuple[str, ...]] = ("a", "b")
    read_only: ClassVar[bool | str] = "it opens containers on the server by path"
    kind: Literal["diff"] = "diff"
    a: str | None  # None with a_default
    b: str | None = None
    b_current: bool = dialect(False)  # DIFF 'a' CURRENT
    layer: int | None = dialect(None)
    limit: int | None = dialect(None)
    physical: bool = dialect(False)
    into_patch: str | None = dialect(None)
    a_default: bool = dialect(False)  # DIFF DEFAULT ...: the built-in default model (encoded on first use)
    b_default: bool = dialect(False)  # DIFF 'a' DEFAULT

    def refused_read_only(self) -> str | None:
        if self.a_default or self.b_default:
            return default_refusal("DIFF")
        return super().refused_read_only()


class DiffCurrent(ast.Statement):
    """DIFF CURRENT [LAYER n] [LIMIT n]: the bound container against the session's edit overlay."""

    keyword: ClassVar[str] = "DIFF CURRENT"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["diff_current"] = "diff_current"
    layer: int | None = None
    limit: int | None = None
    physical: bool = dialect(False)  # refused: an overlay has no physical form
    into_patch: str | None = dialect(None)  # refused: SAVE PATCH writes the overlay


class ScoreRepresentation(ast.Statement):
    """SCORE REPRESENTATION 'cand' AGAINST 'ref' ON 'prompts.jsonl' [GREEDY n]; AGAINST DEFAULT
    scores against the built-in default model (encoded on first use, as OPEN DEFAULT does)."""

    keyword: ClassVar[str] = "SCORE REPRESENTATION"
    paths: ClassVar[tuple[str, ...]] = ("candidate", "reference", "prompts")
    read_only: ClassVar[bool | str] = ("it runs two models over a prompt bank and rewrites a container's index on "
                                       "the server")
    kind: Literal["score_representation"] = "score_representation"
    candidate: str | None  # None with candidate_default
    reference: str | None  # None with reference_default
    prompts: str
    greedy: int | None = None
    reference_default: bool = dialect(False)  # AGAINST DEFAULT
    candidate_default: bool = dialect(False)  # SCORE REPRESENTATION DEFAULT AGAINST ...

    def refused_read_only(self) -> str | None:
        if self.candidate_default or self.reference_default:
            return default_refusal("SCORE REPRESENTATION")
        return super().refused_read_only()


# ---- results (vindex3.represent, .compact, .diff, .evidence) ----------------------------


class KeptTensor(BaseModel):
    tensor: str
    encoding: str
    reason: str


class RepresentResult(Result):
    kind: Literal["represent"] = "represent"
    source: str
    path: str
    encoding: str
    tensors: int
    bytes: int
    source_bytes: int
    encodings: list[EncodingShare]
    kept: list[KeptTensor]  # tensors not in the requested encoding, and why
    not_carried: list[str]  # derived representations left with the source
    exact: bool
    worst: list[dict[str, Any]]  # the tensors with the largest relative RMS error
    seconds: float | None = None


class LeftBehind(BaseModel):
    path: str
    kind: str
    bytes: int


class CompactResult(Result):
    kind: Literal["compact"] = "compact"
    source: str
    path: str
    generation: int
    copied: int
    copied_bytes: int
    left_behind: list[LeftBehind]


class DiffRow(BaseModel):
    kind: Literal["logical", "physical", "metadata"]
    area: str
    what: str
    a: Any = None
    b: Any = None


class DiffResult(Result):
    kind: Literal["diff"] = "diff"
    a: str
    b: str
    verdict: str
    logically_identical: bool
    physically_identical: bool
    relation: str | None
    differences: list[DiffRow]


class TensorChangeRow(BaseModel):
    tensor: str
    layer: int | None
    modes: list[str]
    edits: list[str]
    shape: list[int]
    rows: int
    cols: int
    frobenius: float
    relative: float
    max_abs: float
    rank: int
    rank_bound: int


class OverlayDiffResult(Result):
    """DIFF CURRENT (the base against the session's overlay) or DIFF 'a' 'b' INTO PATCH (the patch written)."""

    kind: Literal["overlay_diff"] = "overlay_diff"
    base: str
    against: str  # "the session's overlay (...)" or b's path
    patch: str | None = None  # INTO PATCH: the file written
    edits: int
    changes: list[TensorChangeRow]
    notes: list[str] = Field(default_factory=list)


class RepresentationScoreResult(Result):
    kind: Literal["score_representation"] = "score_representation"
    candidate: str
    reference: str
    bank: str
    prompts: int
    positions: int
    greedy: int
    kl_mean: float
    kl_p50: float
    kl_p95: float
    kl_max: float
    top1: float
    greedy_agreement: float
    greedy_exact: float
    candidate_encodings: dict[str, str]
    stored: bool
    per_prompt: list[dict[str, Any]]
    seconds: float | None = None


# ---- plans ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class RepresentPlan(Node):
    """REPRESENT: write the bound container (``source``) into ``into`` in ``encoding``."""

    source: str
    into: str
    encoding: str


@dataclass(frozen=True, eq=False)
class CompactPlan(Node):
    source: str
    into: str


@dataclass(frozen=True, eq=False)
class DiffPlan(Node):
    a: str | None  # None: the default model (resolved when it runs: planning encodes nothing)
    b: str | None
    layer: int | None = None  # LAYER n: only the differences that name layer n
    limit: int | None = None  # LIMIT n: at most n differences
    physical: bool = False  # PHYSICAL: only the physical differences


@dataclass(frozen=True, eq=False)
class DiffCurrentPlan(Node):
    layer: int | None = None
    limit: int | None = None


@dataclass(frozen=True, eq=False)
class DiffPatchPlan(Node):
    a: str | None  # None: the default model
    b: str | None
    into: str
    overwrite: bool = False


@dataclass(frozen=True, eq=False)
class ScoreRepresentationPlan(Node):
    candidate: str | None  # None: the default model
    reference: str | None  # None: the default model
    prompts: str
    greedy: int


@fam.plans(Represent)
def plan_represent(s: Represent, ctx: Context) -> Node:
    if s.encoding not in codec_targets():
        raise err(s, f"REPRESENT cannot write encoding {s.encoding!r}",
                  hint=f"REPRESENT writes: {', '.join(codec_targets())}")
    return RepresentPlan(s, source=ctx.catalog.path, into=s.into, encoding=s.encoding)


@fam.plans(Compact)
def plan_compact(s: Compact, ctx: Context) -> Node:
    return CompactPlan(s, source=ctx.catalog.path, into=s.into)


@fam.plans(Diff)
def plan_diff(s: Diff, ctx: Context) -> Node:
    if s.into_patch is not None:
        if s.b is None and not s.b_default:
            raise err(s, "DIFF ... INTO PATCH takes two containers, 'a' and 'b' (the patch makes a compute b)",
                      hint="DIFF 'a' 'b' INTO PATCH 'p.vlp'; SAVE PATCH writes the session's overlay")
        for name, v in (("LAYER", s.layer), ("LIMIT", s.limit), ("PHYSICAL", s.physical or None)):
            if v is not None:
                raise err(s, f"DIFF ... INTO PATCH writes every changed tensor; {name} would leave some out")
        from .. import files

        overwrite = may_overwrite(s, ctx)  # SET overwrite = on (DIFF has no OVERWRITE clause)
        inside = [Path(p) for p in (s.a, s.b) if p is not None] + (files.container_paths(ctx.catalog) if ctx.bound else [])
        if s.a_default or s.b_default:  # never inside the default model's container either (its path, not encoded here)
            from vindex3 import default_model

            inside.append(default_model.container_path())
        files.output_file(s.into_patch, "patch file", overwrite=overwrite, inside=inside)
        return DiffPatchPlan(s, a=s.a, b=s.b, into=s.into_patch, overwrite=overwrite)
    positive(s, s.limit, "LIMIT", "LIMIT 10")
    opts = {"layer": s.layer, "limit": s.limit, "physical": s.physical}
    if s.b_current:
        if not ctx.bound:
            raise NoContainer("DIFF 'a' CURRENT compares a with the open container, and none is open",
                              hint="OPEN one first, or DIFF 'a' 'b'", line=s.line, column=s.column, statement=s.source)
        return DiffPlan(s, a=s.a, b=ctx.catalog.path, **opts)
    if s.b is not None or s.b_default:
        return DiffPlan(s, a=s.a, b=s.b, **opts)
    if not ctx.bound:
        raise NoContainer("DIFF 'b' compares the open container with b, and none is open",
                          hint="DIFF 'a' 'b' compares two containers; or OPEN one first",
                          line=s.line, column=s.column, statement=s.source)
    return DiffPlan(s, a=ctx.catalog.path, b=s.a, **opts)


@fam.plans(DiffCurrent)
def plan_diff_current(s: DiffCurrent, ctx: Context) -> Node:
    if s.physical:
        raise err(s, "DIFF CURRENT PHYSICAL: an edit overlay has no physical form (it lives in memory)",
                  hint="DIFF CURRENT lists the tensors it changes; COMPILE CURRENT INTO VINDEX writes them")
    if s.into_patch is not None:
        raise err(s, "DIFF CURRENT INTO PATCH: the overlay already is patches", hint="SAVE PATCH INTO 'p.vlp'")
    positive(s, s.limit, "LIMIT", "LIMIT 10")
    return DiffCurrentPlan(s, layer=s.layer, limit=s.limit)


@fam.plans(ScoreRepresentation)
def plan_score_representation(s: ScoreRepresentation, ctx: Context) -> Node:
    from vindex3.evidence import GREEDY

    positive(s, s.greedy, "GREEDY", "GREEDY 32")
    return ScoreRepresentationPlan(s, candidate=s.candidate, reference=s.reference, prompts=s.prompts,
                                   greedy=s.greedy if s.greedy is not None else GREEDY)


# ---- runners (the result builders are also the vindex3 command's printers) -------------


def represent_result(r, worst: int = 5) -> RepresentResult:
    """A vindex3 RepresentResult as a result (also the vindex3 command's printer)."""
    from vindex3 import open as vopen

    rec = vopen(r.path).provenance.get("representation", {})
    tensors = rec.get("tensors", {}) if isinstance(rec, dict) else {}
    lossy = sorted(((k, v) for k, v in tensors.items() if isinstance(v, dict) and "rel_rms_error" in v),
                   key=lambda kv: -kv[1]["rel_rms_error"])
    return RepresentResult(
        source=str(r.source), path=str(r.path), encoding=r.encoding, tensors=r.tensors, bytes=r.bytes,
        source_bytes=r.source_bytes,
        encodings=[EncodingShare(encoding=e, tensors=s["tensors"], parameters=s["parameters"], bytes=s["bytes"],
                                 bits_per_weight=round(8 * s["bytes"] / s["parameters"], 3) if s["parameters"] else 0.0)
                   for e, s in sorted(r.by_encoding.items(), key=lambda kv: -kv[1]["bytes"])],
        kept=[KeptTensor(tensor=t, encoding=e, reason=why) for t, e, why in r.kept],
        not_carried=list(r.not_carried), exact=r.exact,
        worst=[{"tensor": k, "encoding": v["encoding"], "rel_rms_error": v["rel_rms_error"],
                "max_abs_error": v["max_abs_error"], "bits_per_weight": v["bits_per_weight"]} for k, v in lossy[:worst]],
        seconds=r.seconds,
    )


def compact_result(r) -> CompactResult:
    return CompactResult(source=str(r.source), path=str(r.path), generation=r.generation, copied=len(r.copied),
                         copied_bytes=r.copied_bytes,
                         left_behind=[LeftBehind(path=f.path, kind=f.kind, bytes=f.bytes) for f in r.left_behind])


def diff_result(d) -> DiffResult:
    rows = ([DiffRow(kind="logical", **x.model_dump()) for x in d.logical]
            + [DiffRow(kind="physical", **x.model_dump()) for x in d.physical]
            + [DiffRow(kind="metadata", **x.model_dump()) for x in d.metadata])
    return DiffResult(a=d.a, b=d.b, verdict=d.verdict, logically_identical=d.logically_identical,
                      physically_identical=d.physically_identical, relation=d.relation, differences=rows)


def score_result(s) -> RepresentationScoreResult:
    return RepresentationScoreResult(
        candidate=s.candidate, reference=s.reference, bank=s.bank, prompts=s.prompts, positions=s.positions,
        greedy=s.greedy, kl_mean=s.kl_mean, kl_p50=s.kl_p50, kl_p95=s.kl_p95, kl_max=s.kl_max, top1=s.top1,
        greedy_agreement=s.greedy_agreement, greedy_exact=s.greedy_exact, candidate_encodings=s.candidate_encodings,
        stored=s.stored, per_prompt=[p.model_dump(exclude={"reference_continuation", "candidate_continuation"})
                                     for p in s.per_prompt],
        seconds=s.seconds,
    )


@fam.runs(RepresentPlan)
def run_represent(session, node: RepresentPlan) -> RepresentResult:
    from vindex3.represent import represent as run

    return represent_result(run(node.source, node.into, node.encoding, progress=session.on_progress))


@fam.runs(CompactPlan)
def run_compact(session, node: CompactPlan) -> CompactResult:
    from vindex3.compact import compact as run

    return compact_result(run(node.source, node.into))


@fam.runs(DiffPlan)
def run_diff(session, node: DiffPlan) -> DiffResult:
    from vindex3.diff import diff as run

    out = diff_result(run(container_or_default(session, node.a), container_or_default(session, node.b)))
    rows = out.differences
    if node.physical:  # PHYSICAL (the reference dialect): the physical differences only
        rows = [d for d in rows if d.kind == "physical"]
    if node.layer is not None:  # LAYER n: the differences that name layer n
        rows = [d for d in rows if node.layer in {int(x) for x in re.findall(r"layers?[._ \[]?(\d+)", f"{d.area} {d.what}")}]
    if node.limit is not None:
        rows = rows[: node.limit]
    out.differences = rows
    return out


def _change_rows(changes) -> list[TensorChangeRow]:
    return [TensorChangeRow(tensor=c.label, layer=c.layer, modes=c.modes, edits=c.edits, shape=list(c.shape),
                            rows=c.rows, cols=c.cols, frobenius=c.frobenius, relative=c.relative, max_abs=c.max_abs,
                            rank=c.rank, rank_bound=c.rank_bound) for c in changes]


@fam.runs(DiffCurrentPlan)
def run_diff_current(session, node: DiffCurrentPlan) -> OverlayDiffResult:
    from vindex3.edits import EditedModel
    from vindex3.edits.diff import changes

    from .edits import edit_state

    st = edit_state(session)
    model = st.model()
    notes = []
    if not isinstance(model, EditedModel):
        return OverlayDiffResult(base=st.base.name, against="the session's overlay (no edits)", edits=0, changes=[],
                                 notes=["no active patch holds an edit: the session runs the container as it is"])
    rows = _change_rows(changes(model))
    knn = [f"{p.name}#{e.id} (layer {e.knn.layer})" for p in model.patches for e in p.edits if e.knn is not None]
    if knn:
        notes.append(f"KNN edits are a retrieval overlay and change no tensor: {', '.join(knn)}")
    if node.layer is not None:
        rows = [r for r in rows if r.layer == node.layer]
    if node.limit is not None:
        rows = rows[: node.limit]
    return OverlayDiffResult(base=st.base.name, against=f"the session's overlay ({model.describe()})",
                             edits=len(model.edits()), changes=rows, notes=notes)


@fam.runs(DiffPatchPlan)
def run_diff_patch(session, node: DiffPatchPlan) -> OverlayDiffResult:
    from vindex3 import jsonio
    from vindex3.edits.diff import patch_between

    from .. import files

    name = os.path.basename(node.into)
    a, b = container_or_default(session, node.a), container_or_default(session, node.b)
    patch, changes = patch_between(a, b, name)
    out = files.output_file(node.into, "patch file", overwrite=node.overwrite)
    jsonio.write_atomic(out, patch.model_dump(mode="json"))
    notes = [(f"bound to {patch.base_name} (digest {patch.base_digest[:16]}…): APPLY PATCH on it computes "
              f"{b}'s logits bit for bit, and refuses any other container"),
             "the changed tensors' values are stored whole (rows or columns), not as deltas"]
    if not patch.edits:
        notes.append("the containers hold the same tensor values: the patch is empty")
    return OverlayDiffResult(base=a, against=b, patch=str(out), edits=len(patch.edits),
                             changes=_change_rows(changes), notes=notes)


@fam.runs(ScoreRepresentationPlan)
def run_score_representation(session, node: ScoreRepresentationPlan) -> RepresentationScoreResult:
    from vindex3.evidence import score_representation as run

    t0 = time.perf_counter()
    bound = session.base_container
    candidate = container_or_default(session, node.candidate)
    cand = bound if bound is not None and _same(bound.path, candidate) else candidate
    reference = container_or_default(session, node.reference)
    s = run(cand, reference, node.prompts, greedy=node.greedy, progress=session.on_progress)
    out = score_result(s)
    out.seconds = time.perf_counter() - t0
    return out


def _same(a, b) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# ---- layouts and rows -------------------------------------------------------------------


@fam.layout(RepresentResult)
def layout_represent(r: RepresentResult, timing: bool) -> list[str]:
    ratio = f" ({100 * r.bytes / r.source_bytes:.1f}% of {fmt_int(r.source_bytes)})" if r.source_bytes else ""
    out = [f"represented {r.source} as {r.encoding} into {r.path}"] + fields([
        ("weights", f"{fmt_int(r.bytes)} bytes{ratio}"),
        ("exact", "yes: every tensor holds its source's values" if r.exact else "no (fidelity per tensor in provenance)"),
    ] + ([("time", fmt_seconds(r.seconds))] if timing and r.seconds is not None else []))
    out += [""] + shares(r.encodings)
    if r.kept:
        groups: dict[tuple[str, str], list[str]] = {}
        for k in r.kept:
            groups.setdefault((k.encoding, k.reason), []).append(k.tensor)
        out += ["", f"not {r.encoding} ({len(r.kept)} tensors):"]
        for (enc, why), names in groups.items():
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            out.append(f"  {enc}: {names[0]}{more}: {why}")
    if r.worst:
        out += ["", "largest relative RMS error:"] + table(
            ["tensor", "encoding", num("rel rms"), num("max abs"), num("bits/weight")],
            [[w["tensor"], w["encoding"], f"{w['rel_rms_error']:.2e}", f"{w['max_abs_error']:.2e}",
              fmt_bpw(w["bits_per_weight"])] for w in r.worst])
    if r.not_carried:
        out += ["", "not carried (derived from the source's weights): " + ", ".join(r.not_carried)]
    return out


@fam.layout(CompactResult)
def layout_compact(r: CompactResult, timing: bool) -> list[str]:
    out = [f"compacted {r.source} into {r.path} (generation {r.generation})"] + fields([
        ("copied", f"{r.copied} files, {fmt_bytes(r.copied_bytes)}, byte for byte"),
        ("left behind", f"{len(r.left_behind)} entries, {fmt_bytes(sum(f.bytes for f in r.left_behind))}"
         if r.left_behind else "nothing (every file is referenced by the index)"),
    ])
    if r.left_behind:
        out += table(["path", "kind", num("bytes")], [[f.path, f.kind, fmt_int(f.bytes)] for f in r.left_behind])
    return out


@fam.records(CompactResult)
def records_compact(r: CompactResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.left_behind]


@fam.layout(DiffResult)
def layout_diff(r: DiffResult, timing: bool) -> list[str]:
    out = fields([("a", r.a), ("b", r.b), ("verdict", r.verdict)] + ([("relation", r.relation)] if r.relation else []))
    if r.differences:
        out += [""] + table(["kind", "area", "what", "a", "b"],
                            [[d.kind, d.area, d.what, _diff_cell(d.a), _diff_cell(d.b)] for d in r.differences])
    return out


def _diff_cell(v: Any) -> str:
    return fmt_int(v) if isinstance(v, int) and not isinstance(v, bool) else fmt_value(v)


@fam.records(DiffResult)
def records_diff(r: DiffResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.differences]


@fam.layout(OverlayDiffResult)
def layout_overlay_diff(r: OverlayDiffResult, timing: bool) -> list[str]:
    out = fields([("base", r.base), ("against", r.against)] + ([("patch", r.patch)] if r.patch else [])
                 + [("edits", str(r.edits)), ("tensors changed", str(len(r.changes)))])
    if r.changes:
        out += [""] + table(["layer", "tensor", "modes", "edits", "shape", num("rows"), num("cols"), num("|Δ|F"),
                             num("|Δ|F/|W|F"), num("max |Δ|"), num("rank"), num("bound")],
                            [["-" if c.layer is None else str(c.layer), c.tensor, ", ".join(c.modes), ", ".join(c.edits),
                              "x".join(str(x) for x in c.shape), fmt_int(c.rows), fmt_int(c.cols),
                              f"{c.frobenius:.3g}", f"{c.relative:.3g}", f"{c.max_abs:.3g}", str(c.rank),
                              str(c.rank_bound)] for c in r.changes])
    return out


@fam.records(OverlayDiffResult)
def records_overlay_diff(r: OverlayDiffResult) -> list[dict[str, Any]]:
    return [dump(x) for x in r.changes]


@fam.layout(RepresentationScoreResult)
def layout_score_representation(r: RepresentationScoreResult, timing: bool) -> list[str]:
    out = [f"{r.candidate} against {r.reference} on {r.bank}: {r.prompts} prompts, {r.positions} positions"] + fields([
        ("KL p50 / p95", f"{r.kl_p50:.3g} / {r.kl_p95:.3g} nats"),
        ("KL mean / max", f"{r.kl_mean:.3g} / {r.kl_max:.3g} nats"),
        ("top-1 agreement", f"{r.top1:.4f}"),
        (f"greedy-{r.greedy} agreement", (f"{r.greedy_agreement:.4f} (all {r.greedy} tokens on "
                                          f"{round(r.greedy_exact * r.prompts)} of {r.prompts} prompts)")),
        ("stored", f"in {r.candidate}'s provenance (evidence)" if r.stored else "no"),
    ] + ([("time", fmt_seconds(r.seconds))] if timing and r.seconds is not None else []))
    out += [""] + table(["prompt", "category", num("positions"), num("KL mean"), num("top-1"), num(f"greedy-{r.greedy}")],
                        [[p["id"], p["category"], fmt_int(p["positions"]), f"{p['kl_mean']:.3g}", f"{p['top1']:.3f}",
                          f"{p['greedy_agreement']:.3f}"] for p in r.per_prompt])
    return out


@fam.records(RepresentationScoreResult)
def records_score_representation(r: RepresentationScoreResult) -> list[dict[str, Any]]:
    return [dict(p) for p in r.per_prompt]
