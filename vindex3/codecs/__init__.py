"""Weight encodings, one module per encoding, registered by name (see base.py).

Adding an encoding is one module here (a `Codec` and its `Weight` with its kernels) plus its
import below; nothing in the operators or the executor changes. The numba kernels
(kernels.py) are imported only when a weight is first multiplied or decoded."""

from . import f32, fp8, ggml, half, int8, nvfp4, q4  # noqa: F401  (register on import)
from .base import (
    ACTIVATIONS,
    Codec,
    Weight,
    WeightShapeError,
    cannot_execute,
    check_activations,
    get,
    is_known,
    known,
    register,
    targets,
)
from .fidelity import Fidelity, measure

__all__ = ["ACTIVATIONS", "Codec", "Fidelity", "Weight", "WeightShapeError", "cannot_execute", "check_activations", "get", "is_known", "known", "measure", "register", "targets"]
