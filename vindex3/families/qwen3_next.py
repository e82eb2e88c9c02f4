"""Gated DeltaNet hybrids: Qwen3-Next (``qwen3_next``) and Qwen3.5 (``qwen3_5_text``,
``qwen3_5_moe_text``, and the released vision-language ``qwen3_5`` / ``qwen3_5_moe`` checkpoints,
of which the text component is admitted).

Layout (``P`` is ``model.`` for the text models, ``model.language_model.`` for the VL ones):
``P.embed_tokens``, ``P.layers.N.input_layernorm`` (before the mixer),
``P.layers.N.linear_attn.*`` (a gated_delta mixer) or ``P.layers.N.self_attn.*`` (gated softmax
attention), ``P.layers.N.post_attention_layernorm`` (before the FFN), ``P.layers.N.mlp.*``,
``P.norm``, ``lm_head``. Every layer is ``h = x + mixer(norm1(x)); h + ffn(norm2(h))``; every
decoder and final norm is zero-centred (weight offset 1.0), so are the attention's q/k norms; the
gated norm inside a linear layer is plain. Tensor tables and config facts are in
vindex3/exec/ops/gated_delta.py's docstring.

Mixers: ``layer_types`` (``linear_attention`` -> gated_delta, ``full_attention`` -> softmax with
an output gate, partial rotary and (1 + w) q/k norms), or ``full_attention_interval`` when that is
how a config declares them (layer L attends iff (L + 1) % interval == 0); a config that declares
neither is refused by name (transformers would fall back to an interval of 4).

FFNs: dense (``mlp.{gate,up,down}_proj``) or routed experts, the ``moe_ffn`` operator: router
``softmax_topk`` over ``num_experts`` with top ``num_experts_per_tok``, renormalised when
``norm_topk_prob`` (qwen3_next; always for the Qwen3.5 MoE models, whose reference has no such key),
no router bias, no correction bias, no groups, no scaling factor; experts of
``moe_intermediate_size`` with ``hidden_act`` (SiLU); a shared expert of
``shared_expert_intermediate_size`` gated by ``sigmoid(x @ shared_expert_gate.T)``. A qwen3_next
layer is routed iff it is not in ``mlp_only_layers``, ``num_experts > 0`` and
(L + 1) % ``decoder_sparse_step`` == 0; every qwen3_5_moe_text layer is routed. Expert tensors
(`ROUTED_SUFFIXES`): the released layout ``mlp.experts.{e}.{gate,up,down}_proj.weight`` is
stacked into one bank per projection (gate and up merged in halves, gate first), the runtime
save's ``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I] is stored as
it is; the router ``mlp.gate.weight`` [E, H], ``mlp.shared_expert.{gate,up,down}_proj.weight``
and ``mlp.shared_expert_gate.weight`` [1, H].

The released checkpoints' multi-token-prediction head (``mtp.*``, which transformers itself
ignores on load) is admitted as a ``drafter`` component (vindex3.draft.mtp) when it is complete
and one layer: ``mtp.fc`` [H, 2H], ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.norm`` (zero-centred norms) and ``mtp.layers.0.*``, a full-attention layer whose FFN kind is
that of layer index 0 (the serving code builds it with index 0); the model's embedding and head
are shared. Any other ``mtp.*`` tensor is refused by name. An incomplete head, or one of more
layers, is set aside with the reason.

Set aside by name, never silently: the VL checkpoints' vision tower (``model.visual.*``, a
perception component this build does not execute) and an MTP head that does not run. Both are
findings at admission and entries of the container's provenance (``components_not_carried`` and
``dropped_tensors``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..operators.gated_delta import LAYOUT_GROUPED, LAYOUT_SPLIT
from .base import CONSUMED, METADATA, ConfigReader, Finding, Lowering, register_family
from .decoder import ACTIVATIONS
from .moe import experts_fused, experts_per_tensor, moe_facts
from .placement import assemble_graph, place_tensors

LINEAR_ROLES = {
    "linear_attn.in_proj_qkvz.weight": "in_proj_qkvz",
    "linear_attn.in_proj_ba.weight": "in_proj_ba",
    "linear_attn.in_proj_qkv.weight": "in_proj_qkv",
    "linear_attn.in_proj_z.weight": "in_proj_z",
    "linear_attn.in_proj_b.weight": "in_proj_b",
    "linear_attn.in_proj_a.weight": "in_proj_a",
    "linear_attn.conv1d.weight": "conv_weight",
    "linear_attn.A_log": "A_log",
    "linear_attn.dt_bias": "dt_bias",
    "linear_attn.norm.weight": "gated_norm",
    "linear_attn.out_proj.weight": "out_proj",
}
LAYOUT_ROLES = {
    LAYOUT_GROUPED: {"in_proj_qkvz", "in_proj_ba"},
    LAYOUT_SPLIT: {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"},
}
ATTENTION_ROLES = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.bias": "v_bias",
    "self_attn.o_proj.bias": "o_bias",
    "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm",
}
NORM_ROLES = {"input_layernorm.weight": "mixer_norm", "post_attention_layernorm.weight": "ffn_norm"}
DENSE_ROLES = {"mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}
SHARED_ROLES = {
    "mlp.shared_expert.gate_proj.weight": "shared_gate",
    "mlp.shared_expert.up_proj.weight": "shared_up",
    "mlp.shared_expert.down_proj.weight": "shared_down",
    "mlp.shared_expert_gate.weight": "shared_expert_gate",
}


def routed_roles(E: int, H: int, In: int) -> dict:
    """A routed layer's FFN tensors (exact suffix -> role or `Part`): the router [E, hidden], the
    experts in either layout (one tensor per expert, stacked into [E, out, in] banks with gate and
    up merged in halves; or the runtime save's fused banks, stored as they are), the shared expert
    and its sigmoid gate [1, hidden]. A checkpoint holding both layouts of a bank is refused."""
    return {"mlp.gate.weight": "moe_router", **experts_per_tensor(E, H, In, "mlp", "gate_proj", "up_proj", "down_proj"),
            **experts_fused(E, H, In, "mlp"), **SHARED_ROLES}


# The spellings a routed layer accepts, for readers ({e}: every expert 0..E-1).
ROUTED_SUFFIXES = (
    "mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
    "mlp.experts.{e}.down_proj.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj", *SHARED_ROLES,
)

LAYER_KINDS = {"linear_attention": "gated_delta", "full_attention": "softmax"}
CHUNK_SIZE = 64  # the reference's chunk length (torch_chunk_gated_delta_rule)
QK_L2NORM_EPS = 1e-6  # the reference's l2norm eps for q and k (use_qk_l2norm_in_kernel)
PARTIAL_ROTARY_DEFAULT = 0.25  # kwargs.setdefault("partial_rotary_factor", 0.25) in every config class


@dataclass(frozen=True)
class Variant:
    text_type: str  # the text model's model_type
    layout: str  # gated_delta projection layout
    ffn: str  # "per_layer" (mlp_only_layers / decoder_sparse_step), "dense", "routed"
    mrope: bool  # rope_parameters may carry mrope_section / mrope_interleaved


TEXT = {
    "qwen3_next": Variant("qwen3_next", LAYOUT_GROUPED, "per_layer", False),
    "qwen3_5_text": Variant("qwen3_5_text", LAYOUT_SPLIT, "dense", True),
    "qwen3_5_moe_text": Variant("qwen3_5_moe_text", LAYOUT_SPLIT, "routed", True),
}
VL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}

VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."


@dataclass
class RoutedFacts:
    """The routing facts of the routed layers, graded from the config; `lower_text` writes them
    into ``surface.operators.moe_ffn``."""

    num_experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int
    renormalize: bool
    layers: list[int] = field(default_factory=list)


# ---- config --------------------------------------------------------------------------------------


def _pos_int(r: ConfigReader, key: str, v) -> bool:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        r.refuse(key, f"expected a positive integer, found {v!r}")
        return False
    return True


def _layer_kinds(r: ConfigReader, L: int) -> list[str] | None:
    """Each layer's mixer operator, from layer_types, or full_attention_interval when that is how
    the config declares it; neither is refused (fail closed, never "all softmax")."""
    has_lt, has_fai = r.has("layer_types"), r.has("full_attention_interval")
    if not has_lt and not has_fai:
        r.refuse("layer_types", "no layer kinds declared (neither layer_types nor full_attention_interval); refusing to "
                                "assume which layers attend", category="structure")
        return None
    pattern = None
    if has_fai:
        fai = r.config["full_attention_interval"]
        if not _pos_int(r, "full_attention_interval", fai):
            return None
        pattern = ["full_attention" if (i + 1) % fai == 0 else "linear_attention" for i in range(L)]
    if not has_lt:
        r.take("full_attention_interval", "layer L attends (full_attention) iff (L + 1) % interval == 0; the others are "
                                          "linear_attention")
        return [LAYER_KINDS[t] for t in pattern]
    lt = r.take("layer_types", "per-layer mixer: linear_attention (gated_delta) or full_attention (gated softmax)")
    if not isinstance(lt, list) or len(lt) != L:
        r.refuse("layer_types", f"expected a list of {L} layer types, found {lt!r}")
        return None
    bad = [(i, t) for i, t in enumerate(lt) if t not in LAYER_KINDS]
    if bad:
        i, t = bad[0]
        r.refuse("layer_types", f"layer {i} has type {t!r} (supported: {', '.join(LAYER_KINDS)})")
        return None
    if pattern is not None:
        if pattern != lt:
            i = next(i for i in range(L) if pattern[i] != lt[i])
            r.refuse("full_attention_interval", f"disagrees with layer_types at layer {i} ({pattern[i]} vs {lt[i]}); "
                                                "refusing rather than choosing one")
            return None
        r.take("full_attention_interval", "checked: agrees with layer_types")
    return [LAYER_KINDS[t] for t in lt]


def _rope(r: ConfigReader, head_dim: int, v: Variant) -> dict | None:
    """rope_parameters (or the legacy top-level rope_theta / partial_rotary_factor / rope_scaling)
    -> the full layers' position policy: default rope on the first int(head_dim · factor) dims."""
    params: dict = {}
    if r.has("rope_parameters"):
        p = r.take("rope_parameters", "rotary position encoding parameters")
        if not isinstance(p, dict):
            r.refuse("rope_parameters", f"expected an object, found {p!r}")
            return None
        params = dict(p)
    if r.has("rope_scaling"):
        if r.config["rope_scaling"] is None:
            r.meta("rope_scaling", "null: no rotary scaling")
        else:
            r.refuse("rope_scaling", "legacy rotary scaling is not supported for this family (supported: rope_type default)")
            return None
    theta = params.get("rope_theta")
    if r.has("rope_theta"):
        top = r.take("rope_theta", "rotary base (legacy top-level spelling)")
        if theta is not None and top != theta:
            r.refuse("rope_theta", f"disagrees with rope_parameters.rope_theta ({theta!r}); refusing rather than choosing one")
            return None
        theta = top
    if theta is None:
        r.refuse("rope_parameters", "no rotary base declared (neither rope_parameters.rope_theta nor rope_theta); refusing "
                                    "to assume one", category="structure")
        return None
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        r.refuse("rope_parameters", f"rope_theta must be a positive finite number, found {theta!r}")
        return None
    factor = params.get("partial_rotary_factor")
    if r.has("partial_rotary_factor"):
        top = r.take("partial_rotary_factor", "share of each head's dims that rotate (legacy top-level spelling)")
        if factor is not None and top != factor:
            r.refuse("partial_rotary_factor", f"disagrees with rope_parameters.partial_rotary_factor ({factor!r})")
            return None
        factor = top
    if factor is None:
        factor = r.take("partial_rotary_factor", "share of each head's dims that rotate", default=PARTIAL_ROTARY_DEFAULT,
                        default_reason=f"the reference sets {PARTIAL_ROTARY_DEFAULT} when no config states it")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        r.refuse("rope_parameters", f"partial_rotary_factor must be in (0, 1], found {factor!r}")
        return None
    rtype = params.get("rope_type", params.get("type", "default"))
    if rtype != "default":
        r.refuse("rope_parameters", f"rope_type {rtype!r} is not supported for this family (supported: default)")
        return None
    known = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
    if v.mrope:
        # Multimodal rope: three position streams (temporal, height, width) interleaved over the
        # rotary dims. For text the three streams are equal, so it is the plain rope below.
        known |= {"mrope_section", "mrope_interleaved"}
    extra = sorted(set(params) - known)
    if extra:
        r.refuse("rope_parameters", f"unknown rotary parameters {', '.join(extra)} (known: {', '.join(sorted(known))})")
        return None
    rotary_dims = int(head_dim * factor)
    if rotary_dims < 2 or rotary_dims % 2:
        r.refuse("rope_parameters", f"partial_rotary_factor {factor} gives {rotary_dims} rotary dims of {head_dim}; "
                                    "rotate-half needs a positive even number")
        return None
    return {"kind": "rope", "theta": float(theta), "rotary_dims": rotary_dims, "scaling": None}


def _routed(r: ConfigReader, v: Variant, L: int) -> tuple[list[str], RoutedFacts | None] | None:
    """Each layer's FFN kind ("dense" or "routed") and, when some layer is routed, its facts."""
    if v.ffn == "dense":
        return ["dense"] * L, None
    E = r.take("num_experts", "routed experts per sparse layer", default=512 if v.ffn == "per_layer" else 256,
               default_reason="the reference's class default")
    if isinstance(E, bool) or not isinstance(E, int) or E < 0:
        r.refuse("num_experts", f"expected a non-negative integer, found {E!r}")
        return None
    if v.ffn == "routed":
        kinds = ["routed"] * L  # qwen3_5_moe_text: every layer's FFN is the sparse block
    else:
        mlo = r.take("mlp_only_layers", "layers whose FFN is dense whatever the sparse step", default=[],
                     default_reason="the reference default is [] (no forced-dense layer)")
        step = r.take("decoder_sparse_step", "layer L is sparse iff (L + 1) % step == 0 (and L not in mlp_only_layers, and "
                                             "num_experts > 0)", default=1, default_reason="the reference default is 1")
        if not isinstance(mlo, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in mlo):
            r.refuse("mlp_only_layers", f"expected a list of layer indices, found {mlo!r}")
            return None
        if not _pos_int(r, "decoder_sparse_step", step):
            return None
        kinds = ["routed" if (i not in mlo and E > 0 and (i + 1) % step == 0) else "dense" for i in range(L)]
    routed = [i for i, k in enumerate(kinds) if k == "routed"]
    keys = ["num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"]
    if v.ffn == "per_layer":
        keys.append("norm_topk_prob")
    if not routed:
        for k in keys:
            r.meta(k, "routed-expert facts; no layer of this model is routed")
        return kinds, None
    k = r.take("num_experts_per_tok", "experts per position (top k)")
    im = r.take("moe_intermediate_size", "each expert's FFN width")
    ish = r.take("shared_expert_intermediate_size", "the shared expert's FFN width (its output is gated by "
                                                    "sigmoid(x @ shared_expert_gate.T))")
    if v.ffn == "per_layer":
        renorm = r.take("norm_topk_prob", "the top-k weights are renormalised to sum to 1", default=True,
                        default_reason="the reference default is true")
    else:  # the Qwen3.5 MoE router always renormalises; a config may still say so
        renorm = True
        if r.has("norm_topk_prob"):
            if r.config["norm_topk_prob"] is True:
                r.meta("norm_topk_prob", "true: the reference's router always renormalises the top-k weights")
            else:
                r.refuse("norm_topk_prob", f"{r.config['norm_topk_prob']!r}: the reference's router always renormalises "
                                           "the top-k weights; a config that turns it off describes a model the "
                                           "reference does not run")
                return None
    if None in (k, im, ish):  # absent: refused by take already; null: refused here
        for key, val in (("num_experts_per_tok", k), ("moe_intermediate_size", im),
                         ("shared_expert_intermediate_size", ish)):
            if val is None and r.has(key):
                r.refuse(key, "is null; the routed layers need it")
        return None
    ok = all([_pos_int(r, "num_experts_per_tok", k), _pos_int(r, "moe_intermediate_size", im),
              _pos_int(r, "shared_expert_intermediate_size", ish)])
    if not isinstance(renorm, bool):
        r.refuse("norm_topk_prob", f"expected true or false, found {renorm!r}")
        ok = False
    if ok and k > E:
        r.refuse("num_experts_per_tok", f"routes each position to {k} of {E} experts")
        ok = False
    if not ok:
        return None
    return kinds, RoutedFacts(E, k, im, ish, renorm, routed)


@dataclass
class TextLowering:
    layers: list[dict]
    surface: dict
    kinds: list[str]  # per layer: gated_delta | softmax
    ffns: list[str]  # per layer: dense | routed
    routed: RoutedFacts | None  # the routing facts, when some layer is routed


def lower_text(r: ConfigReader, v: Variant, tied: bool) -> TextLowering | None:
    """Grade the text model's keys and build its layers and surface (``tied`` is decided by the
    caller: the VL checkpoints tie by their top-level key)."""
    H = r.take("hidden_size", "residual width")
    L = r.take("num_hidden_layers", "number of decoder layers")
    vocab = r.take("vocab_size", "vocabulary size")
    eps = r.take("rms_norm_eps", "epsilon of every RMSNorm (decoder, final, q/k and the gated norm)", default=1e-6,
                 default_reason="the reference default is 1e-6")
    act = r.take("hidden_act", "the linear layers' conv activation and the FFN activation", default="silu",
                 default_reason="the reference default is silu")
    nh = r.take("num_attention_heads", "query heads of the full layers")
    nkv = r.take("num_key_value_heads", "key/value heads of the full layers")
    hd = r.take("head_dim", "per-head width of the full layers (explicit; never hidden / heads)")
    bias = r.take("attention_bias", "bias on q/k/v/o projections", default=False, default_reason="the reference default has none")
    nk = r.take("linear_num_key_heads", "key heads of the linear layers")
    nv = r.take("linear_num_value_heads", "value heads of the linear layers")
    dk = r.take("linear_key_head_dim", "key head width of the linear layers")
    dv = r.take("linear_value_head_dim", "value head width of the linear layers")
    K = r.take("linear_conv_kernel_dim", "the linear layers' causal conv width", default=4,
               default_reason="the reference default is 4")
    if r.has("attn_output_gate"):  # released Qwen3.5 configs; transformers always gates
        if r.config["attn_output_gate"] is True:
            r.take("attn_output_gate", "the full layers' output gate, which the reference always applies")
        else:
            r.refuse("attn_output_gate", "the reference always gates the full layers' output; a config that turns it off "
                                         "describes a model the reference does not run")
    if r.has("output_gate_type"):  # released Qwen3.5 configs: the linear layers' gated norm activation
        if r.config["output_gate_type"] == "swish":
            r.take("output_gate_type", "swish: the linear layers' gated norm multiplies by silu(z), as the reference")
        else:
            r.refuse("output_gate_type", "the reference's gated norm multiplies by silu(z) (swish); no other gate runs")
    r.ignore("mamba_ssm_dtype", "a serving engine's dtype for the recurrent state cache; the reference keeps the state "
                                "in its compute dtype and this executor in float32")
    r.meta("mtp_num_hidden_layers", "layers of the multi-token-prediction head (mtp.*): a drafter component when "
                                    "complete and one layer, else set aside")
    if r.has("mtp_use_dedicated_embeddings") and r.config["mtp_use_dedicated_embeddings"] not in (False, None):
        r.refuse("mtp_use_dedicated_embeddings", f"{r.config['mtp_use_dedicated_embeddings']!r}: an MTP head with its "
                                                 "own embedding has no tensor spelling this build knows")
    else:
        r.meta("mtp_use_dedicated_embeddings", "the multi-token-prediction head reads the model's own embedding")

    ok = True
    for key, val in (("hidden_size", H), ("num_hidden_layers", L), ("vocab_size", vocab), ("num_attention_heads", nh),
                     ("num_key_value_heads", nkv), ("head_dim", hd), ("linear_num_key_heads", nk),
                     ("linear_num_value_heads", nv), ("linear_key_head_dim", dk), ("linear_value_head_dim", dv),
                     ("linear_conv_kernel_dim", K)):
        if val is not None:
            ok = _pos_int(r, key, val) and ok
    if None in (H, L, vocab, nh, nkv, hd, nk, nv, dk, dv) or not ok:
        return None
    if act not in ACTIVATIONS or ACTIVATIONS[act] != "silu":
        r.refuse("hidden_act", f"activation {act!r}: the linear layers' conv runs SiLU only (supported: silu, swish)")
        ok = False
    if nh % nkv:
        r.refuse("num_key_value_heads", f"{nh} query heads are not a multiple of {nkv} key/value heads")
        ok = False
    if nv % nk:
        r.refuse("linear_num_value_heads", f"{nv} value heads are not a multiple of {nk} key heads")
        ok = False
    if not isinstance(bias, bool):
        r.refuse("attention_bias", f"expected true or false, found {bias!r}")
        ok = False
    kinds = _layer_kinds(r, L)
    position = _rope(r, hd, v)
    ffns = _routed(r, v, L)
    if kinds is None or position is None or ffns is None or not ok:
        return None
    ffn_kinds, routed = ffns
    inter = None
    if "dense" in ffn_kinds:
        inter = r.take("intermediate_size", "the dense FFN's width")
        if inter is None or not _pos_int(r, "intermediate_size", inter):
            return None
    elif r.has("intermediate_size"):
        r.meta("intermediate_size", "the dense FFN width; no layer of this model is dense")

    layers = []
    for i, (op, ffn) in enumerate(zip(kinds, ffn_kinds)):
        attn = op == "softmax"
        layers.append({"index": i, "operator": op, "span": "full" if attn else None, "window": None,
                       "position": position if attn else None, "ffn": ffn, "operands": {}})
    surface: dict = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 1.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
    }
    if "softmax" in kinds:
        surface["attention"] = {
            "heads": nh,
            "kv_heads": nkv,
            "head_dim": hd,
            "output_gate": True,
            "head_mapping": "repeat_interleave",
            "query_scale": 1.0,
            "score_scale": float(hd) ** -0.5,
            "bias": {k: bias for k in ("q", "k", "v", "o")},
            "qk_norm": {"kind": "rms", "eps": float(eps), "weight_offset": 1.0, "scope": "head"},
            "qkv_clip": None,
            "sinks": None,
        }
    if "dense" in ffn_kinds:
        surface["ffn"] = {"kind": "gated", "activation": "silu", "intermediate_size": inter, "bias": False,
                          "fused_gate_up": False}
    if routed is not None:
        surface["operators"]["moe_ffn"] = moe_facts(
            E=routed.num_experts, k=routed.top_k, In=routed.expert_intermediate, router="softmax_topk",
            renormalize=routed.renormalize, act="silu", shared="sigmoid_gated",
            shared_intermediate=routed.shared_intermediate, shared_act="silu", shared_gate_up="separate")
    if "gated_delta" in kinds:
        surface["operators"]["gated_delta"] = {
            "num_key_heads": nk, "num_value_heads": nv, "key_head_dim": dk, "value_head_dim": dv,
            "key_dim": nk * dk, "value_dim": nv * dv, "conv_dim": 2 * nk * dk + nv * dv,
            "conv_kernel": K, "conv_activation": "silu", "conv_bias": False, "chunk_size": CHUNK_SIZE,
            "projection_layout": v.layout, "head_mapping": "repeat_interleave", "qk_l2norm_eps": QK_L2NORM_EPS,
            "norm_eps": float(eps), "norm_weight_offset": 0.0, "norm_before_gate": True,
        }
    return TextLowering(layers, surface, kinds, ffn_kinds, routed)


