"""Gemma (``gemma``), Gemma 2 (``gemma2``), Gemma 3 (``gemma3_text``) and the text component of
the Gemma 3 vision-language checkpoint (``gemma3``): embeddings times sqrt(hidden), every RMS norm
(1 + w), a gated GELU FFN (``gated_ffn``).

* gemma: pre-norms only, scores at head_dim^-0.5.
* gemma2: pre + post ("sandwich") norms around both slots (placement ``pre_post``), scores at
  ``query_pre_attn_scalar``^-0.5, attention logits softcapped (``attn_logit_softcapping``) and the
  final logits too (``final_logit_softcapping``), sliding and full layers from ``layer_types``.
* gemma3_text: as gemma2, plus per-head (1 + w) QK-norm and a rope per layer kind
  (``rope_parameters.sliding_attention`` / ``.full_attention``).
* gemma3: the text model under ``model.language_model.*``, graded key by key from text_config;
  the vision tower (``model.vision_tower.*``) and the projector (``model.multi_modal_projector.*``)
  are set aside by name, as for Qwen3.5.

Keys read as transformers 5.24.0 reads them (docs/operators.md): Gemma's legacy
``hidden_act: "gelu"`` is the tanh GELU; Gemma 2 and 3 read ``hidden_activation`` (a
``hidden_act`` beside it that disagrees is refused); Gemma 3's legacy ``rope_theta`` /
``rope_local_base_freq`` / ``rope_scaling`` fill the full / sliding / full rope only where
``rope_parameters`` lacks them; the VL class applies no final-logit softcap."""

from __future__ import annotations

from dataclasses import dataclass

from ..sources import CheckpointSource
from .base import CONSUMED, METADATA, ConfigReader, Lowering, register_family
from .decoder import ACTIVATIONS, ATTENTION_ROLES, rope_policy
from .gpt import attention_surface, layer_entries
from .placement import assemble_graph, place_tensors
from .qwen3_next import _set_aside, _Without

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class Variant:
    act_key: str  # hidden_act (gemma) | hidden_activation (gemma2, gemma3)
    sandwich: bool  # pre + post norms
    softcaps: bool  # attention and final-logit softcapping keys exist
    qk_norm: bool
    pattern: int | None  # layers are sliding unless (i + 1) % pattern == 0, absent layer_types (None: no sliding)
    rope_per_kind: bool


VARIANTS = {
    "gemma": Variant("hidden_act", False, False, False, None, False),
    "gemma2": Variant("hidden_activation", True, True, False, 2, False),
    "gemma3_text": Variant("hidden_activation", True, True, True, 6, True),
}


