"""GPT-2 (``gpt2``) and GPT-NeoX / Pythia (``gpt_neox``): LayerNorm with bias, a non-gated MLP
(the ``mlp_ffn`` operator), biases on every projection, fused q|k|v projections split at encode.

GPT-2: learned absolute positions (a ``position_embedding`` object), NoPE attention, Conv1D
weights stored [in, out] (transposed at encode), ``gelu_new`` (tanh GELU), tied head.
GPT-NeoX: rotary on the first ``partial_rotary_factor`` of each head, q|k|v interleaved per head
([heads, 3, head_dim] rows), the parallel residual ``h + attn(ln1(h)) + mlp(ln2(h))`` when
``use_parallel_residual``, an untied head (``embed_out``).

Every key is graded; transformers 5.24.0's reading of each is the one lowered (see
docs/operators.md, "GPT-2, GPT-NeoX, Gemma, Phi, OLMo 2, SmolLM3")."""

from __future__ import annotations

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family, row_blocks
from .decoder import ACTIVATIONS, rope_policy
from .placement import Drop, Part, Split, assemble_graph, place_tensors

MASK_BUFFER = "a causal-mask buffer older transformers saved with the weights; the mask is the operator's own"


def attention_surface(heads: int, kv_heads: int, head_dim: int, bias: dict, score_scale: float, **more) -> dict:
    """The softmax attention group with nothing optional switched on (callers override)."""
    return {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "output_gate": False,
            "head_mapping": "repeat_interleave", "query_scale": 1.0, "score_scale": score_scale, "bias": bias,
            "qk_norm": None, "qkv_clip": None, "sinks": None, **more}


def layer_entries(L: int, positions: list[dict], ffn: str, spans: list[str] | None = None,
                  window: int | None = None) -> list[dict]:
    spans = spans or ["full"] * L
    return [{"index": i, "operator": "softmax", "span": spans[i], "window": window if spans[i] == "sliding" else None,
             "position": positions[i], "ffn": ffn, "operands": {}} for i in range(L)]


def grade_common(r: ConfigReader) -> bool:
    """Keys every one of these configs may carry that do not change inference, or that must hold
    one value for a causal LM. False when one is refused."""
    ok = True
    for key in ("attn_pdrop", "classifier_dropout", "summary_first_dropout"):
        r.ignore(key, "dropout is a training-time setting")
    for key in ("summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels"):
        r.ignore(key, "the sequence-summary head of the double-heads model; a causal LM has none")
    r.meta("task_specific_params", "generation presets for named tasks; not model math")
    for key in ("is_decoder", "add_cross_attention", "is_encoder_decoder"):
        if r.has(key):
            if r.config[key] in (False, None) or key == "is_decoder":
                r.meta(key, "a model-class flag; the causal LM runs the decoder alone, without cross-attention")
            else:
                r.refuse(key, f"{key}: true declares cross-attention to an encoder, which a text model here does not run")
                ok = False
    return ok


def layer_norm_eps(r: ConfigReader, key: str) -> float | None:
    return r.take_number(key, "LayerNorm epsilon (every layer norm and the final norm)", minimum=0)


def finish_graph(graph: dict, *, positions: bool = False, head_bias: bool = False) -> dict:
    """The LayerNorm objects' biases, and the learned position embedding when there is one."""
    objs = graph["objects"]
    objs["final_norm"]["operands"] = {"weight": "weight", "bias": "bias"}
    if head_bias:
        objs["output_head"]["operands"] = {"weight": "weight", "bias": "bias"}
    if positions:
        new = {"embedding": objs["embedding"], "position_embedding": {"kind": "position_embedding", "operands": {"weight": "weight"}}}
        new.update({k: v for k, v in objs.items() if k != "embedding"})
        graph["objects"] = new
        graph["components"][0]["objects"] = list(new)
    return graph


# ---- GPT-2 -------------------------------------------------------------------------------------

GPT2_PREFIXES = tuple((pre + p, o) for pre in ("transformer.", "") for p, o in (
    ("wte.", "embedding"), ("wpe.", "position_embedding"), ("h.", "decoder_stack"), ("ln_f.", "final_norm"))) + (
    ("lm_head.", "output_head"),)


def _gpt2_table(H: int, inner: int) -> dict:
    T = ("swap_last2",)
    return {
        "ln_1.weight": "attn_norm", "ln_1.bias": "attn_norm_bias",
        "ln_2.weight": "ffn_norm", "ln_2.bias": "ffn_norm_bias",
        "attn.c_attn.weight": Split((H, 3 * H), tuple(
            (role, f"attn.{role}.weight", (*T, row_blocks(H, 3 * H, k * H))) for k, role in enumerate(("q_proj", "k_proj", "v_proj")))),
        "attn.c_attn.bias": Split((3 * H,), tuple(
            (f"{x}_bias", f"attn.{x}_proj.bias", (row_blocks(H, 3 * H, k * H),)) for k, x in enumerate("qkv"))),
        "attn.c_proj.weight": Part("o_proj", "attn.c_proj.weight", 0, 1, (H, H), T),
        "attn.c_proj.bias": "o_bias",
        "mlp.c_fc.weight": Part("ffn_up", "mlp.c_fc.weight", 0, 1, (H, inner), T),
        "mlp.c_fc.bias": "ffn_up_bias",
        "mlp.c_proj.weight": Part("ffn_down", "mlp.c_proj.weight", 0, 1, (inner, H), T),
        "mlp.c_proj.bias": "ffn_down_bias",
        "attn.bias": Drop(MASK_BUFFER),
        "attn.masked_bias": Drop(MASK_BUFFER),
    }


