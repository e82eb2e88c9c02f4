"""REPRESENT: a new container holding the same model in other weight encodings.

The output has the same logical identity as its source — the graph file byte for byte (so the
same graph hash), the same objects and tensor names and shapes, the same capability files —
and new segments. Which encoding each tensor gets is decided here, from how the executor reads
it (`vindex3.opplan.operand_uses`), never from a model family:

1. a tensor stored in an encoding this build has no codec for is carried byte-identically;
2. a tensor read whole as float32 (norms, biases, convolution taps, ``A_log``, ...) or of one
   dimension stays ``f32``;
3. under ``q4`` the embedding and the output head (tied or not) take ``int8``: on SmolLM2 a
   4-bit embedding carries nearly all of q4's loss (docs/representations-notes.md), and a tied
   head is the same tensor — the head is then computed by the int8 kernel from the same bytes
   the embedding gathers rows from;
4. a tensor the codec does not accept (`Codec.accepts`: a last dimension that is not a multiple
   of 32 for int8 and q4) stays ``f32``;
5. everything else takes the requested encoding.

Every choice other than the requested encoding is recorded with its reason, and every tensor
with its fidelity against the source tensor (max abs and relative error, relative RMS error,
bits per weight, exact or not) in ``provenance.representation``, with the source container's
digest and index hash and each codec's name and version. Derived representations (feature
metadata, ...) were computed from the source's weights and are not carried (listed in the
record). The write is atomic (`vindex3.rewrite.ContainerWriter`): nothing is written inside the
source, index.json last and sealed.
"""

from __future__ import annotations

import datetime as _dt
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import __version__, codecs
from .codecs.fidelity import compare
from .container import GRAPH, Container
from .errors import EncodeError, UnsupportedEncoding
from .opplan import OperandUse, operand_uses
from .paths import read_regular
from .rewrite import ContainerWriter, rewritten
from .segments import Encoded, write_segment

TARGETS = codecs.targets()  # the encodings whose Codec says REPRESENT writes them
ENDS_UNDER_Q4 = "int8"
METHOD = "vindex3 represent"
VERSION = 1

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class Choice:
    encoding: str
    reason: str | None  # None: the requested encoding


def choose(target: str, dtype: str, shape: tuple[int, ...], use: OperandUse | None) -> Choice:
    """The encoding one tensor gets under ``target`` (the rules in the module docstring)."""
    if not codecs.is_known(dtype):
        return Choice(dtype, f"stored as {dtype!r}, which this build cannot decode: carried byte-identically")
    if use is None or use.kind == "unknown":
        return Choice("f32", "read by an op this build has no executor for, so how it is read is unknown: kept float32")
    if use.kind == "array" or len(shape) < 2:
        why = "one-dimensional" if len(shape) < 2 else "read whole as float32"
        return Choice("f32", f"{why} ({', '.join(use.roles)}): norms, biases and other array operands stay float32")
    want = target
    reason = None
    if target == "q4" and ({"embedding", "head"} & set(use.roles)):
        want = ENDS_UNDER_Q4
        reason = (f"the {' and '.join(r for r in ('embedding', 'head') if r in use.roles)} takes {ENDS_UNDER_Q4} under q4 "
                  "(a 4-bit embedding carries nearly all of q4's loss on SmolLM2)")
    why = codecs.get(want).accepts(tuple(shape))
    if why is not None:
        return Choice("f32", f"{want} cannot hold shape {list(shape)}: {why}")
    return Choice(want, reason)


@dataclass
class RepresentResult:
    path: Path
    source: Path
    encoding: str
    tensors: int
    bytes: int
    source_bytes: int
    by_encoding: dict[str, dict] = field(default_factory=dict)  # encoding -> tensors, parameters, bytes
    kept: list[tuple[str, str, str]] = field(default_factory=list)  # (tensor label, encoding, reason)
    not_carried: list[str] = field(default_factory=list)  # derived representations left behind
    exact: bool = False
    seconds: float = 0.0
    cleaned: list[str] = field(default_factory=list)


def _major(encodings: dict[str, int]) -> str:
    """The encoding that holds most of an object's elements (ties: the name that sorts first)."""
    return min(encodings.items(), key=lambda kv: (-kv[1], kv[0]))[0]


