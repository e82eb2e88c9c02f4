"""Segment files: the physical representation of one object.

Layout: an 8-byte little-endian header length ``h``, ``h`` bytes of JSON header padded with
spaces so that the payload starts 16-byte aligned, then the tensors packed in name order,
each tensor itself starting on a 16-byte boundary. Readers memory-map the payload and accept
a payload start aligned to 4 bytes (older writers).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from .errors import IntegrityError

SEGMENT_SCHEMA = 1
ALIGN = 16
DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64}
_NP_TO_DTYPE = {np.dtype(v): k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # relative to the payload start
    nbytes: int


@dataclass
class SegmentInfo:
    """What the index records about a written segment."""

    path: str
    tensors: int
    payload_bytes: int
    payload_sha256: str
    segment_sha256: str
    segment_bytes: int


def dtype_name(arr: np.ndarray) -> str:
    try:
        return _NP_TO_DTYPE[arr.dtype]
    except KeyError:
        raise IntegrityError(f"tensor dtype {arr.dtype} has no segment encoding (supported: {sorted(DTYPES)})") from None


def _pad(n: int, align: int = ALIGN) -> int:
    return (-n) % align


def write_segment(
    path: Path,
    representation: str,
    specs: dict[str, tuple[str, tuple[int, ...]]],
    load: Callable[[str], np.ndarray],
    on_tensor: Callable[[str], None] | None = None,
) -> SegmentInfo:
    """Write tensors packed in name order. ``specs`` maps name -> (dtype, shape) so the header
    can be written first; ``load(name)`` yields each array when its turn comes (so a large
    object never has to sit in memory whole). Returns the hashes the index records."""
    names = sorted(specs)
    entries = []
    offset = 0
    for name in names:
        dtype, shape = specs[name]
        nbytes = int(np.dtype(DTYPES[dtype]).itemsize * int(np.prod(shape, dtype=np.int64)))
        entries.append({"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "len": nbytes})
        offset += nbytes + _pad(nbytes)
    header = {"schema": SEGMENT_SCHEMA, "representation": representation, "tensors": entries}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * _pad(8 + len(hbytes))
    payload_hash = hashlib.sha256()
    file_hash = hashlib.sha256()
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    with open(path, "wb") as f:
        f.write(prefix)
        file_hash.update(prefix)
        for name, e in zip(names, entries):
            arr = np.ascontiguousarray(load(name), dtype=DTYPES[e["dtype"]])
            if tuple(arr.shape) != tuple(e["shape"]):
                raise IntegrityError(f"tensor {name}: loaded shape {list(arr.shape)} differs from its spec {e['shape']}")
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            buf = memoryview(arr.reshape(-1)).cast("B")
            pad = b"\0" * _pad(e["len"])
            for chunk in (buf, pad):
                f.write(chunk)
                payload_hash.update(chunk)
                file_hash.update(chunk)
            if on_tensor is not None:
                on_tensor(name)
        f.flush()
        os.fsync(f.fileno())
    size = path.stat().st_size
    return SegmentInfo(
        path=str(path.name),
        tensors=len(names),
        payload_bytes=offset,
        payload_sha256=payload_hash.hexdigest(),
        segment_sha256=file_hash.hexdigest(),
        segment_bytes=size,
    )


class Segment:
    """A memory-mapped segment. Opening reads the header only; tensor bytes are touched
    when a caller asks for a tensor."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                raw = f.read(8)
                if len(raw) < 8:
                    raise IntegrityError(f"segment {self.path.name}: truncated before its header length")
                (hlen,) = struct.unpack("<Q", raw)
                size = os.fstat(f.fileno()).st_size
                if hlen > size - 8:
                    raise IntegrityError(f"segment {self.path.name}: header length {hlen} exceeds file size {size}")
                hraw = f.read(hlen)
        except FileNotFoundError:
            raise IntegrityError(f"segment {self.path.name} is missing (expected at {self.path})") from None
        try:
            header = json.loads(hraw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"segment {self.path.name}: header is not valid JSON ({e})") from None
        self.payload_start = 8 + hlen
        if self.payload_start % 4:
            raise IntegrityError(f"segment {self.path.name}: payload starts at {self.payload_start}, not 4-byte aligned")
        self.representation = header.get("representation")
        self.entries: dict[str, TensorEntry] = {}
        for t in header.get("tensors", []):
            if t["dtype"] not in DTYPES:
                raise IntegrityError(f"segment {self.path.name}: tensor {t['name']} has unknown dtype {t['dtype']!r}")
            e = TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), int(t["offset"]), int(t["len"]))
            if self.payload_start + e.offset + e.nbytes > size:
                raise IntegrityError(
                    f"segment {self.path.name}: tensor {e.name} runs past the end of the file "
                    f"({self.payload_start + e.offset + e.nbytes} > {size} bytes); the segment is truncated"
                )
            self.entries[e.name] = e
        self.size = size
        self._mm: np.memmap | None = None

    def names(self) -> Iterable[str]:
        return self.entries.keys()

    def _map(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def tensor(self, name: str) -> np.ndarray:
        """A read-only view into the mapped file (no copy)."""
        e = self.entries[name]
        start = self.payload_start + e.offset
        raw = self._map()[start : start + e.nbytes]
        return np.ndarray(e.shape, dtype=DTYPES[e.dtype], buffer=raw)


def sha256_file(path: Path, skip: int = 0) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(skip)
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
