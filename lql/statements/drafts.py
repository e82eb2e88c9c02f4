"""Reduced-depth drafts: the session's DRAFT DEPTH (and DRAFT OFF), DUMP LOGITS with provenance,
SCORE DRAFT against the full model, the DRAFT LADDER over a prompt bank (vindex3.draft: drafts
made measurable), and FIT ADAPTER, which fits an exit adapter and stores it in the container as
a drafter component."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from .. import ast, files, limits
from ..binding import SliceBinding, draft_module, slice_of
from ..charts import ladder_figure, require_matplotlib, save_figure
from ..errors import FileRefusal, LimitError
from ..layouts import intervention, summary_fields
from ..planner import (
    BoundPrompt,
    Context,
    Node,
    bind_prompt,
    err,
    may_overwrite,
    run_words,
)
from ..registry import family
from ..results import ReadCost, Result
from ..syntax import Children
from ..text import fields, fmt_bytes, fmt_layers, fmt_seconds, fmt_text, layers_phrase, num, table

fam = family("drafts", module=__name__, statements=("draft_depth", "draft_off", "draft_ladder", "dump_stmt", "score_stmt",
                                                    "fit_adapter_stmt", "fit_vocab_stmt"),
             path_keywords=("INTO", "AGAINST", "ON", "DRAFT"), grammar=r"""
draft_depth: draft_clause [adapter_clause]
draft_off: DRAFT OFF
draft_ladder: DRAFT LADDER DEPTHS _LPAR int_list _RPAR ON STRING [adapter_clause] [INTO STRING] [PLOT INTO STRING] [overwrite_clause]

dump_stmt: DUMP LOGITS prompt dump_option* INTO STRING [overwrite_clause]

?dump_option: draft_clause
            | adapter_clause
            | ablate_clause
            | patch_clause
            | steer_clause

// DRAFT DEPTH d WITH ADAPTER: the draft's residual read through the exit adapter stored for d
adapter_clause: WITH ADAPTER

score_stmt: SCORE DRAFT STRING AGAINST STRING

fit_adapter_stmt: FIT ADAPTER AT DEPTH INT [ON STRING] [RIDGE (INT | FLOAT)]
fit_vocab_stmt: FIT VOCAB CUT TOP INT [ON STRING]
""")

fam.doc('DRAFT DEPTH',
        'DRAFT DEPTH n [WITH ADAPTER] | DRAFT OFF',
        "set (or clear) the session's default draft depth for INFER, TRACE, EXPLAIN, DUMP LOGITS "
        "(WITH ADAPTER: read through the exit adapter stored for n)",
        'DRAFT DEPTH 2;', order=130, aliases=('DRAFT', 'DRAFT OFF'))
fam.doc('DRAFT LADDER',
        "DRAFT LADDER DEPTHS (d, ...) ON 'prompts.jsonl' [WITH ADAPTER] [INTO 'ladder.json'] [PLOT INTO 'ladder.png']",
        'score each draft depth against the full model over a prompt bank (WITH ADAPTER: each read through its stored exit adapter)',
        "DRAFT LADDER DEPTHS (1, 2, 4) ON 'prompts.jsonl';", order=140, aliases=('PLOT',))
fam.doc('DUMP LOGITS',
        "DUMP LOGITS 'prompt' | TOKENS (ids) [DRAFT DEPTH n [WITH ADAPTER]] [ABLATE FEATURES (L:f, ...)] [PATCH ... FROM 'source'] [STEER AT LAYER n WITH ... SCALE x] INTO 'file.f32'",
        'write raw float32 logits [positions, vocab] and a provenance sidecar (WITH ADAPTER: the draft read '
        'through the exit adapter stored for its depth)',
        "DUMP LOGITS 'Hello' DRAFT DEPTH 2 INTO 'draft.f32';", order=150, aliases=('DUMP',))
fam.doc('SCORE DRAFT',
        "SCORE DRAFT 'draft.f32' AGAINST 'target.f32'",
        "compare a draft's logit dump with the full model's: KL, top-1, ranks",
        "SCORE DRAFT 'draft.f32' AGAINST 'full.f32';", order=160, aliases=('SCORE',))
fam.doc('FIT ADAPTER',
        "FIT ADAPTER AT DEPTH d [ON 'corpus.jsonl'] [RIDGE r]",
        "fit the exit adapter (tuned lens) from the residual after depth d to the final one, in closed form, "
        "and store it in the container as a drafter component",
        "FIT ADAPTER AT DEPTH 2 RIDGE 1.0;", order=165, aliases=('FIT', 'ADAPTER'))
fam.doc('FIT VOCAB CUT',
        "FIT VOCAB CUT TOP k [ON 'corpus.jsonl']",
        "count the corpus's k most frequent tokens and store them in the container as a drafter component "
        "(the head SPECULATE DEPTH d VOCAB TOP k reads)",
        "FIT VOCAB CUT TOP 64;", order=166, aliases=('VOCAB', 'CUT'))


@fam.rule
def draft_depth(c: Children) -> DraftDepth:
    opts = c.options("DRAFT DEPTH")
    return DraftDepth(depth=opts["depth"], adapter="adapter" in opts)


@fam.rule
def draft_off(c: Children) -> DraftOff:
    return DraftOff()


@fam.rule
def draft_ladder(c: Children) -> DraftLadder:
    return DraftLadder(depths=c.get("DEPTHS"), prompts=c.string("ON"), into=c.string("INTO", exact=True),
                           plot=c.string("PLOT", "INTO"), overwrite="overwrite" in c.options("DRAFT LADDER"),
                           adapter="adapter" in c.options("DRAFT LADDER"))


@fam.rule
def dump_stmt(c: Children) -> DumpLogits:
    from .interventions import intervention_fields

    fields = intervention_fields(c.options("DUMP LOGITS"))
    overwrite = fields.pop("overwrite", False)
    return DumpLogits(prompt=c.get("LOGITS"), into=c.string("INTO"), overwrite=overwrite, **fields)


@fam.rule
def adapter_clause(c: Children):
    return c.clause("adapter", True)


@fam.rule
def score_stmt(c: Children) -> ScoreDraft:
    return ScoreDraft(draft=c.string("SCORE", "DRAFT"), target=c.string("AGAINST"))


@fam.rule
def fit_adapter_stmt(c: Children) -> FitAdapter:
    ridge = c.get("RIDGE")
    return FitAdapter(depth=c.int("DEPTH"), corpus=c.string("ON"),
                      ridge=float(ridge.value) if ridge is not None else None)


@fam.rule
def fit_vocab_stmt(c: Children) -> FitVocabCut:
    return FitVocabCut(k=c.int("TOP"), corpus=c.string("ON"))


# ---- statements ----


class DraftDepth(ast.Statement):
    """DRAFT DEPTH n: the session's default draft depth for INFER, TRACE, EXPLAIN and DUMP LOGITS."""

    keyword: ClassVar[str] = "DRAFT DEPTH"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["draft_depth"] = "draft_depth"
    depth: int
    adapter: bool = False  # WITH ADAPTER: the session's draft reads through the exit adapter stored for depth


