"""Running the model: INFER (the next-token distribution, greedy generation, self-speculative
decoding), EXPLAIN (the plan of the model or of the very INFER given, without running a token)
and TRACE (which layers ran at each position, and with EXPERTS each routed layer's choice)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import BaseModel, Field, PrivateAttr

from vindex3.generate import Sampler, generate_step, top_probabilities

from .. import ast, files, limits
from .. import results as R
from ..ast import dialect
from ..binding import (
    SliceBinding,
    draft_module,
    expert_layers,
    jsonable,
    placement_info,
    prompt_info,
    reads_info,
    slice_of,
)
from ..errors import StatementError
from ..layouts import (
    generated,
    intervention,
    operand_rows,
    placement,
    prompt_fields,
    reads,
    table_with_banners,
    timing_fields,
)
from ..planner import (
    BoundPrompt,
    Context,
    Node,
    bind_prompt,
    check_infer,
    err,
    positive,
    routed_or_refuse,
    run_words,
)
from ..registry import family
from ..results import (
    OpInfo,
    PlacementInfo,
    PromptInfo,
    ReadCost,
    ReadsInfo,
    Result,
    Timing,
    dump,
)
from ..syntax import Children, Clause
from ..text import (
    fields,
    fmt_bpw,
    fmt_bytes,
    fmt_int,
    fmt_layers,
    fmt_params,
    fmt_prob,
    fmt_text,
    fmt_value,
    layers_phrase,
    num,
    table,
)
from .drafts import adapter_facts, adapter_words, draft_slice
from .interventions import (
    BoundInterventions,
    PatchSpec,
    SteerSpec,
    bind_interventions,
    build_interventions,
    intervention_fields,
)

fam = family("infer", module=__name__, statements=("infer_stmt", "explain_stmt", "explain_infer", "trace_stmt"),
             grammar=r"""
infer_stmt: INFER prompt infer_option*

?infer_option: top_clause
             | generate_clause
             | draft_clause
             | speculate_clause
             | lookahead_clause
             | chat_clause
             | ablate_clause
             | compare_clause
             | patch_clause
             | steer_clause

chat_clause: CHAT
speculate_clause: SPECULATE DEPTH INT [WITH ADAPTER] [VOCAB TOP INT]
                | SPECULATE DEPTH INT VOCAB TOP INT WITH ADAPTER
                | SPECULATE DRAFTER LOOKUP [NGRAM INT] [CORPUS STRING]
                | SPECULATE DRAFTER MTP
lookahead_clause: LOOKAHEAD INT

explain_stmt: EXPLAIN [draft_clause]
explain_infer: EXPLAIN infer_stmt

trace_stmt: TRACE prompt trace_option*

?trace_option: draft_clause
             | ablate_clause
             | experts_clause
             | patch_clause
             | steer_clause

