"""The operators this build ships; importing this module registers them."""

from . import gated_delta, gated_ffn, kda, mamba2, mla, mlp_ffn, moe_ffn, softmax  # noqa: F401
