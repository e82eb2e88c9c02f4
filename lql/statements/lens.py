"""TRACE ... FOR 'token': the token's rank at every layer through the model's own head (the
logit lens) or, with LENS TUNED, through the exit adapters stored in the container (the tuned
lens, vindex3.draft.tuned), DECOMPOSE its logit exactly over every write, SAVE the residual
stream; and the reference dialect's TRACE without FOR."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from .. import ast, limits
from ..ast import dialect
from ..binding import SliceBinding, check_output, internals, internals_data, with_text
from ..layouts import intervention, prompt_text, share, time, token
from ..planner import (
    BoundPrompt,
    Context,
    Node,
    bind_prompt,
    check_executed_layers,
    check_span,
    depth_of,
    err,
    run_words,
)
from ..registry import family
from ..results import Data, InternalsPrompt, Result, dump
from ..syntax import BuildError, Children, Clause
from ..text import fields, fmt_bytes, fmt_prob, layers_phrase, num, table

fam = family("lens", module=__name__, statements=("trace_for_stmt", "trace_ref_stmt"), path_keywords=("INTO",),
             grammar=r"""
// TRACE 'text' FOR 'token': the logit lens per layer, DECOMPOSE the token's logit exactly.
trace_for_stmt: TRACE prompt FOR token_ref trace_for_option*

?trace_for_option: layers_clause
                 | positions_clause
                 | decompose_clause
                 | save_clause
                 | draft_clause
                 | ablate_clause
                 | save_file_clause
                 | tuned_lens_clause

tuned_lens_clause: LENS TUNED
positions_clause: POSITIONS (LAST | ALL)
decompose_clause: DECOMPOSE [HEADS]
save_clause: SAVE INTO STRING
save_file_clause: SAVE STRING            // the reference's SAVE 'f' (needs POSITIONS ALL there and here)

// TRACE 'text' [DECOMPOSE] [LAYERS a-b] [POSITIONS ...] [SAVE 'f'] without FOR: the reference
// traces the predicted token; the options are the TRACE ... FOR ones
trace_ref_stmt: TRACE prompt trace_ref_option+

?trace_ref_option: layers_clause
                 | positions_clause
                 | decompose_clause
                 | save_clause
                 | save_file_clause
""")

fam.doc('TRACE FOR',
        "TRACE 'prompt' FOR 'token' [LAYERS a-b] [POSITIONS LAST | ALL] [DECOMPOSE [HEADS]] [SAVE [INTO] 'trace.npz'] [DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)] [LENS TUNED]",
        "the token's rank per layer (logit lens; LENS TUNED: through the stored exit adapters); DECOMPOSE: its logit split exactly over every write (HEADS: attention writes by head)",
        "TRACE 'The capital of France is' FOR ' Paris' DECOMPOSE;", order=121, aliases=('DECOMPOSE',))


def _trace_fields(c: Children, statement: str) -> dict:
    """TRACE options, with the reference's SAVE 'f' (save_file) folded into save."""
    fields = c.options(statement)
    if "save_file" in fields:
        if "save" in fields:
            raise BuildError(f"SAVE is given twice in one {statement}", c.first, hint="keep one SAVE clause")
        fields["save"], fields["save_file"] = fields.pop("save_file"), True
    return fields


@fam.rule
def trace_for_stmt(c: Children) -> TraceFor:
    return TraceFor(prompt=c.get("TRACE"), token=c.get("FOR"), **_trace_fields(c, "TRACE ... FOR"))


@fam.rule
def trace_ref_stmt(c: Children) -> TraceFor:
    return TraceFor(prompt=c.get("TRACE"), token=None, **_trace_fields(c, "TRACE"))


@fam.rule
def positions_clause(c: Children) -> Clause:
    return c.clause("positions", c.which("LAST", "ALL"))


@fam.rule
def decompose_clause(c: Children) -> Clause:
    return c.clause("decompose", "heads" if c.has("HEADS") else True)


@fam.rule
def save_clause(c: Children) -> Clause:
    return c.clause("save", c.string("SAVE", "INTO"), "SAVE INTO")


