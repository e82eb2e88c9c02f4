"""The operators this build ships; importing this module registers them."""

from . import (  # noqa: F401
    gated_delta,
    gated_ffn,
    gated_ffn_mup,
    kda,
    mamba1,
    mamba2,
    mamba2_mup,
    mla,
    mlp_ffn,
    moe_ffn,
    parallel,
    rg_lru,
    short_conv,
    softmax,
)
