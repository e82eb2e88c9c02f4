"""OLMo 2 (``olmo2``) and SmolLM3 (``smollm3``): llama-shaped layers with one fact each that the
llama lowering does not state.

* olmo2: norms after each slot only (placement ``post_only``: ``h + norm(attn(h))``,
  ``h + norm(mlp(h))``), and RMS QK-norm over the whole q and k projections (scope
  ``projection``, weights [heads · head_dim] and [kv_heads · head_dim]), before rope.
* smollm3: rope on some layers and none on others (``no_rope_layers``: 1 = rope, 0 = NoPE;
  absent, every ``no_rope_layer_interval``-th layer is NoPE), an optional sliding window on the
  layers ``layer_types`` marks, biases as ``attention_bias`` / ``mlp_bias`` say.

Keys read as transformers 5.24.0 reads them (docs/operators.md): SmolLM3 slides a layer only when
``use_sliding_window`` is true and ``layer_types`` marks it; a layer marked sliding while
``use_sliding_window`` is false is masked as sliding but attends in full in the reference, so it is
refused by name."""

from __future__ import annotations

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .decoder import ACTIVATIONS, ATTENTION_ROLES, PREFIXES, rope_policy
from .gpt import attention_surface, layer_entries
from .placement import assemble_graph, place_tensors

FFN_ROLES = {"mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
             "mlp.gate_proj.bias": "ffn_gate_bias", "mlp.up_proj.bias": "ffn_up_bias", "mlp.down_proj.bias": "ffn_down_bias"}


def _common(r: ConfigReader):
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of decoder layers")
    nh = r.take_int("num_attention_heads", "query heads")
    if r.config.get("num_key_value_heads") is None:
        nkv = r.take("num_key_value_heads", "key/value heads", default=nh,
                     default_reason="null or absent: the reference uses num_attention_heads (MHA)")
    else:
        nkv = r.take_int("num_key_value_heads", "key/value heads (GQA)")
    inter = r.take_int("intermediate_size", "FFN width")
    vocab = r.take_int("vocab_size", "vocabulary size")
    eps = r.take_number("rms_norm_eps", "RMSNorm epsilon (layer, final and QK norms)", minimum=0)
    act = r.take_str("hidden_act", "FFN gate activation", default="silu", default_reason="the reference default is silu")
    abias = r.take_bool("attention_bias", "bias on q/k/v/o", default=False, default_reason="the reference default has none")
    ctx_ok, ctx = r.context_length()
    if None in (H, L, nh, nkv, inter, vocab, eps, act, abias) or not ctx_ok:
        return None
    if H % nh or nh % nkv:
        r.refuse("num_attention_heads", f"hidden_size {H}, {nh} heads and {nkv} key/value heads do not divide")
        return None
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    return H, L, nh, nkv, H // nh, inter, vocab, float(eps), act, bool(abias), ctx


def _surface(H, nh, nkv, hd, inter, vocab, eps, act, abias, ctx, tied, *, placement, qk_norm=None, mlp_bias=False) -> dict:
    return {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "attention": attention_surface(nh, nkv, hd, {k: abias for k in "qkvo"}, float(hd) ** -0.5, qk_norm=qk_norm),
        "ffn": {"kind": "gated", "activation": ACTIVATIONS[act], "intermediate_size": inter, "bias": mlp_bias,
                "fused_gate_up": False},
        "norms": {"kind": "rms", "eps": eps, "weight_offset": 0.0, "placement": placement},
        "head": {"vocab": vocab, "tied": tied, "multiplier": 1.0, "softcap": None},
        "operators": {},
        "context_length": ctx,
    }