// TRACE ... EXPERTS: the routing of each position (which experts, with what weights)
experts_clause: EXPERTS [AT LAYER INT]
""")

fam.doc('EXPLAIN',
        'EXPLAIN [DRAFT DEPTH n] | EXPLAIN INFER ... | EXPLAIN INFER ... FEATURES [TOP n] [LAYERS a-b]',
        'the plan without running a token (of the very INFER given): ops, operands, state, bytes read; ... FEATURES: the FFN features most active in the run',
        'EXPLAIN DRAFT DEPTH 2;', order=30)
fam.doc('INFER',
        "INFER 'prompt' | TOKENS (ids) [TOP n] [GENERATE n [EXACTLY]] [DRAFT DEPTH n] [SPECULATE DEPTH d [WITH ADAPTER] [VOCAB TOP k] | SPECULATE DRAFTER LOOKUP [NGRAM n] [CORPUS 'corpus.jsonl'] | SPECULATE DRAFTER MTP] [LOOKAHEAD k] [CHAT] [ABLATE FEATURES (L:f, ...)] [PATCH site AT LAYER n POSITION p | POSITIONS p, ... | POSITIONS ALL FROM 'source'] [STEER AT LAYER n WITH 'a' MINUS 'b' | VECTOR 'v.npy' SCALE x]",
        'next-token distribution (TOP), greedy continuation (GENERATE), speculative decoding (draft depth, through its stored exit adapter WITH ADAPTER, prompt lookup, or a multi-token-prediction head the checkpoint carries)',
        "INFER 'The capital of France is' TOP 3;", order=110, aliases=('SPECULATE', 'GENERATE', 'CHAT', 'EXACTLY', 'ABLATE', 'ABLATE FEATURES'))
fam.doc('TRACE',
        "TRACE 'prompt' | TOKENS (ids) [DRAFT DEPTH n] [EXPERTS [AT LAYER n]] [ABLATE FEATURES (L:f, ...)] [PATCH ... FROM 'source'] [STEER AT LAYER n WITH ... SCALE x]",
        "which layers ran at each position, and the next token there; with EXPERTS, each routed layer's experts and their weights",
        "TRACE 'The capital of France is';", order=120)


@fam.rule
def infer_stmt(c: Children) -> Infer:
    fields = intervention_fields(c.options("INFER"))
    if "generate" in fields:
        fields["generate"], fields["exactly"] = fields["generate"]
    if "speculate" in fields:
        fields["speculate"], fields["vocab_top"], fields["adapter"], corpus = fields["speculate"]
        if corpus is not None:  # a path: the statement's own field (a server confines its paths)
            fields["lookup_corpus"] = corpus
    return Infer(prompt=c.get("INFER"), **fields)


@fam.rule
def chat_clause(c: Children) -> Clause:
    return c.clause("chat", True)


@fam.rule
def speculate_clause(c: Children) -> Clause:
    if c.has("LOOKUP"):
        return c.clause("speculate", (LookupDrafter(ngram=c.int("NGRAM")), None, False, c.string("CORPUS")),
                        "SPECULATE")
    if c.has("MTP"):
        return c.clause("speculate", (MtpDrafter(), None, False, None), "SPECULATE")
    return c.clause("speculate", (c.int("DEPTH"), c.int("TOP"), c.has("ADAPTER"), None), "SPECULATE")


@fam.rule
def lookahead_clause(c: Children) -> Clause:
    return c.clause("lookahead", c.int("LOOKAHEAD"))


@fam.rule
def explain_stmt(c: Children) -> Explain:
    return Explain(depth=c.options("EXPLAIN").get("depth"))


@fam.rule
def explain_infer(c: Children) -> Explain:
    inf = c.get("EXPLAIN")
    return Explain(prompt=inf.prompt, depth=inf.depth, infer=inf)


@fam.rule
def trace_stmt(c: Children) -> Trace:
    return Trace(prompt=c.get("TRACE"), **intervention_fields(c.options("TRACE")))


@fam.rule
def experts_clause(c: Children) -> Clause:
    return c.clause("experts", ExpertsClause(layer=c.int("LAYER")))


# ---- statements ----


class Explain(ast.Statement):
    """EXPLAIN [DRAFT DEPTH n] | EXPLAIN INFER ...: the plan (of the very INFER given) without running a token."""

    keyword: ClassVar[str] = "EXPLAIN"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["explain"] = "explain"
    prompt: ast.Prompt | None = None
    depth: int | None = None
    infer: Infer | None = None  # EXPLAIN INFER ...: the statement whose plan is shown

    def check(self) -> None:
        if self.infer is not None:
            check_infer(self.infer)


class LookupDrafter(ast.Node):
    """SPECULATE DRAFTER LOOKUP [NGRAM n] [CORPUS 'file']: proposals are the continuation of the
    longest earlier n-gram (n ≤ NGRAM) of the prompt and the generated text; no weights. With
    CORPUS, a round whose context holds no match proposes the continuation the corpus's n-grams
    give (vindex3.draft.lookup `CorpusIndex`)."""

    ngram: int | None = None  # None: vindex3.draft.lookup.DEFAULT_NGRAM


class MtpDrafter(ast.Node):
    """SPECULATE DRAFTER MTP: the container's multi-token-prediction drafter component (a
    checkpoint's MTP module, fed the full model's hidden state) proposes, chained on its own output."""

    drafter: Literal["mtp"] = "mtp"


class Infer(ast.Statement):
    """INFER: the next-token distribution, greedy generation, self-speculative decoding."""

    keyword: ClassVar[str] = "INFER"
    paths: ClassVar[tuple[str, ...]] = ("steer_vector", "lookup_corpus")
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["infer"] = "infer"
    prompt: ast.Prompt
    top: int | None = None
    generate: int | None = None
    depth: int | None = None
    speculate: int | LookupDrafter | MtpDrafter | None = None  # the draft depth, or the drafter, that proposes tokens
    lookahead: int | None = None
    vocab_top: int | None = None  # SPECULATE DEPTH d VOCAB TOP k: the draft's head over the k most frequent tokens
    adapter: bool = False  # SPECULATE DEPTH d WITH ADAPTER: the draft's head reads through the exit adapter stored for d
    exactly: bool = False  # GENERATE n EXACTLY: no stop at end-of-sequence
    chat: bool | None = None  # CHAT: wrap the text in the model's chat template (None: the setting)
    ablate: ast.Ablation | None = None  # ABLATE FEATURES (...): zero those FFN features for the run
    compare: bool = dialect(False)  # COMPARE (the reference dialect): refused at planning
    patch: PatchSpec | None = None  # PATCH site AT LAYER n ... FROM 'source'
    steer: SteerSpec | None = None  # STEER AT LAYER n WITH ... SCALE x
    steer_vector: str | None = None  # STEER ... WITH VECTOR 'v.npy': a file read on the server
    lookup_corpus: str | None = None  # SPECULATE DRAFTER LOOKUP ... CORPUS 'file': a file read on the server

    def check(self) -> None:
        check_infer(self)
        if isinstance(self.speculate, LookupDrafter):
            positive(self, self.speculate.ngram, "NGRAM", "NGRAM 3")
        elif self.lookup_corpus is not None:  # a statement built in code: the field alone would be ignored
            raise self.error("a lookup CORPUS belongs to SPECULATE DRAFTER LOOKUP",
                             hint="INFER ... SPECULATE DRAFTER LOOKUP CORPUS 'file.jsonl'")
        positive(self, self.vocab_top, "VOCAB TOP", "VOCAB TOP 8192")


class ExpertsClause(ast.Node):
    """TRACE ... EXPERTS [AT LAYER n]: show each position's routing (of every routed layer the
    slice runs, or of layer n)."""

    layer: int | None = None


class Trace(ast.Statement):
    """TRACE: which layers ran at each position and the next token there (with EXPERTS, the routing)."""

    keyword: ClassVar[str] = "TRACE"
    paths: ClassVar[tuple[str, ...]] = ("steer_vector",)
    read_only: ClassVar[bool | str] = True
    needs_container: ClassVar[bool] = True
    kind: Literal["trace"] = "trace"
    prompt: ast.Prompt
    depth: int | None = None
    ablate: ast.Ablation | None = None
    experts: ExpertsClause | None = None
    patch: PatchSpec | None = None
    steer: SteerSpec | None = None
    steer_vector: str | None = None




# ---- results ----


class ExplainStep(BaseModel):
    stage: Literal["embedding", "layer", "final_norm", "head"]
    layer: int | None = None
    operator: str | None = None
    params: dict[str, Any] = {}
    geometry: str | None = None
    bytes_per_position: int | None = None
    fixed_bytes: int | None = None
    ops: list[OpInfo]
    # the layer's read profile (vindex3 LayerOps.reads.to_data()): always_bytes, bank_bytes,
    # per_position_bytes, total_bytes and each op's detail (a routed FFN's experts, top_k, router,
    # bytes_per_expert...), keyed by the op's role
    reads: dict[str, Any] | None = None


class ExplainResult(Result):
    kind: Literal["explain"] = "explain"
    slice: str
    depth: int | None
    model_layers: int
    executed_layers: list[int]
    skipped_layers: list[int]
    prompt: PromptInfo | None = None
    state_bytes_after_prompt: int | None = None
    operation: str | None = None  # what the explained INFER runs on this plan
    steps: list[ExplainStep]
    reads: ReadCost
    placement: PlacementInfo | None = None  # when the model runs as shards
    per_position: ReadsInfo | None = None  # what one position of this slice reads
    activations: Literal["exact", "q8"] = "exact"  # how int8 / q4 decode products treat activations
    adapter: dict[str, Any] | None = None  # the session's DRAFT DEPTH d WITH ADAPTER: the exit adapter read


# ---- running the model ----------------------------------------------------------------


class Candidate(BaseModel):
    rank: int
    token: str | None  # None when the container carries no tokenizer
    id: int
    probability: float


class InferResult(Result):
    kind: Literal["infer"] = "infer"
    slice: str
    depth: int | None
    executed_layers: list[int]
    prompt: PromptInfo
    top: list[Candidate] | None = None
    generated_ids: list[int] | None = None
    generated_text: str | None = None
    # each generated token's text (as INFER ... TOP shows a token); None without a tokenizer
    generated_tokens: list[str | None] | None = None
    stopped_at: int | None = None  # the end-of-sequence id generation stopped at, if it did
    interrupted: bool = False  # Ctrl-C stopped the generation: the tokens so far
    prepared_reads: int | None = None  # operand reads the slice's executor made when prepared
    prepared_bytes: int | None = None  # distinct bytes it prepared
    intervention: dict[str, Any] | None = None  # ABLATE FEATURES, as the run recorded it
    # PATCH / STEER, as the stream recorded them (vindex3.exec.intervention records); None: none
    interventions: list[dict[str, Any]] | None = None
    # operand bytes each call touched (vindex3's trace.step_bytes): the prefill, then each decode
    # step; a routed layer counts only the experts its positions used. None when not recorded.
    prefill_bytes: int | None = None
    decode_bytes: list[int] | None = None
    expert_layers: list[int] = Field(default_factory=list)  # routed layers the slice ran (their reads depend on the routing)
    activations: Literal["exact", "q8"] = "exact"  # the executor's choice for int8 / q4 decode products, as its trace records
    timing: Timing | None = None
    _logits: Any = PrivateAttr(default=None)

    @property
    def logits(self):
        """The float32 logits [vocab] after the last prompt token (numpy), as the run computed
        them; not part of the JSON."""
        return self._logits


class SpeculateResult(Result):
    kind: Literal["speculate"] = "speculate"
    prompt: PromptInfo
    depth: int | None  # the draft's depth; None for prompt lookup
    lookahead: int
    drafter: str = "depth"  # "depth": a reduced-depth draft; "lookup": prompt lookup; "mtp": the MTP head
    ngram: int | None = None  # prompt lookup: the longest n-gram matched
    corpus: dict[str, Any] | None = None  # prompt lookup's corpus: file, sha256, tokens, proposed, accepted
    vocab_top: int | None = None  # the draft's head over this many most frequent tokens
    vocab_cut: dict[str, Any] | None = None  # the cut's provenance (corpus, digest, tokens counted, kept share)
    adapter: dict[str, Any] | None = None  # WITH ADAPTER: the drafter component read (key, edge, fit's provenance)
    generated_ids: list[int]
    generated_text: str | None
    interrupted: bool = False  # Ctrl-C: the tokens so far, and no statistics
    rounds: int | None = None
    proposed: int | None = None
    accepted: int | None = None
    acceptance_rate: float | None = None
    tokens_per_full_step: float | None = None
    full_model_calls: int | None = None
    rollback: str | None = None
    matches_plain: bool | None = None
    timing: Timing | None = None
    speedup: float | None = None
    plain_tokens_per_second: float | None = None


class ExpertPick(BaseModel):
    """One routed layer at one position: the experts the router chose (in its order) and their
    weights."""

    layer: int
    experts: list[int]
    weights: list[float]


class TraceRow(BaseModel):
    position: int
    token_id: int
    token: str | None
    layers: list[int]
    operators: list[str]
    next_id: int
    next_token: str | None
    bytes_read: int | None = None  # operand bytes this position's step touched (None: not recorded)
    experts: list[ExpertPick] | None = None  # with EXPERTS: the routing, per routed layer shown


class ExpertLayerInfo(BaseModel):
    layer: int
    experts: int  # E
    top_k: int
    router: str


class TraceResult(Result):
    kind: Literal["trace"] = "trace"
    slice: str
    depth: int | None
    model_layers: int
    prompt: PromptInfo
    rows: list[TraceRow]
    intervention: dict[str, Any] | None = None  # ABLATE FEATURES, as the run recorded it
    interventions: list[dict[str, Any]] | None = None  # PATCH / STEER, as the stream recorded them
    expert_layers: list[ExpertLayerInfo] | None = None  # with EXPERTS: the routed layers shown




# ---- plans ----


@dataclass(frozen=True, eq=False)
class Run(Node):
    """INFER: prefill the prompt on the slice, then the TOP n candidates and/or n greedy
    tokens. Generation stops at an end-of-sequence id in ``stop_ids`` unless ``exactly``."""

    slice: SliceBinding
    prompt: BoundPrompt
    top: int | None
    generate: int | None
    exactly: bool = False
    stop_ids: tuple[int, ...] = ()
    intervention: Any = None  # vindex3.exec.intervention.FeatureAblation (ABLATE FEATURES) or None
    stream: BoundInterventions | None = None  # PATCH / STEER on the run's stream

    def describe(self) -> str:
        parts = []
        if self.top is not None:
            parts.append(f"the top {self.top} next tokens")
        if self.generate is not None:
            stop = ("" if self.exactly or not self.stop_ids else
                    f", stopping at end-of-sequence ({', '.join(map(str, self.stop_ids))})")
            parts.append(f"{self.generate} greedy tokens{' exactly' if self.exactly else ''}{stop}")
        head = f"INFER: prefill {len(self.prompt.ids)} tokens"
        tail = f", with {self.intervention.describe()}" if self.intervention is not None else ""
        if self.stream is not None:
            tail += f", with {self.stream.describe()}"
        return head + (", then " + " and ".join(parts) if parts else "") + tail


@dataclass(frozen=True, eq=False)
class Speculate(Node):
    """INFER ... SPECULATE: the draft slice proposes ``lookahead`` tokens, the full model
    (``target``) verifies them; ``generate`` tokens in all."""

    prompt: BoundPrompt
    target: SliceBinding
    draft: SliceBinding | None  # None: prompt lookup (``ngram``) or the MTP drafter (``mtp``) proposes
    generate: int
    lookahead: int
    compare: bool
    ngram: int | None = None
    vocab_top: int | None = None
    adapter: dict[str, Any] | None = None  # WITH ADAPTER: the stored component (store.components' row)
    vocab_stored: dict[str, Any] | None = None  # VOCAB TOP k: the stored cut of k (None: counted on the seed list)
    mtp: dict[str, Any] | None = None  # DRAFTER MTP: the drafter component (name, object, edge, modules)
    corpus: str | None = None  # DRAFTER LOOKUP ... CORPUS: the corpus file whose n-grams propose when the context has none

    def describe(self) -> str:
        if self.mtp is not None:
            m = self.mtp
            return (f"INFER: prefill {len(self.prompt.ids)} tokens, then {self.generate} tokens by multi-token-prediction "
                    f"speculation (drafter component {m['component']!r}, module 0 of {m['modules']}, reading the hidden "
                    f"state after layer {m['after_layer']} through the final norm, proposes up to {self.lookahead} at a "
                    f"time chained on its own output, the {self.target.label} verifies)")
        if self.draft is None:
            corpus = "" if self.corpus is None else f", then those of the corpus {os.path.basename(self.corpus)!r}"
            return (f"INFER: prefill {len(self.prompt.ids)} tokens, then {self.generate} tokens by prompt-lookup "
                    f"speculation (n-grams of up to {self.ngram} tokens of the context{corpus} propose up to "
                    f"{self.lookahead} at a time, the {self.target.label} verifies)")
        via = ""
        if self.adapter is not None:
            via = f" through the exit adapter stored as drafter component {self.adapter['key']!r}"
        if self.vocab_top is not None:
            src = (f"stored as drafter component {self.vocab_stored['key']!r}" if self.vocab_stored is not None
                   else "counted on the built-in seed list")
            via += f", its head over the {self.vocab_top} most frequent tokens ({src})"
        return (f"INFER: prefill {len(self.prompt.ids)} tokens, then {self.generate} tokens by self-speculation "
                f"({self.draft.label}{via} proposes {self.lookahead} at a time, the {self.target.label} verifies)")


@dataclass(frozen=True, eq=False)
class ExplainPlan(Node):
    """EXPLAIN: the slice plan, and the node INFER would run (None for a bare EXPLAIN)."""

    slice: SliceBinding
    target: Run | Speculate | None = None


@dataclass(frozen=True, eq=False)
class TracePlan(Node):
    slice: SliceBinding
    prompt: BoundPrompt
    intervention: Any = None
    experts: tuple[int, ...] | None = None  # TRACE ... EXPERTS: the routed layers whose routing is shown
    stream: BoundInterventions | None = None  # PATCH / STEER on the run's stream



@fam.plans(Explain)
def plan_explain(s: Explain, ctx: Context) -> Node:
    if s.infer is not None:
        target = plan_infer(s.infer, ctx)
        sl = target.slice if isinstance(target, Run) else target.target
        return ExplainPlan(s, slice=sl, target=target)
    return ExplainPlan(s, slice=draft_slice(s, ctx, s.depth))


@fam.plans(Infer)
def plan_infer(s: Infer, ctx: Context) -> Run | Speculate:
    cat = ctx.catalog
    limits.check_count(s.generate, "max_generate", ctx.settings, "GENERATE", "tokens")
    # CHAT on the statement is explicit; the setting applies to text prompts only
    chat = s.chat if s.chat is not None else (bool(ctx.settings.chat) and isinstance(s.prompt, ast.TextPrompt))
    if (s.patch is not None or s.steer is not None) and s.speculate is not None:
        raise err(s, "INFER ... SPECULATE runs a draft and the full model; PATCH and STEER change one run",
                  hint="leave SPECULATE out to run with PATCH or STEER")
    if s.speculate is not None:
        lookahead = s.lookahead if s.lookahead is not None else ctx.settings.lookahead
        limits.check_count(lookahead, "max_lookahead", ctx.settings, "LOOKAHEAD", "draft tokens per round")
        ngram = mtp = None
        if isinstance(s.speculate, MtpDrafter):
            draft = None
            mtp = _mtp_component(s, ctx)
        elif isinstance(s.speculate, LookupDrafter):
            draft = None
            ngram = s.speculate.ngram if s.speculate.ngram is not None else draft_module("SPECULATE DRAFTER LOOKUP").DEFAULT_NGRAM
            if s.lookup_corpus is not None:
                files.input_file(s.lookup_corpus, "SPECULATE DRAFTER LOOKUP corpus")
        else:
            draft = cat.bind_slice(s.speculate)  # refuses depth 0 or deeper than the model
        target = cat.bind_slice(None)
        prompt = bind_prompt(ctx, s.prompt, chat=chat)
        adapter = _stored_adapter(s, ctx, draft.depth) if s.adapter else None
        vocab_stored = _stored_cut(s, ctx, s.vocab_top) if s.vocab_top is not None else None
        node = Speculate(s, prompt=prompt, target=target, draft=draft, generate=s.generate,
                         lookahead=lookahead, compare=bool(ctx.settings.compare), ngram=ngram,
                         vocab_top=s.vocab_top, adapter=adapter, vocab_stored=vocab_stored, mtp=mtp,
                         corpus=s.lookup_corpus)
        _check_speculate(node, ctx)
        return node
    sl = draft_slice(s, ctx, s.depth)  # a bad depth is refused before tokenising anything
    ablation = cat.ablation(s.ablate, sl)
    prompt = bind_prompt(ctx, s.prompt, chat=chat)
    top = s.top if s.top is not None else (None if s.generate is not None else ctx.settings.top)
    stop = () if s.exactly or s.generate is None else cat.eos_ids()
    stream = bind_interventions(s, ctx, sl, prompt, s.patch, s.steer, s.steer_vector)
    node = Run(s, slice=sl, prompt=prompt, top=top, generate=s.generate, exactly=s.exactly, stop_ids=stop,
               intervention=ablation, stream=stream)
    _check_run(node, ctx)
    return node


def _mtp_component(s: Infer, ctx: Context) -> dict[str, Any]:
    """SPECULATE DRAFTER MTP: the container's MTP drafter component (graph only), or refused by name."""
    from vindex3.draft.mtp import mtp_entry
    from vindex3.errors import ComponentError

    try:
        obj, d = mtp_entry(ctx.catalog.container)
    except ComponentError as e:
        raise err(s, f"INFER ... SPECULATE DRAFTER MTP: {e.message}", hint=e.hint) from None
    comp = next(c.name for c in ctx.catalog.container.graph.components if obj in c.objects)
    edge = d.get("edge") or {}
    return {"component": comp, "object": obj, "modules": len(d.get("modules") or []),
            "after_layer": edge.get("after_layer"), "site": edge.get("site"), "chain": d.get("chain")}