class DraftOff(ast.Statement):
    """DRAFT OFF: later statements run the full model."""

    keyword: ClassVar[str] = "DRAFT OFF"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    kind: Literal["draft_off"] = "draft_off"


class DraftLadder(ast.Statement):
    """DRAFT LADDER: each draft depth scored against the full model over a prompt bank."""

    keyword: ClassVar[str] = "DRAFT LADDER"
    paths: ClassVar[tuple[str, ...]] = ("prompts", "into", "plot")
    read_only: ClassVar[bool | str] = "it reads a prompt bank and writes files on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["draft_ladder"] = "draft_ladder"
    depths: list[int]
    prompts: str
    into: str | None = None
    plot: str | None = None  # PLOT INTO 'chart.png' | 'chart.svg'
    overwrite: bool = False  # OVERWRITE: an existing report or chart is replaced
    adapter: bool = False  # WITH ADAPTER: each depth read through the exit adapter stored for it

    def check(self) -> None:
        seen: set[int] = set()
        for d in self.depths:
            if d in seen:
                raise self.error(f"DRAFT LADDER lists depth {d} twice")
            seen.add(d)


class DumpLogits(ast.Statement):
    """DUMP LOGITS: raw float32 logits [positions, vocab] and a provenance sidecar."""

    keyword: ClassVar[str] = "DUMP LOGITS"
    paths: ClassVar[tuple[str, ...]] = ("into", "steer_vector")
    read_only: ClassVar[bool | str] = "it writes a file on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["dump_logits"] = "dump_logits"
    prompt: ast.Prompt
    depth: int | None = None
    ablate: ast.Ablation | None = None
    patch: Any = None  # PATCH ... FROM 'source' (lql.statements.interventions.PatchSpec)
    steer: Any = None  # STEER AT LAYER n WITH ... SCALE x (lql.statements.interventions.SteerSpec)
    steer_vector: str | None = None  # STEER ... WITH VECTOR 'v.npy': a file read on the server
    into: str
    overwrite: bool = False  # OVERWRITE: an existing dump (and its sidecar) is replaced
    adapter: bool = False  # DRAFT DEPTH d WITH ADAPTER: the draft read through the exit adapter stored for d


class ScoreDraft(ast.Statement):
    """SCORE DRAFT: a draft's logit dump against the full model's."""

    keyword: ClassVar[str] = "SCORE DRAFT"
    paths: ClassVar[tuple[str, ...]] = ("draft", "target")
    read_only: ClassVar[bool | str] = "it reads dump files on the server"
    kind: Literal["score_draft"] = "score_draft"
    draft: str
    target: str



