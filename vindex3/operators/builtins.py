"""The operators this build ships; importing this module registers them."""

from . import gated_ffn, mamba2, moe_ffn, softmax  # noqa: F401