def _stored_adapter(s: Infer, ctx: Context, depth: int) -> dict[str, Any]:
    """SPECULATE DEPTH d WITH ADAPTER: the exit adapter the container stores for depth d (index.json
    only; the run reads the file and checks its SHA-256). Absent or stale is refused by name."""
    from vindex3.draft.store import ADAPTER, adapter_key, components

    key = adapter_key(depth)
    rows = components(ctx.catalog.container)
    row = next((x for x in rows if x["key"] == key and x["kind"] == ADAPTER), None)
    if row is None:
        have = sorted(int(x["edge"]["depth"]) for x in rows if x["kind"] == ADAPTER and isinstance(x.get("edge"), dict))
        stored = f"adapters are stored for depths {', '.join(map(str, have))}" if have else "no exit adapter is stored"
        raise err(s, f"INFER ... SPECULATE DEPTH {depth} WITH ADAPTER: {ctx.catalog.name} stores no exit adapter at "
                  f"depth {depth} ({stored})", hint=f"fit one: FIT ADAPTER AT DEPTH {depth}")
    if not row["fresh"]:
        raise err(s, f"INFER ... SPECULATE DEPTH {depth} WITH ADAPTER: the exit adapter stored as {key!r} was fitted "
                  "on another container (stale)", hint=f"fit it again: FIT ADAPTER AT DEPTH {depth}")
    return row


