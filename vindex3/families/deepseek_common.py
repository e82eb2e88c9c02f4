"""What deepseek_v3 and kimi_linear share at the import boundary: the MLA attention facts and
their tensors, the dense FFN layers, the routed-expert (MoE) facts, FP8 weights and the tensors
set aside (MTP layers). Everything here reads a config through a `ConfigReader`, so every key
it touches is graded, and produces graph facts for the ``mla`` operator
(vindex3/operators/mla.py) or findings.

Routed-expert layers. Both families route the FFN of every layer past the dense ones
(``first_k_dense_replace``, or Kimi's ``mlp_layer_types``) through the ``moe_ffn`` operator's
``sigmoid_group_topk`` router: sigmoid scores, the score-correction bias for the selection only,
top-k among the best ``topk_group`` of ``n_group`` groups (each scored by its two best),
renormalised (ε 1e-20) when asked, times ``routed_scaling_factor``; plus a plain shared MLP of
``moe_intermediate_size`` × the number of shared experts. `read_router` grades the keys under
every spelling, `router_surface` turns them into the op's facts (refusing by key what the
reference cannot run), `routed_roles` classifies the expert tensors by exact name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..sources import CheckpointSource
from ..text import runs
from .base import ConfigReader, Finding

# the reference builds kv_a_layernorm / q_a_layernorm as RMSNorm(width): the class default eps
NORM_CLASS_DEFAULT_EPS = 1e-6
EPS_JUDGMENT = ("the reference builds {norm} as RMSNorm(width) at the norm class default eps 1e-6, not at the "
                "config's rms_norm_eps; no config states it (an architecture judgment of the {family} family)")

PREFIXES = (
    ("model.embed_tokens.", "embedding"),
    ("model.layers.", "decoder_stack"),
    ("model.norm.", "final_norm"),
    ("lm_head.", "output_head"),
)

NORM_ROLES = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm"}

# MLA operands below a layer (exact suffix -> role of the mla operator)
MLA_ROLES = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.q_a_proj.weight": "q_a_proj",
    "self_attn.q_a_proj.bias": "q_a_bias",
    "self_attn.q_a_layernorm.weight": "q_a_norm",
    "self_attn.q_b_proj.weight": "q_b_proj",
    "self_attn.kv_a_proj_with_mqa.weight": "kv_a_proj",
    "self_attn.kv_a_proj_with_mqa.bias": "kv_a_bias",
    "self_attn.kv_a_layernorm.weight": "kv_a_norm",
    "self_attn.kv_b_proj.weight": "kv_b_proj",
    "self_attn.o_proj.weight": "o_proj",
    "self_attn.o_proj.bias": "o_bias",
}


def dense_ffn_roles(*modules: str) -> dict[str, str]:
    """The dense gated FFN under each module spelling (``mlp``, Kimi's ``block_sparse_moe``)."""
    return {f"{m}.{p}_proj.weight": f"ffn_{p}" for m in modules for p in ("gate", "up", "down")}


def routed_roles(E: int, H: int, In: int, *, released: str, runtime: str, names: tuple[str, str, str]) -> dict:
    """A routed layer's FFN tensors (exact suffix -> role or `Part`), in the released layout
    (module ``released``: router ``gate.weight`` [E, H], ``gate.e_score_correction_bias`` [E], one
    tensor per expert ``experts.{e}.<gate|up|down>`` named by ``names``, stacked into [E, out, in]
    banks, ``shared_experts.{gate,up,down}_proj.weight``) and transformers' runtime save (module
    ``runtime``: the same router, bias and shared experts, the experts fused as
    ``experts.gate_up_proj`` [E, 2I, H] and ``experts.down_proj`` [E, H, I]). A checkpoint that
    holds both layouts of a bank or of a role is refused (one role, one tensor)."""
    from .moe import experts_fused, experts_per_tensor

    gate, up, down = names
    out: dict = {**experts_per_tensor(E, H, In, released, gate, up, down), **experts_fused(E, H, In, runtime)}
    for m in dict.fromkeys((released, runtime)):
        out[f"{m}.gate.weight"] = "moe_router"
        out[f"{m}.gate.e_score_correction_bias"] = "moe_correction_bias"
        out.update({f"{m}.shared_experts.{p}_proj.weight": f"shared_{p}" for p in ("gate", "up", "down")})
    return out


ACTIVATIONS = {"silu": "silu", "swish": "silu"}  # what the dense FFN (and KDA's convs) run


def positive_int(r: ConfigReader, key: str, value: Any) -> bool:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        r.refuse(key, f"expected a positive integer, found {value!r}")
        return False
    return True


def number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def aliased(r: ConfigReader, spellings: tuple[str, ...], message: str, *, grade: str = "take", default: Any = ...,
            default_reason: str = "") -> Any:
    """One fact that a config may spell several ways (the first spelling is the saved one; the
    others are transformers' attribute_map aliases). Every present spelling is graded; spellings
    that disagree are refused by name. ``grade`` is "take" (consumed) or "meta"."""
    present = [k for k in spellings if r.has(k)]
    if not present:
        if grade == "meta":
            return None if default is ... else default
        return r.take(spellings[0], message, default=default, default_reason=default_reason)
    for k in present:
        note = message if k == spellings[0] else f"{message} (alias of {spellings[0]})"
        (r.take if grade == "take" else r.meta)(k, note)
    values = [r.config[k] for k in present]
    for k, v in zip(present[1:], values[1:]):
        if v != values[0]:
            r.refuse(k, f"{k}={v!r} disagrees with {present[0]}={values[0]!r}; the two spellings name one fact")
            return None
    return values[0]


# ---- MLA ---------------------------------------------------------------------------------------


def mla_widths(r: ConfigReader, *, q_lora_default: int | None) -> dict | None:
    """Heads, ranks and head widths of an MLA layer (the keys both families spell alike);
    ``q_lora_default`` is the family's reference default for an absent q_lora_rank."""
    nh = r.take("num_attention_heads", "MLA query heads")
    nkv = r.take("num_key_value_heads", "must equal num_attention_heads: kv_b_proj expands the latent to every head",
                 default=nh, default_reason="the reference uses num_attention_heads")
    ql = r.take("q_lora_rank", "query rank (null: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj)",
                default=q_lora_default, default_reason=f"the reference default is {q_lora_default}")
    r_ = r.take("kv_lora_rank", "rank of the kv latent kept per position")
    dn = r.take("qk_nope_head_dim", "per-head query/key width without rope")
    dr = r.take("qk_rope_head_dim", "width of the rope key shared by every head")
    dv = r.take("v_head_dim", "per-head value width")
    bias = r.take("attention_bias", "biases on q_a_proj, kv_a_proj_with_mqa and o_proj", default=False,
                  default_reason="the reference default has none")
    ok = all(positive_int(r, k, v) for k, v in (("num_attention_heads", nh), ("kv_lora_rank", r_),
                                                  ("qk_nope_head_dim", dn), ("v_head_dim", dv)))
    if isinstance(dr, bool) or not isinstance(dr, int) or dr < 0:
        r.refuse("qk_rope_head_dim", f"expected an integer >= 0, found {dr!r}")
        ok = False
    if ql is not None and not positive_int(r, "q_lora_rank", ql):
        ok = False
    if not isinstance(bias, bool):
        r.refuse("attention_bias", f"expected true or false, found {bias!r}")
        ok = False
    if ok and nkv != nh:
        r.refuse("num_key_value_heads", f"{nkv!r} differs from num_attention_heads {nh}: the reference's MLA expands the "
                                        "latent to every query head and cannot run grouped keys")
        ok = False
    if ok and r.has("qk_head_dim"):
        if r.config["qk_head_dim"] == dn + dr:
            r.meta("qk_head_dim", "derived: qk_nope_head_dim + qk_rope_head_dim")
        else:
            r.refuse("qk_head_dim", f"{r.config['qk_head_dim']!r} is not qk_nope_head_dim + qk_rope_head_dim = {dn + dr}")
            ok = False
    r.ignore("head_dim", "transformers overwrites it with qk_rope_head_dim; it is not a head width of either operator")
    if not ok:
        return None
    return {"num_heads": nh, "q_lora_rank": ql, "kv_lora_rank": r_, "qk_nope_head_dim": dn, "qk_rope_head_dim": dr,
            "v_head_dim": dv, "attention_bias": bias}


def mla_surface(widths: dict, rope: dict | None, family: str) -> dict:
    """``surface.operators.mla``: the widths, the rope, the two judged eps and the scale."""
    from ..operators.mla import expected_softmax_scale

    ql = widths["q_lora_rank"]
    judgments = {"kv_a_norm_eps": EPS_JUDGMENT.format(norm="kv_a_layernorm", family=family)}
    if ql is not None:
        judgments["q_a_norm_eps"] = EPS_JUDGMENT.format(norm="q_a_layernorm", family=family)
    g = {
        **widths,
        "q_a_norm_eps": NORM_CLASS_DEFAULT_EPS if ql is not None else None,
        "kv_a_norm_eps": NORM_CLASS_DEFAULT_EPS,
        "rope": rope,
        "judgments": judgments,
    }
    y = rope["yarn"] if rope is not None else None
    g["softmax_scale"] = expected_softmax_scale(widths["qk_nope_head_dim"] + widths["qk_rope_head_dim"],
                                                y and y["factor"], y and y["mscale_all_dim"])
    return g


def mla_rope(r: ConfigReader, rotary_dims: int) -> dict | None | bool:
    """DeepSeek's decoupled rope on the qk_rope_head_dim channels: ``rope_parameters`` (or the
    older ``rope_theta`` + ``rope_scaling``), rope_type default or yarn, and ``rope_interleave``.
    Returns the graph's rope facts, or False after a refusal."""
    params: dict | None = None
    if r.has("rope_parameters"):
        params = r.take("rope_parameters", "rope of the shared key and the query's rope channels")
        if not isinstance(params, dict):
            r.refuse("rope_parameters", f"expected an object, found {params!r}")
            return False
        params = dict(params)
    legacy: dict = {}
    if r.has("rope_scaling"):
        sc = r.take("rope_scaling", "rope scaling (older spelling of rope_parameters)")
        if sc is not None and not isinstance(sc, dict):
            r.refuse("rope_scaling", f"expected an object or null, found {sc!r}")
            return False
        legacy.update(sc or {})
    if r.has("rope_theta"):
        legacy["rope_theta"] = r.take("rope_theta", "rope base (older top-level spelling)")
    if params is None:
        params = legacy
    else:
        for k, v in legacy.items():
            if k in params and params[k] != v:
                r.refuse("rope_parameters", f"rope_parameters.{k}={params[k]!r} disagrees with the older spelling ({v!r})")
                return False
        params = {**legacy, **params}
    # transformers writes both "type" and "rope_type"; they must agree
    if "type" in params and "rope_type" in params and params["type"] != params["rope_type"]:
        r.refuse("rope_parameters", f"type {params['type']!r} and rope_type {params['rope_type']!r} disagree")
        return False
    rtype = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta")
    if not number(theta) or theta <= 0:
        r.refuse("rope_parameters", f"no positive finite rope_theta declared (found {theta!r}); refusing to assume a base",
                 category="structure")
        return False
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        r.refuse("rope_parameters", f"partial_rotary_factor {partial!r}: the rope already covers only the "
                                    "qk_rope_head_dim channels; a further fraction has no executor")
        return False
    interleave = r.take("rope_interleave", "rope pairs (x0, x1), (x2, x3), ... rather than rotate-half", default=True,
                        default_reason="the reference default is true")
    if not isinstance(interleave, bool):
        r.refuse("rope_interleave", f"expected true or false, found {interleave!r}")
        return False
    if rotary_dims < 2 or rotary_dims % 2:
        r.refuse("qk_rope_head_dim", f"a rope needs an even qk_rope_head_dim of at least 2, found {rotary_dims}")
        return False
    base = {"rope_theta", "rope_type", "type", "partial_rotary_factor"}
    if rtype == "default":
        extra = sorted(set(params) - base)
        if extra:
            r.refuse("rope_parameters", f"unknown parameters {', '.join(extra)} for rope_type 'default'")
            return False
        return {"theta": float(theta), "interleave": interleave, "yarn": None}
    if rtype != "yarn":
        r.refuse("rope_parameters", f"rope_type {rtype!r} has no executor for MLA (supported: default, yarn)")
        return False
    known = base | {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                    "attention_factor", "truncate"}
    extra = sorted(set(params) - known)
    if extra:
        r.refuse("rope_parameters", f"unknown yarn parameters {', '.join(extra)}")
        return False
    omax, factor = params.get("original_max_position_embeddings"), params.get("factor")
    if omax is None or factor is None:
        # transformers' standardisation fills original_max_position_embeddings from
        # max_position_embeddings, and yarn derives an absent factor as their ratio
        mpe = r.take("max_position_embeddings", "yarn's original_max_position_embeddings and/or factor, which the "
                                                "rope omits")
        if omax is None:
            omax = mpe
        if factor is None:
            factor = mpe / omax if number(mpe) and number(omax) and omax else None
    y = {
        "factor": factor,
        "original_max_position_embeddings": omax,
        # the reference reads these with `or`: absent, null or 0 become 32 and 1
        "beta_fast": params.get("beta_fast") or 32,
        "beta_slow": params.get("beta_slow") or 1,
        "mscale": params.get("mscale"),
        "mscale_all_dim": params.get("mscale_all_dim"),
        "attention_factor": params.get("attention_factor"),
        "truncate": params.get("truncate", True),
    }
    bad = [k for k in ("factor", "beta_fast", "beta_slow") if not number(y[k])]
    bad += [k for k in ("mscale", "mscale_all_dim", "attention_factor") if y[k] is not None and not number(y[k])]
    if not isinstance(omax, int) or isinstance(omax, bool) or omax < 1:
        bad.append("original_max_position_embeddings")
    if not isinstance(y["truncate"], bool):
        bad.append("truncate")
    if bad or y["factor"] <= 0:
        r.refuse("rope_parameters", f"yarn parameters {', '.join(bad) or 'factor'} are not valid ({y!r})")
        return False
    y = {k: (float(v) if k not in ("original_max_position_embeddings", "truncate") and v is not None else v)
         for k, v in y.items()}
    return {"theta": float(theta), "interleave": interleave, "yarn": y}


# ---- dense and routed FFN layers ---------------------------------------------------------------


@dataclass(frozen=True)
class RouterFacts:
    """What the routed-expert FFN of both families needs, read and graded from the config: the
    routing rule of transformers' ``DeepseekV3TopkRouter`` / ``KimiLinearTopkRouter``
    (sigmoid scores; the correction bias chooses, the raw scores weigh; top-k among the best
    ``topk_group`` of ``n_group`` groups, each group scored by its two best; renormalised when
    ``renormalize``; times ``routed_scaling_factor``) and the expert widths."""

    experts: Any
    top_k: Any
    shared_experts: Any
    renormalize: Any
    n_group: Any
    topk_group: Any
    routed_scaling_factor: Any
    expert_width: Any


def read_router(r: ConfigReader, spellings: dict[str, tuple[str, ...]], routed: bool) -> RouterFacts:
    """Grade every router key under each of its spellings: consumed when some layer routes,
    metadata when every layer is dense."""
    msg = "" if routed else "; no layer of this model routes (every FFN is dense)"
    grade = "take" if routed else "meta"
    what = {
        "experts": "routed experts per layer", "top_k": "experts each token is routed to",
        "shared_experts": "shared experts (one MLP of expert_width times this)",
        "renormalize": "renormalise the top-k weights", "n_group": "routing groups",
        "topk_group": "groups kept before the top-k", "routed_scaling_factor": "multiplies the routed weights",
        "expert_width": "expert FFN width",
    }
    vals = {k: aliased(r, spellings[k], what[k] + msg, grade=grade) for k in what}
    return RouterFacts(**vals)


def router_surface(r: ConfigReader, facts: RouterFacts, spellings: dict[str, tuple[str, ...]], act: str) -> dict | None:
    """``surface.operators.moe_ffn`` from the graded router keys: the sigmoid_group_topk router
    with its correction bias, groups, renormalisation and scaling factor, experts of
    ``expert_width`` and a plain shared MLP of ``expert_width`` × ``shared_experts``, both with
    ``act``. A value the reference cannot run is refused by the key the config spells it with."""

    def key(name: str) -> str:
        return next((k for k in spellings[name] if r.has(k)), spellings[name][0])

    f = facts
    missing = [n for n in spellings if getattr(f, n) is None]
    for n in missing:  # absent or disagreeing spellings are refused already; a null is refused here
        if not any(x.blocks and x.key in spellings[n] for x in r.findings):
            r.refuse(key(n), f"is null; the routed layers need it ({n.replace('_', ' ')})")
    if missing:
        return None
    ok = all([positive_int(r, key(n), getattr(f, n)) for n in ("experts", "top_k", "shared_experts", "n_group",  # noqa: C419 (refuse each)
                                                                "topk_group", "expert_width")])
    if not isinstance(f.renormalize, bool):
        r.refuse(key("renormalize"), f"expected true or false, found {f.renormalize!r}")
        ok = False
    if not number(f.routed_scaling_factor):
        r.refuse(key("routed_scaling_factor"), f"expected a finite number, found {f.routed_scaling_factor!r}")
        ok = False
    if not ok:
        return None
    E, k, G, TG = f.experts, f.top_k, f.n_group, f.topk_group
    if E % G:
        r.refuse(key("n_group"), f"{E} experts do not split into {G} groups")
    elif E // G < 2:
        r.refuse(key("n_group"), f"{G} groups of {E // G} expert: the reference scores a group by its two best experts")
    elif TG > G:
        r.refuse(key("topk_group"), f"keeps {TG} of {G} groups")
    elif k > TG * (E // G):
        r.refuse(key("top_k"), f"routes each token to {k} experts, but the {TG} group(s) kept hold only {TG * (E // G)}")
    else:
        from .moe import moe_facts

        g = moe_facts(E=E, k=k, In=f.expert_width, router="sigmoid_group_topk", renormalize=f.renormalize, act=act,
                      shared="plain", shared_intermediate=f.expert_width * f.shared_experts, shared_act=act,
                      shared_gate_up="separate")
        g.update(correction_bias=True, n_group=G, topk_group=TG, routed_scaling_factor=float(f.routed_scaling_factor))
        return g
    return None



def dense_ffn_surface(r: ConfigReader, dense: bool = True) -> tuple[bool, dict | None, str | None]:
    """The FFN activation (``hidden_act``: the dense layers', the experts' and KDA's convs') and,
    when some layer is ``dense``, the dense FFN surface. Returns (ok, surface or None, act)."""
    act = r.take("hidden_act", "activation of the FFN gates (dense layers, experts, shared experts) and of KDA's "
                               "convs", default="silu", default_reason="the reference default is silu")
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", f"activation {act!r} has no executor here (supported: {', '.join(ACTIVATIONS)})")
        return False, None, None
    if not dense:
        r.meta("intermediate_size", "width of the dense FFN layers; no layer of this model is dense")
        return True, None, ACTIVATIONS[act]
    width = r.take("intermediate_size", "width of the dense FFN layers")
    if width is None or not positive_int(r, "intermediate_size", width):
        return False, None, ACTIVATIONS[act]
    return True, {"kind": "gated", "activation": ACTIVATIONS[act], "intermediate_size": width, "bias": False,
                  "fused_gate_up": False}, ACTIVATIONS[act]


# ---- encodings this build cannot execute, tensors set aside ----------------------------------


FP8_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0")


def refuse_fp8(r: ConfigReader, src: CheckpointSource) -> bool:
    """FP8 weights (``quantization_config`` with quant_method fp8, e4m3 tensors, a
    ``weight_scale_inv`` block scale beside each linear) are refused by name: an encoding this
    build cannot execute. Returns True when there are none."""
    ok = True
    if r.has("quantization_config"):
        q = r.config["quantization_config"]
        method = q.get("quant_method") if isinstance(q, dict) else q
        r.refuse("quantization_config", f"quantized weights ({method!r}; FP8 block-scaled weights with weight_scale_inv in "
                                        "DeepSeek-V3's release) are an encoding this build cannot execute")
        ok = False
    specs = src.tensor_specs()
    scales = sorted(n for n in specs if n.endswith(".weight_scale_inv"))
    fp8 = sorted(n for n, s in specs.items() if str(s.dtype).upper() in FP8_DTYPES)
    if scales:
        r.refuse(scales[0], f"an FP8 block scale (and {len(scales) - 1} more *.weight_scale_inv tensors): FP8 "
                            "block-quantized weights are an encoding this build cannot execute", category="structure")
        ok = False
    if fp8:
        r.refuse(fp8[0], f"dtype {specs[fp8[0]].dtype} (and {len(fp8) - 1} more FP8 tensors): an encoding this build "
                         "cannot execute", category="structure")
        ok = False
    return ok


FP8_CODEC = "fp8_e4m3_b128"
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}


def read_fp8(r: ConfigReader, src: CheckpointSource) -> bool | None:
    """DeepSeek-V3's released FP8 weights: ``quantization_config`` {quant_method fp8, fmt e4m3,
    weight_block_size [128, 128], activation_scheme dynamic}, e4m3 ``weight`` tensors, each with a
    float32 ``weight_scale_inv`` per 128 x 128 block. Returns True when the checkpoint is such an
    FP8 checkpoint (its linears are then packed into the ``fp8_e4m3_b128`` encoding by
    `fp8_table`), False when it is not quantized, None when it is refused (by name)."""
    specs = src.tensor_specs()
    fp8 = sorted(n for n, s in specs.items() if str(s.dtype).upper() in FP8_DTYPES)
    if not r.has("quantization_config"):
        if fp8:
            r.refuse(fp8[0], f"dtype {specs[fp8[0]].dtype} (and {len(fp8) - 1} more FP8 tensors) without a "
                             "quantization_config saying how they are scaled", category="structure")
            return None
        return False
    q = r.config["quantization_config"]
    want = ", ".join(f"{k} {v!r}" for k, v in FP8_CONFIG.items())
    if not isinstance(q, dict) or any(q.get(k) != v for k, v in FP8_CONFIG.items()):
        method = q.get("quant_method") if isinstance(q, dict) else q
        r.refuse("quantization_config", f"quantized weights ({method!r}): this build reads FP8 block-scaled weights "
                                        f"({want}) and no other quantization")
        return None
    extra = sorted(set(q) - set(FP8_CONFIG) - {"activation_scheme"})
    if extra or q.get("activation_scheme", "dynamic") != "dynamic":
        r.refuse("quantization_config", f"FP8 settings this build does not judge: "
                                        f"{', '.join(extra) or 'activation_scheme ' + repr(q.get('activation_scheme'))}")
        return None
    if not fp8:
        r.refuse("quantization_config", "declares FP8 weights, but no tensor is stored in e4m3 (the reference would "
                                        "quantize the weights itself on loading, which this build does not do)")
        return None
    wrong = sorted(n for n in fp8 if str(specs[n].dtype).upper() != "F8_E4M3")
    if wrong:
        r.refuse(wrong[0], f"dtype {specs[wrong[0]].dtype}: the quantization_config declares e4m3", category="structure")
        return None
    r.meta("quantization_config", "FP8 e4m3 weights with a float32 scale per 128 x 128 block: packed into the "
                                  "fp8_e4m3_b128 encoding and multiplied as stored (weight * scale_inv); activations "
                                  "stay float32 (the reference's dynamic activation quantization belongs to its FP8 "
                                  "kernels, not to the model: transformers' dequantized reading)")
    return True


def fp8_table(table: dict, src: CheckpointSource, prefix: str = "model.layers.") -> dict:
    """``table`` with every layer linear the checkpoint stores in e4m3 (``<suffix>`` beside
    ``<suffix>_scale_inv``) turned into the two parts of one fp8_e4m3_b128 tensor: a plain role
    becomes a two-part tensor, a part of an expert bank becomes two parts (weight, then scale) of
    the same bank."""
    from dataclasses import replace

    from .placement import Part

    specs = src.tensor_specs()
    quantized = set()
    for name, s in specs.items():
        if str(s.dtype).upper() == "F8_E4M3" and name.startswith(prefix):
            quantized.add(name[len(prefix):].partition(".")[2])
    out = dict(table)
    for suffix, v in table.items():
        if suffix not in quantized:
            continue
        if isinstance(v, str):
            out[suffix] = Part(v, suffix, 0, 2, None, (), FP8_CODEC)
            out[suffix + "_scale_inv"] = Part(v, suffix, 1, 2, None, (), FP8_CODEC)
        elif isinstance(v, Part):
            out[suffix] = replace(v, index=2 * v.index, count=2 * v.count, codec=FP8_CODEC)
            out[suffix + "_scale_inv"] = replace(v, index=2 * v.index + 1, count=2 * v.count, shape=None, codec=FP8_CODEC)
    return out


class WithoutTensors:
    """A view of a checkpoint source without the tensors set aside (placement never sees them)."""

    def __init__(self, src: CheckpointSource, aside: set[str]):
        self._src, self._aside = src, aside
        self.name = src.name

    def tensor_specs(self):
        return {k: v for k, v in self._src.tensor_specs().items() if k not in self._aside}


def set_aside_layers(r: ConfigReader, src: CheckpointSource, num_layers: int, extra: int, what: str, key: str,
                     skip: set[int] = frozenset(), missing: dict[int, list[str] | str] | None = None,
                     ) -> tuple[set[str], list[tuple[str, str]]]:
    """Tensors of ``model.layers.{n}`` for n in [num_layers, num_layers + extra): layers that the
    decoder does not run (DeepSeek's multi-token-prediction modules). Each is set aside by name:
    not encoded, listed with the reason (encode records it in provenance as a dropped tensor)
    and counted in one finding. Modules in ``skip`` (0-based, complete: admitted as a drafter)
    are left for placement; ``missing`` names what an incomplete module lacks. Layers past them
    stay for placement to refuse."""
    aside, dropped = set(), []
    missing = missing or {}
    for name in sorted(src.tensor_specs()):
        if not name.startswith("model.layers."):
            continue
        idx = name[len("model.layers."):].partition(".")[0]
        if idx.isdigit() and num_layers <= int(idx) < num_layers + extra and int(idx) - num_layers not in skip:
            aside.add(name)
            j = int(idx) - num_layers
            m = missing.get(j)
            lacks = f"{m}: " if isinstance(m, str) else f"incomplete, it lacks {', '.join(m)}: " if m else ""
            why = (f"{what} layer {j} of {extra} (model.layers.{idx}, after the {num_layers} "
                   f"decoder layers): {lacks}set aside, never executed")
            dropped.append((name, why))
    if aside:
        layers = sorted({int(n[len('model.layers.'):].partition('.')[0]) for n in aside})
        r.findings.append(Finding(category="metadata", key=key, value=extra,
                                  message=f"{len(aside)} tensors of {what} layer(s) {runs(layers)} set aside by name: "
                                          "not encoded, never executed, recorded in provenance", blocks=False))
    return aside, dropped


# ---- multi-token-prediction (MTP) modules admitted as a drafter component --------------------

MTP_OBJECT = "mtp"
MTP_COMPONENT = "mtp"
# the MTP module's own tensors (exact suffix below model.layers.{L + j}) -> role; the decoder
# block's tensors keep the roles of a decoder layer of the same kind
MTP_ROLES = {
    "enorm.weight": "mtp_enorm",
    "hnorm.weight": "mtp_hnorm",
    "eh_proj.weight": "mtp_eh_proj",
    "shared_head.norm.weight": "mtp_head_norm",
    "shared_head.head.weight": "mtp_head",
    "embed_tokens.weight": "mtp_embedding",
}
MTP_REQUIRED = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
# what a module needs beyond MTP_REQUIRED for its decoder block to be one (the closure then
# checks every operand of the block by its operator's roles)
MTP_BLOCK_MARKERS = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.kv_b_proj.weight",
                     "self_attn.o_proj.weight")


