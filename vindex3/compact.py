"""COMPACT: a copy of a container holding only what its index refers to.

Referenced files — the graph, each representation's segment, each capability file, each file of
a derived representation — are copied byte for byte, each checked against the hash the index
records while it is copied (a damaged source file is refused by name, never copied). Every
other file or directory entry under the source (a stale segment, a leftover temporary file,
anything a person put there) is left behind and listed in the report, never dropped silently.
index.json is rewritten by `vindex3.rewrite.rewritten` (unknown keys kept at every depth,
generation + 1, sealed as the source was); the write is atomic, nothing is written inside the
source."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__
from .container import GRAPH, INDEX, Container
from .errors import IntegrityError
from .paths import confined, open_regular
from .rewrite import ContainerWriter, rewritten


@dataclass
class LeftFile:
    path: str  # relative to the source container
    kind: str  # file, directory, symlink, fifo, socket, device
    bytes: int


@dataclass
class CompactResult:
    path: Path
    source: Path
    copied: list[tuple[str, int]] = field(default_factory=list)  # (relative path, bytes)
    left_behind: list[LeftFile] = field(default_factory=list)
    generation: int = 0
    cleaned: list[str] = field(default_factory=list)

    @property
    def copied_bytes(self) -> int:
        return sum(n for _, n in self.copied)

    @property
    def left_bytes(self) -> int:
        return sum(f.bytes for f in self.left_behind)


def referenced(c: Container) -> dict[str, str | None]:
    """Files the index refers to: relative path -> the SHA-256 it records (None: none recorded)."""
    out: dict[str, str | None] = {GRAPH: c.manifest.graph.sha256}
    for rep in c.manifest.representations.values():
        out[rep.segment] = rep.segment_sha256
    for name, cap in c.manifest.capabilities.items():
        out[name] = cap.sha256
    derived = c.index.get("derived")
    for e in (derived.values() if isinstance(derived, dict) else []):
        files = e.get("files") if isinstance(e, dict) else None
        for rel, f in (files.items() if isinstance(files, dict) else []):
            out[rel] = f.get("sha256") if isinstance(f, dict) else None
    return out


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "file"), (stat.S_ISDIR, "directory"), (stat.S_ISLNK, "symlink"),
                       (stat.S_ISFIFO, "fifo"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "device"


def unreferenced(root: Path, keep: set[str]) -> list[LeftFile]:
    """Every entry under ``root`` that is neither index.json, a file in ``keep`` nor a directory
    on the way to one; symbolic links are listed, never followed."""
    dirs_needed = {str(Path(p).parent) for p in keep} | {"."}
    for p in list(dirs_needed):
        q = Path(p)
        while str(q) not in (".", ""):
            dirs_needed.add(str(q))
            q = q.parent
    left: list[LeftFile] = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        rel_dir = os.path.relpath(dirpath, root)
        for name in sorted(dirnames):
            rel = os.path.normpath(os.path.join(rel_dir, name))
            st = os.lstat(os.path.join(dirpath, name))
            if stat.S_ISLNK(st.st_mode):
                left.append(LeftFile(rel, "symlink", 0))
            elif rel not in dirs_needed:
                size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(os.path.join(dirpath, name)) for f in fs)
                left.append(LeftFile(rel + "/", "directory", size))
        dirnames[:] = [d for d in dirnames if os.path.normpath(os.path.join(rel_dir, d)) in dirs_needed
                       and not os.path.islink(os.path.join(dirpath, d))]
        for name in sorted(filenames):
            rel = os.path.normpath(os.path.join(rel_dir, name))
            if rel == INDEX or rel in keep:
                continue
            st = os.lstat(os.path.join(dirpath, name))
            left.append(LeftFile(rel, _kind(st.st_mode), st.st_size if stat.S_ISREG(st.st_mode) else 0))
    return sorted(left, key=lambda f: f.path)


def _copy(src: Path, dst: Path, want: str | None, rel: str) -> int:
    """Copy ``src`` to ``dst`` byte for byte, hashing on the way; refuse a hash that differs."""
    h = hashlib.sha256()
    n = 0
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open_regular(src, rel) as f, open(dst, "wb") as g:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            g.write(chunk)
            n += len(chunk)
        g.flush()
        os.fsync(g.fileno())
    if want is not None and h.hexdigest() != want:
        raise IntegrityError(f"{rel}: sha256 {h.hexdigest()[:16]}… differs from the index's {want[:16]}…; "
                             "COMPACT copies only intact files (nothing was written)",
                             hint="run `vindex3 verify` on the source to list every difference")
    return n


def compact(src: str | Path, out: str | Path) -> CompactResult:
    """Write ``out``: the referenced files of the container at ``src``, byte for byte, and its
    index rewritten; report every file left behind."""
    source = Container(src)
    refs = referenced(source)
    left = unreferenced(source.path, set(refs))
    with ContainerWriter(out, "compact output", forbid_inside=[source.path]) as w:
        copied = []
        for rel, sha in sorted(refs.items()):
            copied.append((rel, _copy(confined(source.path, rel, rel), w.tmp / rel, sha, rel)))
        record = {
            "method": "vindex3 compact", "writer": f"vindex3 {__version__}",
            "written_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "source": {"name": source.path.name, "digest": source.digest, "generation": source.generation},
            "left_behind": [{"path": f.path, "kind": f.kind, "bytes": f.bytes} for f in left],
        }
        index = rewritten(source.index, provenance={"compacted": record})
        path = w.finish(index)
    return CompactResult(path=path, source=source.path, copied=copied, left_behind=left,
                         generation=int(index["generation"]), cleaned=w.cleaned)
