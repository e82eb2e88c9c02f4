"""Checkpoint sources, one module per source kind: Hugging Face directories (hf.py) and GGUF
files (gguf.py). Each yields a config dict, tensor specs from headers, tensors on demand and the
capability files to snapshot."""

from __future__ import annotations

from pathlib import Path

from ..errors import ContainerNotFound
from .base import CAPABILITY_FILES, CheckpointSource, TensorSpec
from .hf import HfCheckpoint

__all__ = ["CAPABILITY_FILES", "CheckpointSource", "HfCheckpoint", "TensorSpec", "open_source"]


def open_source(path: str | Path) -> CheckpointSource:
    """A checkpoint directory or a .gguf file."""
    p = Path(path)
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ContainerNotFound(f"GGUF file {p} does not exist")
        from .gguf import GgufCheckpoint  # imports the gguf package: only when a GGUF is opened

        return GgufCheckpoint(p)
    if not p.exists():
        raise ContainerNotFound(f"checkpoint {p} does not exist")
    return HfCheckpoint(p)
