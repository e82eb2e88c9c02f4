"""The container itself and checkpoints: VERIFY (re-hash the bound container), PLAN (admission
of a checkpoint), ENCODE (and the reference's EXTRACT), COMPILE (a verified copy)."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from .. import ast, files
from ..binding import jsonable, vindex3
from ..errors import NoContainer
from ..layouts import short
from ..planner import Context, Node, err, may_overwrite
from ..registry import family
from ..results import MixEntry, Result, dump
from ..syntax import Children, Clause, literal_string
from ..text import fields, fmt_bytes, fmt_int, fmt_mix, fmt_seconds, fmt_value, table

fam = family("container", module=__name__, statements=("verify_stmt", "plan_stmt", "encode_stmt", "extract_stmt",
                                                        "compile_stmt"),
             path_keywords=("PLAN", "ENCODE", "INTO"), grammar=r"""
verify_stmt: VERIFY

plan_stmt: PLAN STRING

encode_stmt: ENCODE STRING INTO STRING [overwrite_clause]

// EXTRACT MODEL 'm' INTO 'o' ...: ENCODE by the reference's name
extract_stmt: EXTRACT MODEL STRING INTO STRING extract_option*
?extract_option: components_clause
               | layers_clause
               | with_level_clause
               | format_clause
components_clause: COMPONENTS _name_or_string (_COMMA _name_or_string)*
                 | COMPONENTS _LPAR _name_or_string (_COMMA _name_or_string)* _RPAR
_name_or_string: NAME | STRING
with_level_clause: WITH (INFERENCE | ALL | WEIGHTS)
format_clause: FORMAT NAME

// COMPILE CURRENT | 'p' | DEFAULT INTO VINDEX 'o' | INTO MODEL 'o' FORMAT safetensors | gguf [ON CONFLICT name] [OVERWRITE]
compile_stmt: COMPILE (CURRENT | DEFAULT | STRING) INTO (VINDEX | MODEL) STRING compile_option*
?compile_option: on_conflict_clause
               | format_clause
               | overwrite_clause
