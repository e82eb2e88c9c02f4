"""Falcon-H1 (transformers' ``falcon_h1``, ``FalconH1ForCausalLM``): attention and a Mamba2 mixer
in parallel in every layer.

Layout: ``model.embed_tokens``, ``model.layers.N.input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``mamba.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}``, ``pre_ff_layernorm``,
``feed_forward.{gate,up,down}_proj``, ``model.final_layernorm``, ``lm_head``. Every layer is

    x1 = rms(x);  h = x + ssm_out · ssm(ssm_in · x1) + attn_out · attn(attn_in · x1)
    h + ffn(rms(h))

lowered as one ``parallel`` mixer with two members, ``attention`` (``softmax``) and ``ssm``
(``mamba2_mup``: Mamba2 with the µP ``ssm_multipliers`` on its projection sections and the
optional gated norm). ``key_multiplier`` scales k before the scores; since k only meets q in the
scores, it is lowered as a factor of the score scale (head_dim^-½ · key_multiplier): the same
function, rounded once more or less. ``embedding_multiplier`` and ``lm_head_multiplier`` are the
embedding's and the head's multipliers. ``mlp_multipliers`` (gate, down) other than [1, 1] make
the FFN the ``gated_ffn_mup`` operator.
"""

from __future__ import annotations

import math

from ..sources import CheckpointSource
from . import mamba2 as m2f
from .base import ConfigReader, Lowering, register_family
from .decoder import rope_policy
from .placement import assemble_graph, place_tensors

PREFIXES = (
    ("model.embed_tokens.", "embedding"),
    ("model.layers.", "decoder_stack"),
    ("model.final_layernorm.", "final_norm"),
    ("lm_head.", "output_head"),
)

SSM_ROLES = {**m2f.MIXER_ROLES}
LAYER_ROLES = {
    "input_layernorm.weight": "mixer_norm",
    "pre_ff_layernorm.weight": "ffn_norm",
    "feed_forward.gate_proj.weight": "ffn_gate",
    "feed_forward.up_proj.weight": "ffn_up",
    "feed_forward.down_proj.weight": "ffn_down",
    "feed_forward.gate_proj.bias": "ffn_gate_bias",
    "feed_forward.up_proj.bias": "ffn_up_bias",
    "feed_forward.down_proj.bias": "ffn_down_bias",
    **{f"self_attn.{p}_proj.{w}": f"attention.{p}_{'proj' if w == 'weight' else 'bias'}"
       for p in "qkvo" for w in ("weight", "bias")},
    **{f"mamba.{k}": f"ssm.{v}" for k, v in SSM_ROLES.items()},
}


def _multiplier(r: ConfigReader, key: str, message: str, positive: bool = False) -> float | None:
    return r.take_number(key, message, minimum=0 if positive else None, nonzero=True, default=1.0,
                         default_reason="the reference default is 1.0")


