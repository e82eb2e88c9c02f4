"""What every checkpoint source provides: the import boundary. A source yields a config dict
(as a Hugging Face config.json would), tensor specs read from headers only, tensors on demand,
and the capability files (tokenizer, generation config, chat template) to snapshot.

Hugging Face tensor spellings and file layouts live here and in admission, nowhere past them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

CAPABILITY_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # source dtype spelling, e.g. "F32", "BF16", "Q4_1"
    shape: tuple[int, ...]


class CheckpointSource:
    """Common interface of every importable checkpoint."""

    kind: str  # "hf" | "gguf"
    path: Path
    config: dict

    @property
    def name(self) -> str:
        return self.path.name

    def tensor_specs(self) -> dict[str, TensorSpec]:
        raise NotImplementedError

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32, exactly (widening only; quantized formats dequantized)."""
        raise NotImplementedError

    def load_stored(self, name: str) -> np.ndarray:
        """The tensor as stored, for packing a quantized matrix (vindex3.codecs.packing): 1-byte
        codes (U8, I8, F8_*) as uint8 arrays of the tensor's shape, anything else as `load` gives it."""
        return self.load(name)

    def native_encoding(self, name: str) -> tuple[str, int] | None:
        """(container encoding, stored bytes) the tensor's own bytes are, read from headers only,
        when a native encode can write them as they are (a codec may or may not exist for that
        encoding: one without is carried and refused when executed); None when the source stores
        the tensor in no such form (it is then widened with `load`)."""
        return None

    def encoded(self, name: str) -> np.ndarray:
        """The tensor's bytes in its `native_encoding`, as a 1-D uint8 array in the container's
        layout for that encoding (the same values `load` gives, exactly)."""
        raise NotImplementedError

    def capability_files(self) -> dict[str, bytes]:
        raise NotImplementedError

    def provenance(self) -> dict:
        raise NotImplementedError

    def not_carried(self, capabilities: set[str]) -> list[str]:
        """Files beside the checkpoint that an encode leaves behind (reported, never silently)."""
        return []