""")

fam.doc('VERIFY',
        'VERIFY',
        're-hash every file of the bound container against its index',
        'VERIFY;', order=230)
fam.doc('PLAN',
        "PLAN 'checkpoint'",
        'admission: would this checkpoint encode, and what was judged',
        "PLAN 'path/to/hf-checkpoint';", order=240)
fam.doc('ENCODE',
        "ENCODE 'checkpoint' INTO 'dir'",
        'encode an HF directory or .gguf into a container',
        "ENCODE 'path/to/hf-checkpoint' INTO 'model.vindex3';", order=250)
fam.doc('EXTRACT',
        "EXTRACT MODEL 'checkpoint' INTO 'dir' [WITH INFERENCE | ALL | WEIGHTS] [FORMAT vindex3]",
        "ENCODE by the reference dialect's name; COMPONENTS and LAYERS, which narrow what is carried, are refused by name",
        "EXTRACT MODEL 'path/to/hf-checkpoint' INTO 'model.vindex3';", order=310)
fam.doc('COMPILE',
        "COMPILE CURRENT | 'path' | DEFAULT INTO VINDEX 'dir' | INTO MODEL 'dir' FORMAT safetensors | gguf [ON CONFLICT name]",
        "write the container again (INTO VINDEX) or as a checkpoint (INTO MODEL) with the session's weight edits "
        "baked in and the patches in provenance; without edits, a verified copy that keeps every index field; "
        "DEFAULT: the built-in default model",
        "COMPILE CURRENT INTO VINDEX 'copy.vindex3';", order=320)


@fam.rule
def verify_stmt(c: Children) -> Verify:
    return Verify()


@fam.rule
def plan_stmt(c: Children) -> Plan:
    return Plan(path=c.string("PLAN"))


@fam.rule
def encode_stmt(c: Children) -> Encode:
    return Encode(checkpoint=c.string("ENCODE"), into=c.string("INTO"),
                  overwrite="overwrite" in c.options("ENCODE"))


@fam.rule
def extract_stmt(c: Children) -> Extract:
    return Extract(checkpoint=c.string("EXTRACT", "MODEL"), into=c.string("INTO"), **c.options("EXTRACT"))


@fam.rule
def components_clause(c: Children) -> Clause:
    names = [literal_string(t) if t.type == "STRING" else t.value for t in c.values()]
    return c.clause("components", names)


@fam.rule
def with_level_clause(c: Children) -> Clause:
    return c.clause("level", c.which("INFERENCE", "ALL", "WEIGHTS"))


@fam.rule
def format_clause(c: Children) -> Clause:
    return c.clause("format", c.get("FORMAT").value.lower())


@fam.rule
def compile_stmt(c: Children) -> Compile:
    # COMPILE (CURRENT | DEFAULT | STRING) INTO (VINDEX | MODEL) STRING [on_conflict_clause]
    target = c.which("VINDEX", "MODEL")
    opts = c.options("COMPILE")
    named = not c.has("CURRENT", "DEFAULT")
    return Compile(path=c.string("COMPILE") if named else None, into=c.string(target.upper()), target=target,
                   on_conflict=opts.get("on_conflict"), format=opts.get("format"),
                   overwrite=bool(opts.get("overwrite")), default=c.has("DEFAULT"))


# ---- statements -------------------------------------------------------------------------

_WRITES_A_CONTAINER = "it writes a container on the server"


class Verify(ast.Statement):
    keyword: ClassVar[str] = "VERIFY"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = "it re-hashes every file of the container, long work that no token or limit can stop"
    needs_container: ClassVar[bool] = True
    kind: Literal["verify"] = "verify"


class Plan(ast.Statement):
    keyword: ClassVar[str] = "PLAN"
    paths: ClassVar[tuple[str, ...]] = ("path",)
    read_only: ClassVar[bool | str] = "it reads a checkpoint on the server"
    kind: Literal["plan"] = "plan"
    path: str


class Encode(ast.Statement):
    keyword: ClassVar[str] = "ENCODE"
    paths: ClassVar[tuple[str, ...]] = ("checkpoint", "into")
    read_only: ClassVar[bool | str] = _WRITES_A_CONTAINER
    kind: Literal["encode"] = "encode"
    checkpoint: str
    into: str
    overwrite: bool = False  # OVERWRITE: an existing container is replaced once the encode is complete


class Extract(ast.Statement):
    """EXTRACT MODEL 'm' INTO 'o' [COMPONENTS ...] [LAYERS a-b] [WITH INFERENCE | ALL | WEIGHTS]
    [FORMAT VINDEX3]: ENCODE by the reference's name."""

    keyword: ClassVar[str] = "EXTRACT"
    paths: ClassVar[tuple[str, ...]] = ("checkpoint", "into")
    read_only: ClassVar[bool | str] = _WRITES_A_CONTAINER
    kind: Literal["extract"] = "extract"
    checkpoint: str
    into: str
    components: list[str] | None = None
    layers: ast.LayerSpan | None = None
    level: Literal["inference", "all", "weights"] | None = None
    format: str | None = None


class Compile(ast.Statement):
    """COMPILE CURRENT | 'p' INTO VINDEX 'o' | INTO MODEL 'o' [ON CONFLICT name]."""

    keyword: ClassVar[str] = "COMPILE"
    paths: ClassVar[tuple[str, ...]] = ("path", "into")
    read_only: ClassVar[bool | str] = _WRITES_A_CONTAINER
    kind: Literal["compile"] = "compile"
    path: str | None  # None: CURRENT, the bound container (or DEFAULT with default)
    into: str
    target: Literal["vindex", "model"]
    on_conflict: str | None = None
    format: str | None = None  # INTO MODEL: safetensors | gguf
    overwrite: bool = False
    default: bool = ast.dialect(False)  # COMPILE DEFAULT: the built-in default model (encoded on first use)

    def refused_read_only(self) -> str | None:
        if self.default:
            return files.default_refusal("COMPILE")
        return super().refused_read_only()


# ---- results ----------------------------------------------------------------------------


class VerifyResult(Result):
    kind: Literal["verify"] = "verify"
    path: str
    ok: bool
    checked: int
    problems: list[str]
    show_path: bool = Field(default=False, exclude=True)  # name the container in the text (vindex3 verify)


class FindingRow(BaseModel):
    category: str
    key: str
    value: Any
    message: str
    blocks: bool


class PlanResult(Result):
    kind: Literal["plan"] = "plan"
    source: str
    source_kind: str | None = None
    model_type: str | None
    family: str | None = None
    admissible: bool
    layers: int | None = None
    operator_mix: list[MixEntry] | None = None
    tensors: int | None = None
    parameters: int | None = None
    findings: list[FindingRow]


