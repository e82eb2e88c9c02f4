"""COMPILE (issue 19, the reference dialect's COMPILE ... INTO VINDEX): a container written again
with its patch overlay folded in. This build has no patch overlay, so COMPILE is a verified
copy: every file the index refers to copied byte for byte and checked against its recorded
hash (as COMPACT does), index.json rewritten by `vindex3.rewrite.rewritten` (every key this
build does not understand kept at every depth, generation + 1, sealed as the source was), the
result opened and re-hashed before it is reported."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .compact import _copy, referenced, unreferenced
from .container import Container
from .paths import confined
from .rewrite import ContainerWriter, rewritten


@dataclass
class CompileResult:
    path: Path
    source: Path
    files: int  # files copied (the ones the index refers to)
    bytes: int
    generation: int
    verified: int  # files re-hashed in the written container
    left_behind: int  # files of the source the index does not refer to (not copied)


def compile_copy(src: str | Path, out: str | Path) -> CompileResult:
    """Write ``out``: ``src`` compiled with no patches (a verified copy), and verify it."""
    source = Container(src)
    refs = referenced(source)
    left = unreferenced(source.path, set(refs))
    with ContainerWriter(out, "COMPILE output", forbid_inside=[source.path]) as w:
        total = 0
        for rel, sha in sorted(refs.items()):
            total += _copy(confined(source.path, rel, rel), w.tmp / rel, sha, rel)
        record = {
            "method": "vindex3 compile", "writer": f"vindex3 {__version__}",
            "written_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "source": {"name": source.path.name, "digest": source.digest, "generation": source.generation},
            "patches": [],  # no patch overlay in this build: nothing folded in
        }
        index = rewritten(source.index, provenance={"compiled": record})
        path = w.finish(index)
    report = Container(path).verify()
    if not report.ok:  # pragma: no cover - a copy checked file by file does not come out damaged
        from .errors import IntegrityError

        raise IntegrityError(f"COMPILE wrote {path}, and it does not verify: {report.problems[:3]}")
    return CompileResult(path=Path(path), source=source.path, files=len(refs), bytes=total,
                         generation=int(index["generation"]), verified=report.checked, left_behind=len(left))
