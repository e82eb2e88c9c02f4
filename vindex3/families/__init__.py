"""Model families known at the import boundary. Importing this package registers them."""

from . import (  # noqa: F401
    bamba,
    decoder,
    deepseek_v3,
    falcon_h1,
    gemma,
    gpt,
    granitemoehybrid,
    kimi_linear,
    lfm2,
    mamba,
    mamba2,
    moe,
    olmo2,
    phi,
    qwen3_next,
    recurrent_gemma,
)
