"""The operators this build ships; importing this module registers them."""

from . import gated_delta, gated_ffn, kda, mamba1, mamba2, mla, moe_ffn, short_conv, softmax  # noqa: F401
