"""LFM2's gated short convolution, one sequence, float32 end to end.

Semantics follow transformers 5.24.0 ``Lfm2ShortConv`` (its torch path): ``in_proj`` (bias when
declared) splits into B, C and x [hidden] each, in that order; the causal depthwise conv (kernel
``conv_kernel``, no activation) runs over B·x; the output is ``out_proj(C · conv)``. The only
state is the conv window, the last ``conv_kernel − 1`` values of B·x (vindex3.exec.ops.conv);
prefill and decode run the same compiled conv.
"""

from __future__ import annotations

import numpy as np

from .conv import causal_conv, taps


class Prepared:
    """A layer's operands, ready once per executor."""

    __slots__ = ("conv_bias", "in_proj", "in_proj_bias", "out_proj", "out_proj_bias", "taps")

    def __init__(self, operands: dict):
        self.in_proj = operands["in_proj"]
        self.in_proj_bias = operands.get("in_proj_bias")
        self.taps = taps(operands["conv_weight"])
        self.conv_bias = operands.get("conv_bias")
        self.out_proj = operands["out_proj"]
        self.out_proj_bias = operands.get("out_proj_bias")


def short_conv_forward(x: np.ndarray, p, w: Prepared, window: np.ndarray) -> np.ndarray:
    """``x`` [T, hidden] (the normed layer input) -> [T, hidden], continuing ``window``
    [conv_kernel − 1, hidden] (advanced in place). ``p``: `vindex3.operators.short_conv.ShortConvParams`."""
    H = p.hidden_size
    bcx = w.in_proj.mm(x)
    if w.in_proj_bias is not None:
        bcx += w.in_proj_bias
    conv = causal_conv(window, bcx[:, :H] * bcx[:, 2 * H:], w.taps, w.conv_bias, False)
    out = w.out_proj.mm(bcx[:, H:2 * H] * conv)
    if w.out_proj_bias is not None:
        out += w.out_proj_bias
    return out
