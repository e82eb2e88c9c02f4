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
import itertools
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import codecs
from .errors import IntegrityError
from .paths import open_regular
from .switches import EnvSwitch

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
    header_sha256: str  # the length prefix and the JSON header
    tensor_sha256: dict[str, str]  # name -> SHA-256 of its stored bytes (padding excluded)


def _pad(n: int, align: int = ALIGN) -> int:
    return (-n) % align


@dataclass(frozen=True)
class Encoded:
    """A tensor's stored bytes, already in its spec's encoding (uint8, C order): written as they
    are. How a rewrite carries a tensor it does not re-encode, an encoding this build cannot
    decode included."""

    data: np.ndarray


def write_segment(
    path: Path,
    representation: str,
    specs: dict[str, tuple[str, tuple[int, ...]] | tuple[str, tuple[int, ...], int]],
    load: Callable[[str], np.ndarray | Encoded],
    on_tensor: Callable[[str], None] | None = None,
) -> SegmentInfo:
    """Write tensors packed in name order. ``specs`` maps name -> (encoding, shape) so the
    header can be written first (or (encoding, shape, stored bytes) for an encoding this build
    has no codec for); ``load(name)`` yields each tensor when its turn comes (so a large object
    never has to sit in memory whole): a float32 array, which the encoding's codec writes, or
    `Encoded` bytes, written as they are. Returns the hashes the index records."""
    names = sorted(specs)
    entries = []
    offset = 0
    for name in names:
        dtype, shape, *given = specs[name]
        if codecs.is_known(dtype):
            nbytes = codecs.get(dtype).nbytes(tuple(shape))
            if given and given[0] != nbytes:
                raise IntegrityError(f"tensor {name}: {given[0]} bytes given, its {dtype} encoding takes {nbytes}")
        elif given:
            nbytes = int(given[0])
        else:
            nbytes = codecs.get(dtype, what=f"tensor {name}").nbytes(tuple(shape))  # refuses by name
        entries.append({"name": name, "dtype": dtype, "shape": list(shape), "offset": offset, "len": nbytes})
        offset += nbytes + _pad(nbytes)
    header = {"schema": SEGMENT_SCHEMA, "representation": representation, "tensors": entries}
    hbytes = json.dumps(header, separators=(",", ":")).encode()
    hbytes += b" " * _pad(8 + len(hbytes))
    payload_hash = hashlib.sha256()
    file_hash = hashlib.sha256()
    prefix = struct.pack("<Q", len(hbytes)) + hbytes
    tensor_sha: dict[str, str] = {}
    with open(path, "wb") as f:
        f.write(prefix)
        file_hash.update(prefix)
        for name, e in zip(names, entries):
            arr = load(name)
            if isinstance(arr, Encoded):
                data = arr.data
                if data.dtype != np.uint8:
                    raise IntegrityError(f"tensor {name}: encoded bytes must be uint8, got {data.dtype}")
            else:
                if tuple(arr.shape) != tuple(e["shape"]):
                    raise IntegrityError(f"tensor {name}: loaded shape {list(arr.shape)} differs from its spec {e['shape']}")
                data = codecs.get(e["dtype"]).encode(arr)
            if data.nbytes != e["len"]:
                raise IntegrityError(f"tensor {name}: {data.nbytes} bytes of {e['dtype']} to write, its entry records {e['len']}")
            buf = memoryview(np.ascontiguousarray(data).reshape(-1)).cast("B")
            tensor_sha[name] = hashlib.sha256(buf).hexdigest()
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
        header_sha256=hashlib.sha256(prefix).hexdigest(),
        tensor_sha256=tensor_sha,
    )


MAX_HEADER = 64 << 20  # bytes: a header is a few kilobytes per hundred tensors
MAX_DEPTH = 8  # JSON nesting a segment header may have (it needs 4)


def _depth(obj, limit: int) -> int:
    """Nesting depth of a parsed JSON value, stopping once past ``limit``."""
    stack, worst = [(obj, 1)], 0
    while stack:
        o, d = stack.pop()
        worst = max(worst, d)
        if worst > limit:
            return worst
        if isinstance(o, dict):
            stack.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            stack.extend((v, d + 1) for v in o)
    return worst


