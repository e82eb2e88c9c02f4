"""The operators this build ships; importing this module registers them."""

from . import gated_delta, gated_ffn, mamba2, softmax  # noqa: F401