def _stored_cut(s: Infer, ctx: Context, k: int) -> dict[str, Any] | None:
    """SPECULATE ... VOCAB TOP k: the vocabulary cut of k the container stores (FIT VOCAB CUT TOP k;
    index.json only), or None when none is stored (the run counts one on the seed list). A stored
    cut counted on another container is refused by name, not replaced by a fresh count."""
    from vindex3.draft.store import VOCAB, components, vocab_key

    key = vocab_key(k)
    row = next((x for x in components(ctx.catalog.container) if x["key"] == key and x["kind"] == VOCAB), None)
    if row is not None and not row["fresh"]:
        raise err(s, f"INFER ... SPECULATE ... VOCAB TOP {k}: the vocabulary cut stored as {key!r} was counted on "
                  "another container (stale)", hint=f"count it again: FIT VOCAB CUT TOP {k}")
    return row


def _check_run(node: Run, ctx: Context) -> None:
    """INFER's limits: prompt + generated positions, and the arrays of its largest pass."""
    cat, p, g, depth = ctx.catalog, len(node.prompt.ids), node.generate or 0, node.slice.depth
    limits.check_positions(p + g, cat.context_length, ctx.settings, run_words("INFER", p, g))
    steps = cat.estimate(1, depth, start=p + g - 2) if g > 1 else None
    limits.Need().add("the largest pass", limits.largest(cat.estimate(p, depth), steps)).check(ctx.settings, "INFER")


