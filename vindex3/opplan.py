"""The operand plan: from the graph and the segment tables only, the ordered ops of every layer
with references to the tensors they read. No model family and no operator kind is known here:
the layer skeleton comes from vindex3.layout, and each slot's op from its registered operator
(vindex3.operators), which also gives the op's continuation geometry."""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import Field

from . import continuation as cont
from .graph import Graph
from .layout import NORMS, PARALLEL
from .operators import FFN, MIXER, Operator, Params, ReadProfile, distinct_bytes
from .segments import TensorEntry


@dataclass(frozen=True)
class OperandRef:
    object: str
    tensor: str
    dtype: str  # the stored encoding (a codec name, or one this build cannot execute)
    shape: tuple[int, ...]
    nbytes: int  # stored bytes

    @property
    def label(self) -> str:
        return f"{self.object}/{self.tensor}"


class NormParams(Params):
    eps: float = Field(ge=0, allow_inf_nan=False)
    weight_offset: float = Field(allow_inf_nan=False)
    post: bool | None = None  # True: a post-norm, of the slot's write (not of the residual)


class ResidualParams(Params):
    multiplier: float = Field(allow_inf_nan=False)


class ForkParams(Params):
    """The op where a parallel layer's two branches meet: it adds the mixer's write to the
    residual (times ``multiplier``) and hands the FFN the layer's input normed."""

    norm: str  # the norm kind: rms | layer
    eps: float = Field(ge=0, allow_inf_nan=False)
    weight_offset: float = Field(allow_inf_nan=False)
    multiplier: float = Field(allow_inf_nan=False)


class EmbedParams(Params):
    multiplier: float = Field(allow_inf_nan=False)
    positions: str | None = None  # "learned": the position_embedding row of each position is added


class HeadParams(Params):
    tied: bool
    multiplier: float = Field(allow_inf_nan=False)
    softcap: float | None


class NoParams(Params):
    """A described operator's op: this build knows nothing of its parameters."""


@dataclass
class Op:
    kind: str  # an operator's name, or a core op: embed | rms_norm | layer_norm | parallel_fork | residual_add | head
    params: Params
    operands: dict[str, OperandRef] = field(default_factory=dict)
    role: str = ""  # what the op is for in its layer: "mixer", "ffn", "attn_norm", "ffn_residual", ...
    operator: Operator | None = None  # the registered operator of a slot op

    @property
    def reads(self) -> ReadProfile:
        """What a position reads of this op's operands (sizes only): its operator's profile,
        or every operand for a core or described op."""
        if self.operator is not None:
            return self.operator.read_profile(self.params, self.operands)
        return ReadProfile.dense(distinct_bytes(self.operands))

    @property
    def described(self) -> bool:
        """A slot op whose operator this build does not execute."""
        return self.role in (MIXER, FFN) and self.operator is None

    def describe(self) -> str:
        ps = ", ".join(f"{k}={v}" for k, v in self.params.items() if v is not None)
        return f"{self.kind}({ps})" if ps else self.kind


@dataclass
class LayerOps:
    index: int
    operator: str
    params: dict  # the mixer's summary parameters
    ops: list[Op]
    geometry: cont.Geometry
    described: bool = False  # some slot's operator has no executor here: its state is unknown

    def operands(self) -> list[OperandRef]:
        return [r for op in self.ops for r in op.operands.values()]

    def slot_ops(self) -> list[Op]:
        return [op for op in self.ops if op.role in (MIXER, FFN)]

    @property
    def reads(self) -> ReadProfile:
        """The layer's read profile: the sum of its ops' (plain data via ``to_data()``); the
        operators' own details are keyed by slot."""
        total = ReadProfile(0, 0, 0)
        for op in self.ops:
            r = op.reads
            total = total + ReadProfile(r.always_bytes, r.bank_bytes, r.per_position_bytes,
                                        {op.role: r.detail} if r.detail else {})
        return total


