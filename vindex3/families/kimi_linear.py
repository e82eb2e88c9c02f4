"""Kimi-Linear (transformers' ``kimi_linear``, ``KimiLinearForCausalLM``): KDA layers and MLA
layers (no rope at all), each followed by a dense FFN or, past the dense layers, routed experts.

Layout on disk (the hub's, which transformers' ``save_pretrained`` writes back):
``model.embed_tokens``, ``model.layers.N.input_layernorm`` (before the mixer),
``model.layers.N.self_attn.*`` (KDA: q/k/v_proj, q/k/v_conv1d, f_a/f_b_proj, A_log, dt_bias,
b_proj, g_a/g_b_proj, o_norm, o_proj; MLA: as vindex3.families.deepseek_common.MLA_ROLES),
``model.layers.N.post_attention_layernorm`` (before the FFN), the dense FFN under
``block_sparse_moe.{gate,up,down}_proj`` (or ``mlp.``: transformers renames one into the other
on load), ``model.norm``, ``lm_head``. Each layer is ``h = x + mixer(norm1(x)); h + ffn(norm2(h))``.

Which layers are KDA: ``layer_types`` (``linear_attention`` -> kda, ``full_attention`` -> mla),
else ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-indexed, as the hub writes
them); when both are present they must agree. Absent both, transformers would make every
fourth layer full: a default no checkpoint states, refused. Which FFNs are dense:
``mlp_layer_types`` (dense | sparse), else ``first_k_dense_replace`` (absent: transformers uses
1). A routed (sparse) layer runs the ``moe_ffn`` operator (router ``sigmoid_group_topk``; facts in
vindex3.families.deepseek_common): ``block_sparse_moe.gate.weight``,
``block_sparse_moe.gate.e_score_correction_bias``, ``block_sparse_moe.experts.{e}.w1`` (gate) /
``w3`` (up) / ``w2`` (down), ``block_sparse_moe.shared_experts.{gate,up,down}_proj.weight``; or
transformers' runtime save under ``mlp.`` with the experts fused (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``).

Every config key is graded, under every spelling transformers reads (its attribute_map:
``num_experts``/``num_local_experts``, ``num_experts_per_token``/``num_experts_per_tok``,
``num_shared_experts``/``n_shared_experts``, ``moe_renormalize``/``norm_topk_prob``,
``num_expert_group``/``n_group``, ``model_max_length``/``max_position_embeddings``), plus the
hub's own keys that transformers carries without reading (each must say what the reference
does anyway, or is refused).
"""

from __future__ import annotations

from ..sources import CheckpointSource
from . import deepseek_common as ds
from .base import ConfigReader, Lowering, register_family
from .placement import assemble_graph, place_tensors

KDA_ROLES = {
    "self_attn.q_proj.weight": "q_proj",
    "self_attn.k_proj.weight": "k_proj",
    "self_attn.v_proj.weight": "v_proj",
    "self_attn.q_conv1d.weight": "q_conv",
    "self_attn.k_conv1d.weight": "k_conv",
    "self_attn.v_conv1d.weight": "v_conv",
    "self_attn.f_a_proj.weight": "f_a_proj",
    "self_attn.f_b_proj.weight": "f_b_proj",
    "self_attn.A_log": "A_log",
    "self_attn.dt_bias": "dt_bias",
    "self_attn.b_proj.weight": "b_proj",
    "self_attn.g_a_proj.weight": "g_a_proj",
    "self_attn.g_b_proj.weight": "g_b_proj",
    "self_attn.o_norm.weight": "o_norm",
    "self_attn.o_proj.weight": "o_proj",
}
FFN_ROLES = ds.dense_ffn_roles("block_sparse_moe", "mlp")
TABLES = {  # per mixer, without the FFN (dense: FFN_ROLES; routed: deepseek_common.routed_roles)
    "kda": {**ds.NORM_ROLES, **KDA_ROLES},
    "mla": {**ds.NORM_ROLES, **ds.MLA_ROLES},
}