class FitAdapter(ast.Statement):
    """FIT ADAPTER AT DEPTH d [ON 'corpus.jsonl'] [RIDGE r]: the ridge least-squares map from the
    residual Draft(d) hands its final norm to the one the full model hands it, fitted on the
    corpus (JSON lines of {"text": ...} or {"token_ids": [...]}; default: the built-in seed
    list, never the prompt bank) and stored in the container as a drafter component."""

    keyword: ClassVar[str] = "FIT ADAPTER"
    paths: ClassVar[tuple[str, ...]] = ("corpus",)
    read_only: ClassVar[bool | str] = "it writes a drafter component into the container"
    needs_container: ClassVar[bool] = True
    kind: Literal["fit_adapter"] = "fit_adapter"
    depth: int
    corpus: str | None = None
    ridge: float | None = None  # None: chosen by cross-validation on the corpus

    def check(self) -> None:
        import math

        if self.ridge is not None and not (math.isfinite(self.ridge) and self.ridge >= 0):
            raise self.error(f"FIT ADAPTER RIDGE must be a finite number ≥ 0; got {self.ridge!r}")


class FitVocabCut(ast.Statement):
    """FIT VOCAB CUT TOP k [ON 'corpus.jsonl']: the k most frequent token ids of the corpus
    (default: the built-in seed list, never the prompt bank), stored in the container as a
    drafter component; SPECULATE DEPTH d VOCAB TOP k reads it."""

    keyword: ClassVar[str] = "FIT VOCAB CUT"
    paths: ClassVar[tuple[str, ...]] = ("corpus",)
    read_only: ClassVar[bool | str] = "it writes a drafter component into the container"
    needs_container: ClassVar[bool] = True
    kind: Literal["fit_vocab_cut"] = "fit_vocab_cut"
    k: int
    corpus: str | None = None

    def check(self) -> None:
        if self.k < 1:
            raise self.error(f"FIT VOCAB CUT TOP must be at least 1; got {self.k}")


# ---- results ----


class DraftResult(Result):
    kind: Literal["draft"] = "draft"
    depth: int | None  # None: the full model
    model_layers: int
    executed_layers: list[int]
    reads: ReadCost
    adapter: dict[str, Any] | None = None  # WITH ADAPTER: the stored exit adapter (key, digest, edge, fit's provenance)


# ---- the container, checkpoints, the session ------------------------------------------


class DumpResult(Result):
    kind: Literal["dump_logits"] = "dump_logits"
    path: str
    sidecar: str
    depth: int | None
    positions: int
    vocab: int
    executed_layers: list[int]
    meta: dict[str, Any]


class ScoreResult(Result):
    kind: Literal["score_draft"] = "score_draft"
    draft: str
    target: str
    depth: int | None
    model_layers: int
    summary: dict[str, Any]
    positions: list[dict[str, Any]]  # with target_token / draft_token text when a tokenizer matched
    tokens: bool = False  # whether token text is shown beside ids
    draft_intervention: dict[str, Any] | None = None  # what each dump's run changed (ABLATE FEATURES), from its sidecar
    target_intervention: dict[str, Any] | None = None
    draft_adapter: dict[str, Any] | None = None  # the exit adapter the draft was read through, from its sidecar


class LadderResult(Result):
    kind: Literal["draft_ladder"] = "draft_ladder"
    prompts_file: str
    into: str | None
    model_layers: int
    depths: list[int]
    rows: list[dict[str, Any]]
    target: dict[str, Any]
    report: dict[str, Any]
    plot_path: str | None = None  # the chart written with PLOT INTO
    interrupted: bool = False  # Ctrl-C: the depths finished before it

    def plot(self, path: str | None = None):
        """Draw the ladder (KL and top-1 against depth); with ``path`` also save it (.png or
        .svg). Returns the matplotlib Figure. matplotlib is an optional extra."""
        fig = ladder_figure(self)
        if path is not None:
            save_figure(fig, path)
        return fig


class AdapterResult(Result):
    kind: Literal["fit_adapter"] = "fit_adapter"
    key: str  # the derived representation's key in the container
    depth: int
    model_layers: int
    facts: dict[str, Any]  # the adapter's provenance (corpus, digest, positions, ridge, residuals)
    edge: dict[str, Any]
    fit_seconds: float


class VocabCutResult(Result):
    kind: Literal["fit_vocab_cut"] = "fit_vocab_cut"
    key: str  # the derived representation's key in the container
    facts: dict[str, Any]  # the cut's provenance (k, vocabulary, corpus, digest, texts, tokens counted, kept share)
    fit_seconds: float


# ---- representations and maintenance (vindex3.represent, .compact, .diff, .evidence) ----



# ---- plans ----


@dataclass(frozen=True, eq=False)
class SetDraft(Node):
    """DRAFT DEPTH n (slice bound) or DRAFT OFF (slice of the full model, or None unbound)."""

    slice: SliceBinding | None
    depth: int | None
    adapter: dict[str, Any] | None = None  # WITH ADAPTER: the stored drafter component (store.components' row)


@dataclass(frozen=True, eq=False)
class Ladder(Node):
    depths: tuple[int, ...]
    prompts: str
    into: str | None
    plot: str | None
    overwrite: bool = False
    adapters: tuple[dict[str, Any], ...] = ()  # WITH ADAPTER: the stored component read at each depth


