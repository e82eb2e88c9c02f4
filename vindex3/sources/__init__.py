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
    """A checkpoint directory or a .gguf file (checked as a path first: a name too long, a FIFO
    or a device is refused by name)."""
    from ..errors import PathRefused
    from ..paths import check_text, existing_dir, existing_file

    try:
        p = check_text(path, "checkpoint")
        if p.suffix.lower() == ".gguf":
            try:
                existing_file(p, "GGUF file")
            except PathRefused as e:
                if e.reason == "missing":
                    raise ContainerNotFound(f"GGUF file {p} does not exist") from None
                raise
            from .gguf import GgufCheckpoint  # imports the gguf package: only when a GGUF is opened

            return GgufCheckpoint(p)
        try:
            existing_dir(p, "checkpoint")
        except PathRefused as e:
            if e.reason == "missing":
                raise ContainerNotFound(f"checkpoint {p} does not exist") from None
            if e.reason == "not_a_directory":
                raise ContainerNotFound(f"checkpoint {p} is not a directory") from None
            raise
    except PathRefused as e:
        raise ContainerNotFound(e.message) from None
    return HfCheckpoint(p)
