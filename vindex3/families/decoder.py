"""Llama-shaped decoder families: llama, mistral, qwen2, qwen3, granite.

They share one layout (model.embed_tokens, model.layers.N.{self_attn,mlp,*_layernorm},
model.norm, lm_head) and differ in a few declared traits, each lowered explicitly here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..sources import CheckpointSource
from .base import ConfigReader, HfExport, Lowering, register_export, register_family
from .placement import assemble_graph, place_tensors

PREFIXES = (
    ("model.embed_tokens.", "embedding"),
    ("model.layers.", "decoder_stack"),
    ("model.norm.", "final_norm"),
    ("lm_head.", "output_head"),
)

# Softmax attention operands under a llama-shaped layer (also used by the Granite hybrid).
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
LAYER_ROLES = {
    "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "ffn_norm",
    **ATTENTION_ROLES,
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
    "mlp.gate_proj.bias": "ffn_gate_bias",
    "mlp.up_proj.bias": "ffn_up_bias",
    "mlp.down_proj.bias": "ffn_down_bias",
}

ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}


@dataclass(frozen=True)
class Traits:
    qkv_bias: str  # "config" (attention_bias key) | "fixed_qkv" (q,k,v biased, o not)
    qk_norm: bool
    sliding: str  # "none" | "global" (sliding_window applies to all layers) | "layer_types"
    multipliers: bool  # granite embedding/residual/attention multipliers and logits scaling


TRAITS = {
    "llama": Traits("config", False, "none", False),
    "mistral": Traits("none", False, "global", False),
    "qwen2": Traits("fixed_qkv", False, "layer_types", False),
    "qwen3": Traits("config", True, "layer_types", False),
    "granite": Traits("config", False, "none", True),
}


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def rope_policy(r: ConfigReader, head_dim: int, default: tuple[dict, str] | None = None, *,
                allow_partial: bool = False, params_in: dict | None = None) -> dict | None:
    """Lower rope_parameters (transformers 5.x) or rope_theta + rope_scaling (older). ``default``:
    (parameters, why) where the reference fixes them when a config states none. ``allow_partial``:
    a partial_rotary_factor below 1 rotates the first int(head_dim · factor) dims of each head
    (an odd count is refused). ``params_in``: the parameters already read (one entry of a
    per-layer-kind rope_parameters), graded by the caller."""
    params = dict(params_in) if params_in is not None else None
    if params_in is None and default is not None and not any(r.has(k) for k in ("rope_parameters", "rope_theta", "rope_scaling")):
        params = dict(r.take("rope_parameters", "rotary position encoding parameters", default=default[0],
                             default_reason=default[1]))
    if params_in is None and r.has("rope_parameters"):
        params = r.take("rope_parameters", "rotary position encoding parameters")
        if not isinstance(params, dict):
            r.refuse("rope_parameters", "expected an object")
            return None
        params = dict(params)
    if params_in is None and (r.has("rope_theta") or r.has("rope_scaling")):
        theta = r.take("rope_theta", "rotary base", default=None) if r.has("rope_theta") else None
        scaling = r.take("rope_scaling", "rotary scaling") if r.has("rope_scaling") else None
        legacy = dict(scaling or {})
        if "type" in legacy and "rope_type" not in legacy:
            legacy["rope_type"] = legacy.pop("type")
        if theta is not None:
            legacy["rope_theta"] = theta
        if params is not None:
            for k, v in legacy.items():
                if k in params and params[k] != v:
                    r.refuse("rope_theta", f"rope_parameters.{k}={params[k]!r} disagrees with the legacy key ({v!r})")
                    return None
            params.update(legacy)
        else:
            params = legacy
    if params is None:
        r.refuse("rope_parameters", "no rotary base declared (neither rope_parameters nor rope_theta); refusing to assume one", category="structure")
        return None
    theta = params.get("rope_theta")
    if not _positive_number(theta):
        r.refuse("rope_parameters", f"rope_theta must be a positive finite number, found {theta!r}")
        return None
    rtype = params.get("rope_type", "default")
    known = {"rope_theta", "rope_type", "partial_rotary_factor"}
    partial = params.get("partial_rotary_factor", 1.0)
    if not _positive_number(partial) or partial > 1:
        r.refuse("rope_parameters", f"partial_rotary_factor must be a number in (0, 1], found {partial!r}")
        return None
    rotary_dims = int(head_dim * partial)
    if rotary_dims != head_dim and not allow_partial:
        r.refuse("rope_parameters", f"partial rotary (factor {partial}) is not supported by this family's lowering")
        return None
    if rotary_dims < 2 or rotary_dims % 2:
        r.refuse("rope_parameters", f"partial_rotary_factor {partial} gives {rotary_dims} rotary dims of {head_dim}; "
                                    "rotate-half needs an even count of at least 2")
        return None
    scaling = None
    if rtype == "default":
        pass
    elif rtype in ("linear", "llama3"):
        need = ("factor",) if rtype == "linear" else (
            "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        known |= set(need)
        missing = [k for k in need if k not in params]
        if missing:
            r.refuse("rope_parameters", f"{rtype} rope scaling lacks {', '.join(missing)}")
            return None
        bad = [k for k in need if not _positive_number(params[k])]
        if bad:
            r.refuse("rope_parameters", f"{rtype} rope scaling needs a positive finite {bad[0]}, found {params[bad[0]]!r}")
            return None
        scaling = {"type": rtype, **{k: float(params[k]) for k in need}}
    elif rtype == "yarn":
        known |= {"factor", "beta_fast", "beta_slow", "original_max_position_embeddings", "truncate", "attention_factor",
                  "mscale", "mscale_all_dim"}
        scaling = _yarn(r, params)
        if scaling is None:
            return None
    else:
        r.refuse("rope_parameters", f"rope_type {rtype!r} is not supported (supported: default, linear, llama3, yarn)")
        return None
    extra = sorted(set(params) - known)
    if extra:
        r.refuse("rope_parameters", f"unknown rotary parameters {', '.join(extra)} for rope_type {rtype!r}")
        return None
    return {"kind": "rope", "theta": float(theta), "rotary_dims": rotary_dims, "scaling": scaling}


def _yarn(r: ConfigReader, params: dict) -> dict | None:
    """Resolve YaRN's parameters as transformers 5.24 does (``standardize_rope_params`` then
    ``_compute_yarn_parameters``) and record each value the reference fills in as a defaulted
    finding, so the graph carries every number the kernel uses."""
    from .base import DEFAULTED, Finding

    def number(key: str, v) -> float | None:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            r.refuse("rope_parameters", f"yarn {key} must be a positive finite number, found {v!r}")
            return None
        return float(v)

    def filled(key: str, v, why: str) -> None:
        r.findings.append(Finding(category=DEFAULTED, key=f"rope_parameters.{key}", value=v, message=f"absent; {why}",
                                  blocks=False))

    if r.has("original_max_position_embeddings"):  # a top-level key takes priority in the reference
        orig = r.take("original_max_position_embeddings", "yarn's pretraining context (takes priority over rope_parameters')")
    elif "original_max_position_embeddings" in params:
        orig = params["original_max_position_embeddings"]
    else:
        orig = r.config.get("max_position_embeddings")
        filled("original_max_position_embeddings", orig, "the reference uses max_position_embeddings")
    orig = number("original_max_position_embeddings", orig)
    if orig is None:
        return None
    factor = params.get("factor")
    if factor is None:
        mpe = number("max_position_embeddings", r.config.get("max_position_embeddings"))
        if mpe is None:
            return None
        factor = mpe / orig
        filled("factor", factor, "the reference uses max_position_embeddings / original_max_position_embeddings")
    factor = number("factor", factor)
    if factor is None:
        return None
    # the reference reads ``x or default``: absent, null and 0 all mean the default
    betas = {}
    for key, dflt in (("beta_fast", 32.0), ("beta_slow", 1.0)):
        v = params.get(key)
        if not v:
            filled(key, dflt, f"the reference uses {dflt:g} when it is absent or zero")
            v = dflt
        betas[key] = number(key, v)
    truncate = params.get("truncate", ...)
    if truncate is ...:
        truncate = True
        filled("truncate", True, "the reference truncates the correction range unless told not to")
    if not isinstance(truncate, bool):
        r.refuse("rope_parameters", f"yarn truncate must be true or false, found {truncate!r}")
        return None
    af = params.get("attention_factor")
    if af is None:
        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        ms, msa = params.get("mscale"), params.get("mscale_all_dim")
        af = float(mscale(factor, ms) / mscale(factor, msa)) if ms and msa else mscale(factor)
        filled("attention_factor", af, "the reference derives it from factor (and mscale / mscale_all_dim when both are set)")
    af = number("attention_factor", af)
    if None in (af, *betas.values()):
        return None
    return {"type": "yarn", "factor": factor, "beta_fast": betas["beta_fast"], "beta_slow": betas["beta_slow"],
            "original_max_position_embeddings": orig, "truncate": truncate, "attention_factor": af}


def _build(model_type: str):
    t = TRAITS[model_type]

    def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
        H = r.take_int("hidden_size", "residual width")
        L = r.take_int("num_hidden_layers", "number of decoder layers")
        nh = r.take_int("num_attention_heads", "query heads")
        nkv = r.take_int("num_key_value_heads", "key/value heads (GQA)", default=nh, default_reason="the reference uses num_attention_heads (MHA)")
        inter = r.take_int("intermediate_size", "FFN width")
        vocab = r.take_int("vocab_size", "vocabulary size")
        eps = r.take_number("rms_norm_eps", "RMSNorm epsilon", minimum=0)
        act = r.take_str("hidden_act", "FFN activation", default="silu", default_reason="the reference default is silu")
        tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False, default_reason="the reference default is untied")
        ctx_ok, ctx = r.context_length()
        if None in (H, L, nh, nkv, inter, vocab, eps, act, tied) or not ctx_ok:
            return None
        if r.has("head_dim") and r.config["head_dim"] is not None:
            hd = r.take_int("head_dim", "per-head width")
            if hd is None:
                return None
        else:
            if r.has("head_dim"):
                r.take("head_dim", "null: per-head width is hidden_size / heads")
            hd = H // nh
            if hd * nh != H:
                r.refuse("hidden_size", f"hidden_size {H} is not divisible by {nh} heads and no head_dim is declared")
                return None
        ok = True  # keep grading after a refusal, so every key gets its own finding
        if nh % nkv:
            r.refuse("num_key_value_heads", f"{nh} query heads are not a multiple of {nkv} key/value heads")
            ok = False
        if act not in ACTIVATIONS:
            r.refuse("hidden_act", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
            ok = False
        position = rope_policy(r, hd)
        if position is None or not ok:
            return None

        bias = {"q": False, "k": False, "v": False, "o": False}
        if t.qkv_bias == "config":
            b = r.take_bool("attention_bias", "bias on q/k/v/o projections", default=False, default_reason="the reference default has no bias")
            if b is None:
                return None
            bias = {k: b for k in bias}
        elif t.qkv_bias == "fixed_qkv":
            bias = {"q": True, "k": True, "v": True, "o": False}
        mlp_bias = r.take_bool("mlp_bias", "bias on FFN projections", default=False,
                               default_reason="the reference has no FFN bias unless the config declares one")
        if mlp_bias is None:
            return None

        # sliding windows
        spans = ["full"] * L
        window = None
        if t.sliding == "global":
            sw = r.take_int("sliding_window", "attention window (keys including the query)", nullable=True, default=None, default_reason="no window declared: full attention")
            if sw is None and r.config.get("sliding_window") is not None:
                return None
            if sw is not None:
                window = int(sw)
                spans = ["sliding"] * L
        elif t.sliding == "layer_types":
            sw = r.take_int("sliding_window", "attention window for sliding layers", nullable=True, default=None, default_reason="no window declared")
            use = r.take_bool("use_sliding_window", "whether sliding layers exist", default=False, default_reason="the reference default is off") if (r.has("use_sliding_window") or not r.has("layer_types")) else None
            if (sw is None and r.config.get("sliding_window") is not None) or (use is None and r.has("use_sliding_window")):
                return None
            if r.has("layer_types"):
                lt = r.take("layer_types", "per-layer attention span")
                if r.has("max_window_layers"):
                    r.meta("max_window_layers", "folded into layer_types")
                if not isinstance(lt, list) or len(lt) != L:
                    r.refuse("layer_types", f"expected a list of {L} entries")
                    return None
                for i, kind in enumerate(lt):
                    if kind == "full_attention":
                        continue
                    if kind == "sliding_attention":
                        if sw is None:
                            r.refuse("layer_types", f"layer {i} is sliding_attention but sliding_window is not declared")
                            return None
                        spans[i] = "sliding"
                    else:
                        r.refuse("layer_types", f"layer {i} has type {kind!r} (supported: full_attention, sliding_attention)")
                        return None
                window = int(sw) if "sliding" in spans else None
            else:
                mwl = r.take_int("max_window_layers", "layers below this index use full attention", minimum=0, default=L, default_reason="absent: all layers full")
                if mwl is None:
                    return None
                if use and sw is not None:
                    for i in range(L):
                        if i >= mwl:
                            spans[i] = "sliding"
                    window = int(sw) if "sliding" in spans else None
        elif r.has("sliding_window"):
            if r.config["sliding_window"] is None:
                r.meta("sliding_window", "null: no window")
            else:
                r.refuse("sliding_window", f"{model_type} does not run sliding-window attention in the reference")

        emb_mult = res_mult = 1.0
        score_scale = float(hd) ** -0.5
        head_mult = 1.0
        if t.multipliers:
            emb_mult = r.take_number("embedding_multiplier", "embeddings are scaled by this", nonzero=True, default=1.0)
            res_mult = r.take_number("residual_multiplier", "each sublayer output is scaled before the residual add", nonzero=True, default=1.0)
            score_scale = r.take_number("attention_multiplier", "attention score scale (replaces head_dim^-0.5)", minimum=0, nonzero=True, default=1.0)
            logits_scaling = r.take_number("logits_scaling", "logits are divided by this", nonzero=True, default=1.0)
            if None in (emb_mult, res_mult, score_scale, logits_scaling):
                return None
            head_mult = 1.0 / logits_scaling

        graph_layers = []
        for i in range(L):
            graph_layers.append(
                {
                    "index": i,
                    "operator": "softmax",
                    "span": spans[i],
                    "window": window if spans[i] == "sliding" else None,
                    "position": position,
                    "ffn": "dense",
                    "operands": {},
                }
            )
        surface = {
            "hidden_size": H,
            "embedding": {"multiplier": emb_mult},
            "residual": {"multiplier": res_mult},
            "attention": {
                "heads": nh,
                "kv_heads": nkv,
                "head_dim": hd,
                "output_gate": False,
                "head_mapping": "repeat_interleave",
                "query_scale": 1.0,
                "score_scale": score_scale,
                "bias": bias,
                "qk_norm": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "scope": "head"} if t.qk_norm else None,
                "qkv_clip": None,
                "sinks": None,
            },
            "ffn": {"kind": "gated", "activation": ACTIVATIONS[act], "intermediate_size": inter, "bias": mlp_bias,
                    "fused_gate_up": False},
            "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_only"},
            "head": {"vocab": vocab, "tied": bool(tied), "multiplier": head_mult, "softcap": None},
            "operators": {},
            "context_length": ctx,
        }
        graph = assemble_graph(src.name, model_type, bool(tied), graph_layers, surface)
        placements, dropped = place_tensors(src, graph, r, tied, PREFIXES, lambda i: ("softmax", LAYER_ROLES))
        return Lowering(graph=graph, placements=placements, dropped=dropped)

    return build


# ---- export: the inverse of the lowering (vindex3.export) ----------------------------------------

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "granite": "GraniteForCausalLM"}
# the config spelling of each activation the lowering produces (the first key of ACTIVATIONS naming it)
ACTIVATION_NAMES = {v: k for k, v in reversed(list(ACTIVATIONS.items()))}


def _inverse(x: float) -> float:
    """A float y with 1.0 / y == x exactly (the lowering divides: head multiplier = 1 / logits_scaling)."""
    import numpy as np

    y = 1.0 / x
    for cand in (y, float(np.nextafter(y, np.inf)), float(np.nextafter(y, -np.inf))):
        if 1.0 / cand == x:
            return cand
    return y  # the re-lowering check refuses it by name


def _export_config(model_type: str):
    t = TRAITS[model_type]

    def config(graph: dict) -> dict:
        """config.json keys that lower back to ``graph`` under this family (token ids aside)."""
        s, layers = graph["surface"], graph["layers"]
        att, ffn, head = s["attention"], s["ffn"], s["head"]
        pos = layers[0]["position"] if layers else {}
        cfg: dict = {
            "model_type": model_type,
            "hidden_size": s["hidden_size"],
            "num_hidden_layers": len(layers),
            "num_attention_heads": att["heads"],
            "num_key_value_heads": att["kv_heads"],
            "head_dim": att["head_dim"],
            "intermediate_size": ffn["intermediate_size"],
            "vocab_size": head["vocab"],
            "rms_norm_eps": s["norms"]["eps"],
            "hidden_act": ACTIVATION_NAMES.get(ffn["activation"], ffn["activation"]),
            "tie_word_embeddings": bool(head["tied"]),
            "mlp_bias": bool(ffn["bias"]),
        }
        if s.get("context_length") is not None:
            cfg["max_position_embeddings"] = s["context_length"]
        if pos.get("kind") == "rope":
            scaling = dict(pos.get("scaling") or {})
            rope = {"rope_type": scaling.pop("type", "default"), "rope_theta": pos["theta"], **scaling}
            omp = rope.get("original_max_position_embeddings")
            if isinstance(omp, float) and omp.is_integer():  # a position count; the reference wants an integer
                rope["original_max_position_embeddings"] = int(omp)
            if pos["rotary_dims"] != att["head_dim"]:
                rope["partial_rotary_factor"] = pos["rotary_dims"] / att["head_dim"]
            cfg["rope_parameters"] = rope
        if t.qkv_bias == "config":
            cfg["attention_bias"] = bool(att["bias"]["q"])
        windows = {ly["window"] for ly in layers if ly.get("span") == "sliding"}
        window = windows.pop() if len(windows) == 1 else None
        if t.sliding == "global":
            cfg["sliding_window"] = window
        elif t.sliding == "layer_types":
            cfg["layer_types"] = ["sliding_attention" if ly.get("span") == "sliding" else "full_attention" for ly in layers]
            cfg["use_sliding_window"] = window is not None
            cfg["sliding_window"] = window
        if t.multipliers:
            cfg.update({"embedding_multiplier": s["embedding"]["multiplier"], "residual_multiplier": s["residual"]["multiplier"],
                        "attention_multiplier": att["score_scale"], "logits_scaling": _inverse(head["multiplier"])})
        return cfg

    return config


for _mt in TRAITS:
    register_family(_mt, _mt, _build(_mt))
    register_export(_mt, HfExport(config=_export_config(_mt), prefixes=PREFIXES, architecture=ARCHITECTURES[_mt]))