# ---- tensors -------------------------------------------------------------------------------------


def _layer_table(v: Variant, kind: str, ffn: str, hidden: int, routed: RoutedFacts | None) -> dict:
    """Exact tensor suffix -> operand role (or `Part` of a stacked expert bank) for one layer:
    only this layer's mixer and FFN."""
    if kind == "gated_delta":
        keep = LAYOUT_ROLES[v.layout] | {"conv_weight", "A_log", "dt_bias", "gated_norm", "out_proj"}
        mixer = {s: role for s, role in LINEAR_ROLES.items() if role in keep}
    else:
        mixer = ATTENTION_ROLES
    if ffn == "dense":
        ffn_roles = DENSE_ROLES
    else:
        assert routed is not None  # a routed layer exists only with its facts
        ffn_roles = routed_roles(routed.num_experts, hidden, routed.expert_intermediate)
    return {**NORM_ROLES, **mixer, **ffn_roles}


class _Without:
    """A view of a source without the tensors set aside (placement sees only what it places)."""

    def __init__(self, src, drop):
        self._src, self._drop = src, drop

    def tensor_specs(self):
        return {n: s for n, s in self._src.tensor_specs().items() if not any(n.startswith(p) for p in self._drop)}


def _set_aside(r: ConfigReader, src, prefix: str, component: str, role: str, why: str, into: Lowering) -> None:
    names = sorted(n for n in src.tensor_specs() if n.startswith(prefix))
    if not names:
        return
    specs = src.tensor_specs()
    params = sum(math.prod(specs[n].shape) for n in names)
    r.findings.append(Finding(category=METADATA, key=f"{prefix}*", value=len(names), blocks=False,
                              message=f"{component} ({role}): {len(names)} tensors, {params:,} parameters, not carried; {why}"))
    into.dropped.extend((n, f"{component} ({role}), not carried: {why}") for n in names)
    into.not_carried_components.append({"component": component, "role": role, "prefix": prefix, "tensors": len(names),
                                        "parameters": params, "why": why})


