"""The one place LQL reaches into vindex3 for facts: a read-only catalog view of the open
container that the planner binds statements against, and the small helpers that turn vindex3's
objects and refusals into LQL's.

The planner may ask the catalog for anything that reads no tensor data: the graph, the op
plan, a slice's plan (which layers run, which operands it reads), the vocabulary, the
tokenizer, the chat template, the end-of-sequence ids. Running the model happens in the
command modules (`lql.commands`), through the session's executors.

When vindex3's core changes shape (operators as modules, state parts, the trace on the
stream), this module and the command modules are where LQL adapts."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from . import results as R
from .errors import EngineRefusal, StatementError


def vindex3():
    import vindex3 as v

    return v


def is_engine_error(err: BaseException) -> bool:
    """True for a refusal raised by vindex3 (any `vindex3.errors.VindexError`)."""
    return isinstance(err, vindex3().errors.VindexError)


def engine_refusal(err: Exception) -> EngineRefusal:
    """A vindex3 refusal as an LQL error, with its own message, hint and class name."""
    hint = getattr(err, "hint", None)
    message = str(err)
    suffix = f"\n  hint: {hint}"
    if hint and message.endswith(suffix):
        message = message[: -len(suffix)]
    return EngineRefusal(message, engine_kind=type(err).__name__, hint=hint)


def draft_module(what: str):
    """vindex3.draft (``what`` names the statement that needs it, for readers of the call)."""
    import vindex3.draft

    return vindex3.draft


# ---- the session's feature internals (WALK, DESCRIBE, SELECT, TRACE ... FOR, OBSERVE, BUILD FEATURES)
#
# Each of those statements is one call on the session's `vindex3.internals.Internals` (one per
# bound container), whose pydantic result becomes the LQL result of the same shape. Feature
# metadata is built on demand and kept in the container as derived data; the ``stale`` setting
# says whether metadata built from another state of the container is rebuilt or refused.


def internals(session):
    """The session's internals, set up from its settings (``stale``) and whether it may write
    derived data into the container."""
    ix = session.internals()
    ix.metadata.on_stale = session.settings.stale
    ix.metadata.persist = session.writes_derived  # a read-only server keeps built metadata in memory
    ix.metadata.notice = session.on_notice  # a build that takes a while says so before it starts
    return ix


def internals_data(x) -> dict[str, Any]:
    """An internals result as the fields of its LQL mirror."""
    return x.model_dump(exclude={"kind"})


def internals_query(prompt):
    """What the internals API takes for a bound query (`lql.planner.BoundPrompt`): the text (it
    tokenises it the same way, without BOS) or the ids given as TOKENS."""
    return prompt.text if prompt.text is not None else list(prompt.ids)


def with_text(d: dict[str, Any], prompt) -> dict[str, Any]:
    """Runs take bound ids (the chat template may have wrapped the text); show the text as given."""
    d["prompt"]["text"] = prompt.text
    return d


def check_output(session, path: str, what: str, overwrite: bool) -> None:
    """Refuse a bad output path before anything runs (vindex3's path helper): never inside the
    open container, never over an existing file unless ``overwrite``."""
    from vindex3.paths import output_file

    output_file(path, what, overwrite=overwrite, forbid_inside=[session.base_container.path])


def placement_info(container, sl, positions: int = 0):
    """Where a sharded model's parts run, for a slice (None when the model runs in this
    process). Reads no tensor data and calls no actor."""
    from vindex3.shards import ShardedModel

    from . import results as R

    if not isinstance(container, ShardedModel):
        return None
    p = container.placement(sl, positions=positions)
    return R.PlacementInfo(
        slice=p.slice, positions=p.positions, driver_holds=list(p.driver.get("holds", [])),
        driver_weight_bytes=int(p.driver.get("weight_bytes", 0)),
        shards=[R.ShardRow(name=s.name, layers=list(s.layers), actor=s.actor, pid=s.pid, weight_bytes=s.weight_bytes,
                           state_bytes_per_position=s.state_bytes_per_position, fixed_state_bytes=s.fixed_state_bytes,
                           state_bytes=s.state_bytes) for s in p.shards],
        untouched=list(p.untouched), hops_per_position=p.hops_per_position,
        bytes_per_hop_per_position=p.bytes_per_hop_per_position,
        bytes_between_shards_per_position=p.bytes_between_shards_per_position,
        bytes_moved_per_position=p.bytes_moved_per_position,
    )


def mix(container) -> list[R.MixEntry]:
    """A container's operator mix as result entries ('4 softmax (full)')."""
    return [R.MixEntry(label=label, count=n) for label, n in container.graph.operator_mix()]