@fam.rule
def tuned_lens_clause(c: Children) -> Clause:
    return c.clause("lens", "tuned", "LENS TUNED")


@fam.rule
def save_file_clause(c: Children) -> Clause:
    return c.clause("save_file", c.string("SAVE"))


class TraceFor(ast.Statement):
    """TRACE 'text' FOR 'token' [LAYERS a-b] [POSITIONS LAST | ALL] [DECOMPOSE] [SAVE INTO 'f.npz']
    [DRAFT DEPTH n] [ABLATE FEATURES (...)]."""

    keyword: ClassVar[str] = "TRACE"
    paths: ClassVar[tuple[str, ...]] = ("save",)
    read_only: ClassVar[bool | str] = "TRACE ... SAVE INTO writes a file on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["trace_for"] = "trace_for"
    prompt: ast.Prompt
    token: str | int | None  # text that is one token, or a token id (None: TRACE without FOR, refused)
    layers: ast.LayerSpan | None = None
    positions: Literal["last", "all"] | None = None
    decompose: bool | Literal["heads"] = False  # "heads": DECOMPOSE HEADS splits attention writes by head
    save: str | None = None
    depth: int | None = None
    ablate: ast.Ablation | None = None
    overwrite: bool = False  # replace an existing SAVE INTO file
    save_file: bool = dialect(False)  # written SAVE 'f' (the reference's spelling, which needs POSITIONS ALL)
    lens: Literal["tuned"] | None = None  # LENS TUNED: read through the stored exit adapters

    def refused_read_only(self) -> str | None:
        if self.save is None:
            return None  # without SAVE INTO it only reads
        return super().refused_read_only()

    def check(self) -> None:
        check_span(self, self.layers)