MTP_WHY = "a multi-token-prediction head, which the reference ignores on load; this build runs the text model"
VISION_WHY = "this build executes the primary_text component only; the vision tower is not executed"


def _build_text(model_type: str):
    v = TEXT[model_type]

    def build(r: ConfigReader, src) -> Lowering | None:
        tied = r.take("tie_word_embeddings", "output head shares the embedding", default=False,
                      default_reason="the reference default is untied")
        t = lower_text(r, v, bool(tied))
        return _place(r, src, t, v, "model.", bool(tied), model_type, vision=False) if t is not None else None

    return build


def _build_vl(model_type: str):
    v = TEXT[VL[model_type]]

    def build(r: ConfigReader, src) -> Lowering | None:
        tc = r.config.get("text_config")
        if not isinstance(tc, dict):
            r.refuse("text_config", f"the text model's config is {'absent' if tc is None else 'not an object'}; nothing "
                                    "to admit", category="structure")
            return None
        r._grade("text_config", CONSUMED, f"the text model ({v.text_type}), admitted as the primary_text component")
        if r.has("vision_config"):
            r._grade("vision_config", METADATA, "the vision tower's config (a perception component): not carried")
        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            r.meta(key, "a multimodal token id; this build runs the text component only")
        tied = r.take("tie_word_embeddings", "output head shares the embedding (the VL model ties by this key)",
                      default=False, default_reason="the reference default is untied")
        tr = ConfigReader(tc)
        if "model_type" in tc:
            if tc["model_type"] == v.text_type:
                tr._grade("model_type", CONSUMED, f"the text model is {v.text_type}")
            else:
                tr.refuse("model_type", f"a {model_type} checkpoint's text model is {v.text_type}, found {tc['model_type']!r}")
        if "tie_word_embeddings" in tc:
            if bool(tc["tie_word_embeddings"]) == bool(tied):
                tr.meta("tie_word_embeddings", "agrees with the top-level key, which the VL model ties by")
            else:
                tr.refuse("tie_word_embeddings", f"disagrees with the top-level tie_word_embeddings ({tied!r}), which the "
                                                 "VL model ties by; refusing rather than choosing one")
        t = lower_text(tr, v, bool(tied))
        tr.finish()
        for f in tr.findings:
            r.graded.add(f"text_config.{f.key}")
            r.findings.append(f.model_copy(update={"key": f"text_config.{f.key}"}))
        if t is None or any(f.blocks for f in tr.findings):
            return None
        return _place(r, src, t, v, "model.language_model.", bool(tied), model_type, vision=True)

    return build