class EncodeResult(Result):
    kind: Literal["encode"] = "encode"
    source: str
    path: str
    name: str
    layers: int
    operator_mix: list[MixEntry]
    bytes: int
    seconds: float | None = None  # how long the encode took (machine-dependent)


class CompileResult(Result):
    kind: Literal["compile"] = "compile"
    source: str
    path: str
    files: int
    bytes: int
    generation: int
    verified: int
    left_behind: int
    patches: int = 0
    on_conflict: str | None = None
    format: str = "vindex3"
    edits: int = 0  # edits baked in
    edited: list[str] = Field(default_factory=list)  # tensors written from the overlay
    not_carried: list[str] = Field(default_factory=list)


# ---- plans ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class AdmitPlan(Node):
    path: str


@dataclass(frozen=True, eq=False)
class EncodePlan(Node):
    checkpoint: str
    into: str
    replaces: bool = False  # OVERWRITE: an existing container at ``into`` is replaced when the encode succeeds


@dataclass(frozen=True, eq=False)
class CompilePlan(Node):
    source: str | None  # None: the default model (resolved when it runs: planning encodes nothing)
    into: str
    on_conflict: str | None
    current: bool = False  # CURRENT: the bound container with the session's patches
    format: str = "vindex3"  # or safetensors | gguf (INTO MODEL)
    overwrite: bool = False


@fam.plans(Plan)
def plan_admit(s: Plan, ctx: Context) -> Node:
    files.source(s.path, "checkpoint")
    return AdmitPlan(s, path=s.path)


@fam.plans(Encode)
def plan_encode(s: Encode, ctx: Context) -> Node:
    files.source(s.checkpoint, "checkpoint")
    overwrite = may_overwrite(s, ctx)
    inside = files.container_paths(ctx.catalog) if ctx.bound else []
    replaces = files.encode_target(s.into, overwrite=overwrite, inside=inside)
    return EncodePlan(s, checkpoint=s.checkpoint, into=s.into, replaces=replaces)


@fam.plans(Extract)
def plan_extract(s: Extract, ctx: Context) -> Node:
    if s.components is not None:
        raise err(s, f"EXTRACT ... COMPONENTS {', '.join(s.components)} narrows what is carried; this build's "
                   "ENCODE carries the whole model", hint="leave COMPONENTS out")
    if s.layers is not None:
        raise err(s, f"EXTRACT ... LAYERS {s.layers[0]}-{s.layers[1]} narrows what is carried; this build's ENCODE "
                   "carries every layer", hint="leave LAYERS out (DRAFT DEPTH n runs fewer layers of the whole)")
    if s.format is not None and s.format != "vindex3":
        raise err(s, f"EXTRACT ... FORMAT {s.format} is not a format this build writes", hint="FORMAT vindex3")
    return EncodePlan(s, checkpoint=s.checkpoint, into=s.into)


@fam.plans(Compile)
def plan_compile(s: Compile, ctx: Context) -> Node:
    fmt = s.format or ("vindex3" if s.target == "vindex" else None)
    if s.target == "model" and fmt not in ("safetensors", "gguf"):
        what = f"FORMAT {fmt} is not a checkpoint format" if fmt else "it names no FORMAT"
        raise err(s, f"COMPILE ... INTO MODEL writes a checkpoint, and {what}",
                  hint="FORMAT safetensors (a Hugging Face directory) or FORMAT gguf (llama architecture)")
    if s.target == "vindex" and fmt != "vindex3":
        raise err(s, f"COMPILE ... INTO VINDEX writes a container; FORMAT {fmt} is not one",
                  hint="leave FORMAT out, or COMPILE ... INTO MODEL 'dir' FORMAT safetensors")
    if s.path is None and not s.default:
        if not ctx.bound:
            raise NoContainer("COMPILE CURRENT compiles the open container, and none is open",
                              hint="OPEN one first, or COMPILE 'path' INTO VINDEX 'dir'",
                              line=s.line, column=s.column, statement=s.source)
        source = ctx.catalog.path
    else:
        source = s.path
    current = s.path is None and not s.default
    return CompilePlan(s, source=source, into=s.into, on_conflict=s.on_conflict, current=current, format=fmt,
                       overwrite=may_overwrite(s, ctx))