def mtp_modules(src: CheckpointSource, num_layers: int, extra: int) -> dict[int, set[str]]:
    """Module j (0-based) -> the suffixes stored under ``model.layers.{num_layers + j}.``."""
    out: dict[int, set[str]] = {}
    for name in src.tensor_specs():
        if not name.startswith("model.layers."):
            continue
        idx, _, suffix = name[len("model.layers."):].partition(".")
        if idx.isdigit() and num_layers <= int(idx) < num_layers + extra:
            out.setdefault(int(idx) - num_layers, set()).add(suffix)
    return out


def mtp_complete(suffixes: set[str], ffn_kind: str) -> list[str]:
    """The suffixes a stored MTP module lacks to run as a drafter ([] when it has them all, as far
    as names tell; the closure judges every block operand by its operator at encode)."""
    need = list(MTP_REQUIRED) + list(MTP_BLOCK_MARKERS)
    need.append("mlp.gate.weight" if ffn_kind == "routed" else "mlp.down_proj.weight")
    return [s for s in need if s not in suffixes]


def split_mtp(placements: list, graph: dict, num_layers: int, modules: list[int], drafter: dict) -> list:
    """Move the placed tensors of layers ``num_layers + j`` (the MTP modules, placed as if they
    were decoder layers) into the ``mtp`` object as ``j.<suffix>``, take their layer entries off
    the decoder's list and record them, with the module's own operands, in the graph's drafter
    component. Returns the placements."""
    from dataclasses import replace

    out = []
    for p in placements:
        if p.object == "decoder_stack" and p.layer is not None and p.layer >= num_layers:
            j = p.layer - num_layers
            out.append(replace(p, object=MTP_OBJECT, name=f"{j}.{p.name.partition('.')[2]}", layer=None))
        else:
            out.append(p)
    entries = graph["layers"][num_layers:]
    del graph["layers"][num_layers:]
    mods = []
    for j, e in zip(modules, entries, strict=True):
        ops = {role: f"{j}.{name.partition('.')[2]}" for role, name in e["operands"].items()}
        own = {role[len("mtp_"):]: ops.pop(role) for role in list(ops) if role.startswith("mtp_")}
        block = {**e, "index": 0, "operands": ops}
        mods.append({"module": j, "operands": own, "block": block})
    drafter["modules"] = mods
    graph["objects"][MTP_OBJECT] = {"kind": "decoder_stack", "layers": len(mods), "drafter": drafter}
    graph["components"].append({"name": MTP_COMPONENT, "role": "drafter", "objects": [MTP_OBJECT]})
    return out
