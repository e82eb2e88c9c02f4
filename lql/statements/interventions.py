"""Interventions on a run at named, operator-neutral sites (vindex3.exec.intervention): PATCH
SWEEP (the causal-tracing grid: the corrupted run patched with the clean run's values one layer
and position at a time) and CAPTURE (a run's values at named sites into an .npz with a
provenance sidecar). A site a layer lacks (FFN on a mixer-only layer, HEADS off attention) is
refused by name, naming the layer and its operator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from .. import ast
from ..binding import SliceBinding, check_output, internals
from ..layouts import time, token
from ..planner import (
    BoundPrompt,
    Context,
    Node,
    bind_prompt,
    check_executed_layers,
    check_span,
    depth_of,
    err,
    may_overwrite,
)
from ..registry import family
from ..results import Data, Result, dump
from ..syntax import BuildError, Children, Clause
from ..text import fields, fmt_bytes, layers_phrase, num, table

fam = family("interventions", module=__name__, statements=("patch_sweep_stmt", "capture_stmt", "show_attention_stmt"),
             path_keywords=("INTO",), grammar=r"""
// PATCH SWEEP 'corrupted' FROM 'clean' FOR 'token' SITE RESIDUAL [LAYERS a-b]: the causal-tracing grid
patch_sweep_stmt: PATCH SWEEP prompt FROM prompt FOR token_ref SITE site_name sweep_option* [PLOT INTO STRING [overwrite_clause]]

?sweep_option: layers_clause
             | draft_clause

// a site of every layer: RESIDUAL (entering), RESIDUAL POST (leaving), MIXER / FFN (their writes),
// HEADS (each attention head's output before the output projection)
site_name: RESIDUAL [POST]
         | MIXER
         | FFN
         | HEADS

// CAPTURE 'prompt' SITES RESIDUAL, MIXER [LAYERS a-b] INTO 'acts.npz': a run's values at named sites
capture_stmt: CAPTURE prompt SITES site_name (_COMMA site_name)* capture_option* INTO STRING [overwrite_clause]

?capture_option: layers_clause
               | draft_clause
               | patch_clause
               | steer_clause

// SHOW ATTENTION 'prompt' AT LAYER n [HEAD h]: a softmax layer's weights as the model computes them
show_attention_stmt: SHOW ATTENTION prompt AT LAYER INT [HEAD INT] [draft_clause]

// INFER / TRACE ... PATCH site AT LAYER n POSITION p | POSITIONS p, q | POSITIONS ALL FROM 'clean':
// the run with the site's values at those positions taken from the other prompt's run
patch_clause: PATCH patch_site AT LAYER INT patch_where FROM prompt
?patch_site: site_name
          | HEADS int_list                       -> heads_site
patch_where: POSITION INT
           | POSITIONS ALL
           | POSITIONS int_list

// INFER / TRACE ... STEER AT LAYER n WITH 'a' MINUS 'b' | VECTOR 'v.npy' SCALE x: activation addition
steer_clause: STEER AT LAYER INT WITH steer_source SCALE literal
steer_source: prompt MINUS prompt                -> steer_prompts
            | VECTOR STRING                      -> steer_vector