# ---- runners ----------------------------------------------------------------------------


def verify_result(rep, *, default_path: str | None = None, show_path: bool = False) -> VerifyResult:
    """A vindex3 VerifyReport as a result (also used by the vindex3 command's printer)."""
    return VerifyResult(path=str(rep.path), ok=rep.ok, checked=rep.checked, problems=list(rep.problems),
                        show_path=show_path)


def plan_result(p) -> PlanResult:
    """A vindex3 AdmissionPlan as a result (also used by the vindex3 command's printer)."""
    mix = p.operator_mix
    return PlanResult(
        source=str(p.source), source_kind=p.source_kind, model_type=p.model_type,
        family=p.family, admissible=p.admissible, layers=p.layers,
        operator_mix=[MixEntry(label=label, count=n) for label, n in mix] if mix else None,
        tensors=p.tensors, parameters=p.parameters,
        findings=[FindingRow(category=f.category, key=f.key, value=jsonable(f.value),
                             message=f.message, blocks=f.blocks) for f in p.findings],
    )


@fam.runs(Verify)  # the identity plan: VERIFY binds nothing
def run_verify(session, node: Node) -> VerifyResult:
    return verify_result(session.container.verify(), default_path=str(session.container.path))


@fam.runs(AdmitPlan)
def run_admit(session, node: AdmitPlan) -> PlanResult:
    return plan_result(vindex3().admit(node.path))


@fam.runs(EncodePlan)
def run_encode(session, node: EncodePlan) -> EncodeResult:
    v = vindex3()
    t0 = time.perf_counter()
    if node.replaces:
        out = _encode_replacing(v, node, session.on_progress)
    else:
        out = v.encode(node.checkpoint, node.into, progress=session.on_progress)
    secs = time.perf_counter() - t0
    c = v.open(out)
    return EncodeResult(
        source=node.checkpoint, path=str(out), name=c.name, layers=c.graph.num_layers,
        operator_mix=[MixEntry(label=label, count=n) for label, n in c.graph.operator_mix()],
        bytes=sum(o["bytes"] for o in c.objects()), seconds=secs,
    )


def _encode_replacing(v, node: EncodePlan, progress) -> Path:
    """ENCODE ... OVERWRITE over an existing container: encode beside it, and only when the new
    container is complete move the old one aside, the new one in, and remove the old one. A
    failed encode leaves the old container as it was."""
    from vindex3.paths import hidden_sibling

    target = Path(node.into)
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


def _overlay(session, node: CompilePlan):
    """(source, overrides, provenance, patch count, edit count) of what COMPILE bakes in: the session's
    weight edits for CURRENT (a retrieval overlay is refused by name: it has no weights to bake)."""
    from vindex3.edits import EditedModel
    from vindex3.errors import QueryRefused

    model = session.container if node.current else None
    if not isinstance(model, EditedModel) or not model.edits():
        source = session.base_container if node.current else files.container_or_default(session, node.source)
        return source, None, None, 0, 0
    knn = [e for e in model.edits() if e.mode == "knn"]
    if knn:
        raise QueryRefused(f"COMPILE CURRENT: edit {knn[0].id} ({knn[0].prompt!r}) is MODE KNN, a retrieval overlay: it "
                           "changes no weight, so there is nothing to bake into a checkpoint or a container",
                           hint="DELETE FROM EDGES WHERE mode = 'knn', or REMOVE PATCH it, then COMPILE")
    prov = {"patches": [{"name": p.name, "base_digest": p.base_digest, "edits": [
        {"id": e.id, "mode": e.mode, "prompt": e.prompt, "target": e.target, "layers": e.layers,
         "writes": [w.describe() for w in e.writes]} for e in p.edits]} for p in model.patches if p.edits]}
    return model.base, model.overrides(), prov, len(prov["patches"]), len(model.edits())


