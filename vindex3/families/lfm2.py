"""LFM2 (transformers' ``lfm2``, ``Lfm2ForCausalLM``): gated short convolutions interleaved with
softmax attention.

Layout: ``model.embed_tokens``, ``model.layers.N.operator_norm`` (before the mixer),
``model.layers.N.conv.{in_proj, conv, out_proj}`` (a `short_conv` layer) or
``model.layers.N.self_attn.{q,k,v,out}_proj`` with per-head ``q_layernorm`` / ``k_layernorm``
(a `softmax` layer), ``model.layers.N.ffn_norm`` and ``feed_forward.{w1, w3, w2}`` (gate, up,
down: a SiLU-gated FFN in every layer), ``model.embedding_norm`` (the final norm, despite its
name: transformers applies it after the last layer), ``lm_head``.

Which layers attend is the config's own declaration: ``layer_types`` (``full_attention`` /
``conv``) or ``full_attn_idxs``; with both they must agree; with neither the reference would
make every layer attend, and admission refuses by name instead.
"""

from __future__ import annotations

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .decoder import rope_policy
from .placement import assemble_graph, place_tensors

PREFIXES = (
    ("model.embed_tokens.", "embedding"),
    ("model.layers.", "decoder_stack"),
    ("model.embedding_norm.", "final_norm"),
    ("lm_head.", "output_head"),
)

COMMON_ROLES = {
    "operator_norm.weight": "mixer_norm",
    "ffn_norm.weight": "ffn_norm",
    "feed_forward.w1.weight": "ffn_gate",
    "feed_forward.w3.weight": "ffn_up",
    "feed_forward.w2.weight": "ffn_down",
}
CONV_ROLES = {
    **COMMON_ROLES,
    "conv.in_proj.weight": "in_proj",
    "conv.in_proj.bias": "in_proj_bias",
    "conv.conv.weight": "conv_weight",
    "conv.conv.bias": "conv_bias",
    "conv.out_proj.weight": "out_proj",
    "conv.out_proj.bias": "out_proj_bias",
}
ATTENTION_ROLES = {
    **COMMON_ROLES,
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.out_proj.weight": "o_proj",
    "self_attn.q_layernorm.weight": "q_norm",
    "self_attn.k_layernorm.weight": "k_norm",
}
LAYER_TYPES = {"full_attention": "softmax", "conv": "short_conv"}


def _layer_ops(r: ConfigReader, L: int) -> list[str] | None:
    """Each layer's operator from ``layer_types`` and/or ``full_attn_idxs`` (null counts as
    absent, as in the reference); refused by name when neither declares it."""
    lt = r.config.get("layer_types")
    idxs = r.config.get("full_attn_idxs")
    if lt is None and idxs is None:
        for key in ("layer_types", "full_attn_idxs"):
            if r.has(key):
                r.take(key, "null: declares nothing")
        r.refuse("layer_types", "no layer pattern declared (layer_types and full_attn_idxs are both absent or null); "
                                "the reference would make every layer attend: refusing rather than assuming it",
                 category="structure")
        return None
    ops = None
    if lt is not None:
        r.take("layer_types", "per-layer mixer: full_attention (softmax) or conv (short_conv)")
        if not isinstance(lt, list) or len(lt) != L:
            r.refuse("layer_types", f"expected a list of {L} layer types, found {lt!r}")
            return None
        bad = [(i, t) for i, t in enumerate(lt) if t not in LAYER_TYPES]
        if bad:
            r.refuse("layer_types", f"layer {bad[0][0]} has type {bad[0][1]!r} (supported: {', '.join(LAYER_TYPES)})")
            return None
        ops = [LAYER_TYPES[t] for t in lt]
    elif r.has("layer_types"):
        r.take("layer_types", "null: the pattern is full_attn_idxs")
    if idxs is not None:
        r.take("full_attn_idxs", "indices of the layers that attend (the others are short convolutions)")
        if (not isinstance(idxs, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in idxs)
                or len(set(idxs)) != len(idxs)):
            r.refuse("full_attn_idxs", f"expected distinct layer indices in [0, {L}), found {idxs!r}")
            return None
        from_idxs = ["softmax" if i in idxs else "short_conv" for i in range(L)]
        if ops is not None and ops != from_idxs:
            r.refuse("full_attn_idxs", "disagrees with layer_types on which layers attend")
            return None
        ops = from_idxs
    elif r.has("full_attn_idxs"):
        r.take("full_attn_idxs", "null: the pattern is layer_types")
    return ops


