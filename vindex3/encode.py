"""Encode an admitted checkpoint into a VINDEX3 container.

Atomic: everything is written into a temporary sibling directory; closure is run on what was
written; index.json is written last; the directory is renamed into place. Any failure removes
the temporary directory, so a failed encode leaves no output behind."""

from __future__ import annotations

import datetime as _dt
import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

from . import __version__, closure, jsonio
from .admit import lower, require_admissible
from .container import FORMAT, FORMAT_VERSION, GRAPH, INDEX
from .errors import ClosureError, EncodeError, VindexError
from .families.base import TensorPlacement
from .graph import Graph
from .segments import Segment, write_segment
from .sources import CheckpointSource, open_source

Progress = Callable[[int, int, str], None]


class EncodeResult:
    def __init__(self, path: Path, tensors: int, bytes_: int, dropped: list[tuple[str, str]], not_carried: list[str]):
        self.path = path
        self.tensors = tensors
        self.bytes = bytes_
        self.dropped = dropped
        self.not_carried = not_carried


def encode(src: str | Path | CheckpointSource, out: str | Path, progress: Progress | None = None) -> Path:
    return encode_detailed(src, out, progress).path


def encode_detailed(src: str | Path | CheckpointSource, out: str | Path, progress: Progress | None = None) -> EncodeResult:
    source = src if isinstance(src, CheckpointSource) else open_source(src)
    plan, lowering = lower(source)
    require_admissible(plan)
    assert lowering is not None
    out = Path(out)
    if out.exists():
        raise EncodeError(f"output {out} already exists; refusing to overwrite it (remove it or choose another path)")
    if not out.parent.exists():
        raise EncodeError(f"output directory's parent {out.parent} does not exist")
    tmp = out.parent / f".{out.name}.encoding-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        result = _write(source, lowering, tmp, progress)
        os.replace(tmp, out)
        result.path = out
        return result
    except BaseException as e:  # includes KeyboardInterrupt: never leave a half-written container
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, VindexError):
            raise
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise EncodeError(f"encode of {source.name} failed ({type(e).__name__}: {e}); no output was written") from e


def _write(source: CheckpointSource, lowering, tmp: Path, progress: Progress | None) -> EncodeResult:
    Graph(lowering.graph)  # validate what we are about to write
    tmp.mkdir()
    (tmp / "segments").mkdir()
    specs = source.tensor_specs()
    shapes = {n: tuple(sp.shape) for n, sp in specs.items()}
    by_object: dict[str, dict[str, TensorPlacement]] = {}
    for p in lowering.placements:
        by_object.setdefault(p.object, {})[p.name] = p
    total = len(lowering.placements)
    done = 0

    def tick(name: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, name)

    representations = {}
    segments_list = []
    for obj in sorted(by_object):
        names = by_object[obj]
        seg_specs = {rel: ("f32", p.shape(shapes)) for rel, p in names.items()}
        rel_path = f"segments/{obj}.bin"
        info = write_segment(tmp / rel_path, f"{obj}@f32", seg_specs, lambda rel: names[rel].assemble(source.load), tick)
        key = f"{obj}@f32"
        representations[key] = {
            "object": obj,
            "encoding": "f32",
            "segment": rel_path,
            "tensors": info.tensors,
            "payload_bytes": info.payload_bytes,
            "payload_sha256": info.payload_sha256,
            "segment_sha256": info.segment_sha256,
            "segment_bytes": info.segment_bytes,
        }
        segments_list.append({"path": rel_path, "bytes": info.segment_bytes, "sha256": info.segment_sha256})

    graph_text = jsonio.dumps(lowering.graph) + "\n"
    (tmp / GRAPH).write_text(graph_text, encoding="utf-8")

    capabilities = {}
    for name, data in sorted(source.capability_files().items()):
        (tmp / name).write_bytes(data)
        capabilities[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}

    # Closure on what was written, not on what we meant to write.
    tables = {}
    for rep in representations.values():
        seg = Segment(tmp / rep["segment"])
        tables[rep["object"]] = {n: (e.dtype, e.shape) for n, e in seg.entries.items()}
    defects = closure.check(Graph(lowering.graph), tables)
    if defects:
        raise ClosureError(f"encode of {source.name}: operands do not close over the graph ({len(defects)} defect(s)); no output was written", defects)

    not_carried = source.not_carried(set(capabilities))

    provenance = dict(source.provenance())
    provenance.update(
        {
            "encoder": f"vindex3 {__version__}",
            "encoded_at": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            "dropped_tensors": [{"tensor": n, "why": w} for n, w in lowering.dropped],
            "not_carried": not_carried,
        }
    )
    # container tensors made from several source tensors, or transformed: what from, and how
    assembled = [{"tensor": f"{p.object}/{p.name}", "sources": list(p.inputs), "transform": list(p.transform)}
                 for p in lowering.placements if p.sources or p.transform]
    if assembled:
        provenance["assembled_tensors"] = assembled
    index = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "generation": 1,
        "model": {"name": lowering.graph["model"]["name"], "family": lowering.graph["model"].get("family")},
        "authority": "derived" if source.kind == "gguf" else "canonical",
        "profiles": ["exact"],
        "graph": {"path": GRAPH, "sha256": hashlib.sha256(graph_text.encode()).hexdigest(), "schema": 6},
        "representations": representations,
        "segments": segments_list,
        "capabilities": capabilities,
        "provenance": provenance,
    }
    if lowering.not_carried_components:  # components set aside whole, by name (their tensors are in dropped_tensors)
        index["provenance"]["components_not_carried"] = lowering.not_carried_components
    jsonio.write_atomic(tmp / INDEX, index)  # last: its presence means the container is complete
    total_bytes = sum(r["payload_bytes"] for r in representations.values())
    return EncodeResult(tmp, total, total_bytes, lowering.dropped, not_carried)
