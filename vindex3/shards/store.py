"""Shard sets on disk: containers that hold only some objects or layers of a parent container.

    OUT/
      ends/       embedding, final norm, output head (+ any object no layer reads), tokenizer files
      shard-0/    the segments of layers [a0, b0) only
      shard-1/    ...
      manifest.json   written last: the parent's digest, each member's layers and index hash

Every member is a VINDEX3 directory (index.json, the parent's system_graph.json byte for byte,
segments/) whose index carries a ``shard`` record: the parent's digest, the layers it holds
and the parent's table of every tensor (name, encoding, shape, bytes), so that its op plan is
the parent's op plan while its tensor source holds only its own tensors. A member refuses by name
to read a tensor it does not hold. Writing is atomic like encode: a temporary sibling directory,
member indexes before the manifest, the manifest last, then one rename."""

from __future__ import annotations

import datetime as _dt
import os
import shutil
from functools import cached_property
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .. import __version__, closure, jsonio
from ..container import FORMAT, FORMAT_VERSION, GRAPH, INDEX, Container, read_index
from ..errors import (
    ClosureError,
    ConfigError,
    EncodeError,
    GraphSchemaError,
    IntegrityError,
    VindexError,
)
from ..exec.slice import LayerRange
from ..graph import Graph
from ..manifest import seal
from ..paths import hidden_sibling
from ..segments import Encoded, Segment, TensorEntry, sha256_file, write_segment
from . import split
from .errors import ShardError

MANIFEST = "manifest.json"
SET_FORMAT = "VINDEX3-SHARDS"
SET_VERSION = 1
ENDS = "ends"
KNOWN_INDEX_KEYS = {"format", "version", "generation", "model", "authority", "profiles", "graph", "representations",
                    "segments", "capabilities", "provenance", "index_sha256", "derived"}  # derived data stays with the parent


def member_name(k: int) -> str:
    return f"shard-{k}"


class HeldSource:
    """A tensor source over the segments a member holds; anything else is refused by name."""

    def __init__(self, member: ShardContainer):
        self._m = member

    def weight(self, ref):
        seg = self._m.segments.get(ref.object)
        if seg is None or ref.tensor not in seg.entries:
            raise ShardError(f"{self._m.label} does not hold {ref.label} (it holds {self._m.holds_text()})",
                             hint="run each layer on the shard that holds it")
        w = seg.weight(ref.tensor)
        perm = self._m.permutations.get(ref.object, {}).get(ref.tensor)
        if perm is not None:
            from ..codecs.permuted import PermutedBank

            w = PermutedBank(w, perm)
        return w

    def representation_key(self, obj: str) -> str:
        seg = self._m.segments.get(obj)
        return seg.representation if seg is not None else obj


