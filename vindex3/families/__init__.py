"""Model families known at the import boundary. Importing this package registers them."""

from . import (  # noqa: F401
    decoder,
    granitemoehybrid,
    mamba2,
    qwen3_next,
)
