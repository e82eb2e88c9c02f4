"""Granite 4.0 hybrids (transformers' ``granitemoehybrid``, ``GraniteMoeHybridForCausalLM``)
with dense FFNs: ``layer_types`` mix Mamba2 mixers and softmax attention, and every layer has
the shared MLP.

Layout: ``model.embed_tokens``, ``model.layers.N.input_layernorm`` (before the mixer),
``model.layers.N.mamba.*`` (a Mamba2 mixer) or ``model.layers.N.self_attn.*``,
``model.layers.N.post_attention_layernorm`` (before the FFN),
``model.layers.N.shared_mlp.input_linear`` (gate and up fused, gate first: transformers
``chunk(2)`` and activates the first half) and ``shared_mlp.output_linear``, ``model.norm``,
``lm_head``. Each layer is ``h = x + m·mixer(norm1(x)); h + m·ffn(norm2(h))`` with the Granite
residual multiplier m; embeddings and logits carry Granite's multipliers too.

With ``num_local_experts > 0`` every layer's FFN is routed (`moe_ffn`): a router
(``block_sparse_moe.router.layer.weight`` [E, H], or ``.router.weight`` in transformers' runtime
save) takes the top k raw logits and softmaxes them; the experts are stored fused,
``block_sparse_moe.input_linear.weight`` [E, 2I, H] (gate and up in halves, gate first) and
``output_linear.weight`` [E, H, I] (runtime save: ``block_sparse_moe.experts.gate_up_proj`` /
``.down_proj``); the shared MLP is the op's ungated ("plain") shared expert, added after the
routed sum. With 0 the shared MLP alone is a dense FFN.
"""

from __future__ import annotations

import math

from ..sources import CheckpointSource
from . import mamba2 as m2f
from .base import ConfigReader, Lowering, register_family
from .decoder import ATTENTION_ROLES, PREFIXES, rope_policy
from .moe import moe_facts, positive_int
from .placement import Part, assemble_graph, place_tensors

COMMON_ROLES = {
    "input_layernorm.weight": "mixer_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "shared_mlp.input_linear.weight": "ffn_gate_up",
    "shared_mlp.output_linear.weight": "ffn_down",
}
MAMBA_ROLES = {**COMMON_ROLES, **{f"mamba.{k}": v for k, v in m2f.MIXER_ROLES.items()}}
# No QK-norm in this family: its attention table is the shared one without q_norm/k_norm.
SOFTMAX_ROLES = {**COMMON_ROLES, **{k: v for k, v in ATTENTION_ROLES.items() if v not in ("q_norm", "k_norm")}}

# In a routed layer the shared MLP is the moe_ffn op's shared expert.
ROUTED_COMMON = {
    "input_layernorm.weight": "mixer_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    "shared_mlp.input_linear.weight": "shared_gate_up",
    "shared_mlp.output_linear.weight": "shared_down",
    "block_sparse_moe.router.layer.weight": "moe_router",
    "block_sparse_moe.router.weight": "moe_router",
}


def expert_roles(E: int, H: int, In: int) -> dict:
    """The fused banks in both spellings, stored as they are ([E, 2I, H] halves, [E, H, I])."""
    t = {}
    for gu, dn in (("block_sparse_moe.input_linear.weight", "block_sparse_moe.output_linear.weight"),
                   ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj")):
        t[gu] = Part("moe_gate_up", gu, 0, 1, (E, 2 * In, H))
        t[dn] = Part("moe_down", dn, 0, 1, (E, H, In))
    return t


# transformers 5.24 spellings, and the legacy ones it remaps (configuration_utils).
LAYER_TYPES = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "softmax", "attention": "softmax"}