def _place(r: ConfigReader, src, t: TextLowering, v: Variant, P: str, tied: bool, family: str, vision: bool) -> Lowering:
    prefixes = ((P + "embed_tokens.", "embedding"), (P + "layers.", "decoder_stack"), (P + "norm.", "final_norm"),
                ("lm_head.", "output_head"))
    graph = assemble_graph(src.name, family, tied, t.layers, t.surface)
    aside = [MTP_PREFIX] + ([VISION_PREFIX] if vision else [])

    H = t.surface["hidden_size"]
    tables = {(k, f): _layer_table(v, k, f, H, t.routed) for k, f in set(zip(t.kinds, t.ffns))}

    def table(i: int):
        label = t.kinds[i] + (" + moe_ffn" if t.ffns[i] == "routed" else "")
        return (label, tables[(t.kinds[i], t.ffns[i])])

    L = len(t.layers)
    mtp = _mtp_view(r, src, t, P, L)
    if mtp is not None:  # the head runs: its tensors are placed as layer L, then moved to the drafter
        view, alias, ffn = mtp
        aside = [x for x in aside if x != MTP_PREFIX]
        graph["layers"].append({"index": L, "operator": "softmax", "span": "full", "window": None,
                                "position": t.layers[next(i for i, k in enumerate(t.kinds) if k == "softmax")]["position"],
                                "ffn": ffn, "operands": {}})
        mtp_table = (f"multi-token-prediction head (softmax{' + moe_ffn' if ffn == 'routed' else ''})",
                     {**_layer_table(v, "softmax", ffn, H, t.routed), **MTP_OWN})

        def table(i: int):
            if i == L:
                return mtp_table
            label = t.kinds[i] + (" + moe_ffn" if t.ffns[i] == "routed" else "")
            return (label, tables[(t.kinds[i], t.ffns[i])])

        placements, dropped = place_tensors(_Without(view, aside), graph, r, tied, prefixes, table)
        placements = [_unalias(p, alias) for p in placements]
        groups = {"operators": {k: v2 for k, v2 in t.surface["operators"].items() if k == "moe_ffn" and ffn == "routed"},
                  "attention": t.surface["attention"]}
        if ffn == "dense":
            groups["ffn"] = t.surface["ffn"]
        drafter = {"kind": "mtp", "edge": {"kind": "hidden_state", "component": "text", "after_layer": L - 1,
                                           "site": "final_norm"},
                   "formulation": "qwen3_next", "norm_eps": float(t.surface["norms"]["eps"]),
                   "norm_weight_offset": 1.0, "chain": "own_hidden", "surface": groups}
        from .deepseek_common import split_mtp

        placements = split_mtp(placements, graph, L, [0], drafter)
    else:
        placements, dropped = place_tensors(_Without(src, aside), graph, r, tied, prefixes, table)
    low = Lowering(graph=graph, placements=placements, dropped=dropped, not_carried_components=[])
    if vision:
        _set_aside(r, src, VISION_PREFIX, "vision tower", "perception", VISION_WHY, low)
    if mtp is None:
        _set_aside(r, src, MTP_PREFIX, "multi-token-prediction head", "drafter", MTP_WHY, low)
    return low


