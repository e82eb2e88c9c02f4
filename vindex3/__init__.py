"""VINDEX3: a container format for language models, and a plan-driven numpy executor."""

__version__ = "0.1.0"

from .admit import AdmissionPlan, admit  # noqa: E402
from .container import Container, open, verify  # noqa: E402,A004
from .encode import encode  # noqa: E402
from .exec.slice import Draft, Full, LayerRange  # noqa: E402

__all__ = ["AdmissionPlan", "Container", "Draft", "Full", "LayerRange", "admit", "encode", "open", "verify", "__version__"]