@fam.runs(CompilePlan)
def run_compile(session, node: CompilePlan) -> CompileResult:
    from vindex3.compile import compile, compile_copy

    source, overrides, prov, patches, edits = _overlay(session, node)
    if node.format in ("safetensors", "gguf"):
        from vindex3.export import export_checkpoint

        r = export_checkpoint(source, node.into, node.format, overrides, provenance=prov, overwrite=node.overwrite)
        return CompileResult(source=str(getattr(source, "path", source)), path=str(r.path), files=len(r.files),
                             bytes=r.bytes, generation=0, verified=0, left_behind=0, patches=patches,
                             on_conflict=node.on_conflict, format=node.format, edits=edits, edited=list(r.edited))
    r = compile(source, node.into, overrides=overrides, provenance=prov) if overrides else compile_copy(
        getattr(source, "path", source), node.into)
    return CompileResult(source=str(r.source), path=str(r.path), files=r.files, bytes=r.bytes,
                         generation=r.generation, verified=r.verified, left_behind=r.left_behind,
                         on_conflict=node.on_conflict, patches=patches, edits=edits, edited=list(r.edited),
                         not_carried=list(r.not_carried))


# ---- layouts and rows -------------------------------------------------------------------


@fam.layout(VerifyResult)
def layout_verify(r: VerifyResult, timing: bool) -> list[str]:
    where = f" in {r.path}" if r.show_path else ""
    if r.ok:
        return [f"verified {r.checked} files{where}: every hash matches the index"]
    return ([f"VERIFY FAILED{where}: {len(r.problems)} problem(s) in {r.checked} files checked"]
            + [f"  - {p}" for p in r.problems])


@fam.records(VerifyResult)
def records_verify(r: VerifyResult) -> list[dict[str, Any]]:
    if r.ok:
        return [{"path": r.path, "ok": True, "checked": r.checked, "problem": None}]
    return [{"path": r.path, "ok": False, "checked": r.checked, "problem": p} for p in r.problems]


@fam.layout(PlanResult)
def layout_plan(r: PlanResult, timing: bool) -> list[str]:
    out = fields([
        ("checkpoint", r.source + (f" ({r.source_kind})" if r.source_kind else "")),
        ("model type", r.model_type or "-"),
        ("family", r.family),
        ("admissible", "yes" if r.admissible else "no: " + f"{sum(f.blocks for f in r.findings)} finding(s) block it"),
        ("layers", None if r.layers is None else f"{r.layers} ({fmt_mix(r.operator_mix or [])})"),
        ("tensors", None if r.tensors is None else f"{r.tensors} ({fmt_int(r.parameters)} parameters)"),
    ])
    if r.findings:
        headers = ["category", "key", "value", "blocks", "message"]
        out += [""] + table(headers, [
            [f.category, f.key, short(fmt_value(f.value))]
            + ["BLOCKS" if f.blocks else "", f.message] for f in r.findings
        ])
    return out


@fam.records(PlanResult)
def records_plan(r: PlanResult) -> list[dict[str, Any]]:
    return [dump(f) for f in r.findings]


@fam.layout(EncodeResult)
def layout_encode(r: EncodeResult, timing: bool) -> list[str]:
    out = [f"encoded {r.source} into {r.path}"] + fields([
        ("model", r.name),
        ("layers", f"{r.layers} ({fmt_mix(r.operator_mix)})"),
        ("weights", fmt_bytes(r.bytes)),
    ])
    if timing and r.seconds is not None:
        out += fields([("encode time", fmt_seconds(r.seconds))])
    return out


@fam.layout(CompileResult)
def layout_compile(r: CompileResult, timing: bool) -> list[str]:
    what = (f"{r.edits} edit(s) from {r.patches} patch(es) baked into {len(r.edited)} tensor(s)" if r.edits
            else "no edits, so a verified copy" if r.format == "vindex3" else "no edits")
    if r.format != "vindex3":
        return [f"compiled {r.source} into {r.path} as a {r.format} checkpoint: {what}"] + fields([
            ("files", f"{r.files} written ({fmt_bytes(r.bytes)} of weights)"),
            ("edited", ", ".join(r.edited) if r.edited else None)])
    out = [f"compiled {r.source} into {r.path}: {what}"]
    out += fields([
        ("files", f"{r.files} copied ({fmt_bytes(r.bytes)}), each checked against its recorded hash"),
        ("verified", f"{r.verified} checked in the written container"),
        ("generation", str(r.generation)),
        ("left behind", f"{r.left_behind} file(s) the index does not refer to" if r.left_behind else None),
        ("on conflict", (f"{r.on_conflict} (patches apply in order; no conflict is resolved)" if r.patches
                         else f"{r.on_conflict} (no patches, so no conflicts)") if r.on_conflict else None),
        ("not carried", ", ".join(r.not_carried) + " (derived from the unedited weights)" if r.not_carried else None),
    ])
    return out
