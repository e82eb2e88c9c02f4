"""Model families known at the import boundary. Importing this package registers them."""

from . import (  # noqa: F401
    decoder,
    deepseek_v3,
    gemma,
    gpt,
    granitemoehybrid,
    kimi_linear,
    mamba2,
    moe,
    olmo2,
    phi,
    qwen3_next,
)