def build_gpt2(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take_int("n_embd", "residual width")
    L = r.take_int("n_layer", "number of decoder layers")
    nh = r.take_int("n_head", "attention heads (each with its own keys and values)")
    vocab = r.take_int("vocab_size", "vocabulary size")
    P = r.take_int("n_positions", "rows of the learned position embedding: the context length")
    eps = layer_norm_eps(r, "layer_norm_epsilon")
    act = r.take_str("activation_function", "MLP activation", default="gelu_new", default_reason="the reference default is gelu_new")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=True,
                       default_reason="the GPT-2 reference ties its head unless told not to")
    scale = r.take_bool("scale_attn_weights", "scores scaled by head_dim^-0.5", default=True,
                        default_reason="the reference scales scores unless told not to")
    inv = r.take_bool("scale_attn_by_inverse_layer_idx", "scores also divided by layer index + 1", default=False,
                      default_reason="the reference default is off")
    r.take_bool("reorder_and_upcast_attn", "the reference's mixed-precision attention order; the same math in float32",
                default=False, default_reason="the reference default is off")
    ok = grade_common(r)
    if r.has("n_inner") and r.config["n_inner"] is not None:
        inner = r.take_int("n_inner", "MLP width")
    else:
        r.take("n_inner", "MLP width", default=None, default_reason="null or absent: the reference uses 4 · n_embd")
        inner = 4 * H if H else None
    if r.has("max_position_embeddings"):
        r.refuse("max_position_embeddings", "GPT-2's context is n_positions; a second spelling is ambiguous")
        ok = False
    if r.has("n_ctx"):  # the released configs' older spelling of the context, read by no current reference
        if r.config["n_ctx"] == r.config.get("n_positions"):
            r.meta("n_ctx", "the legacy spelling of n_positions; equal to it")
        else:
            r.refuse("n_ctx", f"n_ctx {r.config['n_ctx']!r} disagrees with n_positions {r.config.get('n_positions')!r}")
            ok = False
    if None in (H, L, nh, vocab, P, eps, act, tied, scale, inv, inner) or not ok:
        return None
    if H % nh:
        r.refuse("n_head", f"n_embd {H} is not divisible by {nh} heads")
        return None
    if act not in ACTIVATIONS:
        r.refuse("activation_function", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    if inv:
        r.refuse("scale_attn_by_inverse_layer_idx", "a score scale per layer (1 / (layer + 1)) is not a fact this build's "
                                                    "attention carries")
        return None
    hd = H // nh
    bias = {"q": True, "k": True, "v": True, "o": True}
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0, "positions": "learned"},
        "residual": {"multiplier": 1.0},
        "attention": attention_surface(nh, nh, hd, bias, float(hd) ** -0.5 if scale else 1.0),
        "ffn": {"kind": "mlp", "activation": ACTIVATIONS[act], "intermediate_size": inner, "bias": True},
        "norms": {"kind": "layer", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_only", "bias": True},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
        "context_length": P,
    }
    layers = layer_entries(L, [{"kind": "none"}] * L, "mlp")
    graph = finish_graph(assemble_graph(src.name, "gpt2", bool(tied), layers, surface), positions=True)
    table = _gpt2_table(H, inner)
    placements, dropped = place_tensors(src, graph, r, tied, GPT2_PREFIXES, lambda i: ("softmax", table))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


# ---- GPT-NeoX ----------------------------------------------------------------------------------

NEOX_PREFIXES = (("gpt_neox.embed_in.", "embedding"), ("gpt_neox.layers.", "decoder_stack"),
                 ("gpt_neox.final_layer_norm.", "final_norm"), ("embed_out.", "output_head"))


def _neox_table(H: int, nh: int, hd: int, inter: int) -> dict:
    return {
        "input_layernorm.weight": "attn_norm", "input_layernorm.bias": "attn_norm_bias",
        "post_attention_layernorm.weight": "ffn_norm", "post_attention_layernorm.bias": "ffn_norm_bias",
        # rows of query_key_value are [heads, 3, head_dim]: q, k and v of head h sit together
        "attention.query_key_value.weight": Split((3 * H, H), tuple(
            (role, f"attention.{role}.weight", (row_blocks(hd, 3 * hd, k * hd),)) for k, role in enumerate(("q_proj", "k_proj", "v_proj")))),
        "attention.query_key_value.bias": Split((3 * H,), tuple(
            (f"{x}_bias", f"attention.{x}_proj.bias", (row_blocks(hd, 3 * hd, k * hd),)) for k, x in enumerate("qkv"))),
        "attention.dense.weight": "o_proj", "attention.dense.bias": "o_bias",
        "mlp.dense_h_to_4h.weight": "ffn_up", "mlp.dense_h_to_4h.bias": "ffn_up_bias",
        "mlp.dense_4h_to_h.weight": "ffn_down", "mlp.dense_4h_to_h.bias": "ffn_down_bias",
        "attention.bias": Drop(MASK_BUFFER),
        "attention.masked_bias": Drop(MASK_BUFFER),
        "attention.rotary_emb.inv_freq": Drop("a cached rotary frequency table; the graph's rope facts rebuild it"),
    }