def represent(src: str | Path, out: str | Path, encoding: str, progress: Progress | None = None) -> RepresentResult:
    """Write ``out``: the container at ``src`` with its tensors in ``encoding`` (one of
    `TARGETS`, as the module docstring decides per tensor)."""
    if encoding not in TARGETS:
        raise EncodeError(f"REPRESENT cannot write encoding {encoding!r} (it writes: {', '.join(TARGETS)})")
    t0 = time.perf_counter()
    source = Container(src)
    plan = source.op_plan()
    uses = operand_uses(plan)
    if any(isinstance(e, dict) and "drafter" in e for e in source.graph.objects.values()):  # an MTP module's tensors
        from .draft.mtp import drafter_uses

        uses.update(drafter_uses(source.graph, {o: s.entries for o, s in source.segments.items()}))
    total = sum(len(s.entries) for s in source.segments.values())
    done = 0
    with ContainerWriter(out, "represent output", forbid_inside=[source.path]) as w:
        reps, segs = {}, []
        fidelity: dict[str, dict] = {}
        kept: list[tuple[str, str, str]] = []
        summary: dict[str, dict] = {}
        all_exact = True
        for obj in sorted(source.segments):
            seg = source.segments[obj]
            specs, choices = {}, {}
            for name, e in seg.entries.items():
                label = f"{obj}/{name}"
                c = choose(encoding, e.dtype, e.shape, uses.get(label))
                choices[name] = c
                specs[name] = (c.encoding, e.shape) if codecs.is_known(c.encoding) else (c.encoding, e.shape, e.nbytes)
                if c.reason is not None:
                    kept.append((label, c.encoding, c.reason))

            def load(name: str, obj=obj, seg=seg, choices=choices):
                nonlocal all_exact
                source.check_tensor(obj, name)  # the source's bytes against its index, first
                e, c = seg.entries[name], choices[name]
                raw = seg.raw(name)
                label = f"{obj}/{name}"
                n = math.prod(e.shape)
                if c.encoding == e.dtype:  # the same encoding: the same bytes
                    rec = {"encoding": c.encoding, "source_encoding": e.dtype, "carried": True, "exact": True,
                           "bits_per_weight": _bpw(e.nbytes, n)}
                    data = Encoded(raw)
                else:
                    src_f32 = seg.weight(name).dense()
                    codec = codecs.get(c.encoding)
                    try:
                        enc = codec.encode(src_f32)
                    except UnsupportedEncoding as e:  # the values, not the shape: name the tensor
                        raise UnsupportedEncoding(f"REPRESENT into {c.encoding}, tensor {label}: {e}") from None
                    f = compare(src_f32, codec.weight(enc, e.shape).dense(), c.encoding, enc.nbytes)
                    rec = {"encoding": c.encoding, "source_encoding": e.dtype, "exact": f.exact,
                           "bits_per_weight": f.bits_per_weight, "max_abs_error": f.max_abs_error,
                           "max_rel_error": f.max_rel_error, "rel_rms_error": f.rel_rms_error}
                    data = Encoded(enc)
                    all_exact = all_exact and f.exact
                if c.reason is not None:
                    rec["reason"] = c.reason
                fidelity[label] = rec
                s = summary.setdefault(c.encoding, {"tensors": 0, "parameters": 0, "bytes": 0})
                s["tensors"] += 1
                s["parameters"] += n
                s["bytes"] += data.data.nbytes
                return data

            def tick(name: str) -> None:
                nonlocal done
                done += 1
                if progress is not None:
                    progress(done, total, name)

            counts: dict[str, int] = {}
            for name, e in seg.entries.items():
                counts[choices[name].encoding] = counts.get(choices[name].encoding, 0) + math.prod(e.shape)
            key = f"{obj}@{_major(counts)}"
            rel = f"segments/{obj}.bin"
            info = write_segment(w.tmp / rel, key, specs, load, tick)
            reps[key] = {
                "object": obj, "encoding": _major(counts), "segment": rel, "tensors": info.tensors,
                "payload_bytes": info.payload_bytes, "payload_sha256": info.payload_sha256,
                "segment_sha256": info.segment_sha256, "segment_bytes": info.segment_bytes,
                "header_sha256": info.header_sha256, "tensor_sha256": info.tensor_sha256,
            }
            perm = source.manifest.representations[next(k for k, r in source.manifest.representations.items()
                                                         if r.object == obj)].permutation
            if perm:  # every tensor is re-encoded in its stored order: a permuted bank stays permuted
                reps[key]["permutation"] = dict(perm)
            segs.append({"path": rel, "bytes": info.segment_bytes, "sha256": info.segment_sha256})

        # the graph and the capability files, byte for byte (their hashes checked on the way)
        (w.tmp / GRAPH).write_bytes(read_regular(source.path / GRAPH, f"{source.path.name}/{GRAPH}", max_bytes=64 << 20))
        for name in sorted(source.manifest.capabilities):
            (w.tmp / name).write_bytes(source.capability_bytes(name))

        derived = source.index.get("derived")
        not_carried = sorted(derived) if isinstance(derived, dict) else []
        record = {
            "method": METHOD, "version": VERSION, "writer": f"vindex3 {__version__}",
            "written_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "encoding": encoding,
            "source": {"name": source.path.name, "model": source.name, "digest": source.digest,
                       "index_sha256": source.index.get("index_sha256"), "generation": source.generation,
                       "authority": source.authority},
            "codecs": {n: {"version": codecs.get(n).version, "bits_per_weight": codecs.get(n).bits_per_weight}
                       for n in sorted(summary) if codecs.is_known(n)},
            "policy": ("array operands and 1-D tensors stay f32; a tensor the codec does not accept stays f32; "
                       "under q4 the embedding and output head take int8; unknown encodings are carried byte-identically"),
            "summary": summary,
            "tensors": fidelity,
            "not_carried": [{"derived": k, "why": "derived from the source's weights; rebuild it from this container"}
                            for k in not_carried],
        }
        prev = source.provenance.get("representation")
        if prev is not None:
            record["previous"] = prev
        index = rewritten(
            source.index,
            replace={"representations": reps, "segments": segs,
                     "authority": source.authority if all_exact else "derived"},
            drop=["derived"],
            provenance={"representation": record},
            sealed=True,
        )
        path = w.finish(index)
    total_bytes = sum(r["payload_bytes"] for r in reps.values())
    return RepresentResult(
        path=path, source=source.path, encoding=encoding, tensors=total, bytes=total_bytes,
        source_bytes=source.weight_bytes, by_encoding=summary, kept=kept, not_carried=not_carried, exact=all_exact,
        seconds=time.perf_counter() - t0, cleaned=w.cleaned,
    )


def _bpw(nbytes: int, n: int) -> float:
    return 8.0 * nbytes / n if n else 0.0
