"""Phi-1/1.5/2 (``phi``) and Phi-3 (``phi3``).

Phi: attention and a GELU MLP side by side on one shared LayerNorm of the layer input
(placement ``parallel_shared``: ``h + attn(ln(h)) + mlp(ln(h))``), biases everywhere, rotary on
the first ``partial_rotary_factor`` of each head, a final LayerNorm and a head with a bias.
Phi-3: a llama-shaped layer with q|k|v fused in ``qkv_proj`` (rows q, then k, then v: split at
encode) and gate|up fused in ``gate_up_proj`` (gate rows first: kept fused, ``fused_gate_up``),
an optional sliding window on every layer, partial rotary.

Keys read as transformers 5.24.0 reads them (docs/operators.md): legacy ``rope_theta`` and
``partial_rotary_factor`` fill rope_parameters in only where it lacks them (Phi's factor then
defaults to 0.5, Phi-3's to 1.0); Phi-3's legacy rope types "su" and "yarn" are its longrope,
refused by name."""

from __future__ import annotations

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .decoder import ACTIVATIONS
from .gpt import attention_surface, finish_graph, grade_common, layer_entries, legacy_rope
from .placement import Split, assemble_graph, place_tensors

PHI_PREFIXES = (("model.embed_tokens.", "embedding"), ("model.layers.", "decoder_stack"),
                ("model.final_layernorm.", "final_norm"), ("lm_head.", "output_head"))
PHI_TABLE = {
    "input_layernorm.weight": "attn_norm", "input_layernorm.bias": "attn_norm_bias",
    "self_attn.q_proj.weight": "q_proj", "self_attn.q_proj.bias": "q_bias",
    "self_attn.k_proj.weight": "k_proj", "self_attn.k_proj.bias": "k_bias",
    "self_attn.v_proj.weight": "v_proj", "self_attn.v_proj.bias": "v_bias",
    "self_attn.dense.weight": "o_proj", "self_attn.dense.bias": "o_bias",
    "mlp.fc1.weight": "ffn_up", "mlp.fc1.bias": "ffn_up_bias",
    "mlp.fc2.weight": "ffn_down", "mlp.fc2.bias": "ffn_down_bias",
}


def _heads(r: ConfigReader) -> tuple[int | None, int | None, int | None]:
    H = r.take_int("hidden_size", "residual width")
    nh = r.take_int("num_attention_heads", "query heads")
    if r.config.get("num_key_value_heads") is None:
        nkv = r.take("num_key_value_heads", "key/value heads", default=nh,
                     default_reason="null or absent: the reference uses num_attention_heads (MHA)")
    else:
        nkv = r.take_int("num_key_value_heads", "key/value heads (GQA)")
    return H, nh, nkv


def build_phi(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H, nh, nkv = _heads(r)
    L = r.take_int("num_hidden_layers", "number of decoder layers")
    inter = r.take_int("intermediate_size", "MLP width")
    vocab = r.take_int("vocab_size", "vocabulary size")
    eps = r.take_number("layer_norm_eps", "LayerNorm epsilon (the shared layer norms and the final norm)", minimum=0)
    act = r.take_str("hidden_act", "MLP activation", default="gelu_new", default_reason="the reference default is gelu_new")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    qkln = r.take_bool("qk_layernorm", "LayerNorms on q and k per head", default=False,
                       default_reason="the reference default is off")
    ctx_ok, ctx = r.context_length()
    ok = grade_common(r)
    if None in (H, nh, nkv, L, inter, vocab, eps, act, tied, qkln) or not ctx_ok or not ok:
        return None
    if qkln:
        r.refuse("qk_layernorm", "per-head LayerNorms (with bias) on q and k are not a fact this build's attention carries "
                                 "(its QK-norm is RMS)")
        return None
    if tied:
        r.refuse("tie_word_embeddings", "Phi's head has a bias; a tied head has nowhere to hold it")
        return None
    if H % nh or nh % nkv:
        r.refuse("num_attention_heads", f"hidden_size {H}, {nh} heads and {nkv} key/value heads do not divide")
        return None
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    hd = H // nh
    position = legacy_rope(r, hd, (("rope_theta", "rope_theta", 10000.0), ("partial_rotary_factor", "partial_rotary_factor", 0.5)))
    if position is None:
        return None
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "attention": attention_surface(nh, nkv, hd, {k: True for k in "qkvo"}, float(hd) ** -0.5),
        "ffn": {"kind": "mlp", "activation": ACTIVATIONS[act], "intermediate_size": inter, "bias": True},
        "norms": {"kind": "layer", "eps": float(eps), "weight_offset": 0.0, "placement": "parallel_shared", "bias": True},
        "head": {"vocab": vocab, "tied": False, "multiplier": 1.0, "softcap": None, "bias": True},
        "operators": {},
        "context_length": ctx,
    }
    graph = finish_graph(assemble_graph(src.name, "phi", False, layer_entries(L, [position] * L, "mlp"), surface),
                         head_bias=True)
    placements, dropped = place_tensors(src, graph, r, False, PHI_PREFIXES, lambda i: ("softmax", PHI_TABLE))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