class ShardContainer:
    """One member of a shard set, opened: headers only, like `Container`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = read_index(self.path)
        rec = self.index.get("shard")
        if not isinstance(rec, dict):
            raise ShardError(f"{self.path.name} is not a member of a shard set (its {INDEX} has no 'shard' record)",
                             hint="open a whole container with vindex3.open, a shard set with vindex3.shards.open_set")
        for key in ("parent_digest", "role", "parent_tables"):
            if key not in rec:
                raise IntegrityError(f"{self.path.name}/{INDEX}: the shard record has no {key!r}")
        self.record = rec
        self.parent_digest: str = rec["parent_digest"]
        self.role: str = rec["role"]
        lay = rec.get("layers")
        self.layers: LayerRange | None = LayerRange(int(lay[0]), int(lay[1])) if lay is not None else None
        gp = self.path / GRAPH
        try:
            self.graph = Graph(jsonio.load(gp))
        except ConfigError as e:
            raise GraphSchemaError(f"{self.path.name}/{GRAPH} is unreadable: {e.message}") from None
        _ = self.graph.component  # exactly one primary_text, or a named refusal
        self.segments: dict[str, Segment] = {}
        self.permutations: dict[str, dict[str, list[int]]] = {}  # object -> permuted expert banks
        for key, rep in sorted(self.index.get("representations", {}).items()):
            obj = rep["object"]
            if obj in self.segments:
                raise IntegrityError(f"{self.path.name}/{INDEX}: object {obj!r} has two representations")
            self.segments[obj] = Segment(self.path / rep["segment"])
            if rep.get("permutation"):
                self.permutations[obj] = dict(rep["permutation"])
        # The parent's tables: the op plan and closure are the parent's.
        self.parent_tables: dict[str, dict[str, TensorEntry]] = {}
        for obj, names in rec["parent_tables"].items():
            self.parent_tables[obj] = {n: TensorEntry(n, d, tuple(s), 0, int(b)) for n, (d, s, b) in names.items()}
        defects = closure.check(self.graph, {o: {n: (e.dtype, e.shape) for n, e in t.items()}
                                             for o, t in self.parent_tables.items()})
        if defects:
            raise ClosureError(f"{self.path.name}: the parent's operands do not close over the graph", defects)
        # What it holds must be the parent's tensors, exactly the ones its role needs.
        want = self.expected_tensors()
        for obj, seg in self.segments.items():
            for n, e in seg.entries.items():
                p = self.parent_tables.get(obj, {}).get(n)
                if p is None or (p.dtype, p.shape, p.nbytes) != (e.dtype, e.shape, e.nbytes):
                    raise IntegrityError(f"{self.label}: {obj}/{n} is not the parent's tensor of that name")
        held = {(o, n) for o, s in self.segments.items() for n in s.entries}
        missing = sorted(want - held)
        if missing:
            raise IntegrityError(f"{self.label}: misses {len(missing)} tensor(s) of {self.holds_text()}, "
                                 f"first {missing[0][0]}/{missing[0][1]}")
        extra = sorted(held - want)
        if extra:
            raise IntegrityError(f"{self.label}: holds {extra[0][0]}/{extra[0][1]}, which is not part of {self.holds_text()}")

    @property
    def label(self) -> str:
        return f"{self.record.get('name', self.path.name)} ({self.path.name})"

    def holds_text(self) -> str:
        if self.layers is not None:
            return split.describe(self.layers)
        return "the ends (" + ", ".join(sorted(self.segments)) + ")"

    @cached_property
    def _op_plan(self):
        from ..opplan import build_op_plan

        return build_op_plan(self.graph, self.parent_tables)

    def op_plan(self):
        return self._op_plan

    def expected_tensors(self) -> set[tuple[str, str]]:
        plan = self._op_plan
        if self.layers is not None:
            return {(r.object, r.tensor) for i in range(self.layers.start, self.layers.end) for r in plan.layers[i].operands()}
        layer_objs = {r.object for lo in plan.layers for r in lo.operands()}
        return {(o, n) for o, t in self.parent_tables.items() if o not in layer_objs for n in t}

    def tensor_source(self) -> HeldSource:
        return HeldSource(self)

    def check_holds(self, r: LayerRange) -> None:
        """Refuse by name, before preparing anything, a range this member does not hold."""
        h = self.layers
        if h is None or r.start < h.start or r.end > h.end:
            raise ShardError(f"{self.label} holds {self.holds_text()}; it refuses to run {split.describe(r)}",
                             hint="run each layer on the shard that holds it")

    # -- facts a driver reads from the ends member, like a Container's --------------------------
    @property
    def name(self) -> str:
        return self.index.get("model", {}).get("name", self.path.name)

    @property
    def digest(self) -> str:
        """The parent's digest: a shard set computes what its parent computes."""
        return self.parent_digest

    @property
    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").exists()

    @cached_property
    def tokenizer(self):
        from ..tokenizer import Tokenizer

        return Tokenizer.from_container(self.path)

    def continuation(self):
        return [lo.geometry for lo in self._op_plan.layers]

    def plan_slice(self, sl=None):
        from ..exec.slice import Full, plan_slice

        return plan_slice(self._op_plan, sl or Full())


# ---- the manifest ------------------------------------------------------------------------------


class _Entry(BaseModel):
    """One member of a shard set as the manifest names it. Its path is one name inside the set's
    directory: absolute paths, '..', separators and empty names are refused by name before any
    file is touched."""

    model_config = ConfigDict(extra="allow")
    name: str
    path: str
    layers: list[int] | None = Field(min_length=2, max_length=2)  # None for the ends (embedding, norm, head)
    index_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("path")
    @classmethod
    def _one_name(cls, v: str) -> str:
        if not v or v in (".", "..") or "/" in v or "\\" in v or "\0" in v or os.path.isabs(v):
            raise ValueError(f"member path {v[:80]!r} is not one name inside the shard set")
        return v


class _Parent(BaseModel):
    model_config = ConfigDict(extra="allow")
    digest: str
    num_layers: int = Field(ge=1)