""")

fam.doc('PATCH SWEEP',
        "PATCH SWEEP 'corrupted' FROM 'clean' FOR 'token' SITE RESIDUAL | RESIDUAL POST | MIXER | FFN [LAYERS a-b] [DRAFT DEPTH n] [PLOT INTO 'grid.png' [OVERWRITE]]",
        "the corrupted run patched with the clean run's values at one layer and position at a time: the token's "
        "logit and the recovered fraction (PLOT INTO: the grid as a heatmap, .png or .svg)",
        "PATCH SWEEP 'The capital of Italy is' FROM 'The capital of France is' FOR ' Paris' SITE RESIDUAL;",
        order=125, aliases=('PATCH',))
fam.doc('CAPTURE',
        "CAPTURE 'prompt' SITES RESIDUAL [POST] | MIXER | FFN | HEADS, ... [LAYERS a-b] [DRAFT DEPTH n] [PATCH ... FROM 'source'] [STEER AT LAYER n WITH ... SCALE x] INTO 'acts.npz' [OVERWRITE]",
        "a run's values at named sites (L12.residual, ...) into an .npz, with a provenance sidecar",
        "CAPTURE 'Hello world' SITES RESIDUAL, MIXER, FFN LAYERS 0-1 INTO 'acts.npz';", order=126)


fam.doc('SHOW ATTENTION',
        "SHOW ATTENTION 'prompt' AT LAYER n [HEAD h] [DRAFT DEPTH n]",
        "a softmax layer's attention weights for a prompt: rows (head, query, key, weight), as the model computes them",
        "SHOW ATTENTION 'Hello world' AT LAYER 0 HEAD 1;", order=127)


@fam.rule
def show_attention_stmt(c: Children) -> ShowAttention:
    return ShowAttention(prompt=c.get("ATTENTION"), layer=c.int("LAYER"), head=c.int("HEAD"), **c.options("SHOW ATTENTION"))


@fam.rule
def site_name(c: Children) -> str:
    if c.has("RESIDUAL"):
        return "residual_post" if c.has("POST") else "residual"
    return c.which("MIXER", "FFN", "HEADS")


@fam.rule
def patch_sweep_stmt(c: Children) -> PatchSweep:
    fields = c.options("PATCH SWEEP")
    return PatchSweep(corrupted=c.get("SWEEP"), clean=c.get("FROM"), token=c.get("FOR"), site=c.get("SITE"),
                      plot=c.string("PLOT", "INTO"), **fields)


@fam.rule
def capture_stmt(c: Children) -> Capture:
    return Capture(prompt=c.get("CAPTURE"), sites=list(c.all("SITES")), into=c.string("INTO"),
                   **intervention_fields(c.options("CAPTURE")))


Site = Literal["residual", "residual_post", "mixer", "ffn", "heads"]


# ---- PATCH and STEER clauses (INFER, TRACE) ----------------------------------------------------


class PatchSpec(ast.Node):
    """PATCH site AT LAYER n POSITION(S) ... FROM 'source': the site's values at those positions
    taken from the source prompt's run (HEADS: the named heads' outputs)."""

    site: Site
    layer: int
    positions: list[int] | Literal["all"]
    heads: list[int] | None = None
    source: ast.Prompt


class SteerSpec(ast.Node):
    """STEER AT LAYER n WITH 'a' MINUS 'b' | VECTOR 'v.npy' SCALE x: scale times the vector added
    to the residual entering the layer at every position of the run. The vector file's path is
    the statement's own field (``steer_vector``), so a server confines it."""

    layer: int
    plus: ast.Prompt | None = None
    minus: ast.Prompt | None = None
    scale: float


@fam.rule
def heads_site(c: Children) -> tuple[str, list[int]]:
    return ("heads", c.get("HEADS"))


@fam.rule
def patch_where(c: Children) -> Clause:
    if c.has("ALL"):
        return c.clause("positions", "all")
    if c.has("POSITION"):
        return c.clause("positions", [c.int("POSITION")])
    return c.clause("positions", list(c.get("POSITIONS")))


@fam.rule
def patch_clause(c: Children) -> Clause:
    site = c.get("PATCH")
    heads = None
    if isinstance(site, tuple):
        site, heads = site
    elif site == "heads":
        raise BuildError("PATCH HEADS names the heads it patches", c.first, hint="e.g. PATCH HEADS 4, 7 AT LAYER 3 ...")
    where = c.options("PATCH")["positions"]
    return c.clause("patch", PatchSpec(site=site, layer=c.int("LAYER"), positions=where, heads=heads,
                                       source=c.get("FROM")), "PATCH")


@fam.rule
def steer_prompts(c: Children) -> tuple:
    plus, minus = c.values(2)
    return (plus, minus)


@fam.rule
def steer_vector(c: Children) -> str:
    return c.string("VECTOR")


@fam.rule
def steer_clause(c: Children) -> Clause:
    src = c.get("WITH")
    scale = c.get("SCALE")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise BuildError(f"STEER ... SCALE takes a number, not {scale!r}", c.keyword("SCALE"), hint="e.g. SCALE 4")
    if isinstance(src, tuple):
        spec, vector = SteerSpec(layer=c.int("LAYER"), plus=src[0], minus=src[1], scale=float(scale)), None
    else:
        spec, vector = SteerSpec(layer=c.int("LAYER"), scale=float(scale)), src
    return c.clause("steer", (spec, vector), "STEER")


def intervention_fields(fields: dict) -> dict:
    """A statement's clause fields with STEER's (spec, vector path) split into ``steer`` and
    ``steer_vector``."""
    if "steer" in fields:
        fields["steer"], fields["steer_vector"] = fields["steer"]
    return fields


