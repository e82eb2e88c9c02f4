"""RecurrentGemma (transformers' ``recurrent_gemma``, Griffin): RG-LRU recurrent blocks
interleaved with local (sliding-window) attention, so every state a layer keeps is bounded: a
recurrence and a conv window, or KV rows capped at the window.

Layout: ``model.embed_tokens``, ``model.layers.N.temporal_pre_norm`` (before the mixer),
``temporal_block.{linear_y, linear_x, conv_1d, rg_lru.*, linear_out}`` (an ``rg_lru`` layer) or
``temporal_block.{q,k,v,o}_proj`` (a sliding ``softmax`` layer: o_proj always biased, partial
rotary), ``channel_pre_norm``, ``mlp_block.{gate,up,down}_proj`` (biased, tanh-GELU gated, width
intermediate_size / 2), ``model.final_norm``, ``lm_head``. Every norm is (1 + w); embeddings are
scaled by sqrt(hidden_size) as the reference holds it, in bfloat16; logits are soft-capped.

The layer pattern is the config's own ``block_types``, repeated over the layers as the reference
does; a config that does not declare it is refused by name (the reference would assume
recurrent, recurrent, attention).
"""

from __future__ import annotations

import numpy as np

from ..sources import CheckpointSource
from .base import ConfigReader, Lowering, register_family
from .placement import assemble_graph, place_tensors