def _check_speculate(node: Speculate, ctx: Context) -> None:
    """SPECULATE's limits: prompt + generated positions (a round never proposes past them: both
    streams hold at most prompt + n - 1 positions), and the arrays of the three streams it runs
    (the full model, the draft and, with compare on, plain greedy decoding)."""
    cat, p, g = ctx.catalog, len(node.prompt.ids), node.generate
    limits.check_positions(p + g, cat.context_length, ctx.settings, run_words("INFER ... SPECULATE", p, g))
    k = min(node.lookahead, g - 1)
    end = p + g - 2  # positions held before the last one-token pass
    need = limits.Need()
    need.add("full model", limits.largest(cat.estimate(p, None), cat.estimate(k + 1, None, start=p + g - k - 2)))
    if node.draft is not None:
        need.add(f"draft depth {node.draft.depth}", limits.largest(cat.estimate(p, node.draft.depth),
                                                                  cat.estimate(1, node.draft.depth, start=max(end, 0))))
    if node.compare:
        need.add("plain greedy", limits.largest(cat.estimate(p, None), cat.estimate(1, None, start=max(end, 0))))
    need.check(ctx.settings, "INFER ... SPECULATE")


@fam.plans(Trace)
def plan_trace(s: Trace, ctx: Context) -> Node:
    cat = ctx.catalog
    sl = draft_slice(s, ctx, s.depth)
    experts = None
    if s.experts is not None:
        layer = s.experts.layer
        routed = routed_or_refuse(s, ctx, layer, "TRACE ... EXPERTS")
        ran = sl.executed_layers
        shown = [i for i in ((layer,) if layer is not None else routed) if i in ran]
        if not shown:
            which = f"layer {layer}" if layer is not None else f"a routed layer (routed: {fmt_layers(routed)})"
            raise err(s, f"{sl.label} runs {'layer' if len(ran) == 1 else 'layers'} {fmt_layers(ran)}, not {which}",
                       hint="a deeper DRAFT DEPTH, or DRAFT OFF, runs it")
        experts = tuple(shown)
    prompt = bind_prompt(ctx, s.prompt)
    p = len(prompt.ids)
    limits.check_positions(p, cat.context_length, ctx.settings, run_words("TRACE", p))
    limits.Need().add("one step at the end", cat.estimate(1, sl.depth, start=p - 1)).check(ctx.settings, "TRACE")
    return TracePlan(s, slice=sl, prompt=prompt, experts=experts, intervention=cat.ablation(s.ablate, sl),
                     stream=bind_interventions(s, ctx, sl, prompt, s.patch, s.steer, s.steer_vector))




# ---- running ----


def op_info(op) -> R.OpInfo:
    return R.OpInfo(
        kind=op.kind, role=op.role, params=jsonable(dict(op.params)),
        operands=[R.Operand(role=role, object=ref.object, tensor=ref.tensor, dtype=ref.dtype, shape=list(ref.shape),
                            bytes=ref.nbytes) for role, ref in op.operands.items()],
    )


@fam.runs(ExplainPlan)
def run_explain(session, node: ExplainPlan) -> ExplainResult:
    c = session.container
    sl = node.slice
    sp = sl.plan
    op_plan = c.op_plan()
    steps = [ExplainStep(stage="embedding", ops=[op_info(op_plan.embedding)])]
    for i in sp.executed_layers:
        lo = op_plan.layers[i]
        g = lo.geometry
        steps.append(ExplainStep(
            stage="layer", layer=lo.index, operator=c.graph.layers[i].label(), params=dict(lo.params),
            geometry=g.describe(), bytes_per_position=g.bytes_per_position, fixed_bytes=g.fixed_bytes,
            ops=[op_info(op) for op in lo.ops], reads=jsonable(lo.reads.to_data()),
        ))
    steps.append(ExplainStep(stage="final_norm", ops=[op_info(op_plan.final_norm)]))
    steps.append(ExplainStep(stage="head", ops=[op_info(op_plan.head)]))
    prompt = state = None
    target = node.target
    if target is not None:
        prompt = prompt_info(target.prompt)
        state = sum(op_plan.layers[i].geometry.bytes_at(len(prompt.ids)) for i in sp.executed_layers)
    executed = sl.executed_layers
    return ExplainResult(
        slice=sl.label, depth=sl.depth, model_layers=c.graph.num_layers,
        executed_layers=executed, skipped_layers=[i for i in range(c.graph.num_layers) if i not in executed],
        prompt=prompt, state_bytes_after_prompt=state,
        operation=target.describe() if target is not None else None, steps=steps, reads=sl.reads,
        placement=placement_info(c, slice_of(sl.depth), len(prompt.ids) if prompt is not None else 0),
        per_position=reads_info(op_plan, executed), activations=session.settings.activations,
        adapter=adapter_facts(sl.adapter),
    )


