"""The operators this build ships; importing this module registers them."""

from . import gated_ffn, kda, mamba2, mla, softmax  # noqa: F401
