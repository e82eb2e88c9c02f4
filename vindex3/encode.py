"""Encode an admitted checkpoint into a VINDEX3 container.

Atomic: everything is written into a temporary sibling directory; closure is run on what was
written; index.json is written last; the directory is renamed into place. Any failure removes
the temporary directory, so a failed encode leaves no output behind; an encode that was killed
outright leaves it, and the next encode into the same directory removes it (`TMP_INFIX`,
`MARKER`). Weights holding NaN or infinity are refused by name."""

from __future__ import annotations

import datetime as _dt
import hashlib
import math
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import numpy as np

from . import __version__, closure, codecs, jsonio
from .admit import lower, require_admissible
from .container import FORMAT, FORMAT_VERSION, GRAPH, INDEX
from .errors import ClosureError, EncodeError, PathRefused, VindexError
from .families.base import TensorPlacement
from .graph import Graph
from .manifest import seal
from .paths import hidden_sibling, output_dir
from .segments import Encoded, Segment, write_segment
from .sources import CheckpointSource, open_source

Progress = Callable[[int, int, str], None]


class EncodeResult:
    def __init__(self, path: Path, tensors: int, bytes_: int, dropped: list[tuple[str, str]], not_carried: list[str],
                 cleaned: list[str] | None = None):
        self.path = path
        self.tensors = tensors
        self.bytes = bytes_
        self.dropped = dropped
        self.not_carried = not_carried
        self.cleaned = list(cleaned or [])  # temporary directories of killed encodes, removed first
        self.native: dict[str, int] = {}  # encoding -> tensors a native encode kept as the source stores them


# An encode writes into ``.<out name>.encoding-<pid>`` beside its output, with this marker file
# inside saying who writes it. A later encode into the same directory removes every such
# directory whose writer is no longer running on this host (a killed encode leaves one behind).
TMP_INFIX = ".encoding-"
MARKER = ".vindex3-encoding.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_stale_temporaries(parent: Path) -> list[str]:
    """Remove the temporary directories of encodes into ``parent`` that are no longer running
    (their marker names a process of this host that does not exist). Returns their names."""
    removed = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    for e in entries:
        if not (e.name.startswith(".") and TMP_INFIX in e.name) or not e.is_dir(follow_symlinks=False):
            continue
        try:
            marker = jsonio.load(Path(e.path) / MARKER)
            pid, host = marker["pid"], marker["host"]
        except (VindexError, KeyError, TypeError):
            continue  # not ours, or not readable: leave it alone
        if host != socket.gethostname() or not isinstance(pid, int) or _alive(pid):
            continue
        shutil.rmtree(e.path, ignore_errors=True)
        if not os.path.exists(e.path):
            removed.append(e.name)
    return removed


def encode(src: str | Path | CheckpointSource, out: str | Path, progress: Progress | None = None, *,
           keep_dtype: bool = False, native: bool = False) -> Path:
    return encode_detailed(src, out, progress, keep_dtype=keep_dtype, native=native).path


# --keep-dtype: a matrix operand whose every source tensor is stored in one of these keeps that
# encoding (exactly: a 16-bit value widened to float32 and written back is the same value).
KEEP_DTYPES = {"BF16": "bf16", "F16": "f16"}


def encode_detailed(src: str | Path | CheckpointSource, out: str | Path, progress: Progress | None = None, *,
                    keep_dtype: bool = False, native: bool = False) -> EncodeResult:
    """Encode ``src`` into ``out``. Every tensor is written float32, except with ``keep_dtype``:
    a matrix operand (read by products or row gathers; see `vindex3.opplan.operand_uses`) whose
    source tensors are all bf16 (or all f16) stays bf16 (f16), exactly; norms, biases and other
    arrays are widened to float32 as always. With ``native``, a matrix operand that is one
    source tensor the source stores in a container encoding (`CheckpointSource.native_encoding`:
    a GGUF file's block types, F16 and BF16) keeps those very bytes, and a quantized matrix a
    family places with a codec (gpt-oss's MXFP4 blocks and scales, DeepSeek-V3's FP8 weights
    and block scales: vindex3.codecs.packing) is packed into that codec; an encoding this build
    has no codec for is carried and refused when executed. Without ``native`` such quantized
    matrices are decoded exactly to float32. The choice per tensor is recorded in provenance."""
    try:
        out = output_dir(out, "encode output")
    except PathRefused as e:
        if e.reason == "exists":
            raise EncodeError(f"output {out} already exists; refusing to overwrite it (remove it or choose another path)") from None
        if e.reason == "parent_missing":
            raise EncodeError(f"output directory's parent {Path(out).parent} does not exist") from None
        raise EncodeError(e.message) from None
    source = src if isinstance(src, CheckpointSource) else open_source(src)
    plan, lowering = lower(source)
    require_admissible(plan)
    assert lowering is not None
    cleaned = clean_stale_temporaries(out.parent)
    tmp = hidden_sibling(out, f"{TMP_INFIX}{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        result = _write(source, lowering, tmp, progress, keep_dtype, native)
        if out.exists():  # another process won the race while we wrote
            raise EncodeError(f"output {out} appeared while encoding; refusing to overwrite it")
        (tmp / MARKER).unlink()
        os.replace(tmp, out)
        result.path = out
        result.cleaned = cleaned
        return result
    except BaseException as e:  # includes KeyboardInterrupt: never leave a half-written container
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, VindexError):
            raise
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise EncodeError(f"encode of {source.name} failed ({type(e).__name__}: {e}); no output was written") from e