@fam.runs(Run)
def run_infer(session, node: Run) -> InferResult:
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    ex, fresh = session.executor(node.slice.depth, node.intervention, adapter=node.slice.adapter)
    ivs = build_interventions(ex, node.stream)
    st = ex.start(interventions=ivs) if ivs else ex.start()
    # the one decode step (vindex3.generate): the prefill's record first, then one per token
    calls = generate_step(st, node.prompt.ids, sampler=Sampler.greedy(), max_tokens=node.generate or 0,
                          stop_ids=node.stop_ids, logits=True)
    t0 = time.perf_counter()
    first = next(calls)
    prefill_s = time.perf_counter() - t0
    last = np.asarray(first.logits)
    executed = [int(i) for i in ex.trace.executed_layers]
    top = None
    if node.top is not None:
        top = top_candidates(last, node.top, cat.token_text)
    gen_ids = gen_text = stopped = None
    interrupted = False
    timing = R.Timing(prepare_seconds=ex.trace.prepare_seconds if fresh else None, prefill_seconds=prefill_s)
    if node.generate is not None:
        gen_ids = []
        t1 = time.perf_counter()
        record = first
        try:
            while record is not None:
                tok = record.token
                gen_ids.append(tok)
                if session.on_token is not None:
                    session.on_token(tok, cat.token_text(tok))
                if record.stop:
                    stopped = tok
                    break
                record = next(calls, None)
        except KeyboardInterrupt:  # Ctrl-C: keep what was generated
            interrupted = True
        decode_s = time.perf_counter() - t1
        gen_text = cat.decode(gen_ids)
        n = len(gen_ids)
        timing.decode_seconds = decode_s
        timing.ms_per_token = decode_s * 1000.0 / n if n else None
        timing.tokens_per_second = n / decode_s if decode_s > 0 and n else None
    steps = [int(n) for n in (getattr(st.trace, "step_bytes", None) or [])]
    result = InferResult(slice=node.slice.label, depth=node.slice.depth, executed_layers=executed,
                           prompt=prompt, top=top, generated_ids=gen_ids, generated_text=gen_text,
                           generated_tokens=[cat.token_text(t) for t in gen_ids] if gen_ids is not None else None,
                           stopped_at=stopped, interrupted=interrupted,
                           prepared_reads=int(ex.trace.operand_reads), prepared_bytes=int(ex.trace.bytes_read),
                           intervention=node.intervention.record() if node.intervention is not None else None,
                           interventions=[iv.record() for iv in ivs] or None,
                           prefill_bytes=steps[0] if steps else None, decode_bytes=steps[1:] if steps else None,
                           expert_layers=expert_layers(session.catalog.op_plan, executed), timing=timing,
                           activations=getattr(st.trace, "activations", "exact"))
    result._logits = last
    return result


@fam.runs(Speculate)
def run_speculate(session, node: Speculate) -> SpeculateResult:
    draft = draft_module("INFER ... SPECULATE")
    c = session.container
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    produced: list[int] = []
    hook = session.on_token

    def on_token(tok: int) -> None:
        produced.append(int(tok))
        if hook is not None:
            hook(int(tok), cat.token_text(int(tok)))

    depth = node.draft.depth if node.draft is not None else None
    drafter = "depth" if node.draft is not None else "mtp" if node.mtp is not None else "lookup"
    cut = None
    adapter = None
    index = None  # prompt lookup's corpus index
    try:
        if node.mtp is not None:
            from vindex3.draft.mtp import mtp_generate

            res = mtp_generate(c, list(node.prompt.ids), node.generate, node.lookahead, on_token=on_token,
                               compare_plain=node.compare, max_positions=session.settings.max_positions)
        elif node.draft is None:
            from vindex3.draft.lookup import corpus_index

            index = corpus_index(c, node.corpus, node.ngram) if node.corpus is not None else None
            res = draft.lookup_generate(c, list(node.prompt.ids), node.generate, node.lookahead, node.ngram,
                                        on_token=on_token, compare_plain=node.compare,
                                        max_positions=session.settings.max_positions,
                                        verify_cost=session.settings.verify_cost, corpus=index)
        else:
            if node.vocab_stored is not None:  # FIT VOCAB CUT's, read and checked (SHA-256, container)
                from vindex3.draft.store import load_vocab_cut

                cut = load_vocab_cut(c, node.vocab_top)
            elif node.vocab_top is not None:  # none stored: counted on the built-in seed list (not the prompt bank)
                from vindex3.draft.vocab import fit_vocab_cut

                cut = fit_vocab_cut(c, node.vocab_top)
            if node.adapter is not None:  # read and checked (SHA-256, container, shape) here, not at planning
                from vindex3.draft.store import load_adapter

                adapter = load_adapter(c, depth)
            res = draft.speculative_generate(c, list(node.prompt.ids), node.generate, depth, node.lookahead,
                                             on_token=on_token, compare_plain=node.compare,
                                             max_positions=session.settings.max_positions, vocab_cut=cut,
                                             adapter=adapter)
    except KeyboardInterrupt:  # Ctrl-C: the tokens so far, no statistics
        return SpeculateResult(prompt=prompt, depth=depth, lookahead=node.lookahead, drafter=drafter, ngram=node.ngram,
                               adapter=adapter_facts(node.adapter), vocab_top=node.vocab_top,
                                 generated_ids=produced, generated_text=cat.decode(produced), interrupted=True)
    plain = res.plain
    corpus = None if res.corpus is None else {"file": res.corpus, "sha256": res.corpus_sha256, "tokens": index.tokens,
                                               "proposed": res.corpus_proposed, "accepted": res.corpus_accepted}
    return SpeculateResult(
        prompt=prompt, depth=res.depth, lookahead=res.lookahead, drafter=drafter, ngram=node.ngram, corpus=corpus,
        vocab_top=res.vocab_top, vocab_cut=_cut_facts(cut, node.vocab_stored) if cut is not None else None,
        adapter=adapter_facts(node.adapter) if res.adapter else None,
        generated_ids=list(res.tokens),
        generated_text=cat.decode(list(res.tokens)), rounds=res.rounds, proposed=res.proposed,
        accepted=res.accepted, acceptance_rate=res.acceptance_rate, tokens_per_full_step=res.tokens_per_full_step,
        full_model_calls=res.full_model_calls, rollback=res.rollback, matches_plain=res.matches_plain,
        timing=R.Timing(prepare_seconds=res.prepare_seconds, decode_seconds=res.seconds,
                        tokens_per_second=res.tokens_per_second),
        speedup=res.speedup,
        plain_tokens_per_second=plain.tokens_per_second if plain is not None else None,
    )


def top_candidates(logits: np.ndarray, n: int, token_text: Callable[[int], str | None]) -> list[Candidate]:
    """The ``n`` most likely next tokens (vindex3's `top_probabilities`: probability descending,
    then id ascending, so ties never depend on a sort), with their text."""
    return [Candidate(rank=k + 1, token=token_text(i), id=i, probability=p)
            for k, (i, p) in enumerate(top_probabilities(logits, n))]