def _activation(r: ConfigReader, v: Variant) -> str | None:
    if v.act_key == "hidden_act":
        act = r.take_str("hidden_act", "FFN gate activation", default="gelu_pytorch_tanh",
                         default_reason="the reference default is gelu_pytorch_tanh")
        if act == "gelu":  # transformers 5.24 rewrites this legacy value of the official releases
            act = "gelu_pytorch_tanh"
            r.findings[-1] = r.findings[-1].model_copy(update={"message": "FFN gate activation: the legacy 'gelu' of the "
                                                               "releases, read by transformers 5.24 as gelu_pytorch_tanh"})
        if r.has("hidden_activation"):
            if r.config["hidden_activation"] in (None, act):
                r.ignore("hidden_activation", "not read by transformers 5.24's Gemma (hidden_act decides)")
            else:
                r.refuse("hidden_activation", f"hidden_activation {r.config['hidden_activation']!r} disagrees with "
                                              f"hidden_act ({act!r}); transformers versions read different ones")
                return None
    else:
        act = r.take_str("hidden_activation", "FFN gate activation", default="gelu_pytorch_tanh",
                         default_reason="the reference default is gelu_pytorch_tanh")
        if r.has("hidden_act"):
            if r.config["hidden_act"] in (None, act):
                r.ignore("hidden_act", "not read by transformers 5.24 (hidden_activation decides)")
            else:
                r.refuse("hidden_act", f"hidden_act {r.config['hidden_act']!r} disagrees with hidden_activation ({act!r}); "
                                       "transformers versions read different ones")
                return None
    if act is not None and act not in ACTIVATIONS:
        r.refuse(v.act_key, f"activation {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
        return None
    return act


def _kinds(r: ConfigReader, v: Variant, L: int) -> list[str] | None:
    if v.pattern is None:
        return [FULL] * L
    for key in ("sliding_window_pattern", "_sliding_window_pattern"):
        if r.has(key):
            if r.has("layer_types"):
                r.meta(key, "the legacy interleave; layer_types states every layer")
            else:
                p = r.take_int(key, "every p-th layer is full, the others sliding")
                if p is None:
                    return None
                return [FULL if (i + 1) % p == 0 else SLIDING for i in range(L)]
    if r.has("layer_types"):
        lt = r.take("layer_types", "each layer's attention span")
        if not isinstance(lt, list) or len(lt) != L or any(k not in (SLIDING, FULL) for k in lt):
            r.refuse("layer_types", f"expected {L} entries of {SLIDING} or {FULL}")
            return None
        return list(lt)
    r.take("layer_types", "each layer's attention span", default=f"every {v.pattern}th layer full",
           default_reason=f"absent: the reference makes layer i full iff (i + 1) % {v.pattern} == 0")
    return [FULL if (i + 1) % v.pattern == 0 else SLIDING for i in range(L)]


def _gemma3_ropes(r: ConfigReader, hd: int) -> dict | None:
    """{kind: position}: rope_parameters per layer kind, with 5.24's legacy fill-ins."""
    rp = r.take("rope_parameters", "rotary parameters per layer kind", default=None,
                default_reason="absent: the reference uses a default rope per kind") if r.has("rope_parameters") else None
    if rp is not None and not (isinstance(rp, dict) and set(rp) <= {SLIDING, FULL}):
        r.refuse("rope_parameters", f"expected an object keyed by {SLIDING} and {FULL}")
        return None
    rp = {k: dict(x or {}) for k, x in (rp or {}).items()}
    rp.setdefault(FULL, {"rope_type": "default"})
    rp.setdefault(SLIDING, {"rope_type": "default"})
    if r.has("rope_scaling"):
        sc = r.take("rope_scaling", "rotary scaling of the full-attention layers")
        if sc is not None and not isinstance(sc, dict):
            r.refuse("rope_scaling", "expected an object or null")
            return None
        rp[FULL].update(sc or {})
    for kind, legacy, dflt in ((FULL, "rope_theta", 1_000_000.0), (SLIDING, "rope_local_base_freq", 10_000.0)):
        if "rope_theta" in rp[kind]:
            if r.has(legacy):
                r.ignore(legacy, f"rope_parameters.{kind}.rope_theta is stated: transformers 5.24 reads that")
        elif r.has(legacy):
            rp[kind]["rope_theta"] = r.take(legacy, f"rope theta of the {kind} layers (legacy spelling)")
        else:
            rp[kind]["rope_theta"] = r.take(legacy, f"rope theta of the {kind} layers", default=dflt,
                                            default_reason=f"absent in both spellings: transformers 5.24 uses {dflt:g}")
    out = {}
    for kind in (SLIDING, FULL):
        p = rp[kind]
        if "type" in p and "rope_type" not in p:
            p["rope_type"] = p.pop("type")
        pos = rope_policy(r, hd, params_in=p)
        if pos is None:
            return None
        out[kind] = pos
    return out


# Released Gemma 3 vision-language configs state a few text keys and leave the rest to
# Gemma3TextConfig's class defaults (transformers 5.24.0), which the reference then runs: those are
# the reference's fixed values, recorded as such (closure still checks every shape they imply).
GEMMA3_DEFAULTS = {"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                   "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
                   "query_pre_attn_scalar": 256, "sliding_window": 4096, "max_position_embeddings": 131_072}


def lower_gemma(r: ConfigReader, model_type: str, tied: bool, vl: bool = False) -> tuple[list[dict], dict] | None:
    v = VARIANTS[model_type]
    dflt = GEMMA3_DEFAULTS if model_type == "gemma3_text" else {}

    def d(key: str) -> dict:
        if key in dflt:
            return {"default": dflt[key], "default_reason": "absent: transformers 5.24's Gemma3TextConfig default"}
        return {}

    H = r.take_int("hidden_size", "residual width", **d("hidden_size"))
    L = r.take_int("num_hidden_layers", "number of decoder layers", **d("num_hidden_layers"))
    nh = r.take_int("num_attention_heads", "query heads", **d("num_attention_heads"))
    nkv = r.take_int("num_key_value_heads", "key/value heads (GQA)",
                     **(d("num_key_value_heads") or {"default": nh, "default_reason": "the reference uses num_attention_heads (MHA)"}))
    hd = r.take_int("head_dim", "per-head width (explicit in Gemma configs)", **d("head_dim"))
    inter = r.take_int("intermediate_size", "FFN width", **d("intermediate_size"))
    vocab = r.take_int("vocab_size", "vocabulary size", **d("vocab_size"))
    eps = r.take_number("rms_norm_eps", "epsilon of every (1 + w) RMS norm", minimum=0, **d("rms_norm_eps"))
    abias = r.take_bool("attention_bias", "bias on q/k/v/o", default=False, default_reason="the reference default has none")
    if "max_position_embeddings" in dflt and not r.has("max_position_embeddings"):
        ctx_ok, ctx = True, r.take_int("max_position_embeddings", "the context length", **d("max_position_embeddings"))
    else:
        ctx_ok, ctx = r.context_length()
    act = _activation(r, v)
    r.meta("task_specific_params", "generation presets for named tasks; not model math")
    r.ignore("cache_implementation", "a generation cache option of the reference, not model math")
    bidir = False
    if r.config.get("use_bidirectional_attention") is not None:
        bidir = r.take_bool("use_bidirectional_attention", "attention looks both ways (an encoder use)")
    else:
        _null(r, "use_bidirectional_attention")
    if None in (H, L, nh, nkv, hd, inter, vocab, eps, abias, act) or not ctx_ok:
        return None
    if bidir:
        r.refuse("use_bidirectional_attention", "bidirectional attention is not causal decoding; this build runs causal "
                                                "text models only")
        return None
    if nh % nkv:
        r.refuse("num_key_value_heads", f"{nh} query heads are not a multiple of {nkv} key/value heads")
        return None
    score = float(hd) ** -0.5
    attn_cap = final_cap = None
    if v.softcaps:
        q = r.take_number("query_pre_attn_scalar", "scores are scaled by its inverse square root", minimum=0, nonzero=True,
                          **d("query_pre_attn_scalar"))
        if r.config.get("attn_logit_softcapping") is not None:
            attn_cap = r.take_number("attn_logit_softcapping", "attention scores softcapped at this value", minimum=0,
                                     nonzero=True)
        else:
            _null(r, "attn_logit_softcapping")
        if r.config.get("final_logit_softcapping") is not None:
            if vl:
                r.refuse("final_logit_softcapping", "transformers 5.24's Gemma 3 vision-language model applies no "
                                                    "final-logit softcap though the text model would; refusing rather "
                                                    "than choosing one")
                return None
            final_cap = r.take_number("final_logit_softcapping", "logits softcapped at this value", minimum=0, nonzero=True)
        else:
            _null(r, "final_logit_softcapping")
        if q is None or (attn_cap is None and r.config.get("attn_logit_softcapping") is not None):
            return None
        score = float(q) ** -0.5
    kinds = _kinds(r, v, L)
    if kinds is None:
        return None
    window = None
    if SLIDING in kinds:
        window = r.take_int("sliding_window", "keys a sliding layer sees, the query included", **d("sliding_window"))
        if window is None:
            return None
    elif r.has("sliding_window"):
        r.meta("sliding_window", "no layer slides")
    if r.has("sliding_window_size"):  # Gemma 2's released configs carry this older spelling too
        if r.config["sliding_window_size"] == r.config.get("sliding_window"):
            r.meta("sliding_window_size", "the legacy spelling of sliding_window; equal to it")
        else:
            r.refuse("sliding_window_size", f"sliding_window_size {r.config['sliding_window_size']!r} disagrees with "
                                            f"sliding_window {r.config.get('sliding_window')!r}")
            return None
    if v.rope_per_kind:
        ropes = _gemma3_ropes(r, hd)
        if ropes is None:
            return None
        positions = [ropes[k] for k in kinds]
    else:
        pos = rope_policy(r, hd)
        if pos is None:
            return None
        positions = [pos] * L
    spans = ["sliding" if k == SLIDING else "full" for k in kinds]
    qk = {"kind": "rms", "eps": float(eps), "weight_offset": 1.0, "scope": "head"} if v.qk_norm else None
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": float(H ** 0.5)},
        "residual": {"multiplier": 1.0},
        "attention": attention_surface(nh, nkv, hd, {k: bool(abias) for k in "qkvo"}, score, qk_norm=qk,
                                       logit_softcap=attn_cap),
        "ffn": {"kind": "gated", "activation": ACTIVATIONS[act], "intermediate_size": inter, "bias": False,
                "fused_gate_up": False},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 1.0, "placement": "pre_post" if v.sandwich else "pre_only"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": final_cap},
        "operators": {},
        "context_length": ctx,
    }
    return layer_entries(L, positions, "dense", spans, window), surface


