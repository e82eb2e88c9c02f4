"""DeepSeek-V3 (transformers' ``deepseek_v3``, ``DeepseekV3ForCausalLM``): every layer is MLA
attention with DeepSeek's decoupled rope, followed by a dense FFN (the first
``first_k_dense_replace`` layers) or routed experts (the rest).

Layout: ``model.embed_tokens``, ``model.layers.N.input_layernorm``, ``model.layers.N.self_attn.*``
(vindex3.families.deepseek_common.MLA_ROLES: q_proj, or q_a_proj / q_a_layernorm / q_b_proj
when ``q_lora_rank`` is set; kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, biases when
``attention_bias``), ``model.layers.N.post_attention_layernorm``, ``model.layers.N.mlp.
{gate,up,down}_proj`` (dense layers), ``model.norm``, ``lm_head``.

The rope (``rope_parameters``, or the older ``rope_theta`` + ``rope_scaling``) is default or
yarn, with ``rope_interleave``; yarn's mscale correction of the softmax scale is lowered into
the mla operator's ``softmax_scale``. Released checkpoints also carry
``num_nextn_predict_layers`` (alias ``num_mtp_layers``) multi-token-prediction modules after the
decoder, ``model.layers.{L + j}.*``: the reference never runs them in a forward pass. A complete
module (``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm``, optionally its own copies
``embed_tokens`` / ``shared_head.head``, and a decoder block of layer L + j's kind) is admitted as
the ``mtp`` drafter component (object ``mtp``, tensors ``j.<suffix>``; vindex3.draft.mtp runs
it), never as a decoder layer; an unknown tensor of a module is refused by name; an incomplete
module is set aside by name with what it lacks and recorded in the container's provenance as
dropped tensors. The released
weights are FP8 (e4m3) with a float32 ``weight_scale_inv`` per 128 x 128 block of each linear and
a ``quantization_config`` (vindex3.families.deepseek_common.read_fp8): each linear's two tensors
are packed into the ``fp8_e4m3_b128`` encoding and run as stored (a widening encode decodes
them exactly); any other quantization is refused by name. Routed layers run the ``moe_ffn`` operator
(router ``sigmoid_group_topk``; facts and tensors in vindex3.families.deepseek_common):
``mlp.gate.weight``, ``mlp.gate.e_score_correction_bias``, ``mlp.experts.{e}.{gate,up,down}_proj.weight``
(or the fused ``mlp.experts.gate_up_proj`` / ``down_proj``) and ``mlp.shared_experts.*``.
"""

from __future__ import annotations

from ..sources import CheckpointSource
from . import deepseek_common as ds
from .base import ConfigReader, Lowering, register_family
from .placement import assemble_graph, place_tensors

