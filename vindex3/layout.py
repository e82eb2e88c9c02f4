"""The layer skeleton every operator sits in: which norms surround the mixer and the FFN under
each norm placement, and the order of a layer's ops. Operators fill the two slots; this module
never names an operator.

    [pre-norm] mixer [post-norm] residual-add   ([pre-norm] ffn [post-norm] residual-add)

Under a parallel placement both slots read the layer's input (GPT-NeoX's parallel residual, Phi):

    h + mixer(norm_a(h)) + ffn(norm_b(h))       (parallel_shared: norm_b is norm_a)

A LayerNorm (norm kind ``layer``) has a bias beside each weight: role ``<norm role>_bias``.
"""

from __future__ import annotations

# placement -> slot -> (norm role before the slot's op, norm role after it); None: no norm there
NORMS: dict[str, dict[str, tuple[str | None, str | None]]] = {
    "pre_only": {"mixer": ("attn_norm", None), "ffn": ("ffn_norm", None)},
    "pre_post": {"mixer": ("attn_norm", "post_attn_norm"), "ffn": ("ffn_norm", "post_ffn_norm")},
    "post_only": {"mixer": (None, "post_attn_norm"), "ffn": (None, "post_ffn_norm")},
    "pre_mixer": {"mixer": ("mixer_norm", None), "ffn": ("ffn_norm", None)},
    "parallel": {"mixer": ("attn_norm", None), "ffn": ("ffn_norm", None)},
    "parallel_shared": {"mixer": ("attn_norm", None), "ffn": ("attn_norm", None)},
}
# placements whose FFN reads the layer's input, not the residual after the mixer
PARALLEL = frozenset({"parallel", "parallel_shared"})


def norm_roles(placement: str, slots: list[str], bias: bool = False) -> list[str]:
    """The norm operand roles a layer with these slots needs under ``placement`` (each once; with
    ``bias``, every norm's bias role after its weight)."""
    out: list[str] = []
    for slot in slots:
        for r in NORMS[placement][slot]:
            if r is not None and r not in out:
                out += [r, f"{r}_bias"] if bias else [r]
    return out