PHI3_PREFIXES = (("model.embed_tokens.", "embedding"), ("model.layers.", "decoder_stack"), ("model.norm.", "final_norm"),
                 ("lm_head.", "output_head"))


def build_phi3(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H, nh, nkv = _heads(r)
    L = r.take_int("num_hidden_layers", "number of decoder layers")
    inter = r.take_int("intermediate_size", "FFN width (of gate and of up)")
    vocab = r.take_int("vocab_size", "vocabulary size")
    eps = r.take_number("rms_norm_eps", "RMSNorm epsilon", minimum=0)
    act = r.take_str("hidden_act", "FFN gate activation", default="silu", default_reason="the reference default is silu")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    ctx_ok, ctx = r.context_length()
    r.meta("original_max_position_embeddings", "the pretraining context; read only by a longrope or yarn rope")
    ok = grade_common(r)
    if None in (H, nh, nkv, L, inter, vocab, eps, act, tied) or not ctx_ok or not ok:
        return None
    if H % nh or nh % nkv:
        r.refuse("num_attention_heads", f"hidden_size {H}, {nh} heads and {nkv} key/value heads do not divide")
        return None
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    hd = H // nh
    position = legacy_rope(r, hd, (("rope_theta", "rope_theta", 10000.0), ("partial_rotary_factor", "partial_rotary_factor", 1.0)),
                           aliases={"su": "longrope", "yarn": "longrope"})
    if position is None:
        return None
    window = None
    if r.config.get("sliding_window") is not None:
        window = r.take_int("sliding_window", "every layer attends to this many keys, the query included")
        if window is None:
            return None
    elif r.has("sliding_window"):
        r.meta("sliding_window", "null: full attention")
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "attention": attention_surface(nh, nkv, hd, {k: False for k in "qkvo"}, float(hd) ** -0.5),
        "ffn": {"kind": "gated", "activation": ACTIVATIONS[act], "intermediate_size": inter, "bias": False,
                "fused_gate_up": True},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_only"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
        "context_length": ctx,
    }
    spans = ["sliding" if window else "full"] * L
    graph = assemble_graph(src.name, "phi3", bool(tied), layer_entries(L, [position] * L, "dense", spans, window), surface)
    q, kv = nh * hd, nkv * hd
    table = {
        "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
        # rows of qkv_proj: all of q, then all of k, then all of v
        "self_attn.qkv_proj.weight": Split((q + 2 * kv, H), (
            ("q_proj", "self_attn.q_proj.weight", (f"row_blocks:{q}:{q + 2 * kv}:0",)),
            ("k_proj", "self_attn.k_proj.weight", (f"row_blocks:{kv}:{q + 2 * kv}:{q}",)),
            ("v_proj", "self_attn.v_proj.weight", (f"row_blocks:{kv}:{q + 2 * kv}:{q + kv}",)))),
        "self_attn.o_proj.weight": "o_proj",
        "mlp.gate_up_proj.weight": "ffn_gate_up",
        "mlp.down_proj.weight": "ffn_down",
    }
    placements, dropped = place_tensors(src, graph, r, bool(tied), PHI3_PREFIXES, lambda i: ("softmax", table))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("phi", "phi", build_phi)
register_family("phi3", "phi3", build_phi3)