TABLE = {**ds.NORM_ROLES, **ds.MLA_ROLES, **ds.dense_ffn_roles("mlp")}
ROUTER_SPELLINGS = {
    "experts": ("n_routed_experts", "num_local_experts"),
    "top_k": ("num_experts_per_tok",),
    "shared_experts": ("n_shared_experts",),
    "renormalize": ("norm_topk_prob",),
    "n_group": ("n_group",),
    "topk_group": ("topk_group",),
    "routed_scaling_factor": ("routed_scaling_factor",),
    "expert_width": ("moe_intermediate_size",),
}
# keys of the released configs that transformers keeps as attributes without reading them
HUB_FIXED = {
    "scoring_func": ("sigmoid", "the reference's router always scores with a sigmoid"),
    "topk_method": ("noaux_tc", "the reference selects with the score-correction bias (noaux_tc)"),
    "moe_layer_freq": (1, "the reference routes every layer from first_k_dense_replace on"),
}
HUB_IGNORED = {
    "ep_size": "the expert-parallel degree of the original serving code; no effect on the math",
    "aux_loss_alpha": "a training loss coefficient",
    "seq_aux": "a training loss option",
    "auto_map": "remote-code class names; this build never runs remote code (the family comes from model_type)",
}


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take("hidden_size", "residual width")
    L = r.take("num_hidden_layers", "number of decoder layers (MTP layers come after them)")
    vocab = r.take("vocab_size", "vocabulary size")
    eps = r.take("rms_norm_eps", "epsilon of the decoder norms (not of MLA's kv_a / q_a norms)")
    tied = r.take("tie_word_embeddings", "output head shares the embedding", default=False,
                  default_reason="the reference default is untied")
    ok = all(ds.positive_int(r, k, v) for k, v in (("hidden_size", H), ("num_hidden_layers", L), ("vocab_size", vocab)))
    if not ds.number(eps) or eps < 0:
        r.refuse("rms_norm_eps", f"expected a number >= 0, found {eps!r}")
        ok = False

    widths = ds.mla_widths(r, q_lora_default=1536)
    rope = ds.mla_rope(r, widths["qk_rope_head_dim"] if widths else 0)
    ok = ok and widths is not None and rope is not False

    k = r.take("first_k_dense_replace", "the first k layers have a dense FFN, the rest routed experts", default=3,
               default_reason="the reference default is 3")
    kinds = None
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        r.refuse("first_k_dense_replace", f"expected an integer >= 0, found {k!r}")
        ok = False
    elif ok:
        kinds = ["dense" if i < k else "routed" for i in range(L)]

    mtp = ds.aliased(r, ("num_nextn_predict_layers", "num_mtp_layers"),
                     "multi-token-prediction (MTP) modules stored after the decoder (a drafter component when "
                     "complete, else set aside)", default=1, default_reason="the reference default is 1")
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        if mtp is not None:
            r.refuse("num_nextn_predict_layers", f"expected an integer >= 0, found {mtp!r}")
        ok = False
    # MTP module j is decoder layer L + j of the reference's numbering: its FFN kind follows
    # first_k_dense_replace like any layer's. Modules 0, 1, ... run while their tensors are all
    # there (module j chains on module j - 1); from the first incomplete one on they are set aside.
    mtp_kinds: dict[int, str] = {}
    incomplete: dict[int, list[str] | str] = {}
    if ok and kinds is not None and mtp:
        stored = ds.mtp_modules(src, L, mtp)
        for j in range(mtp):
            kind = "dense" if L + j < k else "routed"
            missing = ds.mtp_complete(stored.get(j, set()), kind)
            if missing or incomplete:
                if j in stored:
                    incomplete[j] = missing or f"module {min(incomplete)}, which it chains on, is incomplete"
                else:
                    incomplete.setdefault(j, missing)
            else:
                mtp_kinds[j] = kind
    ffn_ok, ffn, act = ds.dense_ffn_surface(r, dense=kinds is None or "dense" in kinds or "dense" in mtp_kinds.values())
    ok = ok and ffn_ok
    routed = bool(kinds) and "routed" in kinds
    mtp_routed = "routed" in mtp_kinds.values()
    facts = ds.read_router(r, ROUTER_SPELLINGS, routed or mtp_routed)
    moe = ds.router_surface(r, facts, ROUTER_SPELLINGS, act) if (routed or mtp_routed) and ok else None
    ok = ok and (moe is not None or not (routed or mtp_routed))
    for key, (want, why) in HUB_FIXED.items():
        if r.has(key):
            v = r.config[key]
            if v == want and isinstance(v, bool) == isinstance(want, bool):
                r.meta(key, f"{why} (released-config key, unread by transformers)")
            else:
                r.refuse(key, f"{v!r}: {why}; a checkpoint that asks otherwise would not run as declared")
                ok = False
    for key, why in HUB_IGNORED.items():
        r.ignore(key, why)
    fp8 = ds.read_fp8(r, src)
    if not ok or fp8 is None:
        return None

    # incomplete MTP modules are set aside by name (with what they lack); complete ones are placed
    # as layers L + j and then moved into the drafter component
    keep = set(mtp_kinds)
    aside, dropped = ds.set_aside_layers(r, src, L, mtp, "multi-token-prediction (MTP)", "num_nextn_predict_layers",
                                         skip=keep, missing=incomplete)
    layers = [{"index": i, "operator": "mla", "span": None, "window": None, "position": None, "ffn": kinds[i],
               "operands": {}} for i in range(L)]
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": 1.0},
        "residual": {"multiplier": 1.0},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_only"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
        "operators": {"mla": ds.mla_surface(widths, rope, "deepseek_v3")},
    }
    if ffn is not None:
        surface["ffn"] = ffn
    tables = {"dense": ("mla", TABLE)}
    if moe is not None:
        if routed:  # a routed MTP module alone keeps the router facts in its own surface
            surface["operators"]["moe_ffn"] = moe
        tables["routed"] = ("mla + moe_ffn", {**ds.NORM_ROLES, **ds.MLA_ROLES, **ds.routed_roles(
            moe["num_experts"], H, moe["expert_intermediate"], released="mlp", runtime="mlp",
            names=("gate_proj", "up_proj", "down_proj"))})
    mods = sorted(keep)
    mtp_surface = None
    mtp_table = {kind: (f"multi-token-prediction module ({op})", {**t, **ds.MTP_ROLES}) for kind, (op, t) in tables.items()}
    if mods:
        mtp_surface = {"operators": {"mla": surface["operators"]["mla"]}}
        if mtp_routed:
            mtp_surface["operators"]["moe_ffn"] = moe
        if "dense" in mtp_kinds.values():
            mtp_surface["ffn"] = ffn
    if fp8:
        tables = {k: (op, ds.fp8_table(t, src)) for k, (op, t) in tables.items()}
        mtp_table = {k: (op, ds.fp8_table(t, src)) for k, (op, t) in mtp_table.items()}
    graph = assemble_graph(src.name, "deepseek_v3", bool(tied), layers, surface)
    graph["layers"] += [{"index": L + j, "operator": "mla", "span": None, "window": None, "position": None,
                         "ffn": mtp_kinds[j], "operands": {}} for j in mods]

    def table(i: int):
        return tables[kinds[i]] if i < L else mtp_table[mtp_kinds[mods[i - L]]]

    placements, more = place_tensors(ds.WithoutTensors(src, aside), graph, r, bool(tied), ds.PREFIXES, table)
    if mods:
        drafter = {"kind": "mtp", "edge": {"kind": "hidden_state", "component": "text", "after_layer": L - 1,
                                           "site": "final_norm"},
                   "formulation": "deepseek_v3", "norm_eps": float(eps), "norm_weight_offset": 0.0,
                   "chain": "own_hidden", "surface": mtp_surface}
        placements = ds.split_mtp(placements, graph, L, mods, drafter)
    return Lowering(graph=graph, placements=placements, dropped=dropped + more)


register_family("deepseek_v3", "deepseek_v3", build)
