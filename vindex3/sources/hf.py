"""A Hugging Face checkpoint directory: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Admission reads safetensors headers only."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

from .. import jsonio
from ..errors import ConfigError, ContainerNotFound
from .base import CAPABILITY_FILES, CheckpointSource, TensorSpec

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64, "I64": np.int64, "I32": np.int32}


class HfCheckpoint(CheckpointSource):
    """A Hugging Face directory: config.json plus model.safetensors, or shards listed in
    model.safetensors.index.json. Admission reads safetensors headers only."""

    kind = "hf"

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ContainerNotFound(f"checkpoint {self.path} is not a directory")
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise ConfigError(f"checkpoint {self.path.name} has no config.json")
        self.config = jsonio.load(cfg)
        if not isinstance(self.config, dict):
            raise ConfigError(f"{self.path.name}/config.json is not a JSON object")
        self._shards = self._find_shards()
        self._specs: dict[str, TensorSpec] | None = None
        self._where: dict[str, tuple[Path, int, int]] = {}

    def _find_shards(self) -> list[Path]:
        idx = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if idx.exists():
            wm = jsonio.load(idx).get("weight_map")
            if not isinstance(wm, dict):
                raise ConfigError(f"{self.path.name}/model.safetensors.index.json has no weight_map")
            shards = sorted({self.path / f for f in wm.values()})
            for s in shards:
                if not s.exists():
                    raise ConfigError(f"shard {s.name} named by model.safetensors.index.json is missing")
            return shards
        if single.exists():
            return [single]
        raise ConfigError(
            f"checkpoint {self.path.name} has no model.safetensors or model.safetensors.index.json"
        )

    @staticmethod
    def _read_header(path: Path) -> tuple[dict, int]:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ConfigError(f"{path.name}: truncated safetensors file")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(n))
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path.name}: safetensors header is not JSON ({e})") from None
        return header, 8 + n

    def tensor_specs(self) -> dict[str, TensorSpec]:
        if self._specs is None:
            specs: dict[str, TensorSpec] = {}
            for shard in self._shards:
                header, base = self._read_header(shard)
                for name, meta in header.items():
                    if name == "__metadata__":
                        continue
                    specs[name] = TensorSpec(name, meta["dtype"], tuple(meta["shape"]))
                    start, end = meta["data_offsets"]
                    self._where[name] = (shard, base + start, end - start)
            self._specs = specs
        return self._specs

    def load(self, name: str) -> np.ndarray:
        spec = self.tensor_specs()[name]
        shard, off, n = self._where[name]
        with open(shard, "rb") as f:
            f.seek(off)
            raw = f.read(n)
        if spec.dtype == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            return u16.view(np.float32).reshape(spec.shape)
        dt = _ST_DTYPES.get(spec.dtype)
        if dt is None:
            raise ConfigError(f"tensor {name} has dtype {spec.dtype}, which has no exact float32 widening")
        arr = np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<")).reshape(spec.shape)
        if arr.dtype.kind == "f" and arr.dtype.itemsize > 4:
            raise ConfigError(f"tensor {name} is {spec.dtype}; narrowing to float32 would not be exact")
        return arr.astype(np.float32)

    def capability_files(self) -> dict[str, bytes]:
        return {n: (self.path / n).read_bytes() for n in CAPABILITY_FILES if (self.path / n).exists()}

    def not_carried(self, capabilities: set[str]) -> list[str]:
        known = {"config.json", "model.safetensors", "model.safetensors.index.json", *capabilities}
        known |= {s.name for s in self._shards}
        return sorted(p.name for p in self.path.iterdir() if p.name not in known)

    def provenance(self) -> dict:
        h = hashlib.sha256((self.path / "config.json").read_bytes())
        return {
            "source_kind": "hf",
            "source_name": self.path.name,
            "config_sha256": h.hexdigest(),
            "shards": [s.name for s in self._shards],
        }