def _source_label(p: TensorPlacement) -> str:
    """The source tensor(s) a container tensor is made from, as a refusal names them."""
    if not p.sources:
        return p.source_name
    return f"{p.name} (assembled from {p.sources[0]} … {len(p.sources)} source tensors)"


def _finite(name: str, arr: np.ndarray) -> np.ndarray:
    """A tensor about to be written: refused by name when it holds NaN or infinity."""
    if arr.dtype.kind == "f":
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        if bad:
            first = int(np.flatnonzero(~np.isfinite(arr.reshape(-1)))[0])
            raise EncodeError(f"tensor {name} holds {bad} NaN or infinite value(s) (first at flat index {first}: "
                              f"{arr.reshape(-1)[first]}); refusing to encode weights that compute NaN")
    return arr


def _drafter_uses(graph: Graph, tables: dict) -> dict:
    """How a drafter component's tensors are read (an MTP module: vindex3.draft.mtp)."""
    if not any(isinstance(e, dict) and "drafter" in e for e in graph.objects.values()):
        return {}
    from .draft.mtp import drafter_uses

    return drafter_uses(graph, tables)


def _kept_encodings(lowering, specs, shapes) -> dict[tuple[str, str], str]:
    """(object, tensor) -> the 16-bit encoding it keeps under --keep-dtype (absent: f32)."""
    from .opplan import build_op_plan, operand_uses
    from .segments import TensorEntry

    tables: dict[str, dict[str, TensorEntry]] = {}
    for p in lowering.placements:
        shape = tuple(p.shape(shapes))
        tables.setdefault(p.object, {})[p.name] = TensorEntry(p.name, "f32", shape, 0, 4 * math.prod(shape))
    graph = Graph(lowering.graph)
    uses = operand_uses(build_op_plan(graph, tables))
    uses.update(_drafter_uses(graph, tables))
    kept = {}
    for p in lowering.placements:
        src = {specs[n].dtype for n in p.inputs}
        use = uses.get(f"{p.object}/{p.name}")
        if len(src) == 1 and (enc := KEEP_DTYPES.get(next(iter(src)))) and use is not None and use.kind == "matrix":
            kept[(p.object, p.name)] = enc
    return kept


def _matrix_operands(lowering, shapes) -> set[tuple[str, str]]:
    """(object, tensor) of every container tensor the plan reads as a matrix (products, gathers)."""
    from .opplan import build_op_plan, operand_uses
    from .segments import TensorEntry

    tables: dict[str, dict[str, TensorEntry]] = {}
    for p in lowering.placements:
        shape = tuple(p.shape(shapes))
        tables.setdefault(p.object, {})[p.name] = TensorEntry(p.name, "f32", shape, 0, 4 * math.prod(shape))
    graph = Graph(lowering.graph)
    uses = operand_uses(build_op_plan(graph, tables))
    uses.update(_drafter_uses(graph, tables))
    return {(p.object, p.name) for p in lowering.placements
            if (u := uses.get(f"{p.object}/{p.name}")) is not None and u.kind == "matrix"}


def _part_shape(p: TensorPlacement, shapes) -> tuple[int, ...]:
    """The shape of one packed part of a quantized matrix (before its transform steps)."""
    from .codecs.packing import groups, part_shape

    return part_shape(p.codec, [tuple(shapes[n]) for n in groups(p.codec, p.inputs)[0]])


def _native_encodings(source: CheckpointSource, lowering, shapes) -> dict[tuple[str, str], tuple[str, int]]:
    """(object, tensor) -> (encoding, stored bytes) for every matrix operand a native encode
    writes as the source stores it: one source tensor, no transform, in a form the source names
    (`CheckpointSource.native_encoding`) other than float32."""
    from .codecs.packing import encodable

    matrices = _matrix_operands(lowering, shapes)
    out = {}
    for p in lowering.placements:
        if p.codec and (p.object, p.name) in matrices and encodable(p.codec, p.transform, _part_shape(p, shapes)):
            out[(p.object, p.name)] = (p.codec, codecs.get(p.codec).nbytes(tuple(p.shape(shapes))))
            continue
        if p.sources or p.transform or (p.object, p.name) not in matrices:
            continue
        got = source.native_encoding(p.source_name)
        if got is None or got[0] == "f32":
            continue
        enc, nbytes = got
        if codecs.is_known(enc) and (codecs.get(enc).accepts(tuple(p.shape(shapes))) is not None
                                     or codecs.get(enc).nbytes(tuple(p.shape(shapes))) != nbytes):
            continue  # a shape the codec cannot hold: widened
        out[(p.object, p.name)] = (enc, nbytes)
    return out