# the head's own tensors (spelled here after their alias below layer L) -> roles of the MTP drafter
MTP_OWN = {"enorm.weight": "mtp_enorm", "hnorm.weight": "mtp_hnorm", "eh_proj.weight": "mtp_eh_proj",
           "shared_head.norm.weight": "mtp_head_norm"}
MTP_ALIASES = {"mtp.fc.weight": "eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "enorm.weight",
               "mtp.pre_fc_norm_hidden.weight": "hnorm.weight", "mtp.norm.weight": "shared_head.norm.weight"}
MTP_BLOCK_MARKERS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight")


class _Aliased:
    """A source whose mtp.* tensors are spelled as decoder layer L's (placement places them there)."""

    def __init__(self, src, alias: dict[str, str]):
        self._src, self._alias = src, alias
        self.name = getattr(src, "name", "")

    def tensor_specs(self):
        back = {v: k for k, v in self._alias.items()}
        return {back.get(n, n): s for n, s in self._src.tensor_specs().items()}


def _unalias(p, alias: dict[str, str]):
    from dataclasses import replace

    if p.source_name in alias or any(x in alias for x in p.sources):
        return replace(p, source_name=alias.get(p.source_name, p.source_name),
                       sources=tuple(alias.get(x, x) for x in p.sources))
    return p