@fam.runs(TracePlan)
def run_trace(session, node: TracePlan) -> TraceResult:
    c = session.container
    cat = session.catalog
    prompt = prompt_info(node.prompt)
    if node.experts is not None:
        from vindex3.shards import ShardedModel

        if isinstance(c, ShardedModel):
            raise StatementError("TRACE ... EXPERTS reads the routing each layer records, and a sharded model's layers "
                                 "record it in their actors, not here", hint="SET shards = 0 (or OPEN without SHARDS)")
    ex, _ = session.executor(node.slice.depth, node.intervention, adapter=node.slice.adapter)
    labels = [lp.label() for lp in c.graph.layers]
    ivs = build_interventions(ex, node.stream)
    st = ex.start(interventions=ivs) if ivs else ex.start()
    rows = []
    # one position at a time (the one decode step, fed step by step): the trace of each position
    for pos, r in enumerate(generate_step(st, prompt.ids, sampler=Sampler.greedy(), max_tokens=0, feed="step",
                                          logits=True)):
        tok, ran = r.fed[0], list(r.executed_layers or ())
        nxt = int(np.argmax(r.logits))
        rows.append(TraceRow(position=pos, token_id=tok, token=cat.token_text(tok), layers=ran,
                             operators=[labels[i] for i in ran], next_id=nxt, next_token=cat.token_text(nxt),
                             bytes_read=r.bytes_read))
    shown = None
    if node.experts is not None:
        from vindex3.operators.moe_ffn import routing_from_trace

        picks: dict[int, list[ExpertPick]] = {r.position: [] for r in rows}
        shown = []
        for lr in routing_from_trace(st.trace, ex.plan):
            if lr.layer not in node.experts:
                continue
            shown.append(ExpertLayerInfo(layer=lr.layer, experts=lr.experts, top_k=lr.top_k, router=lr.router))
            for p in lr.positions:
                picks[p.position].append(ExpertPick(layer=lr.layer, experts=p.experts, weights=p.weights))
        for row in rows:
            row.experts = picks[row.position]
    return TraceResult(slice=node.slice.label, depth=node.slice.depth, model_layers=c.graph.num_layers,
                         prompt=prompt, rows=rows, expert_layers=shown,
                         intervention=node.intervention.record() if node.intervention is not None else None,
                         interventions=[iv.record() for iv in ivs] or None)


# ---- layouts ----


@fam.layout(ExplainResult)
def layout_explain(r: ExplainResult, timing: bool) -> list[str]:
    return _explain_plan(r) + placement(r.placement)


def _explain_plan(r: ExplainResult) -> list[str]:
    head = f"plan: {r.slice}, {layers_phrase(r.executed_layers)} of {r.model_layers}"
    out = [head]
    if r.activations != "exact":  # an executor choice that changes numbers: said wherever it applies
        out.append(f"activations: {r.activations} (int8 and q4 decode products quantize activations per block of 32)")
    if r.adapter is not None:  # the session's DRAFT DEPTH d WITH ADAPTER
        out.append(f"exit adapter: {adapter_words(r.adapter)}, read before the final norm and head")
    if r.skipped_layers:
        out.append(f"not run: {layers_phrase(r.skipped_layers)}")
    if r.prompt is not None:
        out += fields([
            ("runs", r.operation),
            ("prompt", (fmt_text(r.prompt.text) if r.prompt.text is not None else "token ids")
             + (" in the chat template" if r.prompt.chat else "")),
            ("token ids", fmt_value(r.prompt.ids)),
            ("state after prompt", fmt_bytes(r.state_bytes_after_prompt)),
        ])
    headers = ["op", "role", "operand", "tensor", "dtype", "shape", num("bytes"), "params"]
    rows: list[list[str]] = []
    for st in r.steps:
        if st.stage == "layer":
            # the mixer's own parameters head the layer; its row then needs no params column
            mixer = next((op for op in st.ops if op.role == "mixer"), None)
            params = mixer.params if mixer is not None else st.params
            title = f"layer {st.layer}: {st.operator}"
            state = st.geometry or "-"
            if st.bytes_per_position:
                state += f", {st.bytes_per_position:,} bytes/position"
            if st.fixed_bytes:
                state += f", {st.fixed_bytes:,} bytes fixed"
            rows.append([f"[{title}; state {state}]"] + [""] * 7)
            if params:
                rows.append([f"[  {fmt_params(params)}]"] + [""] * 7)
            for role, d in ((st.reads or {}).get("detail") or {}).items():
                if isinstance(d, dict) and "experts" in d and "top_k" in d:
                    rows.append([f"[  {role} {d.get('operator', '')}: {_expert_reads(d)}]"] + [""] * 7)
            rows += operand_rows(st.ops, with_params=True, skip_params_of="mixer")
        else:
            rows.append([f"[{st.stage.replace('_', ' ')}]"] + [""] * 7)
            rows += operand_rows(st.ops, with_params=True)
    out += [""] + table_with_banners(headers, rows)
    c = r.reads
    out += [""] + fields([
        ("reads", f"{c.total_reads} operands, {fmt_bytes(c.total_bytes)}"),
        ("  ends", f"{c.ends_reads} operands, {fmt_bytes(c.ends_bytes)} (embedding, final norm, head)"),
        ("  layers", f"{c.layer_reads} operands, {fmt_bytes(c.layer_bytes)}"),
    ] + [(f"  {e.encoding}", f"{e.tensors} tensors, {fmt_bytes(e.bytes)}, {fmt_bpw(e.bits_per_weight)} bits/weight")
         for e in c.by_encoding])
    return out + reads(r.per_position, "per position (a token reads)")


def _expert_reads(d: dict) -> str:
    """A routed FFN's read detail: 'top 3 of 10 experts (softmax_topk); a token reads 40,380
    bytes = 1,800 always + 3 x 12,860 per expert, of a 128,600-byte bank'."""
    return (f"top {d['top_k']} of {d['experts']} experts ({d.get('router', '?')}); a token reads "
            f"{fmt_int(d.get('bytes_per_position'))} bytes = {fmt_int(d.get('always_bytes'))} always + {d['top_k']} x "
            f"{fmt_int(d.get('bytes_per_expert'))} per expert, of a {fmt_int(d.get('expert_bank_bytes'))}-byte bank")


_LONG_LIST = 8  # a provenance list longer than this is summarised in text (JSON keeps every entry)


@fam.layout(InferResult)
def layout_infer(r: InferResult, timing: bool) -> list[str]:
    out = fields([("slice", f"{r.slice} ({layers_phrase(r.executed_layers)})"), *prompt_fields(r.prompt),
                  ("ablated", intervention(r.intervention)),
                  *_intervened(r.interventions),
                  ("activations", r.activations if r.activations != "exact" else None)])
    if r.top is not None:
        out += [""] + table(
            [num("rank"), "token", num("id"), num("probability")],
            [[str(c.rank), fmt_text(c.token), str(c.id), fmt_prob(c.probability)] for c in r.top],
        )
    if r.generated_ids is not None:
        out += [""] + fields([
            ("generated", generated(len(r.generated_ids), r.interrupted, r.stopped_at)),
            ("ids", fmt_value(r.generated_ids)),
            ("text", fmt_text(r.generated_text) if r.generated_text is not None else None),
        ])
    if r.expert_layers and r.prefill_bytes is not None:
        # reads depend on the routing: what the prefill and the decode steps touched
        dec = r.decode_bytes or []
        out += [""] + fields([
            ("bytes read", f"prefill {fmt_bytes(r.prefill_bytes)}"),
            ("  per decode step", f"{fmt_int(round(sum(dec) / len(dec)))} bytes (mean of {len(dec)}; min "
                                  f"{fmt_int(min(dec))}, max {fmt_int(max(dec))})" if dec else None),
        ])
    if timing and r.timing is not None:
        out += [""] + timing_fields(r.timing)
    return out