def slice_of(depth: int | None):
    """The vindex3 execution slice for a draft depth (None: the full model)."""
    v = vindex3()
    return v.Full() if depth is None else v.Draft(depth)


def slice_label(depth: int | None) -> str:
    return "full model" if depth is None else f"draft depth {depth}"


def encoding_shares(refs) -> list[R.EncodingShare]:
    """Distinct tensors of ``refs`` (OperandRefs or segment entries with object/tensor labels)
    per encoding: count, parameters, stored bytes and bits per weight; most bytes first."""
    import math

    seen: dict[str, Any] = {}
    for r in refs:
        seen.setdefault(r.label, r)
    acc: dict[str, list[int]] = {}
    for r in seen.values():
        a = acc.setdefault(r.dtype, [0, 0, 0])
        a[0] += 1
        a[1] += math.prod(r.shape)
        a[2] += r.nbytes
    rows = [R.EncodingShare(encoding=e, tensors=n, parameters=p, bytes=b, bits_per_weight=round(8 * b / p, 3) if p else 0.0)
            for e, (n, p, b) in acc.items()]
    return sorted(rows, key=lambda x: (-x.bytes, x.encoding))


def read_cost(sp) -> R.ReadCost:
    """A slice plan's operand reads, split into the ends and the layers, and per encoding."""
    return R.ReadCost(ends_reads=sp.ends_reads, ends_bytes=sp.ends_bytes, layer_reads=sp.layer_reads,
                      layer_bytes=sp.layer_bytes, total_reads=sp.total_reads, total_bytes=sp.total_bytes,
                      by_encoding=encoding_shares(sp.operands))


def expert_ops(layer_ops) -> list:
    """The ops of a layer that read a routed-expert bank: their read profile holds banks and
    names its experts and top-k (vindex3's `ReadProfile.detail`)."""
    out = []
    for op in layer_ops.ops:
        r = op.reads
        if r.bank_bytes and "experts" in r.detail and "top_k" in r.detail:
            out.append(op)
    return out


def expert_layers(op_plan, layers=None) -> list[int]:
    """Layers (of ``layers``, default all) with a routed-expert FFN."""
    idx = range(len(op_plan.layers)) if layers is None else layers
    return [int(i) for i in idx if expert_ops(op_plan.layers[i])]


def reads_info(op_plan, layers=None) -> R.ReadsInfo:
    """What one position reads of ``layers`` (default: all) and the ends, from sizes only: the
    expert banks apart from the always-read bytes, and the embedding row."""
    idx = list(range(len(op_plan.layers)) if layers is None else layers)
    whole = op_plan.read_profile(idx, ends=True)
    routed = expert_layers(op_plan, idx)
    bank = sum(op.reads.bank_bytes for i in routed for op in expert_ops(op_plan.layers[i]))
    in_layers = op_plan.read_profile(idx, ends=False).bank_bytes
    return R.ReadsInfo(always_bytes=whole.always_bytes, expert_bank_bytes=bank, expert_layers=routed,
                       embedding_bytes=whole.bank_bytes - in_layers, per_position_bytes=whole.per_position_bytes,
                       total_bytes=whole.total_bytes)


@dataclass(frozen=True, eq=False)
class SliceBinding:
    """A slice bound against the container: the depth asked for and vindex3's plan of it (which
    layers run, which operands are read). EXPLAIN renders this very object; INFER, TRACE and
    DUMP LOGITS run it."""

    depth: int | None
    plan: Any = field(repr=False)  # vindex3.exec.slice.SlicePlan
    # the session's DRAFT DEPTH d WITH ADAPTER: the exit adapter stored for d (its
    # vindex3.draft.store.components row) that the draft's final norm and head read through
    adapter: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def label(self) -> str:
        if self.adapter is not None:
            return f"{slice_label(self.depth)} through exit adapter {self.adapter['key']!r}"
        return slice_label(self.depth)

    @property
    def executed_layers(self) -> list[int]:
        return [int(i) for i in self.plan.executed_layers]

    @property
    def reads(self) -> R.ReadCost:
        return read_cost(self.plan)