class _Manifest(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: str
    version: int
    parent: _Parent
    ends: _Entry
    shards: list[_Entry] = Field(min_length=1)

    @field_validator("shards")
    @classmethod
    def _ranges(cls, v: list[_Entry]) -> list[_Entry]:
        for e in v:
            if e.layers is None:
                raise ValueError(f"member {e.name[:80]!r} names no layer range")
        return v


def read_manifest(out: str | Path) -> dict:
    out = Path(out)
    mp = out / MANIFEST
    if not mp.exists():
        raise ShardError(f"{out} has no {MANIFEST}; it is not a shard set (or its writing did not finish)",
                         hint="write one with `vindex3 shard SRC OUT --ranges 0-14,15-29`")
    m = jsonio.load(mp)
    if not isinstance(m, dict):
        raise ShardError(f"{out.name}/{MANIFEST} holds a JSON {type(m).__name__}, not an object; it is not a shard-set manifest")
    if m.get("format") != SET_FORMAT or m.get("version") != SET_VERSION:
        raise ShardError(f"{out.name}/{MANIFEST}: unsupported shard-set format {m.get('format')!r} version "
                         f"{m.get('version')!r}; supported {SET_FORMAT} version {SET_VERSION}")
    try:
        _Manifest.model_validate(m)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ()))
        raise ShardError(f"{out.name}/{MANIFEST}: {where}: {err.get('msg')}") from None
    return m


def check_member(out: Path, entry: dict, parent_digest: str) -> None:
    """The manifest against one member's index, before any call: the index bytes, the parent
    digest and the layers must all be the ones the manifest names."""
    path = out / entry["path"]
    ip = path / INDEX
    what = f"{entry['name']} ({entry['path']})"
    if not ip.exists():
        raise IntegrityError(f"{what}: missing {INDEX} named by {MANIFEST}")
    got = sha256_file(ip)
    if got != entry["index_sha256"]:
        raise IntegrityError(f"{what}: {INDEX} has sha256 {got[:16]}…, the manifest records {entry['index_sha256'][:16]}…",
                             hint="the shard set was changed after it was written; write it again from its parent")
    rec = read_index(path).get("shard", {})
    if rec.get("parent_digest") != parent_digest:
        raise IntegrityError(f"{what}: derived from parent {str(rec.get('parent_digest'))[:16]}…, the manifest names "
                             f"parent {parent_digest[:16]}…")
    if rec.get("layers") != entry.get("layers"):
        raise IntegrityError(f"{what}: holds layers {rec.get('layers')}, the manifest assigns {entry.get('layers')}")


def check_set(out: str | Path) -> dict:
    """Read the manifest and check it against every member's index; return it."""
    out = Path(out)
    m = read_manifest(out)
    digest = m["parent"]["digest"]
    check_member(out, m["ends"], digest)
    split.check(int(m["parent"]["num_layers"]), [LayerRange(*e["layers"]) for e in m["shards"]])
    for e in m["shards"]:
        check_member(out, e, digest)
    return m


# ---- writing -----------------------------------------------------------------------------------


def write_shards(src: str | Path | Container, out: str | Path, shards) -> Path:
    """Write the shard set of a container: one member per layer range plus the ends, and the
    manifest last. ``shards``: a count, a ranges string ("0-14,15-29") or LayerRanges."""
    c = src if isinstance(src, Container) else Container(src)
    plan = c.op_plan()
    ranges = split.resolve(len(plan.layers), shards)
    out = Path(out)
    if out.exists():
        raise EncodeError(f"output {out} already exists; refusing to overwrite it (remove it or choose another path)")
    if not out.parent.exists():
        raise EncodeError(f"output directory's parent {out.parent} does not exist")
    tmp = hidden_sibling(out, f".sharding-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(c, plan, ranges, tmp)
        os.replace(tmp, out)
        return out
    except BaseException as e:  # never leave a half-written shard set
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, (VindexError, KeyboardInterrupt, SystemExit)):
            raise
        raise EncodeError(f"sharding {c.path.name} failed ({type(e).__name__}: {e}); no output was written") from e