@dataclass(frozen=True, eq=False)
class BoundPatch:
    site: str
    layer: int
    positions: tuple[int, ...]
    heads: tuple[int, ...] | None
    source: BoundPrompt
    words: str  # the source in words, for the record


@dataclass(frozen=True, eq=False)
class BoundSteer:
    layer: int
    plus: BoundPrompt | None
    minus: BoundPrompt | None
    vector: str | None
    scale: float
    words: str


@dataclass(frozen=True, eq=False)
class BoundInterventions:
    """A statement's PATCH and STEER, bound against the container and the slice: checked, with
    their prompts tokenized; the values are computed when the statement runs (`build`)."""

    patch: BoundPatch | None
    steer: BoundSteer | None

    def describe(self) -> str:
        out = []
        if self.patch is not None:
            p = self.patch
            site = p.site.upper().replace("_", " ") + (" " + ", ".join(map(str, p.heads)) if p.heads else "")
            pos = "POSITION" + ("S " if len(p.positions) > 1 else " ") + ", ".join(map(str, p.positions))
            out.append(f"PATCH {site} AT LAYER {p.layer} {pos} FROM {p.words}")
        if self.steer is not None:
            out.append(f"STEER AT LAYER {self.steer.layer} WITH {self.steer.words} SCALE {self.steer.scale:g}")
        return "; ".join(out)


def _prompt_words(b: BoundPrompt) -> str:
    return repr(b.text) if b.text is not None else f"TOKENS ({', '.join(map(str, b.ids))})"


def bind_interventions(s: ast.Statement, ctx: Context, sl: SliceBinding, run: BoundPrompt,
                       patch: PatchSpec | None, steer: SteerSpec | None, vector: str | None) -> BoundInterventions | None:
    """PATCH / STEER of statement ``s`` bound: a site the layer lacks, a layer the slice does not
    run, a head the layer lacks, positions the run's or the source's prompt does not have, and
    prompts of different lengths under POSITIONS ALL are each refused by name."""
    if patch is None and steer is None:
        return None
    from vindex3.errors import QueryRefused
    from vindex3.exec.intervention import check_site

    cat = ctx.catalog
    kw = s.keyword
    bp = bs = None
    if patch is not None:
        try:
            check_site(cat.op_plan, patch.layer, patch.site, f"{kw} ... PATCH")
        except QueryRefused as e:
            raise err(s, str(e), hint="SHOW LAYERS lists each layer's operator") from None
        check_executed_layers(s, sl, (patch.layer,), f"{kw} ... PATCH")
        src = bind_prompt(ctx, patch.source)
        n, m = len(run.ids), len(src.ids)
        if patch.positions == "all":
            if n != m:
                raise err(s, f"{kw} ... PATCH POSITIONS ALL: the prompt is {n} tokens and the source {m}; patching "
                             "every position needs the same length", hint="name positions, or prompts of one length")
            positions = tuple(range(n))
        else:
            positions = tuple(patch.positions)
            if len(set(positions)) != len(positions):
                raise err(s, f"{kw} ... PATCH names a position twice", hint="name each position once")
            for p in positions:
                if p >= min(n, m):
                    which = "prompt" if p >= n else "source prompt"
                    raise err(s, f"{kw} ... PATCH: position {p} is past the {which} ({n if p >= n else m} tokens, "
                                 f"positions 0..{(n if p >= n else m) - 1})",
                              hint="a patched position is in both prompts")
        heads = None
        if patch.heads is not None:
            from vindex3.errors import UnsupportedOperator
            from vindex3.exec.intervention import heads_op

            try:
                heads_op(cat.op_plan, patch.layer, f"{kw} ... PATCH HEADS")  # MLA heads: no executor, said here
            except (QueryRefused, UnsupportedOperator) as e:
                raise err(s, str(e), hint="choose a softmax layer (SHOW LAYERS lists each layer's operator)") from None
            nh = int(cat.op_plan.layers[patch.layer].params.get("heads") or 0)
            heads = tuple(patch.heads)
            if len(set(heads)) != len(heads):
                raise err(s, f"{kw} ... PATCH HEADS names a head twice", hint="name each head once")
            bad = [h for h in heads if h >= nh]
            if bad:
                raise err(s, f"{kw} ... PATCH HEADS: layer {patch.layer} has {nh} heads (0..{nh - 1}); no head {bad[0]}")
        bp = BoundPatch(site=patch.site, layer=patch.layer, positions=positions, heads=heads, source=src,
                        words=_prompt_words(src))
    if steer is not None:
        try:
            check_site(cat.op_plan, steer.layer, "residual", f"{kw} ... STEER")
        except QueryRefused as e:
            raise err(s, str(e)) from None
        check_executed_layers(s, sl, (steer.layer,), f"{kw} ... STEER")
        if vector is not None:
            from .. import files

            files.input_file(vector, f"{kw} ... STEER ... VECTOR")
            bs = BoundSteer(layer=steer.layer, plus=None, minus=None, vector=vector, scale=steer.scale,
                            words=f"VECTOR {vector!r}")
        else:
            plus, minus = bind_prompt(ctx, steer.plus), bind_prompt(ctx, steer.minus)
            bs = BoundSteer(layer=steer.layer, plus=plus, minus=minus, vector=None, scale=steer.scale,
                            words=f"{_prompt_words(plus)} MINUS {_prompt_words(minus)}")
    return BoundInterventions(patch=bp, steer=bs)