PREFIXES = (
    ("model.embed_tokens.", "embedding"),
    ("model.layers.", "decoder_stack"),
    ("model.final_norm.", "final_norm"),
    ("lm_head.", "output_head"),
)
COMMON = {
    "temporal_pre_norm.weight": "mixer_norm",
    "channel_pre_norm.weight": "ffn_norm",
    **{f"mlp_block.{p}_proj.{w}": f"ffn_{p}{'_bias' if w == 'bias' else ''}" for p in ("gate", "up", "down")
       for w in ("weight", "bias")},
}
RECURRENT_ROLES = {
    **COMMON,
    **{f"temporal_block.{n}.{w}": f"{n}{'_bias' if w == 'bias' else ''}" for n in ("linear_y", "linear_x", "linear_out")
       for w in ("weight", "bias")},
    "temporal_block.conv_1d.weight": "conv_weight",
    "temporal_block.conv_1d.bias": "conv_bias",
    **{f"temporal_block.rg_lru.{n}": n for n in ("input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                                                  "recurrent_gate_bias", "recurrent_param")},
}
ATTENTION_ROLES = {
    **COMMON,
    **{f"temporal_block.{p}_proj.weight": f"{p}_proj" for p in "qkvo"},
    **{f"temporal_block.{p}_proj.bias": f"{p}_bias" for p in "qkvo"},
}
BLOCKS = {"recurrent": "rg_lru", "attention": "softmax"}
LOG_DECAY_SCALE = 8.0  # the reference's constant c in log a = -c · r · softplus(Λ)


def bf16(v: float) -> float:
    """``v`` rounded to bfloat16 (nearest, ties to even), as a float: what the reference's
    ``torch.tensor(v, dtype=torch.bfloat16)`` holds."""
    bits = int(np.array(v, np.float32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits, np.uint32).view(np.float32))


def build(r: ConfigReader, src: CheckpointSource) -> Lowering | None:
    H = r.take_int("hidden_size", "residual width")
    L = r.take_int("num_hidden_layers", "number of residual blocks")
    vocab = r.take_int("vocab_size", "vocabulary size")
    inter = r.take_int("intermediate_size", "twice the FFN width (the reference's MLP is intermediate_size // 2 wide)")
    nh = r.take_int("num_attention_heads", "query heads, and the RG-LRU gates' blocks")
    nkv = r.take("num_key_value_heads", "key/value heads (null: as many as query heads)", default=None,
                 default_reason="the reference uses num_attention_heads")
    lru = r.take("lru_width", "RG-LRU width (null: hidden_size)", default=None, default_reason="the reference uses hidden_size")
    window = r.take_int("attention_window_size", "local attention window (keys, the query's own included)", default=2048,
                        default_reason="the reference default is 2048")
    K = r.take_int("conv1d_width", "the recurrent block's conv width", default=4, default_reason="the reference default is 4")
    cap = r.take_number("logits_soft_cap", "logits are soft-capped: tanh(x / cap) · cap", minimum=0, nonzero=True,
                        default=30.0, default_reason="the reference default is 30")
    eps = r.take_number("rms_norm_eps", "epsilon of every (1 + w) RMSNorm", minimum=0, default=1e-6,
                        default_reason="the reference default is 1e-6")
    act = r.take("hidden_activation", "the y branch's and the FFN gate's activation", default="gelu_pytorch_tanh",
                 default_reason="the reference default is gelu_pytorch_tanh")
    bias = r.take_bool("attention_bias", "bias on q/k/v (o_proj always has one)", default=False,
                       default_reason="the reference default has none")
    tied = r.take_bool("tie_word_embeddings", "output head shares the embedding", default=True,
                       default_reason="the reference default is tied")
    ctx_ok, ctx = r.context_length()
    for key, why in (("w_init_variance_scale", "an initialisation scale; trained weights carry the result"),
                     ("final_w_init_variance_scale", "an initialisation scale; trained weights carry the result"),
                     ("is_encoder_decoder", "a generic config flag; a causal LM is not an encoder-decoder")):
        r.ignore(key, why)
    if None in (H, L, vocab, inter, nh, window, K, cap, eps, bias, tied) or not ctx_ok:
        return None
    if act != "gelu_pytorch_tanh":
        r.refuse("hidden_activation", f"{act!r} has no executor here (supported: gelu_pytorch_tanh)")
        return None
    if not r.has("block_types"):
        r.refuse("block_types", "no layer pattern declared; the reference would assume (recurrent, recurrent, attention): "
                                "refusing rather than assuming it", category="structure")
        return None
    blocks = r.take("block_types", "the layer pattern, repeated over the layers (recurrent: rg_lru, attention: local softmax)")
    if not isinstance(blocks, list) or not blocks or any(b not in BLOCKS for b in blocks):
        r.refuse("block_types", f"expected a non-empty list of {' / '.join(BLOCKS)}, found {blocks!r}")
        return None
    ops = [BLOCKS[blocks[i % len(blocks)]] for i in range(L)]
    nkv = nh if nkv is None else nkv
    lru = H if lru is None else lru
    if isinstance(nkv, bool) or not isinstance(nkv, int) or nkv < 1 or nh % nkv:
        r.refuse("num_key_value_heads", f"expected a positive divisor of {nh} query heads, found {nkv!r}")
        return None
    if isinstance(lru, bool) or not isinstance(lru, int) or lru < 1 or lru % nh:
        r.refuse("lru_width", f"expected a positive multiple of {nh} heads, found {lru!r}")
        return None
    hd = H // nh
    if r.has("head_dim"):  # the reference recomputes it as hidden_size // heads
        if r.config["head_dim"] != hd:
            r.refuse("head_dim", f"is {r.config['head_dim']!r}, but the reference recomputes it as hidden_size // heads = {hd}")
            return None
        r.take("head_dim", "per-head width (hidden_size // heads, as the reference recomputes it)")
    rope = r.take("rope_parameters", "rotary position encoding (default rope, partial)", default=None,
                  default_reason="absent: refused below")
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or set(rope) - {
            "rope_type", "rope_theta", "partial_rotary_factor"}:
        r.refuse("rope_parameters", f"expected default rope with rope_theta and partial_rotary_factor, found {rope!r}")
        return None
    theta, partial = rope.get("rope_theta"), rope.get("partial_rotary_factor", 0.5)
    rd = int(hd * partial) if isinstance(partial, (int, float)) and not isinstance(partial, bool) and 0 < partial <= 1 else 0
    if not (isinstance(theta, (int, float)) and not isinstance(theta, bool) and theta > 0) or rd < 2 or rd % 2:
        r.refuse("rope_parameters", f"needs a positive rope_theta and an even rotary width (head_dim · partial), found {rope!r}")
        return None
    position = {"kind": "rope", "theta": float(theta), "rotary_dims": rd, "scaling": None}
    surface = {
        "hidden_size": H,
        "embedding": {"multiplier": bf16(H ** 0.5)},
        "residual": {"multiplier": 1.0},
        "ffn": {"kind": "gated", "activation": "gelu_tanh", "intermediate_size": inter // 2, "bias": True,
                "fused_gate_up": False},
        "norms": {"kind": "rms", "eps": float(eps), "weight_offset": 1.0, "placement": "pre_mixer"},
        "head": {"vocab": vocab, "tied": bool(tied), "multiplier": 1.0, "softcap": float(cap)},
        "operators": {},
        "context_length": ctx,
    }
    if "softmax" in ops:
        surface["attention"] = {
            "heads": nh, "kv_heads": nkv, "head_dim": hd, "output_gate": False, "head_mapping": "repeat_interleave",
            "query_scale": 1.0, "score_scale": float(hd) ** -0.5, "bias": {"q": bias, "k": bias, "v": bias, "o": True},
            "qk_norm": None, "qkv_clip": None, "sinks": None,
        }
    if "rg_lru" in ops:
        surface["operators"]["rg_lru"] = {"lru_width": lru, "num_heads": nh, "conv_kernel": K, "activation": "gelu_tanh",
                                          "log_decay_scale": LOG_DECAY_SCALE}
    layers = [{"index": i, "operator": op, "span": "sliding" if op == "softmax" else None,
               "window": window if op == "softmax" else None, "position": position if op == "softmax" else None,
               "ffn": "dense", "operands": {}} for i, op in enumerate(ops)]
    graph = assemble_graph(src.name, "recurrent_gemma", bool(tied), layers, surface)
    tables = {"rg_lru": RECURRENT_ROLES, "softmax": ATTENTION_ROLES}
    placements, dropped = place_tensors(src, graph, r, bool(tied), PREFIXES, lambda i: (ops[i], tables[ops[i]]))
    return Lowering(graph=graph, placements=placements, dropped=dropped)


register_family("recurrent_gemma", "recurrent_gemma", build)