def build_olmo2(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    got = _common(r)
    if got is None or tied is None:
        return None
    H, L, nh, nkv, hd, inter, vocab, eps, act, abias, ctx = got
    position = rope_policy(r, hd)
    if position is None:
        return None
    qk = {"kind": "rms", "eps": eps, "weight_offset": 0.0, "scope": "projection"}
    surface = _surface(H, nh, nkv, hd, inter, vocab, eps, act, abias, ctx, bool(tied), placement="post_only", qk_norm=qk)
    graph = assemble_graph(src.name, "olmo2", bool(tied), layer_entries(L, [position] * L, "dense"), surface)
    table = {"post_attention_layernorm.weight": "post_attn_norm", "post_feedforward_layernorm.weight": "post_ffn_norm",
             **ATTENTION_ROLES, **FFN_ROLES}
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: ("softmax", table))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


def build_smollm3(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=True,
                       default_reason="the SmolLM3 reference ties its head unless told not to")
    mlp_bias = r.take_bool("mlp_bias", "bias on the FFN projections", default=False, default_reason="the reference default has none")
    got = _common(r)
    if got is None or tied is None or mlp_bias is None:
        return None
    H, L, nh, nkv, hd, inter, vocab, eps, act, abias, ctx = got
    interval = r.take_int("no_rope_layer_interval", "every n-th layer is NoPE when no_rope_layers is absent", default=4,
                          default_reason="the reference default is 4")
    if interval is None:
        return None
    if r.config.get("no_rope_layers") is not None:
        nr = r.take("no_rope_layers", "per layer: 1 rotates (rope), 0 does not (NoPE)")
        if not isinstance(nr, list) or len(nr) != L or any(x not in (0, 1) or isinstance(x, bool) for x in nr):
            r.refuse("no_rope_layers", f"expected {L} entries of 0 or 1")
            return None
    else:
        nr = [int((i + 1) % interval != 0) for i in range(L)]
        r.take("no_rope_layers", "per layer: rope or NoPE", default=nr,
               default_reason=f"null or absent: the reference makes layer i NoPE iff (i + 1) % {interval} == 0")
    use_sw = r.take_bool("use_sliding_window", "whether layers marked sliding slide", default=False,
                         default_reason="the reference default is off")
    if r.config.get("sliding_window") is not None:
        sw = r.take_int("sliding_window", "keys a sliding layer sees, the query included")
    else:
        sw = None
        if r.has("sliding_window"):
            r.meta("sliding_window", "null: no window")
    if use_sw is None or (sw is None and r.config.get("sliding_window") is not None):
        return None
    if r.has("layer_types"):
        lt = r.take("layer_types", "each layer's attention span (sliding only with use_sliding_window)")
        if not isinstance(lt, list) or len(lt) != L or any(k not in ("full_attention", "sliding_attention") for k in lt):
            r.refuse("layer_types", f"expected {L} entries of full_attention or sliding_attention")
            return None
    else:
        lt = ["sliding_attention" if use_sw and sw is not None and not nr[i] else "full_attention" for i in range(L)]
        r.take("layer_types", "each layer's attention span", default=lt,
               default_reason="absent: the reference slides the NoPE layers when use_sliding_window and sliding_window are set")
    if "sliding_attention" in lt and not (use_sw and sw is not None):
        r.refuse("layer_types", "layers are marked sliding_attention but use_sliding_window is off or no sliding_window is "
                                "set: transformers 5.24 masks them as sliding yet attends in full; refusing rather than "
                                "choosing one")
        return None
    position = rope_policy(r, hd)
    if position is None:
        return None
    positions = [position if nr[i] else {"kind": "none"} for i in range(L)]
    spans = ["sliding" if k == "sliding_attention" else "full" for k in lt]
    surface = _surface(H, nh, nkv, hd, inter, vocab, eps, act, abias, ctx, bool(tied), placement="pre_only",
                       mlp_bias=bool(mlp_bias))
    graph = assemble_graph(src.name, "smollm3", bool(tied), layer_entries(L, positions, "dense", spans, sw), surface)
    table = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm", **ATTENTION_ROLES,
             **FFN_ROLES}
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: ("softmax", table))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("olmo2", "olmo2", build_olmo2)
register_family("smollm3", "smollm3", build_smollm3)