def build_interventions(ex, bound: BoundInterventions | None) -> list:
    """The `vindex3.exec.intervention` values a bound PATCH / STEER stands for, computed on ``ex``:
    a patch's values from the source prompt's run there, a steering vector from the two prompts'
    residuals entering the layer at their last positions (or read from the .npy file)."""
    if bound is None:
        return []
    import numpy as np

    from vindex3.errors import QueryRefused
    from vindex3.exec.intervention import Patch, Steer, site_key

    if not hasattr(ex, "run_with_cache"):
        from ..errors import StatementError

        raise StatementError("PATCH and STEER change a run in this process, and the model runs as shards",
                             hint="SET shards = 0 (or OPEN without SHARDS)")
    out = []
    if bound.patch is not None:
        p = bound.patch
        key = site_key(p.layer, p.site)
        vals = ex.run_with_cache(list(p.source.ids), sites=[key])[key][list(p.positions)]
        if p.heads is not None:
            vals = np.ascontiguousarray(vals[:, list(p.heads)])
        out.append(Patch(p.site, p.layer, p.positions, vals, heads=p.heads,
                         source=p.source.text if p.source.text is not None else p.words))
    if bound.steer is not None:
        st = bound.steer
        if st.vector is not None:
            try:
                vec = np.load(st.vector, allow_pickle=False)
            except (ValueError, OSError) as e:
                raise QueryRefused(f"STEER ... VECTOR {st.vector!r} is not a .npy array this build reads ({e})") from None
            if not isinstance(vec, np.ndarray) or vec.dtype != np.float32 or vec.ndim != 1:
                raise QueryRefused(f"STEER ... VECTOR {st.vector!r} holds {getattr(vec, 'dtype', type(vec).__name__)} "
                                   f"{list(getattr(vec, 'shape', []))}; a steering vector is float32 [hidden]")
        else:
            key = site_key(st.layer, "residual")
            a = ex.run_with_cache(list(st.plus.ids), sites=[key])[key][-1]
            b = ex.run_with_cache(list(st.minus.ids), sites=[key])[key][-1]
            vec = (a - b).astype(np.float32)
        out.append(Steer(st.layer, vec, st.scale, source=st.words))
    return out


class PatchSweep(ast.Statement):
    """PATCH SWEEP 'corrupted' FROM 'clean' FOR 'token' SITE s [LAYERS a-b] [DRAFT DEPTH n]."""

    keyword: ClassVar[str] = "PATCH SWEEP"
    paths: ClassVar[tuple[str, ...]] = ("plot",)
    read_only: ClassVar[bool | str] = "PATCH SWEEP ... PLOT INTO writes a file on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["patch_sweep"] = "patch_sweep"
    corrupted: ast.Prompt
    clean: ast.Prompt
    token: str | int
    site: Site
    layers: ast.LayerSpan | None = None
    depth: int | None = None
    plot: str | None = None  # PLOT INTO 'grid.png' | 'grid.svg': the recovered fractions as a heatmap
    overwrite: bool = False

    def refused_read_only(self) -> str | None:
        return None if self.plot is None else super().refused_read_only()

    def check(self) -> None:
        check_span(self, self.layers)


