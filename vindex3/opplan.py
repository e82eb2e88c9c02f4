"""The operand plan: from the graph and the segment tables only, the ordered ops of every
layer with references to the tensors they read. No model family is known here; everything is
dispatched on the graph's operator and surface."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import continuation as cont
from .errors import UnsupportedOperator
from .graph import Graph
from .segments import TensorEntry


@dataclass(frozen=True)
class OperandRef:
    object: str
    tensor: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    @property
    def label(self) -> str:
        return f"{self.object}/{self.tensor}"


@dataclass
class Op:
    kind: str  # embed | rms_norm | attention | gated_ffn | mamba2 | residual_add | head
    params: dict = field(default_factory=dict)
    operands: dict[str, OperandRef] = field(default_factory=dict)
    role: str = ""  # what the op is for within its layer (e.g. "attn_norm")

    def describe(self) -> str:
        ps = ", ".join(f"{k}={v}" for k, v in self.params.items() if v is not None)
        return f"{self.kind}({ps})" if ps else self.kind


@dataclass
class LayerOps:
    index: int
    operator: str
    params: dict
    ops: list[Op]
    geometry: cont.Geometry

    def operands(self) -> list[OperandRef]:
        return [r for op in self.ops for r in op.operands.values()]


@dataclass
class OpPlan:
    embedding: Op
    layers: list[LayerOps]
    final_norm: Op
    head: Op
    hidden_size: int
    vocab: int

    @property
    def end_ops(self) -> list[Op]:
        return [self.embedding, self.final_norm, self.head]


def _ref(tables: dict[str, dict[str, TensorEntry]], obj: str, name: str) -> OperandRef:
    e = tables[obj][name]
    return OperandRef(obj, name, e.dtype, tuple(e.shape), e.nbytes)


def _norm(surface: dict, weight: OperandRef, role: str) -> Op:
    n = surface["norms"]
    if n["kind"] != "rms":
        raise UnsupportedOperator(f"norm kind {n['kind']!r} has no executor (supported: rms)")
    return Op("rms_norm", {"eps": n["eps"], "weight_offset": n.get("weight_offset", 0.0)}, {"weight": weight}, role)


def _attention_op(surface: dict, layer, refs: dict[str, OperandRef]) -> tuple[Op, dict]:
    a = surface["attention"]
    pos = layer.position
    if pos is None:
        raise UnsupportedOperator(f"layer {layer.index}: softmax layer declares no position policy (rope or none)")
    params = {
        "heads": a["heads"],
        "kv_heads": a["kv_heads"],
        "head_dim": a["head_dim"],
        "head_mapping": a["head_mapping"],
        "span": layer.span,
        "window": layer.window,
        "position": pos["kind"],
        "rope_theta": pos.get("theta") if pos["kind"] == "rope" else None,
        "rotary_dims": pos.get("rotary_dims") if pos["kind"] == "rope" else None,
        "rope_scaling": pos.get("scaling") if pos["kind"] == "rope" else None,
        "query_scale": a["query_scale"],
        "score_scale": a["score_scale"],
        "qk_norm_eps": a["qk_norm"]["eps"] if a.get("qk_norm") else None,
        "qk_norm_offset": a["qk_norm"].get("weight_offset", 0.0) if a.get("qk_norm") else None,
    }
    if a["head_mapping"] != "repeat_interleave":
        raise UnsupportedOperator(f"head mapping {a['head_mapping']!r} has no executor (supported: repeat_interleave)")
    if pos["kind"] not in ("rope", "none"):
        raise UnsupportedOperator(f"layer {layer.index}: position kind {pos['kind']!r} has no executor (supported: rope, none)")
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "q_bias", "k_bias", "v_bias", "o_bias", "q_norm", "k_norm"]
    operands = {n: refs[n] for n in names if n in refs}
    return Op("attention", params, operands, "mixer"), {k: params[k] for k in ("heads", "kv_heads", "head_dim", "span", "window", "position", "rope_theta")}


def _ffn_op(surface: dict, refs: dict[str, OperandRef]) -> Op:
    f = surface["ffn"]
    if f["kind"] != "gated":
        raise UnsupportedOperator(f"FFN kind {f['kind']!r} has no executor (supported: gated)")
    names = ["ffn_gate", "ffn_up", "ffn_gate_up", "ffn_down", "ffn_gate_bias", "ffn_up_bias", "ffn_down_bias"]
    return Op("gated_ffn", {"activation": f["activation"], "intermediate_size": f["intermediate_size"]}, {n: refs[n] for n in names if n in refs}, "ffn")


def _mamba2_op(surface: dict, refs: dict[str, OperandRef]) -> tuple[Op, dict]:
    m = dict(surface["operators"]["mamba2"])
    names = ["in_proj", "in_proj_bias", "conv_weight", "conv_bias", "A_log", "D", "dt_bias", "gated_norm", "out_proj", "out_proj_bias"]
    op = Op("mamba2", m, {n: refs[n] for n in names if n in refs}, "mixer")
    return op, {k: m[k] for k in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel") if k in m}


def op_geometry(op: Op) -> cont.Geometry:
    """The state an op keeps between positions. Only ops that keep state say so."""
    if op.kind == "attention":
        p = op.params
        return cont.kv(p["kv_heads"] * p["head_dim"], p["window"])
    if op.kind == "mamba2":
        p = op.params
        nh, hd, ns, g, k = p["num_heads"], p["head_dim"], p["state_size"], p["n_groups"], p["conv_kernel"]
        conv_dim = nh * hd + 2 * g * ns
        return cont.recurrent([cont.Buffer("ssm", (nh, hd, ns)), cont.Buffer("conv", (conv_dim, k))])
    return cont.STATELESS


MIXERS = {"softmax": _attention_op, "mamba2": _mamba2_op}


def build_op_plan(graph: Graph, tables: dict[str, dict[str, TensorEntry]]) -> OpPlan:
    s = graph.surface
    objs = graph.objects
    emb_ref = _ref(tables, "embedding", objs["embedding"]["operands"]["weight"])
    embedding = Op("embed", {"multiplier": s["embedding"]["multiplier"]}, {"weight": emb_ref}, "embedding")
    placement = s["norms"]["placement"]
    res = s.get("residual", {})
    res_params = {"multiplier": res.get("multiplier", 1.0)}
    layers = []
    for lp in graph.layers:
        refs = {role: _ref(tables, "decoder_stack", name) for role, name in lp.operands.items()}
        builder = MIXERS.get(lp.operator)
        if builder is None:
            # Described but not executable: the plan still lists the layer for EXPLAIN/STATS;
            # preparing it refuses by name.
            mixer = Op(lp.operator, {}, {}, "mixer")
            params = {}
        else:
            mixer, params = builder(s, lp, refs) if lp.operator == "softmax" else builder(s, refs)
        ops: list[Op] = []
        pre = refs.get("attn_norm") or refs.get("mixer_norm")
        if placement in ("pre_only", "pre_post", "pre_mixer") and pre is not None:
            ops.append(_norm(s, pre, "attn_norm" if "attn_norm" in refs else "mixer_norm"))
        ops.append(mixer)
        if placement in ("pre_post", "post_only") and "post_attn_norm" in refs:
            ops.append(_norm(s, refs["post_attn_norm"], "post_attn_norm"))
        ops.append(Op("residual_add", res_params, {}, "mixer_residual"))
        if lp.ffn:
            if placement != "post_only" and "ffn_norm" in refs:
                ops.append(_norm(s, refs["ffn_norm"], "ffn_norm"))
            ops.append(_ffn_op(s, refs))
            if placement in ("pre_post", "post_only") and "post_ffn_norm" in refs:
                ops.append(_norm(s, refs["post_ffn_norm"], "post_ffn_norm"))
            ops.append(Op("residual_add", res_params, {}, "ffn_residual"))
        geometry = cont.combine([op_geometry(op) for op in ops])
        layers.append(LayerOps(lp.index, lp.operator, params, ops, geometry))
    fn_ref = _ref(tables, "final_norm", objs["final_norm"]["operands"]["weight"])
    final_norm = _norm(s, fn_ref, "final_norm")
    h = s["head"]
    head_ref = emb_ref if h["tied"] else _ref(tables, "output_head", objs["output_head"]["operands"]["weight"])
    head = Op("head", {"tied": h["tied"], "multiplier": h.get("multiplier", 1.0), "softcap": h.get("softcap")}, {"weight": head_ref}, "head")
    return OpPlan(embedding, layers, final_norm, head, graph.hidden_size, graph.vocab_size)