@dataclass(frozen=True, eq=False)
class Dump(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    into: str
    intervention: Any = None
    overwrite: bool = False
    stream: Any = None  # PATCH / STEER (lql.statements.interventions.BoundInterventions)
    adapter: dict[str, Any] | None = None  # WITH ADAPTER: the stored drafter component (store.components' row)


@dataclass(frozen=True, eq=False)
class Score(Node):
    draft: str
    target: str


@dataclass(frozen=True, eq=False)
class FitAdapterPlan(Node):
    slice: SliceBinding
    depth: int
    corpus: str | None
    ridge: float | None  # None: chosen by cross-validation on the corpus (vindex3.draft.adapter.choose_ridge)


@dataclass(frozen=True, eq=False)
class FitVocabPlan(Node):
    k: int
    corpus: str | None


@fam.plans(FitAdapter)
def plan_fit_adapter(s: FitAdapter, ctx: Context) -> Node:
    sl = ctx.catalog.bind_slice(s.depth)  # the same refusal as DRAFT DEPTH n for a depth the model lacks
    if s.corpus is not None:
        files.input_file(s.corpus, "FIT ADAPTER corpus")
    return FitAdapterPlan(s, slice=sl, depth=s.depth, corpus=s.corpus,
                          ridge=s.ridge)


@fam.plans(FitVocabCut)
def plan_fit_vocab(s: FitVocabCut, ctx: Context) -> Node:
    vocab = int(ctx.catalog.container.graph.vocab_size)
    if s.k > vocab:
        raise s.error(f"FIT VOCAB CUT TOP {s.k} is more than the vocabulary ({vocab} tokens)")
    if s.corpus is not None:
        files.input_file(s.corpus, "FIT VOCAB CUT corpus")
    return FitVocabPlan(s, k=s.k, corpus=s.corpus)


@fam.plans(DraftDepth)
def plan_draft_depth(s: DraftDepth, ctx: Context) -> Node:
    sl = ctx.catalog.bind_slice(s.depth)
    adapter = _stored_adapter(s, ctx, s.depth) if s.adapter else None
    return SetDraft(s, slice=sl, depth=s.depth, adapter=adapter)


def draft_slice(s: ast.Statement, ctx: Context, depth: int | None) -> SliceBinding:
    """The slice a statement that reads the draft's logits runs (INFER, TRACE, EXPLAIN, DUMP
    LOGITS): the depth it names, else the session's; with the session's DRAFT DEPTH d WITH
    ADAPTER (and no depth on the statement) the slice reads through the exit adapter stored for
    d, looked up again here, so one removed or gone stale since is refused by name."""
    if depth is not None or not ctx.draft_adapter:
        return ctx.catalog.bind_slice(depth if depth is not None else ctx.draft_depth)
    d = ctx.draft_depth
    sl = ctx.catalog.bind_slice(d)
    return SliceBinding(sl.depth, sl.plan, adapter=_stored_adapter(s, ctx, d, session=True))


@fam.plans(DraftOff)
def plan_draft_off(s: DraftOff, ctx: Context) -> Node:
    return SetDraft(s, slice=ctx.catalog.bind_slice(None) if ctx.bound else None, depth=None)


@fam.plans(DraftLadder)
def plan_ladder(s: DraftLadder, ctx: Context) -> Node:
    for d in s.depths:
        ctx.catalog.bind_slice(d)  # the same refusal as DRAFT DEPTH n for a depth the model lacks
    overwrite = may_overwrite(s, ctx)
    inside = files.container_paths(ctx.catalog)
    files.input_file(s.prompts, "DRAFT LADDER prompt bank")
    if s.into is not None:
        files.output_file(s.into, "DRAFT LADDER report", overwrite=overwrite, inside=inside)
    if s.plot is not None:
        files.output_file(s.plot, "DRAFT LADDER chart", overwrite=overwrite, inside=inside)
        if s.into is not None and _same_file(s.into, s.plot):
            raise err(s, f"DRAFT LADDER writes its report and its chart to the same file {s.plot!r}",
                       hint="give PLOT INTO another file")
    adapters = tuple(_stored_adapter(s, ctx, d) for d in s.depths) if s.adapter else ()
    return Ladder(s, depths=tuple(s.depths), prompts=s.prompts, into=s.into, plot=s.plot, overwrite=overwrite,
                  adapters=adapters)


def _same_file(a: str, b: str) -> bool:
    import os

    return os.path.realpath(a) == os.path.realpath(b)


@fam.plans(DumpLogits)
def plan_dump(s: DumpLogits, ctx: Context) -> Node:
    cat = ctx.catalog
    overwrite = may_overwrite(s, ctx)
    files.output_file(s.into, "DUMP LOGITS file", overwrite=overwrite, inside=files.container_paths(cat))
    sl = draft_slice(s, ctx, s.depth)
    prompt = bind_prompt(ctx, s.prompt)
    p = len(prompt.ids)
    limits.check_positions(p, cat.context_length, ctx.settings, run_words("DUMP LOGITS", p))
    (limits.Need().add("one step at the end", cat.estimate(1, sl.depth, start=p - 1))
     .add(f"the logits [{p:,}, {cat.vocab:,}] and their bytes", extra=2 * p * cat.vocab * 4)
     .check(ctx.settings, "DUMP LOGITS"))
    from .interventions import bind_interventions

    adapter = _stored_adapter(s, ctx, sl.depth) if s.adapter else sl.adapter
    return Dump(s, slice=sl, prompt=prompt, into=s.into, overwrite=overwrite,
                intervention=cat.ablation(s.ablate, sl),
                stream=bind_interventions(s, ctx, sl, prompt, s.patch, s.steer, s.steer_vector), adapter=adapter)


def _stored_adapter(s: ast.Statement, ctx: Context, depth: int | None, *, session: bool = False) -> dict[str, Any]:
    """DRAFT DEPTH d WITH ADAPTER outside speculation: the exit adapter the container stores for d
    (index.json only; the run reads the file and checks its SHA-256). Absent, stale, or asked of
    the full model: refused by name. ``session``: the depth is the session's DRAFT DEPTH d WITH
    ADAPTER, read by ``s``."""
    from vindex3.draft.store import ADAPTER, adapter_key, components

    if depth is None:
        raise err(s, f"{s.keyword} ... WITH ADAPTER reads a draft's residual through its exit adapter; this run is the "
                     "full model", hint="name the draft: DRAFT DEPTH d WITH ADAPTER")
    what = (f"DRAFT LADDER ... WITH ADAPTER (depth {depth})" if isinstance(s, DraftLadder)
            else f"DRAFT DEPTH {depth} WITH ADAPTER" if isinstance(s, DraftDepth)
            else f"{s.keyword} (the session's DRAFT DEPTH {depth} WITH ADAPTER)" if session
            else f"{s.keyword} ... DRAFT DEPTH {depth} WITH ADAPTER")
    rows = components(ctx.catalog.container)
    key = adapter_key(depth)
    row = next((x for x in rows if x["key"] == key and x["kind"] == ADAPTER), None)
    if row is None:
        have = sorted(int(x["edge"]["depth"]) for x in rows if x["kind"] == ADAPTER and isinstance(x.get("edge"), dict))
        stored = f"adapters are stored for depths {', '.join(map(str, have))}" if have else "no exit adapter is stored"
        raise err(s, f"{what}: {ctx.catalog.name} stores no exit adapter at "
                     f"depth {depth} ({stored})", hint=f"fit one: FIT ADAPTER AT DEPTH {depth}")
    if not row["fresh"]:
        raise err(s, f"{what}: the exit adapter stored as {key!r} was fitted "
                     "on another container (stale)", hint=f"fit it again: FIT ADAPTER AT DEPTH {depth}")
    return row


@fam.plans(ScoreDraft)
def plan_score(s: ScoreDraft, ctx: Context) -> Node:
    files.input_file(s.draft, "SCORE DRAFT draft dump")
    files.input_file(s.target, "SCORE DRAFT target dump")
    return Score(s, draft=s.draft, target=s.target)



# ---- running ----


@fam.runs(SetDraft)
def run_set_draft(session, node: SetDraft) -> DraftResult:
    session.draft_depth = node.depth
    session.draft_adapter = node.adapter is not None
    sl = node.slice
    if sl is None:  # DRAFT OFF with nothing bound
        return DraftResult(depth=None, model_layers=0, executed_layers=[],
                             reads=ReadCost(ends_reads=0, ends_bytes=0, layer_reads=0, layer_bytes=0,
                                              total_reads=0, total_bytes=0))
    return DraftResult(depth=node.depth, model_layers=session.catalog.num_layers,
                         executed_layers=sl.executed_layers, reads=sl.reads, adapter=adapter_facts(node.adapter))


def adapter_facts(row: dict[str, Any] | None) -> dict[str, Any] | None:
    """A stored exit adapter as results name it: key, the SHA-256 of its file, the edge and the
    fit's provenance (depth, corpus and its digest, positions, ridge, fit residual)."""
    if row is None:
        return None
    p = row.get("params") or {}
    return {"key": row["key"], "sha256": row.get("sha256"), "edge": row.get("edge"),
            **{k: p.get(k) for k in ("depth", "corpus", "corpus_sha256", "positions", "ridge", "fit_residual") if k in p}}


def adapter_words(a: dict[str, Any]) -> str:
    """'drafter_adapter_d2' (sha256 0123456789ab…, after layer 1; ridge 1 on 2072 positions of
    'seeds', fit residual 0.362)."""
    edge = a.get("edge") or {}
    fit = []
    if a.get("ridge") is not None and a.get("positions") is not None:
        fit.append(f"ridge {a['ridge']:g} on {a['positions']} positions of {a.get('corpus')!r}")
    if a.get("fit_residual") is not None:
        fit.append(f"fit residual {a['fit_residual']:.3g}")
    sha = f"sha256 {str(a.get('sha256'))[:12]}…, " if a.get("sha256") else ""
    return (f"{a['key']!r} ({sha}after layer {edge.get('after_layer')}"
            + (f"; {', '.join(fit)}" if fit else "") + ")")


@fam.runs(Dump)
def run_dump(session, node: Dump) -> DumpResult:
    draft = draft_module("DUMP LOGITS")
    c = session.container
    path = Path(node.into)
    try:
        extra = {}
        if node.stream is not None:  # PATCH / STEER: values from the source prompts' runs on this slice
            from .interventions import build_interventions

            ex, _ = session.executor(node.slice.depth, node.intervention)
            extra["interventions"] = build_interventions(ex, node.stream)
        if node.adapter is not None:  # read and checked (SHA-256, container, shape) here, not at planning
            extra["adapter"] = "stored"
        meta = draft.dump_logits(c, list(node.prompt.ids), slice_of(node.slice.depth), path, overwrite=node.overwrite,
                                 max_positions=session.settings.max_positions, intervention=node.intervention,
                                 activations=session.settings.activations, **extra)
    except OSError as e:
        raise FileRefusal(f"cannot write {path}: {e.strerror or e}") from None
    sidecar = draft.sidecar_path(path) if hasattr(draft, "sidecar_path") else Path(f"{path}.meta.json")
    return DumpResult(path=str(path), sidecar=str(sidecar), depth=meta.get("draft_depth"),
                        positions=int(meta["positions"]), vocab=int(meta["vocab"]),
                        executed_layers=list(meta.get("executed_layers", [])), meta=meta)


@fam.runs(Score)
def run_score(session, node: Score) -> ScoreResult:
    draft = draft_module("SCORE DRAFT")
    for key in ("draft", "target"):
        if not Path(getattr(node, key)).exists():
            raise FileRefusal(f"SCORE DRAFT: the {key} dump {getattr(node, key)} does not exist")
    rep = draft.score_files(node.draft, node.target)
    positions = [p.model_dump(mode="json") for p in rep.positions]
    # Token text beside ids, when the bound container is the one both dumps were made on.
    tokens = False
    if session.bound and session.catalog.has_tokenizer and session.container.digest == rep.container_digest:
        tokens = True
        for p in positions:
            p["target_token"] = session.catalog.token_text(p["target_argmax"])
            p["draft_token"] = session.catalog.token_text(p["draft_argmax"])
    return ScoreResult(
        draft=node.draft, target=node.target, depth=rep.draft_depth, model_layers=rep.model_layers,
        summary=rep.summary.model_dump(mode="json"), positions=positions, tokens=tokens,
        draft_intervention=rep.draft_intervention, target_intervention=rep.target_intervention,
        draft_adapter=rep.draft_adapter,
    )


def ladder_result(rep, *, prompts_file: str, into: str | None, plot_path: str | None = None) -> LadderResult:
    """A vindex3 ladder report as a result (also used by the vindex3 command's printer)."""
    full = rep.model_dump(mode="json")
    rows = full.pop("rows")
    return LadderResult(prompts_file=prompts_file, into=into, model_layers=rep.model_layers,
                          depths=list(rep.depths), rows=rows, target=full.get("target", {}), report=full,
                          plot_path=plot_path)


@fam.runs(Ladder)
def run_ladder(session, node: Ladder) -> LadderResult:
    draft = draft_module("DRAFT LADDER")
    prompts = Path(node.prompts)
    into = node.into
    if node.plot is not None:
        require_matplotlib("DRAFT LADDER ... PLOT INTO")  # before the long run, not after it
    _check_ladder_memory(session, node)
    finished: list = []
    try:
        rep = draft.run_ladder(session.container, list(node.depths), prompts, out_path=into,
                               progress=session.on_progress, on_row=finished.append, overwrite=node.overwrite,
                               max_prompts=session.settings.max_prompts,
                               max_positions=session.settings.max_positions, adapters=bool(node.adapters))
    except KeyboardInterrupt:  # Ctrl-C: the depths finished so far
        return LadderResult(prompts_file=str(prompts), into=None, model_layers=session.catalog.num_layers,
                              depths=[r.depth for r in finished], rows=[r.model_dump(mode="json") for r in finished],
                              target={}, report={}, interrupted=True)
    result = ladder_result(rep, prompts_file=str(prompts), into=into, plot_path=node.plot)
    if node.plot is not None:
        from ..files import container_paths, output_file

        # checked again: the ladder ran for a while, and a file may have appeared meanwhile
        output_file(node.plot, "DRAFT LADDER chart", overwrite=node.overwrite, inside=container_paths(session.container))
        try:
            save_figure(ladder_figure(result), node.plot)
        except OSError as e:
            raise FileRefusal(f"cannot write {node.plot}: {e.strerror or e}") from None
    return result


def _check_ladder_memory(session, node: Ladder) -> None:
    """The ladder's arrays for its longest prompt (each dump holds one prompt's logits), before
    any work: the bank is read (``max_prompts`` refused by vindex3 as it reads) and tokenised."""
    from vindex3.draft.bank import load_prompts
    from vindex3.errors import LimitExceeded

    from .. import limits

    cat = session.catalog
    limit = session.settings.max_prompts
    try:
        bank = load_prompts(node.prompts, max_prompts=limit)
    except LimitExceeded:
        raise LimitError(f"DRAFT LADDER: the prompt bank {node.prompts!r} holds more than {limit:,} prompts; "
                         f"max_prompts is {limit:,}", hint="use a smaller bank, or SET max_prompts = n to allow more") from None
    longest = max((len(p.token_ids) if p.token_ids is not None else len(cat.tokenize(p.text)) for p in bank), default=0)
    if longest < 1:
        return
    for d in (None, *node.depths):
        need = limits.Need().add("one step at the end", cat.estimate(1, d, start=longest - 1)).add(
            f"the logits of the longest prompt [{longest:,}, {cat.vocab:,}] and their bytes", extra=2 * longest * cat.vocab * 4)
        need.check(session.settings, f"DRAFT LADDER (its longest prompt, {longest:,} tokens)")


def ladder_text(report, *, timing: bool = True) -> str:
    """A vindex3 LadderReport as DRAFT LADDER prints it."""
    from ..render import to_text

    return to_text(ladder_result(report, prompts_file=report.prompts_file, into=None), timing=timing)


@fam.runs(FitAdapterPlan)
def run_fit_adapter(session, node: FitAdapterPlan) -> AdapterResult:
    import time

    from vindex3.draft import store
    from vindex3.draft.adapter import fit_adapter, read_corpus

    c = session.container
    texts = read_corpus(node.corpus) if node.corpus is not None else None
    t0 = time.perf_counter()
    a = fit_adapter(c, node.depth, texts, corpus=Path(node.corpus).name if node.corpus else None, ridge=node.ridge)
    secs = time.perf_counter() - t0
    entry = store.store_adapter(c, a)
    return AdapterResult(key=store.adapter_key(node.depth), depth=node.depth, model_layers=session.catalog.num_layers,
                         facts=a.facts.model_dump(mode="json"), edge=entry["edge"], fit_seconds=secs)


@fam.runs(FitVocabPlan)
def run_fit_vocab(session, node: FitVocabPlan) -> VocabCutResult:
    import time

    from vindex3.draft import store
    from vindex3.draft.adapter import read_corpus
    from vindex3.draft.vocab import fit_vocab_cut

    c = session.container
    texts = read_corpus(node.corpus) if node.corpus is not None else None
    t0 = time.perf_counter()
    cut = fit_vocab_cut(c, node.k, texts, corpus=Path(node.corpus).name if node.corpus else None)
    secs = time.perf_counter() - t0
    store.store_vocab_cut(c, cut)
    facts = cut.model_dump(mode="json", exclude={"kept", "container_digest", "method"})
    return VocabCutResult(key=store.vocab_key(node.k), facts=facts, fit_seconds=secs)


# ---- layouts ----


@fam.layout(DraftResult)
def layout_draft(r: DraftResult, timing: bool) -> list[str]:
    if r.depth is None:
        return [f"draft off: later statements run the full model ({r.model_layers} layers)"]
    c = r.reads
    return [
        (f"draft depth {r.depth}: later INFER, TRACE, EXPLAIN and DUMP LOGITS run "
        f"{layers_phrase(r.executed_layers)} of {r.model_layers}"
         + (", read through its exit adapter" if r.adapter is not None else "")),
    ] + fields([("reads", f"{c.total_reads} operands, {fmt_bytes(c.total_bytes)}"),
                ("adapter", adapter_words(r.adapter) if r.adapter is not None else None)])


@fam.layout(DumpResult)
def layoutdump(r: DumpResult, timing: bool) -> list[str]:
    slice_ = "full model" if r.depth is None else f"draft depth {r.depth}"
    if r.meta.get("adapter") is not None:
        slice_ += f" through exit adapter {r.meta['adapter'].get('key')!r}"
    out = [f"dumped {r.positions} x {r.vocab:,} float32 logits ({slice_}) to {r.path}"]
    out += fields([
        ("sidecar", r.sidecar),
        ("layers run", fmt_layers(r.executed_layers)),
        ("container", str(r.meta.get("container_digest", "-"))[:16]),
        ("ablated", intervention(r.meta.get("intervention"))),
    ])
    if timing:
        out += fields([
            ("prepare", fmt_seconds(r.meta.get("prepare_seconds"))),
            ("per position", f"{r.meta['ms_per_position']:.2f} ms" if r.meta.get("ms_per_position") is not None else None),
        ])
    return out


@fam.layout(ScoreResult)
def layout_score(r: ScoreResult, timing: bool) -> list[str]:
    slice_ = f"full model, {r.model_layers} layers" if r.depth is None else f"depth {r.depth} of {r.model_layers}"
    if r.draft_adapter is not None:
        slice_ += f", through exit adapter {r.draft_adapter.get('key')!r}"
    out = [f"draft {r.draft} ({slice_}) against {r.target} (full model)"]
    if r.draft_intervention is not None or r.target_intervention is not None:
        # an ablated run against a clean one (or two ablations) is a different comparison: say so
        out += fields([("draft run", intervention(r.draft_intervention) or "clean (no intervention)"),
                       ("target run", intervention(r.target_intervention) or "clean (no intervention)")])
    out += fields(summary_fields(r.summary))
    if r.positions:
        if r.tokens:
            out += [""] + table(
                [num("pos"), num("KL"), "top-1", num("target argmax"), "target token", num("draft argmax"), "draft token", num("rank in draft")],
                [[str(p["position"]), f"{p['kl']:.4f}", "yes" if p.get("top1") else "no", str(p["target_argmax"]),
                  fmt_text(p.get("target_token")), str(p["draft_argmax"]), fmt_text(p.get("draft_token")),
                  str(p["target_rank_in_draft"])] for p in r.positions],
            )
        else:
            out += [""] + table(
                [num("pos"), num("KL"), "top-1", num("target argmax"), num("draft argmax"), num("rank in draft")],
                [[str(p["position"]), f"{p['kl']:.4f}", "yes" if p.get("top1") else "no", str(p["target_argmax"]),
                  str(p["draft_argmax"]), str(p["target_rank_in_draft"])] for p in r.positions],
            )
    return out


@fam.layout(LadderResult)
def layout_ladder(r: LadderResult, timing: bool) -> list[str]:
    headers = [num(h) for h in ("depth", "positions", "top-1", "KL p50", "KL p90", "KL p99", "rank p50", "top-5",
                                "top-20")]
    if timing:
        headers += [num("prepare"), num("ms/position")]
    rows = []
    for row in r.rows:
        s = row["summary"]
        cells = [str(row["depth"]), str(s["positions"]), f"{s['top1']:.3f}", f"{s['kl_p50']:.4f}",
                 f"{s['kl_p90']:.4f}", f"{s['kl_p99']:.4f}", f"{s['median_target_rank']:g}",
                 f"{s['top5']:.3f}", f"{s['top20']:.3f}"]
        if timing:
            cells += [fmt_seconds(row.get("prepare_seconds")), f"{row['ms_per_position']:.2f} ms"]
        rows.append(cells)
    if r.interrupted:
        done = ", ".join(str(d) for d in r.depths) or "none"
        out = [f"depth ladder on {r.prompts_file}: interrupted; depths finished: {done}"]
    else:
        out = [f"depth ladder on {r.prompts_file}: {r.report.get('prompts', '?')} prompts, {r.model_layers}-layer model"]
    through = [f"{row['depth']}: {row['adapter']['key']!r}" for row in r.rows if row.get("adapter")]
    if through:
        out.append(f"drafts read through exit adapters ({', '.join(through)})")
    if rows:
        out += table(headers, rows)
    if timing and r.target:
        out.append(f"full model: {fmt_seconds(r.target.get('prepare_seconds'))} prepare, "
                   f"{r.target.get('ms_per_position', 0.0):.2f} ms per position")
    if r.into:
        out.append(f"report written to {r.into}")
    if r.plot_path:
        out.append(f"chart written to {r.plot_path}")
    return out


@fam.layout(AdapterResult)
def layout_fit_adapter(r: AdapterResult, timing: bool) -> list[str]:
    f = r.facts
    out = [f"exit adapter at depth {r.depth} of {r.model_layers} fitted and stored as drafter component {r.key!r}"]
    out += fields([
        ("edge", f"hidden state after layer {r.edge.get('after_layer')} -> the final norm"),
        ("corpus", f"{f['corpus']} ({f['texts']} texts, {f['positions']} positions)"),
        ("ridge", f"{f['ridge']:g}" + (" (given)" if f.get("ridge_choice", "given") == "given" else
                                       f" (chosen by {f['ridge_choice'].split(':')[0]})")),
        ("fit residual", f"{f['fit_residual']:.3g} of the final residual's norm (no adapter: {f['identity_residual']:.3g})"),
    ])
    if timing:
        out += fields([("fit time", fmt_seconds(r.fit_seconds))])
    return out


@fam.layout(VocabCutResult)
def layout_fit_vocab(r: VocabCutResult, timing: bool) -> list[str]:
    f = r.facts
    out = [(f"vocabulary cut of the {f['k']} most frequent of {f['vocab']} tokens counted and stored as drafter "
            f"component {r.key!r}")]
    out += fields([
        ("corpus", f"{f['corpus']} ({f['texts']} texts, {f['tokens_counted']} tokens)"),
        ("kept share", f"{f['kept_share']:.3f} of the counted tokens"),
    ])
    if timing:
        out += fields([("fit time", fmt_seconds(r.fit_seconds))])
    return out


@fam.records(ScoreResult)
def records_score(r: ScoreResult) -> list[dict[str, Any]]:
    return [dict(p) for p in r.positions]


@fam.records(LadderResult)
def records_ladder(r: LadderResult) -> list[dict[str, Any]]:
    out = []
    for row in r.rows:
        rec = {"depth": row["depth"], **{k: v for k, v in row["summary"].items()}}
        rec.update({k: row[k] for k in ("executed_layers", "prepare_seconds", "ms_per_position") if k in row})
        out.append(rec)
    return out