class Capture(ast.Statement):
    """CAPTURE 'prompt' SITES s, ... [LAYERS a-b] [DRAFT DEPTH n] INTO 'acts.npz' [OVERWRITE]."""

    keyword: ClassVar[str] = "CAPTURE"
    paths: ClassVar[tuple[str, ...]] = ("into", "steer_vector")
    read_only: ClassVar[bool | str] = "CAPTURE ... INTO writes a file on the server"
    needs_container: ClassVar[bool] = True
    kind: Literal["capture"] = "capture"
    prompt: ast.Prompt
    sites: list[Site]
    layers: ast.LayerSpan | None = None
    depth: int | None = None
    into: str
    overwrite: bool = False
    patch: PatchSpec | None = None
    steer: SteerSpec | None = None
    steer_vector: str | None = None

    def check(self) -> None:
        check_span(self, self.layers)
        if len(set(self.sites)) != len(self.sites):
            raise err(self, "CAPTURE names a site twice", hint="name each site once")


class ShowAttention(ast.Statement):
    """SHOW ATTENTION 'prompt' AT LAYER n [HEAD h] [DRAFT DEPTH n]."""

    keyword: ClassVar[str] = "SHOW ATTENTION"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["show_attention"] = "show_attention"
    prompt: ast.Prompt
    layer: int
    head: int | None = None
    depth: int | None = None