def _null(r: ConfigReader, key: str) -> None:
    if r.has(key):
        r.meta(key, "null: none")


def layer_table(sandwich: bool) -> dict:
    norms = ({"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "post_attn_norm",
              "pre_feedforward_layernorm.weight": "ffn_norm", "post_feedforward_layernorm.weight": "post_ffn_norm"}
             if sandwich else {"input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm"})
    return {**norms, **ATTENTION_ROLES, "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
            "mlp.down_proj.weight": "ffn_down"}


def _place(r: ConfigReader, src, layers, surface, P: str, tied: bool, family: str, sandwich: bool,
           aside: tuple[tuple[str, str, str], ...] = (), head: str = "lm_head.") -> Lowering:
    prefixes = ((P + "embed_tokens.", "embedding"), (P + "layers.", "decoder_stack"), (P + "norm.", "final_norm"),
                (head, "output_head"))
    graph = assemble_graph(src.name, family, tied, layers, surface)
    table = layer_table(sandwich)
    placements, dropped = place_tensors(_Without(src, [a[0] for a in aside]), graph, r, tied, prefixes,
                                        lambda i: ("softmax", table))
    low = Lowering(graph=graph, placements=placements, dropped=dropped, not_carried_components=[])
    for prefix, component, why in aside:
        _set_aside(r, src, prefix, component, "perception", why, low)
    return low