def _mtp_view(r: ConfigReader, src, t: TextLowering, P: str, L: int):
    """(source view, alias -> real name, ffn kind) when the checkpoint's mtp.* head is complete and
    one layer (it then runs as a drafter component), else None (it is set aside, with the reason
    in the finding). The head's layer is a full-attention layer; its FFN kind is that of the
    reference's layer index 0 (the serving code builds it with index 0)."""
    names = sorted(n for n in src.tensor_specs() if n.startswith(MTP_PREFIX))
    if not names:
        return None
    cfg = r.config.get("text_config") if isinstance(r.config.get("text_config"), dict) else r.config  # VL: the text's
    n_layers = cfg.get("mtp_num_hidden_layers", 1)
    layers = {n[len("mtp.layers."):].partition(".")[0] for n in names if n.startswith("mtp.layers.")}
    present = set(names)
    missing = [k for k in MTP_ALIASES if k not in present] + [f"mtp.layers.0.{m}" for m in MTP_BLOCK_MARKERS
                                                               if f"mtp.layers.0.{m}" not in present]
    if n_layers != 1 or layers != {"0"} or missing or "softmax" not in t.kinds:
        why = (f"mtp_num_hidden_layers is {n_layers!r} (one layer runs here)" if n_layers != 1 or layers != {"0"} else
               f"incomplete: it lacks {', '.join(missing[:4])}" if missing else "the model has no full-attention layer")
        r.findings.append(Finding(category=METADATA, key="mtp.*", value=len(names), blocks=False,
                                  message=f"the multi-token-prediction head does not run as a drafter: {why}"))
        return None
    alias = {}
    for n in names:
        if n in MTP_ALIASES:
            alias[f"{P}layers.{L}.{MTP_ALIASES[n]}"] = n
        elif n.startswith("mtp.layers.0."):
            alias[f"{P}layers.{L}.{n[len('mtp.layers.0.'):]}"] = n
        else:
            r.refuse(n, "an mtp.* tensor of no known role (known: mtp.fc, mtp.pre_fc_norm_embedding, "
                        "mtp.pre_fc_norm_hidden, mtp.norm, mtp.layers.0.*)", category="structure")
            return None
    return _Aliased(src, alias), alias, t.ffns[0]


for _mt in TEXT:
    register_family(_mt, _mt, _build_text(_mt))
for _mt in VL:
    register_family(_mt, _mt, _build_vl(_mt))