def _native_tensor(source: CheckpointSource, label: str, p: TensorPlacement, enc: str, shape: tuple[int, ...]) -> Encoded:
    """A native tensor's bytes (the source's own, or a quantized matrix's parts packed and
    assembled as bytes), refused by name when a codec decodes them to NaN or infinity (an
    encoding without a codec is carried unchecked)."""
    if p.codec:
        from .codecs.packing import steps_encoded

        parts = p.packed_parts(source.load_stored)
        raw = steps_encoded(p.codec, p.transform, [r for r, _ in parts], parts[0][1])
        assert raw is not None  # _native_encodings kept only placements whose steps apply to bytes
    else:
        raw = source.encoded(p.source_name)
    if codecs.is_known(enc):
        bad = codecs.get(enc).weight(raw, shape).nonfinite()
        if bad:
            raise EncodeError(f"tensor {label} ({enc}) decodes to {bad} NaN or infinite value(s); "
                              "refusing to encode weights that compute NaN")
    return Encoded(raw)


def _write(source: CheckpointSource, lowering, tmp: Path, progress: Progress | None, keep_dtype: bool = False,
           native: bool = False) -> EncodeResult:
    Graph(lowering.graph)  # validate what we are about to write
    tmp.mkdir()
    jsonio.write_atomic(tmp / MARKER, {"pid": os.getpid(), "host": socket.gethostname()})
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

    kept = _kept_encodings(lowering, specs, shapes) if keep_dtype else {}
    natives = _native_encodings(source, lowering, shapes) if native else {}
    representations = {}
    segments_list = []
    for obj in sorted(by_object):
        names = by_object[obj]
        seg_specs: dict = {}
        for rel, p in names.items():
            if (obj, rel) in natives:
                enc, nbytes = natives[(obj, rel)]
                seg_specs[rel] = (enc, tuple(p.shape(shapes)), nbytes)
            else:
                seg_specs[rel] = (kept.get((obj, rel), "f32"), p.shape(shapes))
        counts: dict[str, int] = {}
        for enc, shape, *_ in seg_specs.values():
            counts[enc] = counts.get(enc, 0) + math.prod(shape)
        encoding = min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0] if counts else "f32"  # most elements
        rel_path = f"segments/{obj}.bin"
        key = f"{obj}@{encoding}"

        def load(rel: str, names=names, obj=obj):
            p = names[rel]
            if (obj, rel) in natives:
                return _native_tensor(source, _source_label(p), p, natives[(obj, rel)][0], tuple(p.shape(shapes)))
            return _finite(_source_label(p), p.assemble(source.load, source.load_stored))

        info = write_segment(tmp / rel_path, key, seg_specs, load, tick)
        representations[key] = {
            "object": obj,
            "encoding": encoding,
            "segment": rel_path,
            "tensors": info.tensors,
            "payload_bytes": info.payload_bytes,
            "payload_sha256": info.payload_sha256,
            "segment_sha256": info.segment_sha256,
            "segment_bytes": info.segment_bytes,
            "header_sha256": info.header_sha256,
            "tensor_sha256": info.tensor_sha256,
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
            "encoded_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "dropped_tensors": [{"tensor": n, "why": w} for n, w in lowering.dropped],
            "not_carried": not_carried,
        }
    )
    # container tensors made from several source tensors, or transformed: what from, and how
    assembled = [{"tensor": f"{p.object}/{p.name}", "sources": list(p.inputs), "transform": list(p.transform),
                  **({"packed_as": p.codec} if p.codec else {})}
                 for p in lowering.placements if p.sources or p.transform]
    if assembled:
        provenance["assembled_tensors"] = assembled
    if native:  # what a native encode kept as the source stores it (everything else: f32 or --keep-dtype)
        by_native: dict[str, list[str]] = {}
        for (obj, name), (enc, _) in sorted(natives.items()):
            by_native.setdefault(enc, []).append(f"{obj}/{name}")
        provenance["native"] = {
            "kept": by_native,
            "not_executable": sorted(e for e in by_native if not codecs.is_known(e)),
            "rule": "matrix operands that are one source tensor stored in an encoding the container names keep "
                    "those bytes, and quantized matrices (blocks and scales) are packed losslessly into their codec; "
                    "norms, biases, other assembled or transformed tensors and float32 are written f32",
        }
    if keep_dtype:  # what --keep-dtype kept, by encoding (everything else was widened to float32)
        by_enc: dict[str, list[str]] = {}
        for (obj, name), enc in sorted(kept.items()):
            by_enc.setdefault(enc, []).append(f"{obj}/{name}")
        provenance["keep_dtype"] = {"kept": by_enc, "rule": "matrix operands whose source tensors are all bf16 (or "
                                    "all f16) keep that encoding exactly; everything else is widened to f32"}
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
    jsonio.write_atomic(tmp / INDEX, seal(index))  # last: its presence means the container is complete
    total_bytes = sum(r["payload_bytes"] for r in representations.values())
    result = EncodeResult(tmp, total, total_bytes, lowering.dropped, not_carried)
    for enc, _ in natives.values():
        result.native[enc] = result.native.get(enc, 0) + 1
    return result