def _intervened(records: list[dict[str, Any]] | None) -> list[tuple[str, str]]:
    """One field per PATCH / STEER the run carried: a result made under an intervention says so."""
    return [("intervened", x["text"]) for x in records or ()]


def _cut_facts(cut, stored: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cut's provenance; ``stored``: the drafter component's key it was read from (None: counted for the run)."""
    return {**{k: getattr(cut, k) for k in ("k", "vocab", "corpus", "corpus_sha256", "texts", "tokens_counted",
                                             "kept_share")}, "stored": stored["key"] if stored is not None else None}


def _drafter_words(r: SpeculateResult) -> str:
    if r.drafter == "lookup":
        corpus = "" if r.corpus is None else (f", then corpus {r.corpus['file']!r} ({r.corpus['tokens']} tokens; "
                                              f"{r.corpus['accepted']} of its {r.corpus['proposed']} proposals kept)")
        return f"prompt lookup (n-grams of up to {r.ngram} tokens{corpus}), lookahead {r.lookahead}"
    if r.drafter == "mtp":
        return f"multi-token-prediction head (drafter component 'mtp', chained), lookahead {r.lookahead}"
    how = []
    if r.adapter is not None:
        how.append(f"through exit adapter {r.adapter['key']!r}")
    if r.vocab_top is not None:
        stored = (r.vocab_cut or {}).get("stored")
        how.append(f"head over the {r.vocab_top} most frequent tokens" + (f" of {stored!r}" if stored else ""))
    return f"depth {r.depth}{' (' + ', '.join(how) + ')' if how else ''}, lookahead {r.lookahead}"


@fam.layout(SpeculateResult)
def layout_speculate(r: SpeculateResult, timing: bool) -> list[str]:
    if r.interrupted:
        return fields([
            *prompt_fields(r.prompt),
            ("draft", _drafter_words(r)),
            ("generated", generated(len(r.generated_ids), True)),
            ("ids", fmt_value(r.generated_ids)),
            ("text", fmt_text(r.generated_text) if r.generated_text is not None else None),
        ])
    out = fields([
        *prompt_fields(r.prompt),
        ("draft", f"{_drafter_words(r)}, rollback by {r.rollback}"),
        ("generated", f"{len(r.generated_ids)} tokens"),
        ("ids", fmt_value(r.generated_ids)),
        ("text", fmt_text(r.generated_text) if r.generated_text is not None else None),
        ("acceptance", f"{r.accepted} of {r.proposed} proposed tokens ({r.acceptance_rate:.3f})"),
        ("full-model calls", f"{r.full_model_calls} ({r.tokens_per_full_step:.2f} tokens per call)"),
        ("same as greedy", None if r.matches_plain is None else ("yes" if r.matches_plain else "NO")),
    ])
    if timing and r.timing is not None:
        out += [""] + timing_fields(r.timing, [
            ("plain greedy", f"{r.plain_tokens_per_second:.1f} tok/s" if r.plain_tokens_per_second is not None else None),
            ("speedup", f"{r.speedup:.2f} x" if r.speedup is not None else None),
        ])
    return out


@fam.layout(TraceResult)
def layout_trace(r: TraceResult, timing: bool) -> list[str]:
    if r.expert_layers is not None:
        return _trace_experts(r)
    out = [f"trace: {r.slice}, {r.model_layers}-layer model"]
    if r.intervention is not None:
        out.append(f"with {intervention(r.intervention)}")
    out += [f"with {x['text']}" for x in r.interventions or ()]
    rows = []
    for x in r.rows:
        ran = _layers_with_operators(x.layers, x.operators)
        rows.append([str(x.position), str(x.token_id), fmt_text(x.token), ran, str(x.next_id), fmt_text(x.next_token)])
    return out + table([num("pos"), num("id"), "token", "layers run", num("next id"), "next token"], rows)


def _trace_experts(r: TraceResult) -> list[str]:
    """TRACE ... EXPERTS: per position, each shown layer's experts with their weights
    ('expert:weight', in the router's order), the bytes the step read, and the next token."""
    shown = r.expert_layers or []
    out = [f"trace: {r.slice}, {r.model_layers}-layer model; experts of "
           + "; ".join(f"layer {x.layer} (top {x.top_k} of {x.experts}, {x.router})" for x in shown)]
    rows = []
    for x in r.rows:
        picks = {p.layer: p for p in x.experts or []}
        cells = [" ".join(f"{e}:{w:.3f}" for e, w in zip(picks[s.layer].experts, picks[s.layer].weights))
                 if s.layer in picks else "-" for s in shown]
        rows.append([str(x.position), str(x.token_id), fmt_text(x.token), *cells, fmt_int(x.bytes_read),
                     str(x.next_id), fmt_text(x.next_token)])
    headers = [num("pos"), num("id"), "token", *[f"layer {s.layer} experts" for s in shown], num("bytes read"),
               num("next id"), "next token"]
    return out + table(headers, rows)


def _layers_with_operators(layers: Sequence[int], operators: Sequence[str]) -> str:
    """Runs of consecutive layers with one operator: '0-3 softmax (full)', '0-2 mamba2, 3 softmax (full)'."""
    runs: list[list] = []
    for i, op in zip(layers, operators):
        if runs and runs[-1][2] == op and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i, op])
    return ", ".join((f"{a}-{b}" if a != b else f"{a}") + f" {op}" for a, b, op in runs) or "none"



@fam.records(ExplainResult)
def _rec_explain(r: ExplainResult) -> list[dict[str, Any]]:
    out = []
    for st in r.steps:
        for op in st.ops:
            for o in op.operands or [None]:
                out.append({"stage": st.stage, "layer": st.layer, "operator": st.operator, "op": op.kind,
                            "op_role": op.role, "operand": o.role if o else None,
                            "tensor": f"{o.object}/{o.tensor}" if o else None, "dtype": o.dtype if o else None,
                            "shape": o.shape if o else None, "bytes": o.bytes if o else None})
    return out


@fam.records(InferResult)
def _rec_infer(r: InferResult) -> list[dict[str, Any]]:
    if r.top is not None:
        return _named([dump(c) for c in r.top], r.interventions)
    tokens = r.generated_tokens or [None] * len(r.generated_ids or [])
    return _named([{"position": i, "id": t, "token": tok}
                   for i, (t, tok) in enumerate(zip(r.generated_ids or [], tokens))], r.interventions)


def _named(rows: list[dict[str, Any]], records: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Each record of a run made under PATCH / STEER names them (a clean run's records are as before)."""
    if not records:
        return rows
    text = "; ".join(x["text"] for x in records)
    return [{**row, "interventions": text} for row in rows]


@fam.records(TraceResult)
def _rec_trace(r: TraceResult) -> list[dict[str, Any]]:
    return _named([dump(x) for x in r.rows], r.interventions)


