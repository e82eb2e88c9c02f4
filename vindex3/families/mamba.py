"""Mamba1 (transformers' ``mamba``, ``MambaForCausalLM``) and Falcon-Mamba (``falcon_mamba``,
``FalconMambaForCausalLM``): pure selective-scan models.

Layout: ``backbone.embeddings``, ``backbone.layers.N.norm`` (the pre-mixer RMSNorm),
``backbone.layers.N.mixer.*`` (in_proj, conv1d, x_proj, dt_proj, A_log, D, out_proj),
``backbone.norm_f``, ``lm_head``. Each layer is ``x + mixer(norm(x))``: operator ``mamba1``, no
attention, no FFN. Falcon-Mamba differs only by the weightless RMS norms on Δ, B and C inside
the mixer (``mixer_rms_eps``); their weights are non-persistent buffers of ones in the reference
and are never in a checkpoint.
"""

from __future__ import annotations

import math

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .placement import assemble_graph, place_tensors

MIXER_ROLES = {
    "in_proj.weight": "in_proj",
    "in_proj.bias": "in_proj_bias",
    "conv1d.weight": "conv_weight",
    "conv1d.bias": "conv_bias",
    "x_proj.weight": "x_proj",
    "dt_proj.weight": "dt_proj",
    "dt_proj.bias": "dt_proj_bias",
    "A_log": "A_log",
    "D": "D",
    "out_proj.weight": "out_proj",
    "out_proj.bias": "out_proj_bias",
}

PREFIXES = (
    ("backbone.embeddings.", "embedding"),
    ("backbone.layers.", "decoder_stack"),
    ("backbone.norm_f.", "final_norm"),
    ("lm_head.", "output_head"),
)

LAYER_ROLES = {"norm.weight": "mixer_norm", **{f"mixer.{k}": v for k, v in MIXER_ROLES.items()}}


def _build(r: ConfigReader, src: CheckpointSource, falcon: bool) -> Lowering | None:
    family = "falcon_mamba" if falcon else "mamba"
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of Mamba layers")
    vocab = r.take_int("vocab_size", "vocabulary size")
    N = r.take_int("state_size", "SSM state per channel", default=16, default_reason="the reference default is 16")
    K = r.take_int("conv_kernel", "causal depthwise conv width", default=4, default_reason="the reference default is 4")
    expand = r.take("expand", "inner width = int(expand * hidden_size)", default=2, default_reason="the reference default is 2")
    eps = r.take_number("layer_norm_epsilon", "epsilon of the pre-mixer and final RMSNorms", minimum=0, default=1e-5,
                        default_reason="the reference default is 1e-5")
    use_bias = r.take_bool("use_bias", "bias on in_proj and out_proj", default=False, default_reason="the reference default has none")
    use_conv_bias = r.take_bool("use_conv_bias", "bias on the causal conv", default=True,
                                default_reason="the reference default has one")
    fp32 = r.take_bool("residual_in_fp32", "the residual stream is kept in float32 (this executor is float32 end to end)",
                       default=True, default_reason="the reference default is true")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=True,
                       default_reason="the reference default is tied")
    ctx_ok, ctx = r.context_length()
    act = r.take("hidden_act", "activation after the mixer's causal conv", default="silu",
                 default_reason="the reference default is silu")
    ok = ctx_ok and None not in (H, L, vocab, N, K, eps, use_bias, use_conv_bias, fp32, tied)
    if act not in ("silu", "swish"):
        r.refuse("hidden_act", f"mamba1 conv activation {act!r} has no executor (supported: silu)")
        ok = False
    rms_eps = None
    if falcon:
        rms_eps = r.take_number("mixer_rms_eps", "epsilon of the weightless RMS norms on Δ, B and C inside the mixer",
                                minimum=0, default=1e-6, default_reason="the reference default is 1e-6")
        ok = ok and rms_eps is not None
    for key, why in (("time_step_min", "initialisation range of dt_proj's bias; trained weights carry the result"),
                     ("time_step_max", "initialisation range of dt_proj's bias; trained weights carry the result"),
                     ("time_step_floor", "initialisation floor of dt_proj's bias; trained weights carry the result"),
                     ("time_step_scale", "initialisation scale of dt_proj; trained weights carry the result"),
                     ("time_step_init_scheme", "initialisation scheme of dt_proj; trained weights carry the result"),
                     ("use_mambapy", "a training fallback of the reference (its mamba.py scan); same math"),
                     ("use_falcon_mambapy", "a training fallback of the reference (its mamba.py scan); same math"),
                     ("use_associative_scan", "the reference's compiled parallel scan; same math as its loop"),
                     ("is_encoder_decoder", "a generic config flag; a causal LM is not an encoder-decoder")):
        r.ignore(key, why)
    if not ok:
        return None
    if not (isinstance(expand, (int, float)) and not isinstance(expand, bool) and math.isfinite(expand) and expand > 0):
        r.refuse("expand", f"expected a positive number, found {expand!r}")
        return None
    inner = int(expand * H)
    if r.has("intermediate_size"):
        # the reference recomputes it from expand on load; a disagreeing value would be overwritten
        if r.config["intermediate_size"] != inner:
            r.refuse("intermediate_size", f"is {r.config['intermediate_size']!r}, but the reference recomputes it as "
                                          f"int(expand * hidden_size) = {inner}")
            return None
        r.take("intermediate_size", "inner width (equals int(expand * hidden_size), as the reference recomputes it)")
    rank = r.take("time_step_rank", "width of the time-step projection's input; 'auto' is ceil(hidden_size / 16)",
                  default="auto", default_reason="the reference default is auto")
    if rank == "auto":
        rank = math.ceil(H / 16)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        r.refuse("time_step_rank", f"expected a positive integer or 'auto', found {rank!r}")
        return None
    if r.has("layer_types"):  # the reference derives it; a config may still spell it out
        lt = r.take("layer_types", "per-layer mixer type (every layer is a Mamba mixer)")
        if not isinstance(lt, list) or len(lt) != L or any(t not in ("linear_attention", "mamba") for t in lt):
            r.refuse("layer_types", f"a {family} model has {L} layers of type linear_attention; found {lt!r}")
            return None

    layers = [{"index": i, "operator": "mamba1", "span": None, "window": None, "position": None, "ffn": None,
               "operands": {}} for i in range(L)]
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0, "fp32": bool(fp32)},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {"mamba1": {
            "intermediate_size": inner, "state_size": N, "conv_kernel": K, "time_step_rank": rank, "activation": "silu",
            "use_bias": bool(use_bias), "use_conv_bias": bool(use_conv_bias), "bcdt_rms_eps": rms_eps,
        }},
        "context_length": ctx,
    }
    graph = assemble_graph(src.name, family, bool(tied), layers, surface)
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: ("mamba1", LAYER_ROLES))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("mamba", "mamba", lambda r, src: _build(r, src, False))
register_family("falcon_mamba", "falcon_mamba", lambda r, src: _build(r, src, True))
