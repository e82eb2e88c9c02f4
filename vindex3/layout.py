"""The layer skeleton every operator sits in: which norms surround the mixer and the FFN under
each norm placement, and the order of a layer's ops. Operators fill the two slots; this module
never names an operator.

    [pre-norm] mixer [post-norm] residual-add   ([pre-norm] ffn [post-norm] residual-add)
"""

from __future__ import annotations

# placement -> slot -> (norm role before the slot's op, norm role after it); None: no norm there
NORMS: dict[str, dict[str, tuple[str | None, str | None]]] = {
    "pre_only": {"mixer": ("attn_norm", None), "ffn": ("ffn_norm", None)},
    "pre_post": {"mixer": ("attn_norm", "post_attn_norm"), "ffn": ("ffn_norm", "post_ffn_norm")},
    "post_only": {"mixer": (None, "post_attn_norm"), "ffn": (None, "post_ffn_norm")},
    "pre_mixer": {"mixer": ("mixer_norm", None), "ffn": ("ffn_norm", None)},
}


def norm_roles(placement: str, slots: list[str]) -> list[str]:
    """The norm operand roles a layer with these slots needs under ``placement``."""
    out = []
    for slot in slots:
        out += [r for r in NORMS[placement][slot] if r is not None]
    return out