def _numbers(r: ConfigReader, key: str, n: int, message: str) -> list[float] | None:
    v = r.take(key, message, default=[1.0] * n, default_reason=f"the reference default is {[1.0] * n}")
    if v is None:
        v = [1.0] * n  # the reference fills null with ones
    if (not isinstance(v, list) or len(v) != n
            or any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) for x in v)):
        r.refuse(key, f"expected {n} finite numbers, found {v!r}")
        return None
    return [float(x) for x in v]


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of decoder layers (each attention beside a Mamba2 mixer)")
    vocab = r.take_int("vocab_size", "vocabulary size")
    inter = r.take_int("intermediate_size", "FFN width")
    eps = r.take_number("rms_norm_eps", "epsilon of every RMSNorm (the gated norm's too)", minimum=0, default=1e-5,
                        default_reason="the reference default is 1e-5")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    ctx_ok, ctx = r.context_length()
    act = m2f.conv_activation(r, also=" and of the FFN's gate")
    nh = r.take_int("num_attention_heads", "query heads", default=32, default_reason="the reference default is 32")
    nkv = r.take("num_key_value_heads", "key/value heads (GQA; null: as many as query heads)", default=8,
                 default_reason="the reference default is 8")
    if nkv is None:
        nkv = nh
    attn_bias = r.take_bool("attention_bias", "bias on q/k/v/o", default=False, default_reason="the reference default has none")
    mlp_bias = r.take_bool("mlp_bias", "bias on the FFN projections", default=False, default_reason="the reference default has none")
    out_bias = r.take_bool("projectors_bias", "bias on the Mamba2 out_proj", default=False,
                           default_reason="the reference default has none")
    in_bias = r.take_bool("mamba_proj_bias", "bias on the Mamba2 in_proj", default=False,
                          default_reason="the reference default has none")
    conv_bias = r.take_bool("mamba_conv_bias", "bias on the Mamba2 causal conv", default=True,
                            default_reason="the reference default has one")
    mnh = r.take_int("mamba_n_heads", "SSM heads", default=128, default_reason="the reference default is 128")
    mg = r.take_int("mamba_n_groups", "groups sharing B and C", default=1, default_reason="the reference default is 1")
    ns = r.take_int("mamba_d_state", "SSM state per head channel", default=256, default_reason="the reference default is 256")
    mk = r.take_int("mamba_d_conv", "causal conv width", default=4, default_reason="the reference default is 4")
    chunk = r.take_int("mamba_chunk_size", "the reference's SSD chunk length (a tiling, carried)", default=256,
                       default_reason="the reference default is 256")
    mexp = r.take("mamba_expand", "SSM width = mamba_expand * hidden_size when mamba_d_ssm is null", default=2,
                  default_reason="the reference default is 2")
    d_ssm = r.take("mamba_d_ssm", "SSM width (null: mamba_expand * hidden_size)", default=1024,
                   default_reason="the reference default is 1024")
    mhd = r.take("mamba_d_head", "channels per SSM head ('auto': SSM width / heads)", default="auto",
                 default_reason="the reference default is auto")
    rms = r.take_bool("mamba_rms_norm", "a gated RMSNorm after the scan (false: y · silu(gate))", default=False,
                      default_reason="the reference default has none")
    limit = m2f.time_step_limit(r)
    emb_mult = _multiplier(r, "embedding_multiplier", "embeddings are scaled by this")
    head_mult = _multiplier(r, "lm_head_multiplier", "logits are scaled by this")
    key_mult = _multiplier(r, "key_multiplier", "k is scaled by this before the scores (lowered into the score scale)",
                           positive=True)
    a_in = _multiplier(r, "attention_in_multiplier", "the attention member's input is scaled by this")
    a_out = _multiplier(r, "attention_out_multiplier", "the attention member's write is scaled by this")
    s_in = _multiplier(r, "ssm_in_multiplier", "the SSM member's input is scaled by this")
    s_out = _multiplier(r, "ssm_out_multiplier", "the SSM member's write is scaled by this")
    ssm_mult = _numbers(r, "ssm_multipliers", 5, "µP multipliers of the in_proj sections gate, x, B, C, dt")
    mlp_mult = _numbers(r, "mlp_multipliers", 2, "µP multipliers of the FFN gate and down projections")
    for key, why in (("num_logits_to_keep", "an output option of the reference (logits of the last positions)"),
                     ("is_encoder_decoder", "a generic config flag; a causal LM is not an encoder-decoder"),
                     ("time_step_min", "initialisation range of dt_bias; trained weights carry the result"),
                     ("time_step_max", "initialisation range of dt_bias; trained weights carry the result"),
                     ("time_step_floor", "initialisation floor of dt_bias; trained weights carry the result")):
        r.ignore(key, why)
    gated = "none"
    if rms:
        before = r.take_bool("mamba_norm_before_gate", "the gated norm normalises before multiplying by silu(gate)",
                             default=True, default_reason="the reference default is true")
        gated = None if before is None else ("norm_then_gate" if before else "gate_then_norm")
    else:
        r.ignore("mamba_norm_before_gate", "mamba_rms_norm is false: there is no gated norm to order")
    if None in (H, L, vocab, inter, eps, tied, act, nh, attn_bias, mlp_bias, out_bias, in_bias, conv_bias, mnh, mg, ns, mk,
                chunk, rms, limit, emb_mult, head_mult, key_mult, a_in, a_out, s_in, s_out, ssm_mult, mlp_mult, gated) \
            or not ctx_ok:
        return None
    if isinstance(nkv, bool) or not isinstance(nkv, int) or nkv < 1 or nh % nkv:
        r.refuse("num_key_value_heads", f"expected a positive divisor of {nh} query heads, found {nkv!r}")
        return None
    if r.has("head_dim"):  # not a field of the reference's config, but read (getattr) when a config carries it
        hd = r.take_int("head_dim", "per-head width")
        if hd is None:
            return None
    else:
        hd = H // nh
        if hd * nh != H:
            r.refuse("num_attention_heads", f"hidden_size {H} is not divisible by {nh} heads and no head_dim is declared")
            return None
    if d_ssm is None:
        if isinstance(mexp, bool) or not isinstance(mexp, (int, float)) or not mexp > 0:
            r.refuse("mamba_expand", f"expected a positive number, found {mexp!r}")
            return None
        ssm_width = int(mexp * H)
    elif isinstance(d_ssm, bool) or not isinstance(d_ssm, int) or d_ssm < 1:
        r.refuse("mamba_d_ssm", f"expected a positive integer or null, found {d_ssm!r}")
        return None
    else:
        ssm_width = d_ssm
    if mhd == "auto":
        mhd = ssm_width // mnh
    if isinstance(mhd, bool) or not isinstance(mhd, int) or mhd < 1 or mhd * mnh != ssm_width:
        r.refuse("mamba_d_head", f"{mhd!r} heads' channels times {mnh} heads must equal the SSM width {ssm_width}")
        return None
    if mnh % mg:
        r.refuse("mamba_n_groups", f"{mnh} heads are not a multiple of {mg} groups")
        return None
    position = rope_policy(r, hd)
    if position is None:
        return None

    geo = m2f.mixer_geometry(hidden=H, num_heads=mnh, head_dim=mhd, state_size=ns, n_groups=mg, conv_kernel=mk,
                             chunk_size=chunk, limit=limit, eps=eps, use_conv_bias=bool(conv_bias), use_bias=False)
    ssm = {k: geo[k] for k in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size",
                               "intermediate_size", "conv_dim", "in_proj_dim", "time_step_limit", "activation",
                               "use_conv_bias")}
    ssm.update(projection_multipliers=ssm_mult, gated_norm=gated, norm_eps=None if gated == "none" else float(eps),
               in_proj_bias=bool(in_bias), out_proj_bias=bool(out_bias))
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": emb_mult},
        "residual": {"multiplier": 1.0},
        "attention": {
            "heads": nh, "kv_heads": nkv, "head_dim": hd, "output_gate": False, "head_mapping": "repeat_interleave",
            "query_scale": 1.0, "score_scale": float(hd) ** -0.5 * key_mult,
            "bias": {k: bool(attn_bias) for k in ("q", "k", "v", "o")}, "qk_norm": None, "qkv_clip": None, "sinks": None,
        },
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": head_mult, "softcap": None},
        "operators": {
            "mamba2_mup": ssm,
            "parallel": {"combine": "sum", "members": [
                {"name": "attention", "operator": "softmax", "in_multiplier": a_in, "out_multiplier": a_out},
                {"name": "ssm", "operator": "mamba2_mup", "in_multiplier": s_in, "out_multiplier": s_out},
            ]},
        },
        "context_length": ctx,
    }
    # µP FFN multipliers other than 1 need the gated_ffn_mup operator; without them the plain
    # gated FFN (whose features the internals queries read) is the same function
    if mlp_mult == [1.0, 1.0]:
        ffn = "dense"
        surface["ffn"] = {"kind": "gated", "activation": "silu", "intermediate_size": inter, "bias": bool(mlp_bias),
                          "fused_gate_up": False}
    else:
        ffn = "dense_mup"
        surface["operators"]["gated_ffn_mup"] = {"activation": "silu", "intermediate_size": inter, "bias": bool(mlp_bias),
                                                 "gate_multiplier": mlp_mult[0], "down_multiplier": mlp_mult[1]}
    layers = [{"index": i, "operator": "parallel", "span": "full", "window": None, "position": position, "ffn": ffn,
               "operands": {}} for i in range(L)]
    graph = assemble_graph(src.name, "falcon_h1", bool(tied), layers, surface)
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: ("parallel", LAYER_ROLES))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("falcon_h1", "falcon_h1", build)
