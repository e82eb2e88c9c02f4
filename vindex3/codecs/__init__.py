"""Weight encodings, one module per encoding, registered by name (see base.py).

Adding an encoding is one module here (a `Codec` and its `Weight` with its kernels) plus its
import below; nothing in the operators or the executor changes."""

from . import f32  # noqa: F401  (registers on import)
from .base import Codec, Weight, get, is_known, known, register

__all__ = ["Codec", "Weight", "get", "is_known", "known", "register"]
