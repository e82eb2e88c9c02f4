"""Mamba2 (transformers' ``mamba2``, ``Mamba2ForCausalLM``): a pure state-space model.

Layout: ``backbone.embeddings``, ``backbone.layers.N.norm`` (the pre-mixer RMSNorm),
``backbone.layers.N.mixer.*`` (in_proj, conv1d, A_log, D, dt_bias, the gated norm, out_proj),
``backbone.norm_f``, ``lm_head``. Each layer is ``x + mixer(norm(x))``: no attention, no FFN.

The mixer geometry and the time-step limit are graded by helpers that the hybrid families
(vindex3.families.granitemoehybrid) share, so one mixer is described one way whatever the
checkpoint spells its keys.
"""

from __future__ import annotations

import math

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .placement import assemble_graph, place_tensors

# Mixer tensor suffix (below the layer's mixer module) -> operand role, exact match only.
MIXER_ROLES = {
    "in_proj.weight": "in_proj",
    "in_proj.bias": "in_proj_bias",
    "conv1d.weight": "conv_weight",
    "conv1d.bias": "conv_bias",
    "A_log": "A_log",
    "D": "D",
    "dt_bias": "dt_bias",
    "norm.weight": "gated_norm",
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

# Layer-type spellings transformers 5.24 reads for a Mamba2 mixer (the legacy one is remapped
# by transformers.configuration_utils._LEGACY_LAYER_TYPE_REMAP).
MAMBA_LAYER_TYPES = ("linear_attention", "mamba")


def _positive_int(r: ConfigReader, key: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        r.refuse(key, f"expected a positive integer, found {value!r}")
        return False
    return True


def time_step_limit(r: ConfigReader, key: str = "time_step_limit") -> tuple[float, float] | None:
    """Δ is clamped to these bounds after the softplus (in the chunk form). The upper bound may
    be infinite, spelled bare ``Infinity`` or ``{"__float__": "Infinity"}`` (both read as inf)."""
    lim = r.take(key, "Δ clamp (lower, upper) after the softplus; an infinite upper bound never binds",
                 default=(0.0, math.inf), default_reason="the reference default is (0.0, inf)")
    if lim is None and r.has(key):
        r.refuse(key, "null: the reference's chunk form cannot run without a limit pair")
        return None
    ok = isinstance(lim, (list, tuple)) and len(lim) == 2 and all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in lim)
    if not ok:
        r.refuse(key, f"expected two numbers (lower, upper), found {lim!r}")
        return None
    lo, hi = float(lim[0]), float(lim[1])
    if math.isnan(lo) or math.isnan(hi) or lo < 0 or math.isinf(lo) or hi < lo:
        r.refuse(key, f"expected 0 <= lower <= upper (upper may be inf), found ({lo!r}, {hi!r})")
        return None
    return lo, hi


def mixer_geometry(*, hidden: int, num_heads: int, head_dim: int, state_size: int, n_groups: int, conv_kernel: int,
                   chunk_size: int, limit: tuple[float, float], eps: float, use_conv_bias: bool,
                   use_bias: bool) -> dict:
    """``surface.operators.mamba2``: what the mixer's operands and buffers are shaped by."""
    inter = num_heads * head_dim
    conv_dim = inter + 2 * n_groups * state_size
    return {
        "num_heads": num_heads,
        "head_dim": head_dim,
        "state_size": state_size,
        "n_groups": n_groups,
        "conv_kernel": conv_kernel,
        "chunk_size": chunk_size,
        "intermediate_size": inter,
        "conv_dim": conv_dim,
        "in_proj_dim": inter + conv_dim + num_heads,
        "time_step_limit": [limit[0], limit[1]],
        "activation": "silu",
        "norm_eps": float(eps),
        "norm_before_gate": False,
        "use_conv_bias": bool(use_conv_bias),
        "use_bias": bool(use_bias),
    }


def check_mixer_widths(r: ConfigReader, hidden: int, num_heads: int, head_dim: int, n_groups: int, expand,
                       keys: dict[str, str]) -> bool:
    """expand * hidden must be heads * head_dim, and heads a multiple of n_groups."""
    ok = True
    if (not (isinstance(expand, (int, float)) and not isinstance(expand, bool)) or not math.isfinite(expand)
            or int(expand * hidden) != num_heads * head_dim):
        r.refuse(keys["expand"], f"{keys['expand']} * hidden_size = {expand!r} * {hidden} does not equal "
                                 f"{keys['num_heads']} * {keys['head_dim']} = {num_heads} * {head_dim}")
        ok = False
    if num_heads % n_groups:
        r.refuse(keys["n_groups"], f"{num_heads} heads are not a multiple of {n_groups} groups")
        ok = False
    return ok


def conv_activation(r: ConfigReader, key: str = "hidden_act", *, also: str = "") -> str | None:
    act = r.take(key, f"activation after the mixer's causal conv{also}", default="silu",
                 default_reason="the reference default is silu")
    if not isinstance(act, str) or act not in ("silu", "swish"):
        r.refuse(key, f"mamba2 conv activation {act!r} has no executor (supported: silu)")
        return None
    return act


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take("hidden_size", "residual width")
    L = r.take("num_hidden_layers", "number of Mamba2 layers")
    vocab = r.take("vocab_size", "vocabulary size")
    nh = r.take("num_heads", "SSM heads", default=128, default_reason="the reference default is 128")
    hd = r.take("head_dim", "channels per SSM head", default=64, default_reason="the reference default is 64")
    ns = r.take("state_size", "SSM state per head channel", default=128, default_reason="the reference default is 128")
    g = r.take("n_groups", "groups sharing B and C (and gated-norm groups)", default=8, default_reason="the reference default is 8")
    expand = r.take("expand", "intermediate = expand * hidden_size (checked against heads * head_dim)", default=2,
                    default_reason="the reference default is 2")
    k = r.take("conv_kernel", "causal depthwise conv width", default=4, default_reason="the reference default is 4")
    chunk = r.take("chunk_size", "the reference's SSD chunk length: a tiling of one exact recurrence, carried, not needed",
                   default=256, default_reason="the reference default is 256")
    eps = r.take("layer_norm_epsilon", "epsilon of the pre-mixer, gated and final RMSNorms", default=1e-5,
                 default_reason="the reference default is 1e-5")
    use_bias = r.take_bool("use_bias", "bias on in_proj and out_proj", default=False, default_reason="the reference default has none")
    use_conv_bias = r.take_bool("use_conv_bias", "bias on the causal conv", default=True, default_reason="the reference default has one")
    fp32 = r.take_bool("residual_in_fp32", "the residual stream is kept in float32 (this executor is float32 end to end)",
                       default=True, default_reason="the reference default is true")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    ctx_ok, ctx = r.context_length()
    act = conv_activation(r)
    limit = time_step_limit(r)
    for key, why in (("time_step_min", "initialisation range of dt_bias; trained weights carry the result"),
                     ("time_step_max", "initialisation range of dt_bias; trained weights carry the result"),
                     ("time_step_floor", "initialisation floor of dt_bias; trained weights carry the result"),
                     ("time_step_rank", "Mamba2 has no time-step projection; transformers 5.24's mixer never reads it")):
        r.ignore(key, why)
    ok = act is not None and limit is not None and ctx_ok and None not in (use_bias, use_conv_bias, fp32, tied)
    if r.has("rms_norm"):
        if r.config["rms_norm"] is True:
            r.take("rms_norm", "the norms are RMSNorm, as the reference runs them")
        else:
            r.refuse("rms_norm", f"rms_norm={r.config['rms_norm']!r} declares LayerNorm, which transformers' Mamba2 "
                                 "does not run (it always uses RMSNorm); refusing rather than guessing which is meant")
            ok = False
    if r.has("norm_before_gate"):
        if r.config["norm_before_gate"] is False:
            r.take("norm_before_gate", "the gated norm multiplies by silu(gate) before normalising, as the reference does")
        else:
            r.refuse("norm_before_gate", f"norm_before_gate={r.config['norm_before_gate']!r}: transformers' Mamba2 gates "
                                         "before the norm; the other order is not executed")
            ok = False
    r.ignore("fused_add_norm", "a kernel fusion of the residual add and the norm; the same math")
    if r.has("pad_vocab_size_multiple"):
        r.meta("pad_vocab_size_multiple", "the vocabulary is already padded in the stored embedding")
    if r.has("layer_types"):
        lt = r.take("layer_types", "per-layer mixer type (every Mamba2 layer is a mamba2 mixer)")
        if not isinstance(lt, list) or len(lt) != L or any(t not in MAMBA_LAYER_TYPES for t in lt):
            r.refuse("layer_types", f"a Mamba2 model has {L} layers of type linear_attention (or legacy mamba); found {lt!r}")
            ok = False
    if None in (H, L, vocab):
        return None
    for key, v in (("hidden_size", H), ("num_hidden_layers", L), ("vocab_size", vocab), ("num_heads", nh),
                   ("head_dim", hd), ("state_size", ns), ("n_groups", g), ("conv_kernel", k), ("chunk_size", chunk)):
        ok = _positive_int(r, key, v) and ok
    if not ok:
        return None
    if not check_mixer_widths(r, H, nh, hd, g, expand, {"expand": "expand", "num_heads": "num_heads", "head_dim": "head_dim", "n_groups": "n_groups"}):
        return None
    if not (isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps >= 0):
        r.refuse("layer_norm_epsilon", f"expected a finite non-negative number, found {eps!r}")
        return None

    layers = [{"index": i, "operator": "mamba2", "span": None, "window": None, "position": None, "ffn": None,
               "operands": {}} for i in range(L)]
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0, "fp32": bool(fp32)},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {"mamba2": mixer_geometry(hidden=H, num_heads=nh, head_dim=hd, state_size=ns, n_groups=g,
                                               conv_kernel=k, chunk_size=chunk, limit=limit, eps=eps,
                                               use_conv_bias=bool(use_conv_bias), use_bias=bool(use_bias))},
        "context_length": ctx,
    }
    graph = assemble_graph(src.name, "mamba2", bool(tied), layers, surface)
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: ("mamba2", LAYER_ROLES))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("mamba2", "mamba2", build)