@dataclass
class OpPlan:
    embedding: Op
    layers: list[LayerOps]
    final_norm: Op
    head: Op
    hidden_size: int
    vocab: int
    context_length: int | None = None  # the graph's fact (None: the checkpoint states none, or an older graph)

    @property
    def end_ops(self) -> list[Op]:
        return [self.embedding, self.final_norm, self.head]

    def read_profile(self, layers: list[int] | None = None, ends: bool = True) -> ReadProfile:
        """Operand bytes of ``layers`` (all by default) and the ends, from sizes only: what every
        position reads, what sits in banks a position reads a part of, and what one position
        reads. The embedding is a bank of rows (a position gathers one), unless the head is the
        embedding itself, which reads it whole."""
        idx = range(len(self.layers)) if layers is None else layers
        total = ReadProfile(0, 0, 0)
        for i in idx:
            lo = self.layers[i].reads
            total = total + ReadProfile(lo.always_bytes, lo.bank_bytes, lo.per_position_bytes)
        if ends:
            emb = self.embedding.operands["weight"]
            head = {f"final_norm.{k}": r for k, r in self.final_norm.operands.items()}
            head.update({f"head.{k}": r for k, r in self.head.operands.items()})
            total = total + ReadProfile.dense(distinct_bytes(head))
            if emb.label not in {r.label for r in head.values()}:
                total = total + ReadProfile(0, emb.nbytes, emb.nbytes // emb.shape[0])
            pos = self.embedding.operands.get("positions")
            if pos is not None:  # one row per position, read by position
                total = total + ReadProfile(0, pos.nbytes, pos.nbytes // pos.shape[0])
        return total


def _ref(tables: dict[str, dict[str, TensorEntry]], obj: str, name: str) -> OperandRef:
    e = tables[obj][name]
    return OperandRef(obj, name, e.dtype, tuple(e.shape), e.nbytes)


def build_op_plan(graph: Graph, tables: dict[str, dict[str, TensorEntry]]) -> OpPlan:
    core = graph.core
    objs = graph.objects
    emb_ref = _ref(tables, "embedding", objs["embedding"]["operands"]["weight"])
    emb_operands = {"weight": emb_ref}
    if core.embedding.positions == "learned":
        emb_operands["positions"] = _ref(tables, "position_embedding", objs["position_embedding"]["operands"]["weight"])
    embedding = Op("embed", EmbedParams(multiplier=core.embedding.multiplier, positions=core.embedding.positions),
                   emb_operands, "embedding")
    norm_params = NormParams(eps=core.norms.eps, weight_offset=core.norms.weight_offset)
    post_params = NormParams(eps=core.norms.eps, weight_offset=core.norms.weight_offset, post=True)
    res_params = ResidualParams(multiplier=core.residual.multiplier)
    skeleton = NORMS[core.norms.placement]
    norm_kind = "layer_norm" if core.norms.kind == "layer" else "rms_norm"
    parallel = core.norms.placement in PARALLEL
    fork_params = ForkParams(norm=core.norms.kind, eps=core.norms.eps, weight_offset=core.norms.weight_offset,
                             multiplier=core.residual.multiplier)

    def norm_operands(refs: dict, role: str) -> dict:
        got = {"weight": refs[role]}
        if f"{role}_bias" in refs:
            got["bias"] = refs[f"{role}_bias"]
        return got

    layers = []
    for lp in graph.layers:
        refs = {role: _ref(tables, "decoder_stack", name) for role, name in lp.operands.items()}
        slots = [MIXER] + ([FFN] if lp.ffn else [])
        norm_role_names = {x for s in slots for r in skeleton[s] if r is not None for x in (r, f"{r}_bias")}
        slot_ops: dict[str, Op] = {}
        for s in slots:
            op = graph.operator(lp.index, s)
            if op is not None:
                p = graph.layer_params[lp.index][s]
                names = [r.name for r in op.roles(p)]
                slot_ops[s] = Op(op.name, p, {n: refs[n] for n in names if n in refs}, s, op)
        for s in slots:
            if s not in slot_ops:  # described: it reads whatever no other part of the layer claims
                taken = norm_role_names | {n for o in slot_ops.values() for n in o.operands}
                kind = lp.operator if s == MIXER else str(lp.ffn)
                slot_ops[s] = Op(kind, NoParams(), {n: r for n, r in refs.items() if n not in taken}, s)
        ops: list[Op] = []
        for s in slots:
            pre, post = skeleton[s]
            fork = parallel and s == FFN
            if fork:  # the mixer's residual add and the FFN's norm of the layer input, in one op
                ops.append(Op("parallel_fork", fork_params, norm_operands(refs, pre), "ffn_norm"))
            elif pre is not None and pre in refs:
                ops.append(Op(norm_kind, norm_params, norm_operands(refs, pre), pre))
            ops.append(slot_ops[s])
            if post is not None and post in refs:
                ops.append(Op(norm_kind, post_params, norm_operands(refs, post), post))
            if not (parallel and s == MIXER and FFN in slots):
                ops.append(Op("residual_add", res_params, {}, f"{s}_residual"))
        described = any(o.described for o in slot_ops.values())
        parts = [part for o in slot_ops.values() if o.operator is not None for part in o.operator.geometry(o.params).parts]
        mixer = slot_ops[MIXER]
        params = mixer.operator.summary(mixer.params) if mixer.operator is not None else {}
        layers.append(LayerOps(lp.index, lp.operator, params, ops, cont.combine(parts), described))
    fn_ops = {k: _ref(tables, "final_norm", v) for k, v in objs["final_norm"]["operands"].items() if k in ("weight", "bias")}
    final_norm = Op(norm_kind, norm_params, fn_ops, "final_norm")
    h = core.head
    head_ops = {"weight": emb_ref if h.tied else _ref(tables, "output_head", objs["output_head"]["operands"]["weight"])}
    if h.bias:
        head_ops["bias"] = _ref(tables, "output_head", objs["output_head"]["operands"]["bias"])
    head = Op("head", HeadParams(tied=h.tied, multiplier=h.multiplier, softcap=h.softcap), head_ops, "head")
    return OpPlan(embedding, layers, final_norm, head, graph.hidden_size, graph.vocab_size, graph.context_length)


@dataclass(frozen=True)
class OperandUse:
    """How the executor reads one tensor: ``kind`` is "matrix" (a weight object: products,
    row gathers, expert views — any encoding with a codec runs), "array" (the whole tensor as
    float32: norms, biases, convolution taps, ...) or "unknown" (read by an op this build has no
    executor for); ``roles`` names every op role that reads it."""

    kind: str
    roles: tuple[str, ...]


def operand_uses(plan: OpPlan) -> dict[str, OperandUse]:
    """label -> how the plan reads that tensor. A tensor read both ways counts as an array (it
    must then stay float32-decodable as a whole), one read by an op without an executor as
    unknown."""
    from .operators import MATRIX

    seen: dict[str, tuple[set[str], list[str]]] = {}

    def add(ref: OperandRef, kind: str, role: str) -> None:
        kinds, roles = seen.setdefault(ref.label, (set(), []))
        kinds.add(kind)
        if role not in roles:
            roles.append(role)

    add(plan.embedding.operands["weight"], "matrix", "embedding")
    if "positions" in plan.embedding.operands:
        add(plan.embedding.operands["positions"], "matrix", "position_embedding")
    add(plan.head.operands["weight"], "matrix", "head")
    if "bias" in plan.head.operands:
        add(plan.head.operands["bias"], "array", "head_bias")
    for k, ref in plan.final_norm.operands.items():
        add(ref, "array", "final_norm" if k == "weight" else f"final_norm_{k}")
    for lo in plan.layers:
        for op in lo.ops:
            if op.operator is not None:
                kinds = {r.name: r.kind for r in op.operator.roles(op.params)}
                for role, ref in op.operands.items():
                    add(ref, "matrix" if kinds.get(role, MATRIX) == MATRIX else "array", role)
            else:
                for role, ref in op.operands.items():
                    core = op.kind in ("rms_norm", "layer_norm", "parallel_fork")
                    add(ref, "array" if core else "unknown", op.role if core else role)
    out = {}
    for label, (kinds, roles) in seen.items():
        kind = "unknown" if "unknown" in kinds else ("array" if "array" in kinds else "matrix")
        out[label] = OperandUse(kind, tuple(roles))
    return out