class Segment:
    """A memory-mapped segment. Opening reads and checks the header only (it never blocks on a
    FIFO and never maps anything that is not a regular file); tensor bytes are touched when a
    caller asks for a tensor.

    Header checks: the length prefix fits the file and is at most MAX_HEADER; the header is a
    JSON object (schema 1, a representation name, a list of tensors) nested at most MAX_DEPTH
    deep; every entry is typed; a known encoding's ``len`` is what the codec takes for the shape;
    every tensor starts 4-byte aligned, lies inside the file and overlaps no other."""

    def __init__(self, path: Path, what: str | None = None):
        self.path = Path(path)
        name = what or f"segment {self.path.name}"
        self.what = name
        with open_regular(self.path, name) as f:
            size = os.fstat(f.fileno()).st_size
            _no_readahead(f)
            raw = f.read(8)
            if len(raw) < 8:
                raise IntegrityError(f"{name}: truncated before its header length ({size} bytes)")
            (hlen,) = struct.unpack("<Q", raw)
            if hlen > size - 8:
                raise IntegrityError(f"{name}: header length {hlen} exceeds the file size {size}")
            if hlen > MAX_HEADER:
                raise IntegrityError(f"{name}: header length {hlen:,} exceeds the {MAX_HEADER:,} bytes a header may take")
            hraw = f.read(hlen)
        if len(hraw) != hlen:
            raise IntegrityError(f"{name}: the file ended inside its header")
        self.header_sha256 = hashlib.sha256(raw + hraw).hexdigest()
        try:
            header = json.loads(hraw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IntegrityError(f"{name}: header is not valid JSON ({e})") from None
        except RecursionError:
            raise IntegrityError(f"{name}: header JSON is nested too deeply") from None
        if _depth(header, MAX_DEPTH) > MAX_DEPTH:
            raise IntegrityError(f"{name}: header JSON is nested deeper than {MAX_DEPTH} levels")
        self.payload_start = 8 + hlen
        if self.payload_start % 4:
            raise IntegrityError(f"{name}: payload starts at {self.payload_start}, not 4-byte aligned")
        if not isinstance(header, dict) or not isinstance(header.get("tensors"), list):
            raise IntegrityError(f"{name}: header is not an object with a list of tensors")
        schema = header.get("schema")
        if schema != SEGMENT_SCHEMA or isinstance(schema, bool):
            raise IntegrityError(f"{name}: header schema {schema!r}; this build reads segment schema {SEGMENT_SCHEMA}")
        self.representation = header.get("representation")
        if not isinstance(self.representation, str):
            raise IntegrityError(f"{name}: header names no representation (found {self.representation!r})")
        self.entries: dict[str, TensorEntry] = {}
        for t in header["tensors"]:
            e = _entry(name, t)
            if e.name in self.entries:
                raise IntegrityError(f"{name}: tensor {e.name} is listed twice")
            start = self.payload_start + e.offset
            if start + e.nbytes > size:
                raise IntegrityError(
                    f"{name}: tensor {e.name} runs past the end of the file "
                    f"({start + e.nbytes} > {size} bytes); the segment is truncated or its offsets are wrong"
                )
            if start % 4:
                raise IntegrityError(f"{name}: tensor {e.name} starts at byte {start}, not 4-byte aligned")
            self.entries[e.name] = e
        spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in self.entries.values() if e.nbytes)
        for (a0, a1, an), (b0, _, bn) in itertools.pairwise(spans):
            if b0 < a1:
                raise IntegrityError(f"{name}: tensors {an} and {bn} overlap (bytes {b0}..{a1} of the payload)")
        self.size = size
        self._mm: np.ndarray | None = None

    def names(self) -> Iterable[str]:
        return self.entries.keys()

    def _map(self) -> np.ndarray:
        if self._mm is None:
            from .switches import weights_mode

            resident = weights_mode() == "resident"
            with open_regular(self.path, self.what) as f:
                size = os.fstat(f.fileno()).st_size
                if size != self.size:
                    raise IntegrityError(f"{self.what} changed size since it was opened ({self.size} -> {size} bytes)")
                if resident:
                    self._mm = _resident(f, size, self.what)
                else:
                    self._mm = _mapped(f)
        return self._mm

    def raw(self, name: str) -> np.ndarray:
        """The tensor's stored bytes: a read-only uint8 view into the mapped file (no copy)."""
        e = self.entries[name]
        start = self.payload_start + e.offset
        return self._map()[start : start + e.nbytes]

    def tensor_sha256(self, name: str) -> str:
        """SHA-256 of the tensor's stored bytes."""
        return hashlib.sha256(memoryview(self.raw(name))).hexdigest()

    def weight(self, name: str):
        """The tensor as a weight object of its encoding's codec (refused by name without one)."""
        e = self.entries[name]
        if not codecs.is_known(e.dtype):
            raise codecs.cannot_execute(e.dtype, self.representation, self.representation.split("@")[0], name)
        return codecs.get(e.dtype).weight(self.raw(name), e.shape)

    def tensor(self, name: str) -> np.ndarray:
        """The whole tensor as float32 (a view of the mapped file when it is stored as f32)."""
        return self.weight(name).dense()


HUGE = 2 << 20  # the x86-64 huge page: a resident buffer is rounded up to whole ones

# Mapped weights in huge pages. A decode step streams every weight once, and a file mapped in
# 4 KB pages streams slower than the memory allows (a TLB miss per page; the hardware prefetcher
# stops at each page). Linux maps a file 2 MB at a time where its page cache holds the pages in
# 2 MB folios (ext4 and xfs keep large folios, Linux 6.x), and whoever reads the file first
# decides the folios: a mapping marked MADV_HUGEPAGE is read ahead in 2 MB folios, while faults
# through an unmarked mapping in a decode's order of tensors left mostly small ones, which every
# later process then maps in 4 KB pages until the pages leave the cache. Measured on an AMD
# Zen 4, Linux 6.18, ext4 (bench/mapped_huge.py, results/mapped_huge_zen4.json): SmolLM2 f32
# decode with the page cache filled by an unmarked mapping against a marked one, ms a step and
# kB mapped 2 MB at a time in the table there. VINDEX3_HUGE_PAGES=0 leaves the mapping unmarked.
# No byte changes: it is where the bytes come from.