def _ffn_width(r: ConfigReader) -> int | None:
    """The FFN width as the reference derives it from intermediate_size (or legacy block_ff_dim)
    and the block_* adjustment keys."""
    base = r.take_int("intermediate_size", "the FFN width before the reference's auto-adjustment", default=12288,
                      default_reason="the reference default is 12288")
    if r.has("block_ff_dim"):  # the reference's legacy spelling, which wins when given
        legacy = r.take_int("block_ff_dim", "legacy spelling of intermediate_size (the reference prefers it)")
        if legacy is None:
            return None
        base = legacy
    adjust = r.take_bool("block_auto_adjust_ff_dim", "width = multiple_of-rounded int(multiplier * int(2/3 * width))",
                         default=True, default_reason="the reference default is true")
    mult = r.take("block_ffn_dim_multiplier", "width multiplier of the auto-adjustment (null: none)", default=1.0,
                  default_reason="the reference default is 1.0")
    multiple = r.take_int("block_multiple_of", "the auto-adjusted width is rounded up to a multiple of this", default=256,
                          default_reason="the reference default is 256")
    if None in (base, adjust, multiple):
        return None
    if not adjust:
        return base
    width = int(2 * base / 3)
    if mult is not None:
        if isinstance(mult, bool) or not isinstance(mult, (int, float)) or not mult > 0:
            r.refuse("block_ffn_dim_multiplier", f"expected a positive number or null, found {mult!r}")
            return None
        width = int(mult * width)
        width = multiple * ((width + multiple - 1) // multiple)
    return width


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of decoder layers")
    vocab = r.take_int("vocab_size", "vocabulary size")
    eps = r.take_number("norm_eps", "epsilon of every RMSNorm (layer, q/k and final)", minimum=0, default=1e-5,
                        default_reason="the reference default is 1e-5")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=True,
                       default_reason="the reference default is tied")
    if r.has("tie_embedding"):  # the reference's legacy spelling, which wins when given
        legacy = r.take_bool("tie_embedding", "legacy spelling of tie_word_embeddings (the reference prefers it)")
        tied = legacy if legacy is not None else None
    ctx_ok, ctx = r.context_length()
    K = r.take_int("conv_L_cache", "short conv width (its state keeps conv_L_cache - 1 rows)", default=3,
                   default_reason="the reference default is 3")
    cbias = r.take_bool("conv_bias", "bias on the short conv's in_proj, conv and out_proj", default=False,
                        default_reason="the reference default has none")
    inter = _ffn_width(r)
    r.ignore("is_encoder_decoder", "a generic config flag; a causal LM is not an encoder-decoder")
    ops = _layer_ops(r, L) if isinstance(L, int) else None
    if None in (H, L, vocab, eps, tied, K, cbias, inter, ops) or not ctx_ok:
        return None
    has_attn = "softmax" in ops
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "ffn": {"kind": "gated", "activation": "silu", "intermediate_size": inter, "bias": False, "fused_gate_up": False},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
        "context_length": ctx,
    }
    position = None
    nh = r.take_int("num_attention_heads", "query heads", default=32, default_reason="the reference default is 32")
    nkv = r.take_int("num_key_value_heads", "key/value heads (GQA)", default=8, default_reason="the reference default is 8")
    if None in (nh, nkv):
        return None
    if r.has("head_dim"):  # not a field of the reference's config, but read (getattr) when a config carries it
        hd = r.take_int("head_dim", "per-head width")
    else:
        hd = H // nh
        if hd * nh != H:
            r.refuse("num_attention_heads", f"hidden_size {H} is not divisible by {nh} heads and no head_dim is declared")
            return None
    if hd is None:
        return None
    if nh % nkv:
        r.refuse("num_key_value_heads", f"{nh} query heads are not a multiple of {nkv} key/value heads")
        return None
    if has_attn:
        position = rope_policy(r, hd, default=({"rope_type": "default", "rope_theta": 1000000.0},
                                               "the reference default is default rope with theta 1e6"))
        if position is None:
            return None
        surface["attention"] = {
            "heads": nh, "kv_heads": nkv, "head_dim": hd, "output_gate": False, "head_mapping": "repeat_interleave",
            "query_scale": 1.0, "score_scale": float(hd) ** -0.5, "bias": {k: False for k in ("q", "k", "v", "o")},
            "qk_norm": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "scope": "head"},
            "qkv_clip": None, "sinks": None,
        }
    else:
        for key in ("rope_parameters", "rope_theta"):
            r.ignore(key, "no layer attends: no rotary embedding runs")
    if "short_conv" in ops:
        surface["operators"]["short_conv"] = {"conv_kernel": K, "bias": bool(cbias)}
    layers = [{"index": i, "operator": op, "span": "full" if op == "softmax" else None, "window": None,
               "position": position if op == "softmax" else None, "ffn": "dense", "operands": {}}
              for i, op in enumerate(ops)]
    graph = assemble_graph(src.name, "lfm2", bool(tied), layers, surface)
    tables = {"softmax": ATTENTION_ROLES, "short_conv": CONV_ROLES}
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: (ops[i], tables[ops[i]]))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("lfm2", "lfm2", build)
