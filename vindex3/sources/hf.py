"""A Hugging Face checkpoint directory: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Admission reads safetensors headers only."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import struct
from pathlib import Path

import numpy as np

from .. import jsonio
from ..errors import ConfigError, ContainerNotFound, PathRefused
from ..paths import existing_file, open_regular, read_regular
from .base import CAPABILITY_FILES, CheckpointSource, TensorSpec

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None, "F64": np.float64, "I64": np.int64, "I32": np.int32}
_ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_BYTE_CODES = ("U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0")  # read as stored by load_stored
MAX_ST_HEADER = 100 << 20  # safetensors' own reader refuses headers above 100 MB


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
            doc = jsonio.load(idx)
            wm = doc.get("weight_map") if isinstance(doc, dict) else None
            if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
                raise ConfigError(f"{self.path.name}/model.safetensors.index.json has no weight_map of tensor -> shard file")
            shards = []
            for f in sorted(set(wm.values())):
                try:
                    shards.append(existing_file(f, f"shard {f!r} named by model.safetensors.index.json", within=self.path))
                except PathRefused as e:
                    raise ConfigError(e.message) from None
            return shards
        if single.exists():
            return [single]
        raise ConfigError(
            f"checkpoint {self.path.name} has no model.safetensors or model.safetensors.index.json"
        )

    @staticmethod
    def _read_header(path: Path) -> tuple[dict, int, int]:
        """A safetensors header: (tensor entries, payload start, payload bytes), every field typed
        and every tensor's bytes inside the file; anything else is a named ConfigError."""
        with open_regular(path, f"safetensors file {path.name}") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise ConfigError(f"{path.name}: truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ConfigError(f"{path.name}: safetensors header length {n:,} exceeds the file size {size:,}")
            if n > MAX_ST_HEADER:
                raise ConfigError(f"{path.name}: safetensors header length {n:,} exceeds the {MAX_ST_HEADER:,} bytes a header may take")
            data = f.read(n)
        try:
            header = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path.name}: safetensors header is not JSON ({e})") from None
        except RecursionError:
            raise ConfigError(f"{path.name}: safetensors header JSON is nested too deeply") from None
        if not isinstance(header, dict):
            raise ConfigError(f"{path.name}: safetensors header is not a JSON object (found {type(header).__name__})")
        base = 8 + n
        payload = size - base
        spans = []
        for name, meta in header.items():
            if name == "__metadata__":
                if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
                    raise ConfigError(f"{path.name}: safetensors __metadata__ must map names to strings")
                continue
            where = f"{path.name}: tensor {name!r}"
            ok = (isinstance(meta, dict) and isinstance(meta.get("dtype"), str) and isinstance(meta.get("shape"), list)
                  and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in meta["shape"])
                  and isinstance(meta.get("data_offsets"), list) and len(meta["data_offsets"]) == 2
                  and all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in meta["data_offsets"]))
            if not ok:
                raise ConfigError(f"{where}: header entry must be {{dtype: str, shape: [int], data_offsets: [int, int]}}, "
                                  f"found {str(meta)[:160]}")
            start, end = meta["data_offsets"]
            if not start <= end <= payload:
                raise ConfigError(f"{where}: data_offsets [{start}, {end}] are not inside the {payload:,}-byte payload")
            item = _ITEMSIZE.get(meta["dtype"])
            if item is not None and end - start != math.prod(meta["shape"]) * item:
                raise ConfigError(f"{where}: {meta['dtype']} {meta['shape']} takes {math.prod(meta['shape']) * item} bytes, "
                                  f"data_offsets span {end - start}")
            spans.append((start, end, name))
        spans.sort()
        for (a0, a1, an), (b0, _, bn) in itertools.pairwise(spans):
            if b0 < a1 and a1 > a0:
                raise ConfigError(f"{path.name}: tensors {an!r} and {bn!r} overlap in the payload")
        return header, base, payload

    def tensor_specs(self) -> dict[str, TensorSpec]:
        if self._specs is None:
            specs: dict[str, TensorSpec] = {}
            for shard in self._shards:
                header, base, _ = self._read_header(shard)
                for name, meta in header.items():
                    if name == "__metadata__":
                        continue
                    if name in specs:
                        raise ConfigError(f"tensor {name!r} appears in two shards ({self._where[name][0].name}, {shard.name})")
                    specs[name] = TensorSpec(name, meta["dtype"], tuple(meta["shape"]))
                    start, end = meta["data_offsets"]
                    self._where[name] = (shard, base + start, end - start)
            self._specs = specs
        return self._specs

    def load(self, name: str) -> np.ndarray:
        """The tensor as float32, exactly: BF16 and F16 widen exactly; an integer tensor is
        accepted only when every value survives the trip to float32 and back; F64 is refused."""
        spec = self.tensor_specs()[name]
        shard, off, n = self._where[name]
        with open_regular(shard, f"safetensors file {shard.name}") as f:
            f.seek(off)
            raw = f.read(n)
        if len(raw) != n:
            raise ConfigError(f"{shard.name}: tensor {name} is cut short ({len(raw)} of {n} bytes); the file is truncated")
        if spec.dtype == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            return u16.view(np.float32).reshape(spec.shape)
        dt = _ST_DTYPES.get(spec.dtype)
        if dt is None:
            raise ConfigError(f"tensor {name} has dtype {spec.dtype}, which has no exact float32 widening")
        arr = np.frombuffer(raw, dtype=np.dtype(dt).newbyteorder("<")).reshape(spec.shape)
        if arr.dtype.kind == "f" and arr.dtype.itemsize > 4:
            raise ConfigError(f"tensor {name} is {spec.dtype}; narrowing to float32 would not be exact")
        out = arr.astype(np.float32)
        if arr.dtype.kind in "iu":
            # float32 holds every integer up to 2**24 exactly, and some beyond: compare the round trip
            big = np.abs(out) >= np.float32(2.0**62)
            back = np.where(big, 0, out).astype(np.int64)
            lossy = big | (back != arr.astype(np.int64))
            if lossy.any():
                first = int(np.flatnonzero(lossy.reshape(-1))[0])
                raise ConfigError(f"tensor {name} is {spec.dtype} and {int(lossy.sum())} of its values have no exact float32 "
                                  f"(first at flat index {first}: {int(arr.reshape(-1)[first])}); refusing a lossy widening")
        return out

    def load_stored(self, name: str) -> np.ndarray:
        spec = self.tensor_specs()[name]
        if spec.dtype not in _BYTE_CODES:
            return self.load(name)
        shard, off, n = self._where[name]
        with open_regular(shard, f"safetensors file {shard.name}") as f:
            f.seek(off)
            raw = f.read(n)
        if len(raw) != n:
            raise ConfigError(f"{shard.name}: tensor {name} is cut short ({len(raw)} of {n} bytes); the file is truncated")
        return np.frombuffer(raw, dtype=np.uint8).reshape(spec.shape).copy()

    def capability_files(self) -> dict[str, bytes]:
        out = {}
        for n in CAPABILITY_FILES:
            if (self.path / n).exists():
                try:
                    out[n] = read_regular(existing_file(n, f"{self.path.name}/{n}", within=self.path), n,
                                          max_bytes=512 << 20)
                except PathRefused as e:
                    raise ConfigError(e.message) from None
        return out

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