class _Huge:
    on = EnvSwitch("VINDEX3_HUGE_PAGES")


HUGE_PAGES = _Huge()


def _no_readahead(f) -> None:
    """Read only the pages asked for through ``f`` (POSIX_FADV_RANDOM), where the platform takes
    the advice. Reading a segment's header with readahead left the pages after it in small
    folios marked for more readahead, and faults through the later mapping that reached them
    went on reading ahead in small folios instead of 2 MB ones: SmolLM2's int8 head segment
    (31 MB) mapped none of itself 2 MB at a time, and 26.6 MB with this advice; the int8
    container 114 MB of ~150 before, 139 MB after, its decode step 7.8-7.9 ms before, 7.3-7.6
    after (tests/test_mapped_huge.py compares a segment read afresh with a bare marked mapping)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        except OSError:  # advice only
            pass


def _mapped(f) -> np.ndarray:
    """The file mapped read-only, marked MADV_HUGEPAGE where the platform has it (unless
    VINDEX3_HUGE_PAGES=0)."""
    mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if HUGE_PAGES.on and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # advice only (a kernel built without THP refuses it): 4 KB pages, same bytes
            pass
    return np.frombuffer(mm, dtype=np.uint8)


def available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where the system does not say)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _resident(f, size: int, what: str) -> np.ndarray:
    """The file's bytes read into private anonymous memory asked for in huge pages
    (MADV_HUGEPAGE where the platform has it), returned read-only. Refused by name, before any
    byte is read, when the machine reports less memory available than the copy needs, or
    reports none."""
    need = -(-max(size, 1) // HUGE) * HUGE
    avail = available_memory()
    if avail is None:  # no figure to check the copy against: refused, not guessed
        from .errors import LimitExceeded

        raise LimitExceeded(f"{what}: holding it resident needs {need >> 20} MiB, and this system does not report "
                            "its available memory (/proc/meminfo MemAvailable)",
                            hint="unset VINDEX3_WEIGHTS (or set it to mapped) to map the file instead")
    if need > avail:
        from .errors import LimitExceeded

        raise LimitExceeded(f"{what}: holding its {size} bytes resident needs {need >> 20} MiB; the machine has "
                            f"{avail >> 20} MiB available", hint="unset VINDEX3_WEIGHTS (or set it to mapped) to map the file instead")
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    mm = mmap.mmap(-1, need, flags=flags) if flags else mmap.mmap(-1, need)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mm.madvise(mmap.MADV_HUGEPAGE)
    buf = np.frombuffer(mm, dtype=np.uint8)[:size]
    f.seek(0)
    view, got = memoryview(buf), 0
    while got < size:
        n = f.readinto(view[got:])
        if not n:
            raise IntegrityError(f"{what} gave {got} of its {size} bytes when read")
        got += n
    buf.flags.writeable = False
    return buf


def _entry(seg: str, t) -> TensorEntry:
    """One header entry, checked for types and, where a codec knows the encoding, its length."""
    ok = (isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"] != "" and isinstance(t.get("dtype"), str)
          and isinstance(t.get("shape"), list) and len(t["shape"]) <= 8
          and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in t["shape"])
          and all(isinstance(t.get(k), int) and not isinstance(t.get(k), bool) and t[k] >= 0 for k in ("offset", "len")))
    if not ok:
        raise IntegrityError(f"{seg}: a tensor entry is malformed (name, dtype, shape of at most 8 dims, offset, len): "
                             f"{str(t)[:200]}")
    e = TensorEntry(t["name"], t["dtype"], tuple(t["shape"]), t["offset"], t["len"])
    if codecs.is_known(e.dtype):
        want = codecs.get(e.dtype).nbytes(e.shape)
        if want != e.nbytes:
            raise IntegrityError(f"{seg}: tensor {e.name} ({e.dtype} {list(e.shape)}) records {e.nbytes} bytes, its encoding takes {want}")
    return e


def sha256_file(path: Path, skip: int = 0, what: str = "file") -> str:
    """SHA-256 of a regular file from byte ``skip`` on (a FIFO or device is refused, never read)."""
    return sha256_file_and_tail(path, skip, what)[1]


def sha256_file_and_tail(path: Path, skip: int, what: str = "file") -> tuple[str, str]:
    """(SHA-256 of the whole file, SHA-256 of its bytes from ``skip`` on) in one read."""
    whole, tail = hashlib.sha256(), hashlib.sha256()
    pos = 0
    with open_regular(path, what) as f:
        while chunk := f.read(1 << 22):
            whole.update(chunk)
            if pos + len(chunk) > skip:
                tail.update(memoryview(chunk)[max(0, skip - pos):])
            pos += len(chunk)
    return whole.hexdigest(), tail.hexdigest()
