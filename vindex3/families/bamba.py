"""Bamba (transformers' ``bamba``, ``BambaForCausalLM``): Mamba2 mixers and softmax attention
interleaved, a SiLU-gated FFN in every layer. It falls out of the existing operators: the mixer
is exactly ``mamba2`` (gate, then an RMSNorm over n_groups groups), attention is ``softmax``
with a half-width rotary embedding.

Layout: ``model.embed_tokens``, ``model.layers.N.input_layernorm``, ``mamba.*`` (a Mamba2 mixer)
or ``self_attn.{q,k,v,o}_proj``, ``pre_ff_layernorm``, ``feed_forward.{gate,up,down}_proj``,
``model.final_layernorm``, ``lm_head``. Which layers attend is the config's ``attn_layer_indices``;
a config without it is refused by name (the reference would make every layer a Mamba2 mixer).
The reference fixes ``partial_rotary_factor`` at 0.5 whatever a config says; another value is
refused rather than silently replaced.
"""

from __future__ import annotations

from ..sources import CheckpointSource
from . import mamba2 as m2f
from .base import ConfigReader, Lowering, register_family
from .placement import assemble_graph, place_tensors

PREFIXES = (
    ("model.embed_tokens.", "embedding"),
    ("model.layers.", "decoder_stack"),
    ("model.final_layernorm.", "final_norm"),
    ("lm_head.", "output_head"),
)
COMMON = {
    "input_layernorm.weight": "mixer_norm",
    "pre_ff_layernorm.weight": "ffn_norm",
    **{f"feed_forward.{p}_proj.{w}": f"ffn_{p}{'_bias' if w == 'bias' else ''}" for p in ("gate", "up", "down")
       for w in ("weight", "bias")},
}
TABLES = {
    "mamba2": {**COMMON, **{f"mamba.{k}": v for k, v in m2f.MIXER_ROLES.items()}},
    "softmax": {**COMMON, **{f"self_attn.{p}_proj.weight": f"{p}_proj" for p in "qkvo"},
                **{f"self_attn.{p}_proj.bias": f"{p}_bias" for p in "qkvo"}},
}


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of decoder layers")
    vocab = r.take_int("vocab_size", "vocabulary size")
    inter = r.take_int("intermediate_size", "FFN width")
    eps = r.take_number("rms_norm_eps", "epsilon of every RMSNorm, the gated norm's too", minimum=0, default=1e-5,
                        default_reason="the reference default is 1e-5")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    ctx_ok, ctx = r.context_length()
    act = m2f.conv_activation(r, also=" and of the FFN's gate")
    nh = r.take_int("num_attention_heads", "query heads", default=32, default_reason="the reference default is 32")
    nkv = r.take("num_key_value_heads", "key/value heads (null: as many as query heads)", default=8,
                 default_reason="the reference default is 8")
    attn_bias = r.take_bool("attention_bias", "bias on q/k/v/o", default=False, default_reason="the reference default has none")
    mlp_bias = r.take_bool("mlp_bias", "bias on the FFN projections", default=False, default_reason="the reference default has none")
    mnh = r.take_int("mamba_n_heads", "SSM heads", default=128, default_reason="the reference default is 128")
    mg = r.take_int("mamba_n_groups", "groups sharing B and C (and gated-norm groups)", default=1,
                    default_reason="the reference default is 1")
    ns = r.take_int("mamba_d_state", "SSM state per head channel", default=256, default_reason="the reference default is 256")
    mk = r.take_int("mamba_d_conv", "causal conv width", default=4, default_reason="the reference default is 4")
    chunk = r.take_int("mamba_chunk_size", "the reference's SSD chunk length (a tiling, carried)", default=256,
                       default_reason="the reference default is 256")
    mexp = r.take("mamba_expand", "SSM width = mamba_expand * hidden_size", default=2, default_reason="the reference default is 2")
    mhd = r.take("mamba_d_head", "channels per SSM head ('auto': SSM width / heads)", default="auto",
                 default_reason="the reference default is auto")
    conv_bias = r.take_bool("mamba_conv_bias", "bias on the causal conv", default=True, default_reason="the reference default has one")
    proj_bias = r.take_bool("mamba_proj_bias", "bias on in_proj and out_proj", default=False,
                            default_reason="the reference default has none")
    limit = m2f.time_step_limit(r)
    for key, why in (("num_logits_to_keep", "an output option of the reference (logits of the last positions)"),
                     ("z_loss_coefficient", "a training loss coefficient"),
                     ("is_encoder_decoder", "a generic config flag; a causal LM is not an encoder-decoder")):
        r.ignore(key, why)
    if None in (H, L, vocab, inter, eps, tied, act, nh, attn_bias, mlp_bias, mnh, mg, ns, mk, chunk, conv_bias, proj_bias,
                limit) or not ctx_ok:
        return None
    idxs = r.config.get("attn_layer_indices")
    if idxs is None:
        if r.has("attn_layer_indices"):
            r.take("attn_layer_indices", "null: declares nothing")
        r.refuse("attn_layer_indices", "no layer pattern declared (absent or null); the reference would make every layer "
                                       "a Mamba2 mixer: refusing rather than assuming it", category="structure")
        return None
    r.take("attn_layer_indices", "indices of the layers that attend (the others are Mamba2 mixers)")
    if (not isinstance(idxs, list) or len(set(idxs)) != len(idxs)
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < L for i in idxs)):
        r.refuse("attn_layer_indices", f"expected distinct layer indices in [0, {L}), found {idxs!r}")
        return None
    ops = ["softmax" if i in idxs else "mamba2" for i in range(L)]
    nkv = nh if nkv is None else nkv
    if isinstance(nkv, bool) or not isinstance(nkv, int) or nkv < 1 or nh % nkv:
        r.refuse("num_key_value_heads", f"expected a positive divisor of {nh} query heads, found {nkv!r}")
        return None
    if mhd == "auto" and isinstance(mexp, int) and not isinstance(mexp, bool):
        mhd = mexp * H // mnh
    if not m2f._positive_int(r, "mamba_d_head", mhd):
        return None
    if not m2f.check_mixer_widths(r, H, mnh, mhd, mg, mexp, {"expand": "mamba_expand", "num_heads": "mamba_n_heads",
                                                            "head_dim": "mamba_d_head", "n_groups": "mamba_n_groups"}):
        return None
    hd = H // nh
    if r.has("head_dim"):  # not a field of the reference's config, but read (getattr) when a config carries it
        hd = r.take_int("head_dim", "per-head width")
        if hd is None:
            return None
    elif hd * nh != H:
        r.refuse("num_attention_heads", f"hidden_size {H} is not divisible by {nh} heads and no head_dim is declared")
        return None
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "ffn": {"kind": "gated", "activation": "silu", "intermediate_size": inter, "bias": bool(mlp_bias),
                "fused_gate_up": False},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
        "context_length": ctx,
    }
    position = None
    if "softmax" in ops:
        rope = r.take("rope_parameters", "rotary position encoding (default rope at half the head width)", default=None,
                      default_reason="absent: refused below")
        ok = isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and not set(rope) - {
            "rope_type", "rope_theta", "partial_rotary_factor"}
        theta = rope.get("rope_theta") if ok else None
        if not ok or isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0 \
                or rope.get("partial_rotary_factor", 0.5) != 0.5 or (hd // 2) % 2:
            r.refuse("rope_parameters", f"expected default rope with a positive rope_theta at the reference's fixed "
                                        f"partial_rotary_factor 0.5 (an even rotary width), found {rope!r}")
            return None
        position = {"kind": "rope", "theta": float(theta), "rotary_dims": hd // 2, "scaling": None}
        surface["attention"] = {
            "heads": nh, "kv_heads": nkv, "head_dim": hd, "output_gate": False, "head_mapping": "repeat_interleave",
            "query_scale": 1.0, "score_scale": float(hd) ** -0.5, "bias": {k: bool(attn_bias) for k in "qkvo"},
            "qk_norm": None, "qkv_clip": None, "sinks": None,
        }
    else:
        r.ignore("rope_parameters", "no layer attends: no rotary embedding runs")
    if "mamba2" in ops:
        surface["operators"]["mamba2"] = m2f.mixer_geometry(
            hidden=H, num_heads=mnh, head_dim=mhd, state_size=ns, n_groups=mg, conv_kernel=mk, chunk_size=chunk,
            limit=limit, eps=eps, use_conv_bias=bool(conv_bias), use_bias=bool(proj_bias))
    layers = [{"index": i, "operator": op, "span": "full" if op == "softmax" else None, "window": None,
               "position": position if op == "softmax" else None, "ffn": "dense", "operands": {}}
              for i, op in enumerate(ops)]
    graph = assemble_graph(src.name, "bamba", bool(tied), layers, surface)
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: (ops[i], TABLES[ops[i]]))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("bamba", "bamba", build)