def _write(c: Container, plan, ranges: list[LayerRange], tmp: Path) -> None:
    tmp.mkdir()
    graph_bytes = (c.path / GRAPH).read_bytes()
    parent_tables = {o: {n: [e.dtype, list(e.shape), e.nbytes] for n, e in s.entries.items()} for o, s in c.segments.items()}
    # the index's own records (per-tensor hashes included), not the listing view of them
    reps_by_obj = {rep["object"]: (key, rep) for key, rep in c.index["representations"].items()}
    layer_objs = {r.object for lo in plan.layers for r in lo.operands()}
    now = _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat()
    base = {"parent_digest": c.digest, "parent_name": c.name, "parent_tables": parent_tables}

    def index_for(name: str, role: str, layers, reps: dict, segs: list, caps: dict, extra: dict) -> dict:
        return {
            **extra,
            "format": FORMAT, "version": FORMAT_VERSION, "generation": 1,
            "model": dict(c.index.get("model", {})), "authority": "derived", "profiles": list(c.index.get("profiles", ["exact"])),
            "graph": dict(c.index.get("graph", {})), "representations": reps, "segments": segs, "capabilities": caps,
            "provenance": {"derived_from": {"name": c.name, "digest": c.digest}, "encoder": f"vindex3 {__version__}",
                           "sharded_at": now},
            "shard": {**base, "name": name, "role": role, "layers": layers},
        }

    entries = []
    # The ends: every object no layer reads, copied segment file for segment file, with the
    # capability files and the parent's unknown index keys.
    d = tmp / ENDS
    (d / "segments").mkdir(parents=True)
    (d / GRAPH).write_bytes(graph_bytes)
    reps, segs = {}, []
    for obj in sorted(set(c.segments) - layer_objs):
        key, rep = reps_by_obj[obj]
        shutil.copyfile(c.path / rep["segment"], d / rep["segment"])
        reps[key] = dict(rep)
        segs.append({"path": rep["segment"], "bytes": rep["segment_bytes"], "sha256": rep["segment_sha256"]})
    caps = {}
    for name, cap in sorted(c.index.get("capabilities", {}).items()):
        shutil.copyfile(c.path / name, d / name)
        caps[name] = dict(cap)
    unknown = {k: v for k, v in c.index.items() if k not in KNOWN_INDEX_KEYS}
    jsonio.write_atomic(d / INDEX, seal(index_for(ENDS, "ends", None, reps, segs, caps, unknown)))
    entries.append(("ends", None, ENDS, d))

    for k, r in enumerate(ranges):
        name = member_name(k)
        d = tmp / name
        (d / "segments").mkdir(parents=True)
        (d / GRAPH).write_bytes(graph_bytes)
        held: dict[str, list[str]] = {}
        for i in range(r.start, r.end):
            for ref in plan.layers[i].operands():
                held.setdefault(ref.object, []).append(ref.tensor)
        reps, segs = {}, []
        for obj, names in sorted(held.items()):
            key, prep = reps_by_obj[obj]
            seg = c.segments[obj]
            # the stored bytes, as they are (an encoding may have no writer here, or none at all)
            specs = {n: (seg.entries[n].dtype, seg.entries[n].shape, seg.entries[n].nbytes) for n in names}
            rel = prep["segment"]
            info = write_segment(d / rel, key, specs, lambda n, seg=seg: Encoded(np.asarray(seg.raw(n))))
            written = Segment(d / rel)
            for n in names:  # the bytes are the parent's bytes, tensor for tensor
                if not np.array_equal(written.raw(n), seg.raw(n)):
                    raise IntegrityError(f"{name}: {obj}/{n} did not copy byte for byte (encoding {seg.entries[n].dtype})")
            reps[key] = {"object": obj, "encoding": prep.get("encoding"), "segment": rel, "tensors": info.tensors,
                         "payload_bytes": info.payload_bytes, "payload_sha256": info.payload_sha256,
                         "segment_sha256": info.segment_sha256, "segment_bytes": info.segment_bytes,
                         "header_sha256": info.header_sha256, "tensor_sha256": info.tensor_sha256}
            perm = {n: p for n, p in (prep.get("permutation") or {}).items() if n in names}
            if perm:  # a permuted bank stays permuted, and says so
                reps[key]["permutation"] = perm
            segs.append({"path": rel, "bytes": info.segment_bytes, "sha256": info.segment_sha256})
        jsonio.write_atomic(d / INDEX, seal(index_for(name, "layers", [r.start, r.end], reps, segs, {}, {})))
        entries.append((name, [r.start, r.end], name, d))

    for name, layers, rel, d in entries:
        ShardContainer(d)  # every member opens and closes over the parent's graph before it is real

    def entry(name, layers, rel, d):
        return {"name": name, "path": rel, "layers": layers, "index_sha256": sha256_file(d / INDEX)}

    manifest = {
        "format": SET_FORMAT, "version": SET_VERSION,
        "parent": {"name": c.name, "digest": c.digest, "num_layers": len(plan.layers), "hidden_size": plan.hidden_size},
        "ends": entry(*entries[0]),
        "shards": [entry(*e) for e in entries[1:]],
        "written_by": f"vindex3 {__version__}", "written_at": now,
    }
    jsonio.write_atomic(tmp / MANIFEST, manifest)  # last: its presence means the set is complete
