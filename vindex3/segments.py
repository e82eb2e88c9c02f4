"""Segment files: the physical representation of one object.

Layout: an 8-byte little-endian header length ``h``, ``h`` bytes of JSON header padded with
spaces so that the payload starts 16-byte aligned, then the tensors packed in name order,
each tensor itself starting on a 16-byte boundary. Readers memory-map the payload and accept
a payload start aligned to 4 bytes (older writers).

A tensor's ``dtype`` is its encoding: the name of a codec (vindex3.codecs) whose ``nbytes`` gives
its stored length. An entry whose encoding this build has no codec for is kept as it is (its
``len`` is trusted for accounting); only reading it as a weight is refused, by name.
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

from . import codecs
from .errors import IntegrityError

SEGMENT_SCHEMA = 1
ALIGN = 16


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


def _pad(n: int, align: int = ALIGN) -> int:
    return (-n) % align


def write_segment(
    path: Path,
    representation: str,
    specs: dict[str, tuple[str, tuple[int, ...]]],
    load: Callable[[str], np.ndarray],
    on_tensor: Callable[[str], None] | None = None,
) -> SegmentInfo:
    """Write tensors packed in name order. ``specs`` maps name -> (encoding, shape) so the
    header can be written first; ``load(name)`` yields each float32 array when its turn comes (so
    a large object never has to sit in memory whole), and the encoding's codec writes its bytes.
    Returns the hashes the index records."""
    names = sorted(specs)
    entries = []
    offset = 0
    for name in names:
        dtype, shape = specs[name]
        nbytes = codecs.get(dtype, what=f"tensor {name}").nbytes(tuple(shape))
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
            arr = load(name)
            if tuple(arr.shape) != tuple(e["shape"]):
                raise IntegrityError(f"tensor {name}: loaded shape {list(arr.shape)} differs from its spec {e['shape']}")
            data = codecs.get(e["dtype"]).encode(arr)
            if data.nbytes != e["len"]:
                raise IntegrityError(f"tensor {name}: the {e['dtype']} codec wrote {data.nbytes} bytes, expected {e['len']}")
            buf = memoryview(np.ascontiguousarray(data).reshape(-1)).cast("B")
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
        if not isinstance(header, dict) or not isinstance(header.get("tensors", []), list):
            raise IntegrityError(f"segment {self.path.name}: header is not an object with a list of tensors")
        self.representation = header.get("representation")
        self.entries: dict[str, TensorEntry] = {}
        for t in header.get("tensors", []):
            e = _entry(self.path.name, t)
            if e.name in self.entries:
                raise IntegrityError(f"segment {self.path.name}: tensor {e.name} is listed twice")
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

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes: a read-only uint8 view into the mapped file (no copy)."""
        e = self.entries[name]
        start = self.payload_start + e.offset
        return self._map()[start : start + e.nbytes]

    def weight(self, name: str):
        """The tensor as a weight object of its encoding's codec (refused by name without one)."""
        e = self.entries[name]
        codec = codecs.get(e.dtype, what=f"tensor {self.path.name}:{name}")
        return codec.weight(self.raw(name), e.shape)

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor as float32 (a view of the mapped file when it is stored as f32)."""
        return self.weight(name).dense()


def _entry(seg: str, t) -> TensorEntry:
    """One header entry, checked for types and, where a codec knows the encoding, its length."""
    ok = (isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("dtype"), str)
          and isinstance(t.get("shape"), list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t["shape"])
          and all(isinstance(t.get(k), int) and not isinstance(t.get(k), bool) and t[k] >= 0 for k in ("offset", "len")))
    if not ok:
        raise IntegrityError(f"segment {seg}: a tensor entry is malformed (name, dtype, shape, offset, len): {str(t)[:200]}")
    e = TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["len"])
    if codecs.is_known(e.dtype):
        want = codecs.get(e.dtype).nbytes(e.shape)
        if want != e.nbytes:
            raise IntegrityError(f"segment {seg}: tensor {e.name} ({e.dtype} {list(e.shape)}) records {e.nbytes} bytes, its encoding takes {want}")
    return e


def sha256_file(path: Path, skip: int = 0) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(skip)
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()