@dataclass(frozen=True, eq=False)
class ShowAttentionPlan(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    layer: int
    head: int | None


@dataclass(frozen=True, eq=False)
class PatchSweepPlan(Node):
    slice: SliceBinding
    corrupted: BoundPrompt
    clean: BoundPrompt
    target: int
    site: str
    layers: tuple[int, ...] | None
    plot: str | None = None
    overwrite: bool = False


@dataclass(frozen=True, eq=False)
class CapturePlan(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    sites: tuple[str, ...]
    layers: tuple[int, ...] | None
    into: str
    overwrite: bool
    stream: BoundInterventions | None = None


@fam.plans(PatchSweep)
def plan_patch_sweep(s: PatchSweep, ctx: Context) -> Node:
    cat = ctx.catalog
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    layers = cat.layer_span(s.layers, "LAYERS")
    check_executed_layers(s, sl, layers, "PATCH SWEEP ... LAYERS")
    corrupted, clean = bind_prompt(ctx, s.corrupted), bind_prompt(ctx, s.clean)
    if len(corrupted.ids) != len(clean.ids):
        raise err(s, f"PATCH SWEEP: the corrupted prompt is {len(corrupted.ids)} tokens and the clean one "
                     f"{len(clean.ids)}; patching position by position needs the same length",
                  hint="choose prompts that differ in tokens, not in length")
    overwrite = may_overwrite(s, ctx)
    if s.plot is not None:
        from .. import files
        from ..charts import check_chart_path

        check_chart_path(s.plot, "PATCH SWEEP ... PLOT INTO")
        files.output_file(s.plot, "PATCH SWEEP chart", overwrite=overwrite, inside=files.container_paths(cat))
    return PatchSweepPlan(s, slice=sl, corrupted=corrupted, clean=clean,
                          target=cat.single_token(s.token, "PATCH SWEEP ... FOR"), site=s.site, layers=layers,
                          plot=s.plot, overwrite=overwrite)


@fam.plans(Capture)
def plan_capture(s: Capture, ctx: Context) -> Node:
    cat = ctx.catalog
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    layers = cat.layer_span(s.layers, "LAYERS")
    check_executed_layers(s, sl, layers, "CAPTURE ... LAYERS")
    prompt = bind_prompt(ctx, s.prompt)
    return CapturePlan(s, slice=sl, prompt=prompt, sites=tuple(s.sites), layers=layers,
                       into=s.into, overwrite=bool(s.overwrite or ctx.settings.overwrite),
                       stream=bind_interventions(s, ctx, sl, prompt, s.patch, s.steer, s.steer_vector))


@fam.plans(ShowAttention)
def plan_show_attention(s: ShowAttention, ctx: Context) -> Node:
    from vindex3.errors import QueryRefused
    from vindex3.exec.intervention import check_site

    cat = ctx.catalog
    sl = cat.bind_slice(depth_of(ctx, s.depth))
    try:
        check_site(cat.op_plan, s.layer, "heads", "SHOW ATTENTION")
    except QueryRefused as e:  # said at this statement
        raise err(s, str(e), hint="choose a softmax or MLA layer (SHOW LAYERS lists each layer's operator)") from None
    check_executed_layers(s, sl, (s.layer,), "SHOW ATTENTION ... AT LAYER")
    heads = cat.op_plan.layers[s.layer].params.get("heads")
    if s.head is not None and heads is not None and not 0 <= s.head < int(heads):
        raise err(s, f"SHOW ATTENTION: layer {s.layer} has {heads} heads (0..{int(heads) - 1}); no head {s.head}")
    return ShowAttentionPlan(s, slice=sl, prompt=bind_prompt(ctx, s.prompt), layer=s.layer, head=s.head)


# ---- results ---------------------------------------------------------------------------------


class SweepCell(Data):
    layer: int
    position: int
    token_id: int
    token: str | None
    logit: float
    recovered: float | None


class PatchSweepResult(Result):
    """PATCH SWEEP: one row per (layer, position)."""

    kind: Literal["patch_sweep"] = "patch_sweep"
    site: str
    target_id: int
    target: str | None
    slice: str
    clean_logit: float
    corrupted_logit: float
    layers: list[int]
    positions: int
    cells: list[SweepCell]
    passes: int
    layer_runs: int = 0  # layer executions of the cells' passes (each runs from its layer on)
    seconds: float
    plot_path: str | None = None  # the heatmap written with PLOT INTO

    def plot(self, path: str | None = None):
        """Draw the grid (recovered fraction by layer and position); with ``path`` also save it
        (.png or .svg). Returns the matplotlib Figure (shown inline in a notebook). matplotlib is
        an optional extra."""
        from ..charts import save_figure, sweep_figure

        fig = sweep_figure(self)
        if path is not None:
            save_figure(fig, path)
        return fig


class CaptureResult(Result):
    kind: Literal["capture"] = "capture"
    path: str
    sidecar: str
    arrays: list[str]
    bytes: int
    positions: int
    slice: str
    seconds: float


class AttentionRow(Data):
    head: int
    query: int
    key: int
    weight: float


class AttentionResult(Result):
    """SHOW ATTENTION: one row per (head, query, key) with key <= query."""

    kind: Literal["show_attention"] = "show_attention"
    layer: int
    head: int | None
    heads: int
    tokens: list[str | None]
    ids: list[int]
    slice: str
    rows: list[AttentionRow]
    seconds: float


@fam.runs(ShowAttentionPlan)
def run_show_attention(session, node: ShowAttentionPlan) -> AttentionResult:
    import time as _time

    from vindex3.internals.attention import attention

    t0 = _time.perf_counter()
    ex, _ = internals(session).executor(node.slice.depth)
    ids = list(node.prompt.ids)
    w, _ = attention(ex, ids, node.layer)
    heads = [node.head] if node.head is not None else range(w.shape[0])
    rows = [AttentionRow(head=h, query=q, key=k, weight=float(w[h, q, k]))
            for h in heads for q in range(len(ids)) for k in range(q + 1)]
    cat = session.catalog
    return AttentionResult(layer=node.layer, head=node.head, heads=int(w.shape[0]), ids=ids,
                           tokens=[cat.token_text(i) for i in ids], slice=ex.slice.describe(), rows=rows,
                           seconds=_time.perf_counter() - t0)


@fam.layout(AttentionResult)
def layout_show_attention(r: AttentionResult, timing: bool) -> list[str]:
    which = f"head {r.head}" if r.head is not None else f"{r.heads} heads"
    out = [f"attention at layer {r.layer} ({which}), {len(r.ids)} positions: {r.slice}; keys after the query are masked"]
    tok = [token(t, i) for t, i in zip(r.tokens, r.ids)]
    out += table([num("head"), num("query"), "query token", num("key"), "key token", num("weight")],
                 [[str(x.head), str(x.query), tok[x.query], str(x.key), tok[x.key], f"{x.weight:.4f}"] for x in r.rows])
    return out + fields([time(r.seconds, timing)])


@fam.records(AttentionResult)
def records_show_attention(r: AttentionResult) -> list[dict[str, Any]]:
    return [{"layer": r.layer, **dump(x)} for x in r.rows]


def _keys(ex, sites, layers) -> list[str]:
    from vindex3.exec.intervention import site_key

    if layers is None:
        return list(sites)
    return [site_key(i, s) for s in sites for i in layers]


@fam.runs(PatchSweepPlan)
def run_patch_sweep(session, node: PatchSweepPlan) -> PatchSweepResult:
    from vindex3.internals.patching import patch_sweep

    if node.plot is not None:
        from ..charts import require_matplotlib

        require_matplotlib("PATCH SWEEP ... PLOT INTO")  # before the sweep, not after it
    ex, _ = internals(session).executor(node.slice.depth)
    r = patch_sweep(ex, node.clean.ids, node.corrupted.ids, node.target, node.site, node.layers)
    cat = session.catalog
    cells = [SweepCell(**dump(c), token=cat.token_text(c.token_id)) for c in r.cells]
    d = dump(r)
    d.pop("cells")
    result = PatchSweepResult(**d, cells=cells, target=cat.token_text(node.target), slice=ex.slice.describe(),
                              plot_path=node.plot)
    if node.plot is not None:
        from ..charts import save_figure, sweep_figure
        from ..errors import FileRefusal
        from ..files import container_paths, output_file

        # checked again: the sweep ran for a while, and a file may have appeared meanwhile
        output_file(node.plot, "PATCH SWEEP chart", overwrite=node.overwrite, inside=container_paths(session.container))
        try:
            save_figure(sweep_figure(result), node.plot)
        except OSError as e:
            raise FileRefusal(f"cannot write {node.plot}: {e.strerror or e}") from None
    return result


@fam.runs(CapturePlan)
def run_capture(session, node: CapturePlan) -> CaptureResult:
    from vindex3.draft.slices import container_facts
    from vindex3.internals.patching import write_capture
    from vindex3.internals.record import library_versions

    check_output(session, node.into, "CAPTURE ... INTO", node.overwrite)
    ex, _ = internals(session).executor(node.slice.depth)
    facts = container_facts(session.base_container)
    ivs = build_interventions(ex, node.stream)
    prov = {"container_digest": facts["digest"], "component": facts["component"], "model_layers": facts["num_layers"],
            "statement": node.statement.source, "versions": library_versions()}
    r = write_capture(ex, node.prompt.ids, _keys(ex, node.sites, node.layers), node.into, provenance=prov,
                      overwrite=node.overwrite, forbid_inside=[session.base_container.path], interventions=ivs)
    return CaptureResult(**dump(r), slice=ex.slice.describe())


def _recovered(x: float | None) -> str:
    if x is None:
        return "-"
    return "0.00" if round(x, 2) == 0 else f"{x:.2f}"  # never '-0.00' for a fraction that rounds to nothing


@fam.layout(PatchSweepResult)
def layout_patch_sweep(r: PatchSweepResult, timing: bool) -> list[str]:
    site = r.site.upper().replace("_", " ")
    out = [(f"patch sweep of {site} for {token(r.target, r.target_id)} (id {r.target_id}): {r.slice}, "
            f"{layers_phrase(r.layers)}, {r.positions} positions, {r.passes} prefills"),
           ("each cell runs from its layer on, on the corrupted run's residual there (the layers before it are "
            "the corrupted run's)"),
           ("each cell: the corrupted run with the clean run's values at that layer and position; recovered = "
           "(patched - corrupted) / (clean - corrupted)")]
    out += table([num("layer"), num("pos"), "token", num("logit"), num("recovered")],
                 [[str(c.layer), str(c.position), token(c.token, c.token_id), f"{c.logit:.4f}", _recovered(c.recovered)]
                  for c in r.cells])
    out += fields([("clean logit", f"{r.clean_logit:.4f}"), ("corrupted logit", f"{r.corrupted_logit:.4f}"),
                   ("plot", r.plot_path), time(r.seconds, timing)])
    return out


@fam.records(PatchSweepResult)
def records_patch_sweep(r: PatchSweepResult) -> list[dict[str, Any]]:
    return [{"site": r.site, "target_id": r.target_id, **dump(c)} for c in r.cells]


@fam.layout(CaptureResult)
def layout_capture(r: CaptureResult, timing: bool) -> list[str]:
    sites = [a for a in r.arrays if a != "token_ids"]
    return [f"captured {len(sites)} site(s) over {r.positions} positions ({r.slice}) into {r.path}"] + fields([
        ("sites", ", ".join(sites)), ("bytes", fmt_bytes(r.bytes)), ("sidecar", r.sidecar), time(r.seconds, timing)])
