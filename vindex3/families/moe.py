"""Llama-shaped decoders with routed experts: qwen3_moe, olmoe, mixtral and gpt_oss.

Layout (transformers 5.24.0): ``model.embed_tokens``, ``model.layers.N.{input_layernorm,
self_attn.*, post_attention_layernorm, <ffn>}``, ``model.norm``, ``lm_head``. Every layer is
pre-norm attention then a pre-norm FFN, which is the routed-expert FFN (`moe_ffn`) or, for
qwen3_moe layers that ``mlp_only_layers`` / ``decoder_sparse_step`` leave dense, the gated
dense FFN.

Expert tensors come in two layouts per family and both are read; each tensor is classified by
exact name and shape, and the container stores one stacked bank per projection, [E, out, in]
(gate and up fused in halves, gate first; see `vindex3.operators.moe_ffn`):

============  =====================================================  ==========================
family        per expert (the released layout)                       fused (transformers'
                                                                      runtime save)
============  =====================================================  ==========================
qwen3_moe,    mlp.gate.weight [E, H];                                mlp.experts.gate_up_proj
olmoe         mlp.experts.{e}.gate_proj.weight [I, H], .up_proj      [E, 2I, H],
              [I, H], .down_proj [H, I]: stacked                     .down_proj [E, H, I]
mixtral       block_sparse_moe.gate.weight [E, H];                   mlp.gate.weight,
              block_sparse_moe.experts.{e}.w1 (gate) / w3 (up)       mlp.experts.gate_up_proj,
              [I, H], .w2 (down) [H, I]: stacked                     mlp.experts.down_proj
gpt_oss       (none)                                                 mlp.router.weight [E, H] and
                                                                      .bias [E];
                                                                      mlp.experts.gate_up_proj
                                                                      [E, H, 2I] (in-out, gate and
                                                                      up interleaved: transposed
                                                                      and de-interleaved),
                                                                      .gate_up_proj_bias [E, 2I]
                                                                      (de-interleaved),
                                                                      .down_proj [E, I, H]
                                                                      (transposed),
                                                                      .down_proj_bias [E, H]
============  =====================================================  ==========================

The released gpt-oss checkpoints store their experts in MXFP4 (``*_blocks`` / ``*_scales`` and a
``quantization_config`` with quant_method mxfp4): the two tensors of each bank are packed into the
``mxfp4`` encoding losslessly (vindex3.codecs.packing) and run as stored; a widening encode
decodes them exactly to float32. Any other quantization_config is refused by name.

Every config key is graded; the routing rules become facts of the op (nothing is inferred from
``model_type`` past this module):

* qwen3_moe: router softmax_topk, ``norm_topk_prob`` (reference default false); layer i is
  routed iff i is not in ``mlp_only_layers`` and ``num_experts`` > 0 and
  (i + 1) % ``decoder_sparse_step`` == 0, else a dense FFN of ``intermediate_size``; experts of
  ``moe_intermediate_size``; QK-norm per head; ``use_sliding_window`` puts every layer on
  ``sliding_window`` (``max_window_layers`` is not read by this reference).
* olmoe: softmax_topk, ``norm_topk_prob`` (default false, no renormalisation); every layer
  routed, experts of ``intermediate_size``; QK-norm over the whole q and k projections;
  ``clip_qkv`` clamps q, k and v.
* mixtral: softmax_topk, always renormalised (no key); ``sliding_window`` on every layer when
  set; ``router_jitter_noise`` is training-only.
* gpt_oss: topk_softmax with a router bias; clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``);
  expert biases; attention with biases, learned sinks, ``layer_types`` sliding / full (default:
  alternating, sliding first) and yarn rope (default: the reference's yarn parameters).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .decoder import ACTIVATIONS, ATTENTION_ROLES, PREFIXES, rope_policy
from .placement import Part, assemble_graph, place_tensors

NORM_ROLES = {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm"}
DENSE_ROLES = {"mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down"}

def experts_per_tensor(E: int, H: int, In: int, module: str, gate: str, up: str, down: str) -> dict:
    """Parts of the two banks from one tensor per expert: gate and up [I, H] stacked in pairs into
    ``{module}.experts.gate_up_proj`` [E, 2I, H] (halves, gate first), down [H, I] into
    ``{module}.experts.down_proj`` [E, H, I]."""
    gu, dn = f"{module}.experts.gate_up_proj", f"{module}.experts.down_proj"
    t = {}
    for e in range(E):
        t[f"{module}.experts.{e}.{gate}.weight"] = Part("moe_gate_up", gu, 2 * e, 2 * E, (In, H), ("stack", "merge_pairs"))
        t[f"{module}.experts.{e}.{up}.weight"] = Part("moe_gate_up", gu, 2 * e + 1, 2 * E, (In, H), ("stack", "merge_pairs"))
        t[f"{module}.experts.{e}.{down}.weight"] = Part("moe_down", dn, e, E, (H, In), ("stack",))
    return t


def experts_fused(E: int, H: int, In: int, module: str) -> dict:
    """transformers' runtime layout: ``{module}.experts.gate_up_proj`` [E, 2I, H] (halves) and
    ``.down_proj`` [E, H, I], stored as they are."""
    gu, dn = f"{module}.experts.gate_up_proj", f"{module}.experts.down_proj"
    return {gu: Part("moe_gate_up", gu, 0, 1, (E, 2 * In, H)), dn: Part("moe_down", dn, 0, 1, (E, H, In))}


def moe_facts(*, E: int, k: int, In: int, router: str, renormalize: bool, act: str, router_bias: bool = False,
              expert_bias: bool = False, swiglu: tuple[float, float] | None = None, shared: str = "none",
              shared_intermediate: int | None = None, shared_act: str | None = None,
              shared_gate_up: str | None = None) -> dict:
    """The ``surface.operators.moe_ffn`` group for the routers these families use (the
    sigmoid-group router's facts are null here; families that route that way set them)."""
    return {
        "num_experts": E, "top_k": k, "expert_intermediate": In, "router": router, "renormalize": renormalize,
        "router_bias": router_bias, "correction_bias": False, "n_group": None, "topk_group": None,
        "routed_scaling_factor": None, "expert_act": act,
        "swiglu_limit": swiglu[0] if swiglu else None, "swiglu_alpha": swiglu[1] if swiglu else None,
        "gate_up": "fused_halves", "expert_bias": expert_bias, "shared": shared,
        "shared_intermediate": shared_intermediate, "shared_act": shared_act, "shared_gate_up": shared_gate_up,
    }


def positive_int(r: ConfigReader, key: str, v) -> bool:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        r.refuse(key, f"expected a positive integer, found {v!r}")
        return False
    return True


def alias(r: ConfigReader, keys: tuple[str, str], message: str, **default) -> object:
    """A value transformers reads under two spellings (its ``attribute_map``): either may be
    given; both must agree."""
    present = [k for k in keys if r.has(k)]
    if len(present) == 2 and r.config[keys[0]] != r.config[keys[1]]:
        r.refuse(keys[1], f"{keys[0]}={r.config[keys[0]]!r} and {keys[1]}={r.config[keys[1]]!r} name one value and disagree")
        return None
    if present:
        v = r.take(present[0], message)
        if len(present) == 2:
            r.take(present[1], f"the same value as {present[0]}")
        return v
    return r.take(keys[0], message, **default)


def _finite(r: ConfigReader, key: str, v, positive: bool = True) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or (positive and v <= 0):
        r.refuse(key, f"expected a {'positive ' if positive else ''}finite number, found {v!r}")
        return None
    return float(v)


# ---- per family ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Experts:
    """What a family's expert keys say."""

    E: int
    k: int
    In: int  # one expert's intermediate width
    renormalize: bool
    act: str  # the experts' activation (ours), or "swiglu_clamped"
    routed: list[bool]  # per layer
    dense_intermediate: int | None = None  # width of the dense FFN of layers left dense
    swiglu: tuple[float, float] | None = None  # (limit, alpha)


class Spec:
    """What differs between the four families (everything else is one builder)."""

    model_type: str
    kv_default: int | None  # None: num_attention_heads
    bias_default: bool
    qk_norm: str | None  # "head" | "projection" | None
    sinks: bool = False
    rope_default: tuple[dict, str] | None = None  # the reference's rotary parameters when a config states none

    def experts(self, r: ConfigReader, L: int) -> Experts | None:
        raise NotImplementedError

    def tables(self, E: int, H: int, In: int) -> dict:
        raise NotImplementedError

    def spans(self, r: ConfigReader, L: int) -> tuple[list[str], int | None] | None:
        raise NotImplementedError

    def extra(self, r: ConfigReader) -> bool:
        """Grade family-specific keys; False if one blocks."""
        return True


def _act(r: ConfigReader, why: str) -> str | None:
    act = r.take("hidden_act", why, default="silu", default_reason="the reference default is silu")
    if act not in ACTIVATIONS:
        r.refuse("hidden_act", f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    return ACTIVATIONS[act]


def _no_sliding(r: ConfigReader, L: int) -> tuple[list[str], None]:
    return ["full"] * L, None


def _global_window(r: ConfigReader, L: int, use_key: str | None) -> tuple[list[str], int | None] | None:
    use = True
    if use_key is not None:
        use = bool(r.take(use_key, "whether the sliding window applies (to every layer)", default=False,
                          default_reason="the reference default is off"))
    if not use:
        if r.has("sliding_window"):
            r.meta("sliding_window", f"not applied: {use_key} is false")
        return ["full"] * L, None
    sw = r.take("sliding_window", "attention window on every layer (keys including the query)", default=None,
                default_reason="no window declared: full attention")
    if sw is None:
        return ["full"] * L, None
    if not positive_int(r, "sliding_window", sw):
        return None
    return ["sliding"] * L, int(sw)


class Qwen3Moe(Spec):
    model_type = "qwen3_moe"
    kv_default = 4
    bias_default = False
    qk_norm = "head"

    def spans(self, r, L):
        if r.has("max_window_layers"):
            r.meta("max_window_layers", "not read by transformers' qwen3_moe (the window, when used, is on every layer)")
        return _global_window(r, L, "use_sliding_window")

    def experts(self, r, L):
        act = _act(r, "activation of the experts and of the dense FFN layers")
        E = alias(r, ("num_experts", "num_local_experts"), "routed experts per MoE layer")
        k = r.take("num_experts_per_tok", "experts each position is routed to")
        In = r.take("moe_intermediate_size", "width of one routed expert")
        dense_inter = r.take("intermediate_size", "width of the dense FFN of layers left dense")
        renorm = r.take("norm_topk_prob", "divide the k router probabilities by their sum", default=False,
                        default_reason="the reference default is false")
        step = r.take("decoder_sparse_step", "every step-th layer is routed", default=1, default_reason="the reference default is 1")
        only = r.take("mlp_only_layers", "layers that keep a dense FFN", default=[], default_reason="the reference default is none")
        if act is None or None in (E, k, In, dense_inter) or not positive_int(r, "decoder_sparse_step", step):
            return None
        if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < L for i in only):
            r.refuse("mlp_only_layers", f"expected a list of layer indices in [0, {L}), found {only!r}")
            return None
        if isinstance(E, bool) or not isinstance(E, int) or E < 0:
            r.refuse("num_experts", f"expected a non-negative integer, found {E!r}")
            return None
        routed = [i not in only and E > 0 and (i + 1) % step == 0 for i in range(L)]
        return Experts(E, k, In, bool(renorm), act, routed, dense_inter)

    def tables(self, E, H, In):
        return {"mlp.gate.weight": "moe_router", **experts_per_tensor(E, H, In, "mlp", "gate_proj", "up_proj", "down_proj"),
                **experts_fused(E, H, In, "mlp")}


class Olmoe(Spec):
    model_type = "olmoe"
    kv_default = None
    bias_default = False
    qk_norm = "projection"

    def spans(self, r, L):
        return _no_sliding(r, L)

    def experts(self, r, L):
        act = _act(r, "activation of the experts")
        E = alias(r, ("num_experts", "num_local_experts"), "routed experts per layer")
        k = r.take("num_experts_per_tok", "experts each position is routed to")
        In = r.take("intermediate_size", "width of one routed expert")
        renorm = r.take("norm_topk_prob", "divide the k router probabilities by their sum", default=False,
                        default_reason="the reference default is false (no renormalisation)")
        if act is None or None in (E, k, In):
            return None
        return Experts(E, k, In, bool(renorm), act, [True] * L)

    def tables(self, E, H, In):
        return {"mlp.gate.weight": "moe_router", **experts_per_tensor(E, H, In, "mlp", "gate_proj", "up_proj", "down_proj"),
                **experts_fused(E, H, In, "mlp")}


class Mixtral(Spec):
    model_type = "mixtral"
    kv_default = 8
    bias_default = False
    qk_norm = None

    def spans(self, r, L):
        return _global_window(r, L, None)

    def experts(self, r, L):
        act = _act(r, "activation of the experts")
        E = alias(r, ("num_local_experts", "num_experts"), "routed experts per layer")
        k = r.take("num_experts_per_tok", "experts each position is routed to")
        In = r.take("intermediate_size", "width of one routed expert")
        r.ignore("router_jitter_noise", "multiplicative noise on the router input in training only")
        if act is None or None in (E, k, In):
            return None
        return Experts(E, k, In, True, act, [True] * L)  # mixtral always renormalises

    def tables(self, E, H, In):
        return {"block_sparse_moe.gate.weight": "moe_router", "mlp.gate.weight": "moe_router",
                **experts_per_tensor(E, H, In, "block_sparse_moe", "w1", "w3", "w2"), **experts_fused(E, H, In, "mlp")}


class GptOss(Spec):
    model_type = "gpt_oss"
    kv_default = 8
    bias_default = True
    qk_norm = None
    sinks = True
    rope_default = ({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
                    "the reference's default: yarn (factor 32 over 4096 positions) on theta 150000")

    def spans(self, r, L):
        sw = r.take("sliding_window", "window of the sliding layers (keys including the query)", default=128,
                    default_reason="the reference default is 128")
        if r.has("layer_types"):
            lt = r.take("layer_types", "per-layer attention span: sliding_attention or full_attention")
        else:
            lt = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
            r.take("layer_types", "per-layer attention span", default=lt,
                   default_reason="the reference alternates sliding and full layers, sliding first")
        if not isinstance(lt, list) or len(lt) != L:
            r.refuse("layer_types", f"expected a list of {L} layer types, found {lt!r}")
            return None
        bad = [(i, t) for i, t in enumerate(lt) if t not in ("sliding_attention", "full_attention")]
        if bad:
            r.refuse("layer_types", f"layer {bad[0][0]} has type {bad[0][1]!r} (supported: sliding_attention, full_attention)")
            return None
        spans = ["sliding" if t == "sliding_attention" else "full" for t in lt]
        if "sliding" in spans:
            if sw is None or not positive_int(r, "sliding_window", sw):
                if sw is None:
                    r.refuse("sliding_window", "sliding layers are declared but no window is")
                return None
            return spans, int(sw)
        return spans, None

    def extra(self, r):
        ok = True
        if r.has("quantization_config"):
            q = r.config["quantization_config"]
            method = q.get("quant_method") if isinstance(q, dict) else q
            extra = sorted(set(q) - {"quant_method", "modules_to_not_convert"}) if isinstance(q, dict) else []
            if method == "mxfp4" and not extra:
                # which tensors are quantized is read from the tensors themselves (*_blocks / *_scales)
                r.meta("quantization_config", "MXFP4 experts: their *_blocks / *_scales are packed into the mxfp4 encoding")
            else:
                r.refuse("quantization_config", f"quantized checkpoint ({method!r}"
                                                f"{'; keys ' + ', '.join(extra) if extra else ''}): an encoding this build "
                                                "does not read (MXFP4 experts, f32 / f16 / bf16 checkpoints are admitted)")
                ok = False
        r.meta("initial_context_length", "not read by the reference")
        if r.has("experts_per_token"):
            if r.config.get("experts_per_token") != r.config.get("num_experts_per_tok"):
                r.refuse("experts_per_token", "not read by the reference, and it disagrees with num_experts_per_tok")
                ok = False
            else:
                r.meta("experts_per_token", "not read by the reference; equals num_experts_per_tok")
        return ok

    def experts(self, r, L):
        r.meta("hidden_act", "not read by gpt-oss's experts, which apply the clamped SwiGLU")
        E = alias(r, ("num_local_experts", "num_experts"), "routed experts per layer", default=128,
                  default_reason="the reference default is 128")
        k = r.take("num_experts_per_tok", "experts each position is routed to", default=4,
                   default_reason="the reference default is 4")
        In = r.take("intermediate_size", "width of one routed expert")
        limit = r.take("swiglu_limit", "clamp of the experts' gate (above) and up (both sides)", default=7.0,
                       default_reason="the reference default is 7.0")
        alpha = r.take("swiglu_alpha", "sigmoid gain of the experts' clamped SwiGLU", default=1.702,
                       default_reason="the reference default is 1.702")
        limit, alpha = _finite(r, "swiglu_limit", limit), _finite(r, "swiglu_alpha", alpha)
        if None in (E, k, In, limit, alpha):
            return None
        return Experts(E, k, In, False, "swiglu_clamped", [True] * L, swiglu=(limit, alpha))

    def tables(self, E, H, In):
        gu, dn = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
        return {
            "mlp.router.weight": "moe_router",
            "mlp.router.bias": "moe_router_bias",
            gu: Part("moe_gate_up", gu, 0, 1, (E, H, 2 * In), ("swap_last2", "uninterleave_axis1")),
            gu + "_bias": Part("moe_gate_up_bias", gu + "_bias", 0, 1, (E, 2 * In), ("uninterleave_axis1",)),
            dn: Part("moe_down", dn, 0, 1, (E, In, H), ("swap_last2",)),
            dn + "_bias": Part("moe_down_bias", dn + "_bias", 0, 1, (E, H)),
            # the released MXFP4 spelling (vindex3.codecs.packing): [E, out, in/32, 16] codes and
            # [E, out, in/32] e8m0 exponents, already out-major, packed into mxfp4 losslessly
            gu + "_blocks": Part("moe_gate_up", gu, 0, 2, (E, 2 * In, H // 32, 16), ("uninterleave_axis1",), "mxfp4"),
            gu + "_scales": Part("moe_gate_up", gu, 1, 2, (E, 2 * In, H // 32), ("uninterleave_axis1",), "mxfp4"),
            dn + "_blocks": Part("moe_down", dn, 0, 2, (E, H, In // 32, 16), (), "mxfp4"),
            dn + "_scales": Part("moe_down", dn, 1, 2, (E, H, In // 32), (), "mxfp4"),
        }


SPECS: dict[str, Spec] = {s.model_type: s for s in (Qwen3Moe(), Olmoe(), Mixtral(), GptOss())}


def _build(spec: Spec) -> Callable[[ConfigReader, CheckpointSource], Lowering | None]:
    def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
        mt = spec.model_type
        H = r.take("hidden_size", "residual width")
        L = r.take("num_hidden_layers", "number of decoder layers")
        nh = r.take("num_attention_heads", "query heads")
        if spec.kv_default is None:
            nkv = r.take("num_key_value_heads", "key/value heads (GQA)", default=nh,
                         default_reason="the reference uses num_attention_heads (MHA)")
        else:
            nkv = r.take("num_key_value_heads", "key/value heads (GQA)", default=spec.kv_default,
                         default_reason=f"the reference default is {spec.kv_default}")
        vocab = r.take("vocab_size", "vocabulary size")
        eps = r.take("rms_norm_eps", "RMSNorm epsilon (layer norms, final norm, QK norms)")
        tied = r.take("tie_word_embeddings", "output head shares the embedding", default=False,
                      default_reason="the reference default is untied")
        bias = r.take("attention_bias", "bias on q/k/v/o projections", default=spec.bias_default,
                      default_reason=f"the reference default is {str(spec.bias_default).lower()}")
        ok = spec.extra(r)
        for key, v in (("hidden_size", H), ("num_hidden_layers", L), ("num_attention_heads", nh),
                       ("num_key_value_heads", nkv), ("vocab_size", vocab)):
            ok = positive_int(r, key, v) and ok
        if not ok or eps is None:
            return None
        if nh % nkv:
            r.refuse("num_key_value_heads", f"{nh} query heads are not a multiple of {nkv} key/value heads")
            return None
        # head width: an explicit head_dim, else hidden / heads (OLMoE's QK norms are hidden wide,
        # so its reference cannot run any other)
        if mt == "gpt_oss" and not r.has("head_dim"):
            hd = r.take("head_dim", "per-head width", default=64, default_reason="the reference default is 64")
        elif r.has("head_dim") and r.config["head_dim"] is not None:
            hd = r.take("head_dim", "per-head width")
            if mt == "olmoe" and hd * nh != H:
                r.refuse("head_dim", f"OLMoE's q norm is hidden_size ({H}) wide, which {nh} heads of {hd} do not fill")
                return None
        else:
            if r.has("head_dim"):
                r.take("head_dim", "null: per-head width is hidden_size / heads")
            hd = H // nh
            if hd * nh != H:
                r.refuse("hidden_size", f"hidden_size {H} is not divisible by {nh} heads and no head_dim is declared")
                return None
        if not positive_int(r, "head_dim", hd):
            return None
        clip = None
        if mt == "olmoe":
            clip = r.take("clip_qkv", "q, k and v are clamped to [-clip_qkv, clip_qkv]", default=None,
                          default_reason="the reference default is no clamp")
            if clip is not None and _finite(r, "clip_qkv", clip) is None:
                return None
        position = rope_policy(r, hd, default=spec.rope_default)
        spans = spec.spans(r, L)
        ex = spec.experts(r, L)
        if position is None or spans is None or ex is None:
            return None
        spans, window = spans
        routed, E, k, In = ex.routed, ex.E, ex.k, ex.In
        if any(routed):
            for key, v in (("num_experts", E), ("num_experts_per_tok", k), ("intermediate_size", In)):
                ok = positive_int(r, key, v) and ok
            if ok and k > E:
                r.refuse("num_experts_per_tok", f"routes each position to {k} of {E} experts")
                ok = False
        if not all(routed) and not positive_int(r, "intermediate_size", ex.dense_intermediate):
            ok = False
        if not ok:
            return None
        act = ex.act
        if ex.swiglu is not None:
            moe = moe_facts(E=E, k=k, In=In, router="topk_softmax", renormalize=False, act=act, router_bias=True,
                            expert_bias=True, swiglu=ex.swiglu)
        else:
            moe = moe_facts(E=E, k=k, In=In, router="softmax_topk", renormalize=ex.renormalize, act=act)
        dense_inter = ex.dense_intermediate
        layers = [{"index": i, "operator": "softmax", "span": spans[i], "window": window if spans[i] == "sliding" else None,
                   "position": position, "ffn": "routed" if routed[i] else "dense", "operands": {}} for i in range(L)]
        surface = {
            "hidden_size": H,
            "embedding": {"multiplier": 1.0},
            "residual": {"multiplier": 1.0},
            "attention": {
                "heads": nh, "kv_heads": nkv, "head_dim": hd, "head_mapping": "repeat_interleave", "query_scale": 1.0,
                "score_scale": float(hd) ** -0.5, "bias": {x: bool(bias) for x in "qkvo"},
                "qk_norm": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "scope": spec.qk_norm} if spec.qk_norm else None,
                "qkv_clip": float(clip) if clip is not None else None,
                "sinks": "learned" if spec.sinks else None,
                "output_gate": False,
            },
            "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 0.0, "placement": "pre_only"},
            "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": None},
            "operators": {"moe_ffn": moe} if any(routed) else {},
        }
        if not all(routed):
            surface["ffn"] = {"kind": "gated", "activation": act, "intermediate_size": dense_inter, "bias": False,
                              "fused_gate_up": False}
        graph = assemble_graph(src.name, mt, bool(tied), layers, surface)
        attn = {**NORM_ROLES, **{s: role for s, role in ATTENTION_ROLES.items()
                                 if spec.qk_norm or role not in ("q_norm", "k_norm")}}
        if spec.sinks:
            attn["self_attn.sinks"] = "sinks"
        routed_table = {**attn, **spec.tables(E, H, In)} if any(routed) else None
        dense_table = {**attn, **DENSE_ROLES}

        def table(i: int):
            return ("softmax + moe_ffn", routed_table) if routed[i] else ("softmax + gated_ffn", dense_table)

        placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, table)
        return Lowering(graph=graph, placements=placements, dropped=dropped)

    return build


for _mt, _spec in SPECS.items():
    register_family(_mt, _mt, _build(_spec))