@dataclass(frozen=True)
class FeatureLayer:
    """A layer as the feature statements see it: its mixer, its FFN operator (None: no FFN),
    its feature count (None: no features), and why it has none."""

    layer: int
    mixer: str
    ffn: str | None
    features: int | None
    reason: str | None

    @property
    def has_features(self) -> bool:
        return self.features is not None


class Catalog:
    """A read-only view of an open container for the planner: facts only, no tensor data."""

    def __init__(self, container):
        self.container = container

    # ---- the graph and the plan --------------------------------------------------------

    @property
    def name(self) -> str:
        return self.container.name

    @property
    def path(self) -> str:
        return str(self.container.path)

    @property
    def num_layers(self) -> int:
        return self.container.graph.num_layers

    @cached_property
    def op_plan(self):
        return self.container.op_plan()

    @property
    def vocab(self) -> int:
        return self.op_plan.vocab

    def bind_slice(self, depth: int | None) -> SliceBinding:
        """Plan a slice; vindex3 refuses a depth of 0 or deeper than the model (`SliceError`)."""
        return SliceBinding(depth, self.container.plan_slice(slice_of(depth)))

    def expert_layers(self) -> list[int]:
        """Layers whose FFN routes to experts (reads a bank of which a position uses k of E)."""
        return expert_layers(self.op_plan)

    @property
    def context_length(self) -> int | None:
        """The model's context length as the graph records it (None: it states none)."""
        return self.container.graph.context_length

    def estimate(self, positions: int, depth: int | None, *, start: int = 0, last_only: bool = False):
        """vindex3's `MemoryEstimate` of a prefill of ``positions`` after ``start`` held ones on
        the slice of ``depth`` (from the plan; nothing is read or allocated)."""
        from vindex3.limits import estimate_prefill

        return estimate_prefill(self.op_plan, positions, slice_of(depth), start=start, last_only=last_only)

    def check_layer(self, layer: int, what: str = "layer") -> None:
        n = self.num_layers
        if not 0 <= layer < n:
            raise StatementError(f"{what} {layer} does not exist: the model has {n} layers (0..{n - 1})")

    # ---- FFN features (the internals statements) ----------------------------------------

    @cached_property
    def feature_layers(self) -> list[FeatureLayer]:
        """Per layer, its FFN's features or why it has none, from the op plan alone (the same
        rule as vindex3.internals: an FFN operator that opts into `FeatureFfn` has features)."""
        from vindex3.operators import FFN, FeatureFfn, no_features_reason

        out = []
        for lo in self.op_plan.layers:
            ffn = next((op for op in lo.slot_ops() if op.role == FFN), None)
            if ffn is None:
                out.append(FeatureLayer(lo.index, lo.operator, None, None,
                                        f"{lo.operator} layer with no FFN (mixer only): it has no features"))
            elif ffn.operator is None:
                out.append(FeatureLayer(lo.index, lo.operator, ffn.kind, None,
                                        f"FFN kind {ffn.kind!r} has no executor in this build"))
            elif not isinstance(ffn.operator, FeatureFfn):
                out.append(FeatureLayer(lo.index, lo.operator, ffn.kind, None, no_features_reason(ffn.kind, ffn.operator)))
            else:
                out.append(FeatureLayer(lo.index, lo.operator, ffn.kind, int(ffn.operator.feature_count(ffn.params)), None))
        return out

    def layer_span(self, span: tuple[int, int] | None, clause: str) -> tuple[int, ...] | None:
        """The layers of ``LAYERS a-b`` (None stays None: every layer); refuses a range that runs
        backwards or names a layer the model does not have."""
        if span is None:
            return None
        a, b = span
        if b < a:
            raise StatementError(f"{clause} {a}-{b} runs backwards", hint=f"write {clause} {b}-{a}")
        n = self.num_layers
        for i in (a, b):
            if not 0 <= i < n:
                raise StatementError(f"{clause} names layer {i}, which does not exist: the model has {n} layers (0..{n - 1})")
        return tuple(range(a, b + 1))

    def ablation(self, pairs, sl: SliceBinding):
        """ABLATE FEATURES (...) bound against a slice: a `vindex3.exec.intervention.FeatureAblation`,
        or None. Refused by name (vindex3's own check, which reads no tensor data): a layer the
        model or the slice does not have, a layer without an FFN, an FFN operator that does not
        expose features, a feature index outside its layer."""
        if pairs is None:
            return None
        from vindex3.exec.intervention import FeatureAblation, resolve

        ab = FeatureAblation.of(pairs)
        resolve(ab, self.op_plan, sl.executed_layers, sl.label)
        return ab

    def single_token(self, token: str | int, what: str) -> int:
        """A vocabulary entry: a token id, or a text that is exactly one token of this
        vocabulary (no BOS added)."""
        v = self.vocab
        if isinstance(token, int):
            if not 0 <= token < v:
                raise StatementError(f"{what}: token id {token} is outside the vocabulary [0, {v})")
            return token
        if not self.has_tokenizer:
            raise StatementError(f"{what}: the container carries no tokenizer, so {token!r} cannot be looked up",
                                 hint="give a token id instead, e.g. FOR 42")
        tok = self.container.tokenizer
        ids = [int(i) for i in tok.pieces(token)]
        if len(ids) == 1:
            return ids[0]
        pieces = ", ".join(repr(self.token_text(i)) for i in ids) or "nothing"
        hint = None
        if not token.startswith(" "):
            alt = tok.pieces(" " + token)
            if len(alt) == 1:
                hint = f"{' ' + token!r} (with its leading space) is one token, id {int(alt[0])}"
        raise StatementError(f"{what}: {token!r} is not one token of this vocabulary (it is {len(ids)}: {pieces})",
                             hint=hint)

    # ---- the tokenizer -------------------------------------------------------------------

    @property
    def has_tokenizer(self) -> bool:
        return self.container.has_tokenizer

    def tokenize(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text`` (a missing tokenizer is vindex3's `TokenizerMissing`).
        ``special=False`` encodes without adding BOS/EOS: a chat template writes its own."""
        return [int(i) for i in self.container.tokenizer.encode(text, special=special)]

    def token_text(self, token_id: int) -> str | None:
        return self.container.tokenizer.token_text(token_id) if self.has_tokenizer else None

    def decode(self, ids: list[int]) -> str | None:
        return self.container.tokenizer.decode(ids) if self.has_tokenizer else None

    def eos_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids as the container declares them: generation_config.json's
        ``eos_token_id`` (one id or a list) when present, else the tokenizer's EOS token.
        Empty when neither declares one."""
        gc = Path(self.container.path) / "generation_config.json"
        if gc.exists():
            try:
                v = json.loads(gc.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, ValueError):
                v = None
            if isinstance(v, int) and not isinstance(v, bool):
                return (v,)
            if isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                return tuple(v)
        if self.has_tokenizer and self.container.tokenizer.eos_id is not None:
            return (int(self.container.tokenizer.eos_id),)
        return ()

    def chat_template(self) -> str | None:
        """The container's chat template (tokenizer_config.json's ``chat_template``, or a
        ``chat_template.jinja`` / ``chat_template.json`` snapshot), or None."""
        path = Path(self.container.path)
        jinja = path / "chat_template.jinja"
        if jinja.exists():
            return jinja.read_text(encoding="utf-8")
        cj = path / "chat_template.json"
        if cj.exists():
            t = json.loads(cj.read_text(encoding="utf-8")).get("chat_template")
            if isinstance(t, str):
                return t
        if self.has_tokenizer:
            t = self.container.tokenizer.config.get("chat_template")
            if isinstance(t, str):
                return t
        return None

    def special_tokens(self) -> dict[str, str]:
        """bos_token / eos_token spellings for a chat template."""
        if not self.has_tokenizer:
            return {}
        tok = self.container.tokenizer
        return {k: v for k, v in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token)) if v}


def jsonable(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return repr(v)


def prompt_info(p) -> R.PromptInfo:
    """A bound prompt (`lql.planner.BoundPrompt`) as results show it."""
    return R.PromptInfo(text=p.text, ids=list(p.ids), chat=p.chat)