@dataclass(frozen=True, eq=False)
class TraceForPlan(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    target: int  # the token id traced
    layers: tuple[int, ...] | None
    positions: str  # "last" | "all"
    decompose: bool | str  # True, or "heads"
    save: str | None
    overwrite: bool
    intervention: Any
    lens: str = "logit"  # "logit" | "tuned"


@fam.plans(TraceFor)
def plan_trace_for(s: TraceFor, ctx: Context) -> Node:
    if s.save_file and s.positions != "all":
        raise err(s, "TRACE ... SAVE 'file' saves every position's trace, so it needs POSITIONS ALL (as in the "
                   "reference dialect)", hint="add POSITIONS ALL, or write SAVE INTO 'file' for the positions shown")
    if s.token is None:
        raise err(s, "TRACE 'text' without FOR traces the predicted token in the reference dialect; this build "
                   "traces a token you name", hint="add FOR 'token' (INFER 'text' TOP 1 names the prediction)")
    cat = ctx.catalog
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    layers = cat.layer_span(s.layers, "LAYERS")
    check_executed_layers(s, sl, layers, "TRACE ... LAYERS")
    ablation = cat.ablation(s.ablate, sl)
    target = cat.single_token(s.token, "TRACE ... FOR")
    prompt = bind_prompt(ctx, s.prompt)
    _check_trace_limits(s, ctx, sl, len(prompt.ids), layers)
    if s.lens == "tuned":
        _check_tuned(s, ctx, sl, layers, ablation)
    return TraceForPlan(s, slice=sl, prompt=prompt, target=target, layers=layers,
                        positions=s.positions or "last", decompose=s.decompose, save=s.save,
                        overwrite=bool(s.overwrite or ctx.settings.overwrite), intervention=ablation,
                        lens=s.lens or "logit")


def _check_tuned(s: TraceFor, ctx: Context, sl: SliceBinding, layers, ablation) -> None:
    """LENS TUNED reads the full model's residuals through the adapters the container stores
    (index.json only): what it cannot honour is refused by name before any work."""
    from vindex3.draft.tuned import adapter_layers

    if sl.depth is not None:
        raise err(s, f"TRACE ... LENS TUNED reads the full model's residuals; it does not run DRAFT DEPTH {sl.depth}",
                  hint="DRAFT OFF first, or drop LENS TUNED")
    if ablation is not None:
        raise err(s, "TRACE ... LENS TUNED does not run with ABLATE FEATURES (the adapters were fitted on the clean model)")
    if s.save is not None:
        raise err(s, "TRACE ... SAVE INTO saves the logit lens's arrays; it does not save the tuned lens",
                  hint="drop SAVE INTO, or LENS TUNED")
    have = adapter_layers(ctx.catalog.container)
    if not have:
        raise err(s, f"TRACE ... LENS TUNED: {ctx.catalog.name} stores no exit adapter",
                  hint="fit one: FIT ADAPTER AT DEPTH d (it reads the residual after layer d-1)")
    for i in layers or ():
        if i not in have:
            raise err(s, f"TRACE ... LENS TUNED: layer {i} has no stored exit adapter (depth {i + 1}); the container "
                      f"stores adapters for layers {', '.join(map(str, have))}", hint=f"FIT ADAPTER AT DEPTH {i + 1}")


def _check_trace_limits(s: TraceFor, ctx: Context, sl: SliceBinding, p: int, layers) -> None:
    """TRACE ... FOR's limits, before any work: the positions, and the arrays it keeps (the
    prefill's own, a residual and a write per layer and position, and with POSITIONS ALL the
    lens logits of every layer at every position)."""
    cat = ctx.catalog
    limits.check_positions(p, cat.context_length, ctx.settings, run_words("TRACE ... FOR", p))
    n = len(layers) if layers is not None else len(sl.executed_layers)
    shown = p if s.positions == "all" else 1
    hidden = cat.op_plan.hidden_size
    (limits.Need().add("the prefill", cat.estimate(p, sl.depth))
     .add(f"residuals and writes [{n + 1} x 3, {p:,}, {hidden:,}]", extra=3 * (n + 1) * p * hidden * 4)
     .add(f"lens logits [{n + 1}, {shown:,}, {cat.vocab:,}]", extra=(n + 1) * shown * cat.vocab * 4)
     .check(ctx.settings, "TRACE ... FOR"))


# ---- results (mirrors of vindex3.internals' models, see `lql.results.Data`) ----------------


class LensRow(Data):
    layer: int | None  # None: the embedding, before the first layer
    operator: str
    position: int
    rank: int
    prob: float
    logit: float
    top_id: int
    top_token: str | None
    top_prob: float


class Part(Data):
    name: str
    layer: int | None
    site: Literal["embedding", "mixer", "ffn", "head", "bias"]  # head, bias: DECOMPOSE HEADS
    operator: str | None
    logit: float
    share: float | None


class Decomposition(Data):
    token_id: int
    token: str | None
    position: int
    final_logit: float
    logit_before_softcap: float | None
    sum_of_parts: float
    unexplained: float
    bound: float
    scale: float
    parts: list[Part]
    notes: list[str]
    method: str


class SavedFile(Data):
    path: str
    arrays: list[str]
    bytes: int


class TraceForResult(Result):
    """TRACE ... FOR: the logit lens, and with DECOMPOSE the exact attribution."""

    kind: Literal["trace_for"] = "trace_for"
    prompt: InternalsPrompt
    target_id: int
    target: str | None
    positions: Literal["last", "all"]
    slice: str
    executed_layers: list[int]
    intervention: dict[str, Any] | None
    rows: list[LensRow]
    final: LensRow
    decomposition: Decomposition | None
    saved: SavedFile | None
    seconds: float
    lens: Literal["logit", "tuned"] = "logit"


@fam.runs(TraceForPlan)
def run_trace_for(session, node: TraceForPlan) -> TraceForResult:
    if node.save is not None:
        check_output(session, node.save, "TRACE ... SAVE INTO", node.overwrite)
    r = internals(session).trace(list(node.prompt.ids), node.target, layers=node.layers, positions=node.positions,
                                 decompose=node.decompose, save=node.save, overwrite=node.overwrite,
                                 slice=node.slice.depth, intervention=node.intervention,
                                 activations=session.settings.activations)
    res = TraceForResult.model_validate(with_text(internals_data(r), node.prompt))
    if node.lens != "tuned":
        return res
    import time as _time

    from vindex3.draft.tuned import tuned_lens

    t0 = _time.perf_counter()
    tuned = tuned_lens(session.container, list(node.prompt.ids), node.target, layers=node.layers,
                       positions=node.positions)
    cat = session.catalog
    rows = [LensRow(layer=x.layer, operator=x.operator, position=x.position, rank=x.rank, prob=x.prob, logit=x.logit,
                    top_id=x.top_id, top_token=cat.token_text(x.top_id), top_prob=x.top_prob) for x in tuned]
    return res.model_copy(update={"rows": rows, "lens": "tuned", "seconds": res.seconds + _time.perf_counter() - t0})


@fam.layout(TraceForResult)
def layout_trace_for(r: TraceForResult, timing: bool) -> list[str]:
    where = "the last position" if r.positions == "last" else "every position"
    out = [(f"trace {prompt_text(r.prompt)} for {token(r.target, r.target_id)} (id {r.target_id}): {r.slice}, "
           f"{layers_phrase(r.executed_layers)}, {where}")]
    if r.intervention is not None:
        out.append(f"with {intervention(r.intervention)}")
    if r.lens == "tuned":
        out.append("tuned lens: the residual after each layer, mapped by the exit adapter stored for it, read by the "
                   "model's own final norm and head")
    else:
        out.append("logit lens: the model's own final norm and head read the residual after each layer")
    out += table(
        ["layer", "operator", num("pos"), num("rank"), num("probability"), num("logit"), "top-1", num("top-1 prob")],
        [["embedding" if x.layer is None else str(x.layer), x.operator, str(x.position), str(x.rank), fmt_prob(x.prob),
          f"{x.logit:.4f}", token(x.top_token, x.top_id), fmt_prob(x.top_prob)] for x in r.rows],
    )
    f = r.final
    out += fields([("output", (f"rank {f.rank}, probability {fmt_prob(f.prob)}, logit {f.logit:.4f}; top-1 "
                              f"{token(f.top_token, f.top_id)} ({fmt_prob(f.top_prob)})"))])
    d = r.decomposition
    if d is not None:
        base = f"logit before the softcap {d.logit_before_softcap:.4f}" if d.logit_before_softcap is not None else None
        out += ["", (f"decomposition of the logit of {token(d.token, d.token_id)} at position {d.position}: each part is "
                    "a write read through the head with the final norm's scale frozen")]
        out += table(["part", "site", num("logit"), num("share")],
                     [[x.name, x.site, f"{x.logit:.4f}", share(x.share)] for x in d.parts])
        out += fields([
            ("final logit", f"{d.final_logit:.4f}"),
            ("before softcap", base),
            ("sum of parts", f"{d.sum_of_parts:.4f} ({len(d.parts)} parts; {_residue(d)})"),
            *[("note" if i == 0 else "", n) for i, n in enumerate(d.notes)],
        ])
    out += fields([("saved", None if r.saved is None else
                    f"{r.saved.path} ({len(r.saved.arrays)} arrays, {fmt_bytes(r.saved.bytes)})"),
                   time(r.seconds, timing)])
    return out


def _residue(d: Decomposition) -> str:
    """The residue as a bound, never its value (its last digits depend on the order of float
    additions); a residue past the bound is printed, since it is no longer rounding."""
    if abs(d.unexplained) <= d.bound:
        return "equal to the logit up to float32 rounding, within 1e-5 of the parts' absolute sum"
    return f"{d.unexplained:.1e} unexplained, more than float32 rounding's {d.bound:.1e}"


@fam.records(TraceForResult)
def records_trace_for(r: TraceForResult) -> list[dict[str, Any]]:
    """The lens rows (``row: lens``), then with DECOMPOSE the parts (``row: part``)."""
    out = [{"row": "lens", **dump(x)} for x in r.rows]
    if r.decomposition is not None:
        out += [{"row": "part", **dump(p)} for p in r.decomposition.parts]
    return out
