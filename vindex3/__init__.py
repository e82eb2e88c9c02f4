"""VINDEX3: a container format for language models, and a plan-driven numpy executor."""

__version__ = "0.1.0"

from .admit import AdmissionPlan, admit
from .container import Container, open, verify
from .encode import encode
from .exec.slice import Draft, Full, LayerRange

__all__ = ["AdmissionPlan", "Container", "Draft", "Full", "LayerRange", "__version__", "admit", "encode", "open", "verify"]