LAYER_TYPES = {"linear_attention": "kda", "full_attention": "mla"}
ROUTER_SPELLINGS = {
    "experts": ("num_experts", "num_local_experts"),
    "top_k": ("num_experts_per_token", "num_experts_per_tok"),
    "shared_experts": ("num_shared_experts", "n_shared_experts"),
    "renormalize": ("moe_renormalize", "norm_topk_prob"),
    "n_group": ("num_expert_group", "n_group"),
    "topk_group": ("topk_group",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "expert_width": ("moe_intermediate_size",),
}
KDA_CHUNK = 64  # the reference's chunk_kimi_delta_attention(chunk_size=64)
KDA_L2NORM_EPS = 1e-6  # the reference's l2norm(x, eps=1e-6) inside its KDA kernels
# hub keys transformers keeps without reading them: the value the reference behaves as
HUB_FIXED = {
    "moe_router_activation_func": ("sigmoid", "the reference's router always scores with a sigmoid"),
    "use_grouped_topk": (True, "the reference's router always routes group-limited"),
    "moe_layer_freq": (1, "the reference routes every layer past the dense ones"),
    "topk_method": ("noaux_tc", "the reference selects with the correction bias (noaux_tc)"),
    "mla_use_nope": (True, "the reference's MLA runs no rope"),
    "mla_use_output_gate": (False, "the reference's MLA has no output gate"),
    "num_nextn_predict_layers": (0, "the reference builds no multi-token-prediction layers for this family"),
}


def _same(a, b) -> bool:
    """Equal, with true never equal to 1 (JSON keeps them apart)."""
    return a is b if isinstance(a, bool) or isinstance(b, bool) else a == b


def _layer_list(r: ConfigReader, lac: dict, key: str, L: int) -> list[int] | None:
    v = lac[key]
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        r.refuse("linear_attn_config", f"{key} must be a list of 1-indexed layer numbers, found {v!r}")
        return None
    bad = [x for x in v if not 1 <= x <= L]
    if bad:
        r.refuse("linear_attn_config", f"{key} names layer {bad[0]}, outside 1..{L} (the hub numbers layers from 1)")
        return None
    return v


def _mixers(r: ConfigReader, L: int) -> tuple[list[str] | None, dict]:
    """Per-layer mixer from layer_types and/or linear_attn_config; also returns the KDA widths
    linear_attn_config states (head_dim, num_heads, short_conv_kernel_size)."""
    lac: dict = {}
    if r.has("linear_attn_config"):
        lac = r.take("linear_attn_config", "KDA geometry and the 1-indexed KDA / full-attention layer lists")
        if not isinstance(lac, dict):
            r.refuse("linear_attn_config", f"expected an object, found {lac!r}")
            return None, {}
        extra = sorted(set(lac) - {"head_dim", "num_heads", "short_conv_kernel_size", "kda_layers", "full_attn_layers"})
        if extra:
            r.refuse("linear_attn_config", f"unknown keys {', '.join(extra)} (known: head_dim, num_heads, "
                                           "short_conv_kernel_size, kda_layers, full_attn_layers)")
            return None, {}
    from_lists = None
    if "kda_layers" in lac or "full_attn_layers" in lac:
        if not ("kda_layers" in lac and "full_attn_layers" in lac):
            r.refuse("linear_attn_config", "kda_layers and full_attn_layers come together (the reference reads them only "
                                           "as a pair)")
            return None, lac
        kda, full = _layer_list(r, lac, "kda_layers", L), _layer_list(r, lac, "full_attn_layers", L)
        if kda is None or full is None:
            return None, lac
        both = sorted(set(kda) & set(full))
        missing = sorted(set(range(1, L + 1)) - set(kda) - set(full))
        if both or missing or len(kda) + len(full) != L:
            what = f"layer {both[0]} is in both lists" if both else (
                f"layer {missing[0]} is in neither list" if missing else "a layer is listed twice")
            r.refuse("linear_attn_config", f"kda_layers and full_attn_layers must split layers 1..{L} between them: {what}")
            return None, lac
        from_lists = ["kda" if i + 1 in kda else "mla" for i in range(L)]
    from_types = None
    if r.has("layer_types"):
        lt = r.take("layer_types", "per-layer mixer: linear_attention (KDA) or full_attention (MLA)")
        if not isinstance(lt, list) or len(lt) != L:
            r.refuse("layer_types", f"expected a list of {L} layer types, found {lt!r}")
            return None, lac
        bad = [(i, t) for i, t in enumerate(lt) if t not in LAYER_TYPES]
        if bad:
            r.refuse("layer_types", f"layer {bad[0][0]} has type {bad[0][1]!r} (supported: {', '.join(LAYER_TYPES)})")
            return None, lac
        from_types = [LAYER_TYPES[t] for t in lt]
    if from_types is not None and from_lists is not None and from_types != from_lists:
        i = next(i for i in range(L) if from_types[i] != from_lists[i])
        r.refuse("layer_types", f"layer {i} is {from_types[i]} by layer_types but {from_lists[i]} by "
                                f"linear_attn_config (layer number {i + 1} there); refusing to pick one")
        return None, lac
    mixers = from_types or from_lists
    if mixers is None:
        r.refuse("layer_types", "no per-layer mixer declared (neither layer_types nor linear_attn_config's kda_layers / "
                                "full_attn_layers); the reference would make every fourth layer full attention by default, "
                                "which no checkpoint states", category="structure")
    return mixers, lac


def _kda_width(r: ConfigReader, lac: dict, sub: str, flat: str, default: int, what: str):
    """A KDA width stated in linear_attn_config and/or as its flat saved copy (transformers reads
    linear_attn_config first); both present must agree."""
    if sub in lac:
        v = lac[sub]
        if r.has(flat):
            r.meta(flat, f"saved copy of linear_attn_config.{sub}")
            if r.config[flat] != v:
                r.refuse(flat, f"{r.config[flat]!r} disagrees with linear_attn_config.{sub} = {v!r}")
                return None
        return v
    return r.take(flat, what, default=default, default_reason=f"the reference default is {default}")


def _gate_rank(r: ConfigReader, src: CheckpointSource, layers: list[int], suffix: str, what: str) -> int | None:
    """A KDA gate's inner rank, read from the tensors' shapes ([rank, hidden]) of every KDA layer;
    all must agree (one operator group carries one rank)."""
    specs = src.tensor_specs()
    ranks = {}
    for i in layers:
        s = specs.get(f"model.layers.{i}.self_attn.{suffix}")
        if s is None or len(s.shape) != 2:
            r.refuse(f"model.layers.{i}.self_attn.{suffix}", f"the {what}'s inner rank is read from this tensor "
                                                             f"([rank, hidden]); found {None if s is None else list(s.shape)}",
                     category="structure")
            return None
        ranks[i] = s.shape[0]
    if len(set(ranks.values())) > 1:
        r.refuse(f"model.layers.{layers[0]}.self_attn.{suffix}", f"the {what}'s rank differs between KDA layers "
                                                                 f"({ranks}); one rank per model is supported",
                 category="structure")
        return None
    return ranks[layers[0]]


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take("hidden_size", "residual width")
    L = r.take("num_hidden_layers", "number of decoder layers")
    vocab = r.take("vocab_size", "vocabulary size")
    eps = r.take("rms_norm_eps", "epsilon of the decoder norms and of KDA's output norm (not of MLA's kv_a/q_a norms)")
    tied = r.take("tie_word_embeddings", "output head shares the embedding", default=False,
                  default_reason="the reference default is untied")
    widths_ok = [ds.positive_int(r, k, v) for k, v in (("hidden_size", H), ("num_hidden_layers", L), ("vocab_size", vocab))]
    ok = all(widths_ok)
    if not ds.number(eps) or eps < 0:
        r.refuse("rms_norm_eps", f"expected a number >= 0, found {eps!r}")
        ok = False
    L = L if widths_ok[1] else 0

    mixers, lac = _mixers(r, L) if L else (None, {})
    ok = ok and mixers is not None
    kda_layers = [i for i, m in enumerate(mixers or []) if m == "kda"]
    act = r.config.get("hidden_act", "silu")

    # -- MLA (no rope in this family) ----------------------------------------------------------
    widths = ds.mla_widths(r, q_lora_default=None)
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        r.ignore(key, "Kimi-Linear's MLA runs no rope: these parameters are unused")
    ds.aliased(r, ("model_max_length", "max_position_embeddings"), "context length (description only: no rope)",
               grade="meta")
    ok = ok and widths is not None

    # -- KDA -----------------------------------------------------------------------------------------
    D = _kda_width(r, lac, "head_dim", "linear_head_dim", 128, "KDA head width (keys and values)")
    nh = _kda_width(r, lac, "num_heads", "linear_num_heads", 32, "KDA heads")
    K = _kda_width(r, lac, "short_conv_kernel_size", "linear_conv_kernel_dim", 4, "KDA causal conv width")
    kda = None
    if kda_layers and ok:
        good = all(ds.positive_int(r, k, v) for k, v in (("linear_head_dim", D), ("linear_num_heads", nh),
                                                           ("linear_conv_kernel_dim", K)))
        if act not in ds.ACTIVATIONS:
            good = False  # refused by dense_ffn_surface already: one activation drives both
        fr = _gate_rank(r, src, kda_layers, "f_a_proj.weight", "forget gate") if good else None
        gr = _gate_rank(r, src, kda_layers, "g_a_proj.weight", "output gate") if good else None
        if fr is None or gr is None:
            ok = False
        else:
            kda = {
                "num_heads": nh, "head_dim": D, "conv_kernel": K, "forget_rank": fr, "gate_rank": gr,
                "chunk_size": KDA_CHUNK, "norm_eps": float(eps), "l2norm_eps": KDA_L2NORM_EPS,
                "conv_activation": ds.ACTIVATIONS[act],
                "judgments": {
                    "l2norm_eps": "the reference's KDA kernels L2-normalise q and k with a fixed eps 1e-6 that no config "
                                  "states (an architecture judgment of the kimi_linear family)",
                    "chunk_size": "the reference's prefill tiling (chunk_kimi_delta_attention's 64); it changes rounding "
                                  "only",
                },
            }

    # -- FFN: dense, or routed ------------------------------------------------------------------
    kinds = None
    if r.has("mlp_layer_types"):
        mlt = r.take("mlp_layer_types", "per-layer FFN: dense, or sparse (routed experts)")
        if not isinstance(mlt, list) or len(mlt) != L or any(t not in ("dense", "sparse") for t in mlt):
            r.refuse("mlp_layer_types", f"expected a list of {L} of 'dense' / 'sparse', found {mlt!r}")
            ok = False
        else:
            kinds = ["dense" if t == "dense" else "routed" for t in mlt]
        if r.has("first_k_dense_replace"):
            k = r.config["first_k_dense_replace"]
            r.meta("first_k_dense_replace", "folded into mlp_layer_types (which the reference reads first)")
            if kinds is not None and kinds != ["dense" if i < k else "routed" for i in range(L)]:
                r.refuse("first_k_dense_replace", f"{k!r} disagrees with mlp_layer_types; refusing to pick one")
                ok = False
    else:
        k = r.take("first_k_dense_replace", "the first k layers have a dense FFN, the rest routed experts", default=1,
                   default_reason="transformers reads it as 1 when absent")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            r.refuse("first_k_dense_replace", f"expected an integer >= 0, found {k!r}")
            ok = False
        else:
            kinds = ["dense" if i < k else "routed" for i in range(L)]
    ffn_ok, ffn, ffn_act = ds.dense_ffn_surface(r, dense=kinds is None or "dense" in kinds)
    ok = ok and ffn_ok
    routed = bool(kinds) and "routed" in kinds
    facts = ds.read_router(r, ROUTER_SPELLINGS, routed)
    moe = ds.router_surface(r, facts, ROUTER_SPELLINGS, ffn_act) if routed and ffn_ok else None
    ok = ok and (moe is not None or not routed)

    # -- hub keys transformers carries unread ------------------------------------------------------
    for key, (want, why) in HUB_FIXED.items():
        if r.has(key):
            if _same(r.config[key], want):
                r.meta(key, f"{why} (hub key, unread by transformers)")
            else:
                r.refuse(key, f"{r.config[key]!r}: {why}; a checkpoint that asks otherwise would not run as declared")
                ok = False
    r.ignore("auto_map", "remote-code class names; this build never runs remote code (the family comes from model_type)")
    ok = ds.refuse_fp8(r, src) and ok
    if not ok:
        return None

    layers = [{"index": i, "operator": m, "span": None, "window": None, "position": None, "ffn": kinds[i], "operands": {}}
              for i, m in enumerate(mixers)]
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_only"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {},
    }
    if ffn is not None:
        surface["ffn"] = ffn
    if kda is not None:
        surface["operators"]["kda"] = kda
    if "mla" in mixers:
        surface["operators"]["mla"] = ds.mla_surface(widths, None, "kimi_linear")
    experts = {}
    if moe is not None:
        surface["operators"]["moe_ffn"] = moe
        experts = ds.routed_roles(moe["num_experts"], H, moe["expert_intermediate"], released="block_sparse_moe",
                                  runtime="mlp", names=("w1", "w3", "w2"))
    tables = {(m, f): ((m, {**TABLES[m], **FFN_ROLES}) if f == "dense" else
                       (f"{m} + moe_ffn", {**TABLES[m], **experts})) for m, f in set(zip(mixers, kinds))}
    graph = assemble_graph(src.name, "kimi_linear", bool(tied), layers, surface)
    placements, dropped = place_tensors(src, graph, r, bool(tied), ds.PREFIXES, lambda i: tables[(mixers[i], kinds[i])])
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("kimi_linear", "kimi_linear", build)