def _build_text(model_type: str):
    def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
        tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=True,
                           default_reason="the Gemma reference ties its head unless told not to")
        got = lower_gemma(r, model_type, bool(tied)) if tied is not None else None
        if got is None:
            return None
        return _place(r, src, *got, "model.", bool(tied), model_type, VARIANTS[model_type].sandwich)

    return build


VISION_WHY = "this build executes the primary_text component only; the vision tower is not executed"


def build_gemma3(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    tc = r.config.get("text_config")
    if not isinstance(tc, dict):
        r.refuse("text_config", f"the text model's config is {'absent' if tc is None else 'not an object'}; nothing to "
                                "admit", category="structure")
        return None
    r._grade("text_config", CONSUMED, "the text model (gemma3_text), admitted as the primary_text component")
    if r.has("vision_config"):
        r._grade("vision_config", METADATA, "the vision tower's config (a perception component): not carried")
    for key in ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index", "image_token_id",
                "boi_token_id", "eoi_token_id"):
        r.meta(key, "a multimodal fact; this build runs the text component only")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding (the VL model ties by this key)",
                       default=True, default_reason="the Gemma 3 reference ties its head unless told not to")
    tr = ConfigReader(tc)
    if "model_type" in tc:
        if tc["model_type"] == "gemma3_text":
            tr._grade("model_type", CONSUMED, "the text model is gemma3_text")
        else:
            tr.refuse("model_type", f"a gemma3 checkpoint's text model is gemma3_text, found {tc['model_type']!r}")
    if "tie_word_embeddings" in tc:
        if bool(tc["tie_word_embeddings"]) == bool(tied):
            tr.meta("tie_word_embeddings", "agrees with the top-level key, which the VL model ties by")
        else:
            tr.refuse("tie_word_embeddings", f"disagrees with the top-level tie_word_embeddings ({tied!r}), which the VL "
                                             "model ties by; refusing rather than choosing one")
    got = lower_gemma(tr, "gemma3_text", bool(tied), vl=True) if tied is not None else None
    tr.finish(stopped=got is None)
    for f in tr.findings:
        r.graded.add(f"text_config.{f.key}")
        r.findings.append(f.model_copy(update={"key": f"text_config.{f.key}"}))
    if got is None or any(f.blocks for f in tr.findings):
        return None
    # the released layout (language_model.model.*, vision_tower.*) or transformers 5's own
    # (model.language_model.*, model.vision_tower.*): whichever the checkpoint holds
    released = any(n.startswith("language_model.model.") for n in src.tensor_specs())
    outer, P, head = ("", "language_model.model.", "language_model.lm_head.") if released else \
        ("model.", "model.language_model.", "lm_head.")
    aside = ((outer + "vision_tower.", "vision tower", VISION_WHY),
             (outer + "multi_modal_projector.", "multimodal projector", VISION_WHY))
    return _place(r, src, *got, P, bool(tied), "gemma3", True, aside, head)


for _mt in VARIANTS:
    register_family(_mt, _mt, _build_text(_mt))
register_family("gemma3", "gemma3", build_gemma3)