def _layer_types(r: ConfigReader, L: int) -> list[str] | None:
    keys = [k for k in ("layer_types", "layers_block_type") if r.has(k)]
    if not keys:
        r.refuse("layer_types", "no per-layer mixer types declared (neither layer_types nor layers_block_type); "
                                "refusing to assume which layers attend", category="structure")
        return None
    seen = []
    for k in keys:
        lt = r.take(k, "per-layer mixer: Mamba2 (linear_attention, legacy mamba) or softmax (full_attention, legacy attention)")
        if not isinstance(lt, list) or len(lt) != L:
            r.refuse(k, f"expected a list of {L} layer types, found {lt!r}")
            return None
        bad = [(i, t) for i, t in enumerate(lt) if t not in LAYER_TYPES]
        if bad:
            i, t = bad[0]
            r.refuse(k, f"layer {i} has type {t!r} (supported: {', '.join(LAYER_TYPES)})")
            return None
        seen.append([LAYER_TYPES[t] for t in lt])
    if len(seen) == 2 and seen[0] != seen[1]:
        r.refuse("layers_block_type", "layers_block_type and layer_types disagree")
        return None
    return seen[0]


def _number(r: ConfigReader, key: str, message: str, positive: bool = False) -> float | None:
    """A Granite multiplier: a finite non-zero number (positive where ``positive``); absent
    means the reference default 1.0."""
    return r.take_number(key, message, minimum=0 if positive else None, nonzero=True, default=1.0,
                         default_reason="the reference default is 1.0")


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take("hidden_size", "residual width")
    L = r.take("num_hidden_layers", "number of decoder layers")
    vocab = r.take("vocab_size", "vocabulary size")
    eps = r.take_number("rms_norm_eps", "epsilon of every RMSNorm, the Mamba2 gated norm included", minimum=0, default=1e-6,
                        default_reason="the reference default is 1e-6")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    ctx_ok, ctx = r.context_length()
    ok = ctx_ok and tied is not None

    # -- experts ------------------------------------------------------------------------------
    experts = r.take("num_local_experts", "routed experts per layer (0: dense, the shared MLP only)", default=8,
                     default_reason="the reference default is 8 routed experts")
    k = e_inter = None
    if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
        r.refuse("num_local_experts", f"expected a non-negative integer, found {experts!r}")
        ok = False
    elif experts == 0:
        r.meta("num_experts_per_tok", "routing width; no routed experts with num_local_experts = 0")
        r.meta("intermediate_size", "routed-expert width; no routed experts with num_local_experts = 0")
    else:
        k = r.take("num_experts_per_tok", "experts each position is routed to (top k raw router logits)", default=2,
                   default_reason="the reference default is 2")
        e_inter = r.take("intermediate_size", "width of one routed expert", default=11008,
                         default_reason="the reference default is 11008")
        ok = positive_int(r, "num_experts_per_tok", k) and positive_int(r, "intermediate_size", e_inter) and ok
        if ok and k > experts:
            r.refuse("num_experts_per_tok", f"routes each position to {k} of {experts} experts")
            ok = False
    routed = isinstance(experts, int) and not isinstance(experts, bool) and experts > 0
    inter = r.take("shared_intermediate_size", "width of the shared MLP (the dense FFN, or the routed layers' shared expert)",
                   default=1024, default_reason="the reference default is 1024")
    act = m2f.conv_activation(r, also=", of the shared MLP's gate and of the experts")

    # -- layers ------------------------------------------------------------------------------
    if not isinstance(L, int) or isinstance(L, bool) or L < 1:
        if L is not None:
            r.refuse("num_hidden_layers", f"expected a positive integer, found {L!r}")
        return None
    ops = _layer_types(r, L)
    if ops is None:
        ok = False
        ops = []
    has_attn = "softmax" in ops
    has_mamba = "mamba2" in ops

    # -- attention ---------------------------------------------------------------------------
    nh = r.take("num_attention_heads", "query heads")
    nkv = r.take("num_key_value_heads", "key/value heads (GQA)", default=nh, default_reason="the reference uses num_attention_heads")
    bias = r.take_bool("attention_bias", "bias on q/k/v/o projections", default=False, default_reason="the reference default has none")
    ok = ok and bias is not None
    score_scale = _number(r, "attention_multiplier", "attention score scale (replaces head_dim^-0.5)", positive=True)
    pe = r.take("position_embedding_type", "null or 'nope': NoPE attention; 'rope': rotary", default=None,
                default_reason="the reference default is null (no position encoding)")
    if r.has("normalization_function"):
        if r.config["normalization_function"] == "rmsnorm":
            r.take("normalization_function", "the norms are RMSNorm, as the reference runs them")
        else:
            r.refuse("normalization_function", f"{r.config['normalization_function']!r}: the reference runs RMSNorm "
                                               "whatever this says; refusing rather than guessing which is meant")
            ok = False
    hd = None
    if isinstance(nh, int) and nh > 0 and isinstance(H, int):
        if r.has("head_dim") and r.config["head_dim"] is not None:
            hd = r.take("head_dim", "per-head width")
        else:
            if r.has("head_dim"):
                r.take("head_dim", "null: per-head width is hidden_size / heads")
            hd = H // nh
            if hd * nh != H:
                r.refuse("num_attention_heads", f"hidden_size {H} is not divisible by {nh} heads and no head_dim is declared")
                ok = False
    if isinstance(nh, int) and isinstance(nkv, int) and nkv > 0 and nh % nkv:
        r.refuse("num_key_value_heads", f"{nh} query heads are not a multiple of {nkv} key/value heads")
        ok = False
    position = None
    if pe is None or pe == "nope":
        position = {"kind": "none"}
        for key in ("rope_parameters", "rope_theta", "rope_scaling"):
            r.ignore(key, "position_embedding_type is null: no rotary embedding runs, its parameters are unused")
    elif pe == "rope":
        if isinstance(hd, int) and hd % 2:
            r.refuse("position_embedding_type", f"a rotary embedding needs an even head width, found {hd} "
                                                "(the reference cannot run it either)")
            for key in ("rope_parameters", "rope_theta", "rope_scaling"):
                r.ignore(key, "not lowered: the rotary embedding is refused (odd head width)")
            ok = False
        else:
            position = rope_policy(r, hd) if hd else None
            ok = ok and position is not None
    else:
        r.refuse("position_embedding_type", f"{pe!r} is not a position encoding this build runs (null or 'nope': none; 'rope')")
        ok = False

    # -- the Mamba2 mixer ------------------------------------------------------------------------
    mnh = r.take("mamba_n_heads", "SSM heads", default=128, default_reason="the reference default is 128")
    mg = r.take("mamba_n_groups", "groups sharing B and C (and gated-norm groups)", default=1, default_reason="the reference default is 1")
    ns = r.take("mamba_d_state", "SSM state per head channel", default=256, default_reason="the reference default is 256")
    mk = r.take("mamba_d_conv", "causal depthwise conv width", default=4, default_reason="the reference default is 4")
    mexp = r.take("mamba_expand", "mixer intermediate = mamba_expand * hidden_size", default=2, default_reason="the reference default is 2")
    chunk = r.take("mamba_chunk_size", "the reference's SSD chunk length: a tiling of one exact recurrence, carried, not needed",
                   default=256, default_reason="the reference default is 256")
    conv_bias = r.take_bool("mamba_conv_bias", "bias on the causal conv", default=True, default_reason="the reference default has one")
    proj_bias = r.take_bool("mamba_proj_bias", "bias on in_proj and out_proj", default=False, default_reason="the reference default has none")
    ok = ok and None not in (conv_bias, proj_bias)
    mhd = r.take("mamba_d_head", "channels per SSM head ('auto': intermediate / heads)", default="auto",
                 default_reason="the reference default is auto")
    limit = m2f.time_step_limit(r)
    if not (isinstance(mexp, (int, float)) and not isinstance(mexp, bool) and math.isfinite(mexp) and mexp > 0):
        r.refuse("mamba_expand", f"expected a positive finite number, found {mexp!r}")
        ok = False
    elif (mhd == "auto" and isinstance(H, int) and not isinstance(H, bool) and isinstance(mnh, int)
          and not isinstance(mnh, bool) and mnh > 0):
        mhd = int(mexp * H) // mnh

    # -- granite multipliers -------------------------------------------------------------------
    emb_mult = _number(r, "embedding_multiplier", "embeddings are scaled by this")
    res_mult = _number(r, "residual_multiplier", "each sublayer output is scaled before the residual add")
    logits_scaling = _number(r, "logits_scaling", "logits are divided by this")

    if None in (H, vocab, eps) or not ok or act is None or limit is None:
        return None
    for key, v in (("hidden_size", H), ("vocab_size", vocab), ("shared_intermediate_size", inter)):
        ok = m2f._positive_int(r, key, v) and ok
    if has_attn:
        for key, v in (("num_attention_heads", nh), ("num_key_value_heads", nkv), ("head_dim", hd)):
            ok = m2f._positive_int(r, key, v) and ok
    if has_mamba:
        for key, v in (("mamba_n_heads", mnh), ("mamba_d_head", mhd), ("mamba_d_state", ns), ("mamba_n_groups", mg),
                       ("mamba_d_conv", mk), ("mamba_chunk_size", chunk)):
            ok = m2f._positive_int(r, key, v) and ok
        if ok:
            ok = m2f.check_mixer_widths(r, H, mnh, mhd, mg, mexp, {"expand": "mamba_expand", "num_heads": "mamba_n_heads",
                                                                   "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups"})
    if None in (score_scale, emb_mult, res_mult, logits_scaling):
        ok = False
    elif logits_scaling == 0:
        r.refuse("logits_scaling", f"expected a finite non-zero divisor, found {logits_scaling!r}")
        ok = False
    if not ok:
        return None

    layers = []
    for i, op in enumerate(ops):
        layers.append({
            "index": i,
            "operator": op,
            "span": "full" if op == "softmax" else None,
            "window": None,
            "position": position if op == "softmax" else None,
            "ffn": "routed" if routed else "dense",
            "operands": {},
        })
    # the activation is silu (or its alias swish): conv_activation refused anything else
    dense = {"kind": "gated", "activation": "silu", "intermediate_size": inter, "bias": False, "fused_gate_up": True}
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": emb_mult},
        "residual": {"multiplier": res_mult},
        **({} if routed else {"ffn": dense}),
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0 / logits_scaling, "softcap": None},
        "operators": {},
        "context_length": ctx,
    }
    if routed:
        surface["operators"]["moe_ffn"] = moe_facts(
            E=experts, k=k, In=e_inter, router="topk_softmax", renormalize=False, act="silu", shared="plain",
            shared_intermediate=inter, shared_act="silu", shared_gate_up="fused_halves")
    if has_attn:
        surface["attention"] = {
            "heads": nh,
            "kv_heads": nkv,
            "head_dim": hd,
            "output_gate": False,
            "head_mapping": "repeat_interleave",
            "query_scale": 1.0,
            "score_scale": score_scale,
            "bias": {k: bias for k in ("q", "k", "v", "o")},
            "qk_norm": None,
            "qkv_clip": None,
            "sinks": None,
        }
    if has_mamba:
        surface["operators"]["mamba2"] = m2f.mixer_geometry(
            hidden=H, num_heads=mnh, head_dim=mhd, state_size=ns, n_groups=mg, conv_kernel=mk, chunk_size=chunk,
            limit=limit, eps=eps, use_conv_bias=bool(conv_bias), use_bias=bool(proj_bias))
    graph = assemble_graph(src.name, "granitemoehybrid", bool(tied), layers, surface)

    if routed:
        banks = expert_roles(experts, H, e_inter)
        mixer_roles = {"mamba2": {f"mamba.{k_}": v for k_, v in m2f.MIXER_ROLES.items()},
                       "softmax": {k_: v for k_, v in ATTENTION_ROLES.items() if v not in ("q_norm", "k_norm")}}
        tables = {op: {**ROUTED_COMMON, **roles, **banks} for op, roles in mixer_roles.items()}
    else:
        tables = {"mamba2": MAMBA_ROLES, "softmax": SOFTMAX_ROLES}

    def table(i: int):
        return (ops[i], tables[ops[i]])

    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, table)
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("granitemoehybrid", "granitemoehybrid", build)