def _neox_rope(r: ConfigReader, hd: int) -> dict | None:
    """transformers 5.24 reads rope_parameters first and fills the two legacy keys in only where it
    lacks them: rotary_emb_base -> rope_theta (else 10000), rotary_pct -> partial_rotary_factor
    (else 0.25)."""
    return legacy_rope(r, hd, (("rotary_emb_base", "rope_theta", 10000.0), ("rotary_pct", "partial_rotary_factor", 0.25)))


def legacy_rope(r: ConfigReader, hd: int, fills: tuple[tuple[str, str, float], ...],
                aliases: dict[str, str] | None = None) -> dict | None:
    """rope_parameters (or a legacy rope_scaling) as transformers 5.24 standardises it: each
    ``(legacy key, parameter, default)`` of ``fills`` fills the parameter in only where the
    parameters lack it (the legacy key, else the default); ``aliases`` renames rope types as the
    reference does (Phi-3's legacy "su" and "yarn" are its longrope)."""
    params = {}
    if r.has("rope_parameters") or r.has("rope_scaling"):
        key = "rope_parameters" if r.has("rope_parameters") else "rope_scaling"
        got = r.take(key, "rotary position encoding parameters")
        if got is not None and not isinstance(got, dict):
            r.refuse(key, "expected an object or null")
            return None
        params = dict(got or {})
        if key == "rope_parameters" and r.has("rope_scaling"):
            r.refuse("rope_scaling", "both rope_parameters and rope_scaling are given; the reference takes rope_scaling")
            return None
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    if aliases and params["rope_type"] in aliases:
        params["rope_type"] = aliases[params["rope_type"]]
    for legacy, name, dflt in fills:
        if name in params:
            if r.has(legacy):
                r.ignore(legacy, f"rope_parameters.{name} is stated: transformers 5.24 reads it, not this legacy key")
        elif r.has(legacy):
            params[name] = r.take(legacy, f"legacy spelling of rope_parameters.{name}")
        else:
            params[name] = r.take(legacy, f"rope_parameters.{name}", default=dflt,
                                  default_reason=f"absent in both spellings: transformers 5.24 uses {dflt}")
    return rope_policy(r, hd, allow_partial=True, params_in=params)


def build_gpt_neox(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of decoder layers")
    nh = r.take_int("num_attention_heads", "attention heads (each with its own keys and values)")
    inter = r.take_int("intermediate_size", "MLP width")
    vocab = r.take_int("vocab_size", "vocabulary size")
    eps = layer_norm_eps(r, "layer_norm_eps")
    act = r.take_str("hidden_act", "MLP activation", default="gelu", default_reason="the reference default is gelu (erf)")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=False,
                       default_reason="the reference default is untied")
    parallel = r.take_bool("use_parallel_residual", "h + attn(ln1(h)) + mlp(ln2(h)) instead of the sequential residual",
                           default=True, default_reason="the reference default is the parallel residual")
    abias = r.take_bool("attention_bias", "bias on query_key_value and dense", default=True,
                        default_reason="the reference default has attention biases")
    r.ignore("hidden_dropout", "dropout is a training-time setting")
    r.ignore("attention_dropout", "dropout is a training-time setting")
    ctx_ok, ctx = r.context_length()
    ok = grade_common(r)
    if None in (H, L, nh, inter, vocab, eps, act, tied, parallel, abias) or not ctx_ok or not ok:
        return None
    if H % nh:
        r.refuse("num_attention_heads", f"hidden_size {H} is not divisible by {nh} heads")
        return None
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    hd = H // nh
    position = _neox_rope(r, hd)
    if position is None:
        return None
    bias = {k: bool(abias) for k in ("q", "k", "v", "o")}
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "attention": attention_surface(nh, nh, hd, bias, float(hd) ** -0.5),
        "ffn": {"kind": "mlp", "activation": ACTIVATIONS[act], "intermediate_size": inter, "bias": True},
        "norms": {"kind": "layer", "eps": float(eps), "weight_offset": 0.0,
                  "placement": "parallel" if parallel else "pre_only", "bias": True},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
        "context_length": ctx,
    }
    graph = finish_graph(assemble_graph(src.name, "gpt_neox", bool(tied), layer_entries(L, [position] * L, "mlp"), surface))
    table = _neox_table(H, nh, hd, inter)
    placements, dropped = place_tensors(src, graph, r, tied, NEOX_PREFIXES, lambda i: ("softmax", table))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("gpt2", "gpt2", build_gpt2)
register_family("gpt_neox", "gpt_neox", build_gpt_neox)
