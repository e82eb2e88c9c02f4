"""Opening a VINDEX3 container: index first (format version before anything else), then the
graph (schema 6), then segment headers (memory-mapped lazily), then operand closure.
Opening reads no tensor data."""

from __future__ import annotations

import hashlib
import math
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from . import closure, jsonio
from .errors import (
    ClosureError,
    ConfigError,
    ContainerNotFound,
    FormatVersionError,
    GraphSchemaError,
    IntegrityError,
    SliceError,
)
from .graph import Graph
from .segments import Segment, sha256_file

if TYPE_CHECKING:
    from .exec.engine import Executor
    from .exec.intervention import Intervention
    from .exec.slice import ExecutionSlice

FORMAT = "VINDEX3"
FORMAT_VERSION = 3
INDEX = "index.json"
GRAPH = "system_graph.json"


class VerifyReport(BaseModel):
    """Plain data; its text layout is lql.render.verify_text (the one renderer)."""

    path: str
    ok: bool
    checked: int
    problems: list[str]


class DerivedRow(BaseModel):
    """One derived representation (index.json ``derived``): what it is, what it was derived
    from, and whether that source is this container as it is now."""

    key: str
    kind: str
    version: int | None
    authority: str
    method: str | None
    params: dict
    source_digest: str | None
    fresh: bool  # source_digest is this container's digest
    files: int
    bytes: int
    summary: str | None


def read_index(path: Path) -> dict:
    """Read index.json and refuse an unknown format or version before anything else is read."""
    if not path.exists():
        raise ContainerNotFound(f"{path} does not exist")
    if not path.is_dir():
        raise ContainerNotFound(f"{path} is not a directory (a VINDEX3 container is a directory)")
    ip = path / INDEX
    if not ip.exists():
        raise ContainerNotFound(f"{path} has no {INDEX}; it is not a VINDEX3 container (or its encode did not finish)")
    try:
        index = jsonio.load(ip)
    except ConfigError as e:
        raise FormatVersionError(f"{path.name}/{INDEX} is unreadable: {e.message}") from None
    if not isinstance(index, dict):
        raise FormatVersionError(f"{path.name}/{INDEX} is not a JSON object")
    fmt, ver = index.get("format"), index.get("version")
    if fmt != FORMAT or ver != FORMAT_VERSION:
        found = f"{fmt} version {ver}" if fmt else f"no format tag (version {ver!r})"
        if fmt in ("VINDEX2", "VINDEX") or ver == 2:
            found = f"VINDEX2 (format {fmt!r}, version {ver!r})"
        raise FormatVersionError(
            f"{path.name}: unsupported container format: found {found}, supported {FORMAT} version {FORMAT_VERSION}",
            hint="re-encode the model from its checkpoint with `vindex3 encode SRC OUT`",
        )
    return index


class Container:
    """An opened container. Cheap: holds headers and memory maps, never tensor copies."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = read_index(self.path)
        if isinstance(self.index.get("shard"), dict):  # a member of a shard set holds part of a model
            from .shards.errors import ShardError

            raise ShardError(f"{self.path.name} is a member of a shard set (it holds part of "
                             f"{self.index['shard'].get('parent_name', 'a model')}); it is not a whole container",
                             hint="open the shard set's directory with vindex3.shards.open_set")
        gp = self.path / GRAPH
        if not gp.exists():
            raise GraphSchemaError(f"{self.path.name} has no {GRAPH}", hint="re-encode the container")
        try:
            raw = jsonio.load(gp)
        except ConfigError as e:
            raise GraphSchemaError(f"{GRAPH} is unreadable: {e.message}") from None
        self.graph = Graph(raw)
        _ = self.graph.component  # exactly one primary_text, or a named refusal
        # object -> its one representation. A second representation of an object is refused by
        # name: it must never silently win over the first.
        self.segments: dict[str, Segment] = {}
        chosen: dict[str, str] = {}
        for key, rep in sorted(self.representations_by_key.items()):
            if not isinstance(rep, dict) or not isinstance(rep.get("object"), str) or not isinstance(rep.get("segment"), str):
                raise IntegrityError(f"{INDEX}: representation {key!r} must name its object and segment")
            obj = rep["object"]
            if obj in chosen:
                raise IntegrityError(
                    f"{INDEX}: object {obj!r} has two representations, {chosen[obj]!r} and {key!r}; this build executes "
                    "exactly one representation per object and will not pick one",
                    hint="keep one representation per object in a container (vindex3 represent writes a new container)",
                )
            chosen[obj] = key
            self.segments[obj] = Segment(self.path / rep["segment"])
        tables = {o: {n: (e.dtype, e.shape) for n, e in s.entries.items()} for o, s in self.segments.items()}
        defects = closure.check(self.graph, tables)
        if defects:
            raise ClosureError(f"{self.path.name}: operands do not close over the graph ({len(defects)} defect(s))", defects)

    # -- facts from the index ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.index.get("model", {}).get("name", self.path.name)

    @property
    def generation(self) -> int:
        return int(self.index.get("generation", 1))

    @property
    def representations_by_key(self) -> dict[str, dict]:
        return self.index.get("representations", {})

    @property
    def representations(self) -> list[dict]:
        return [{"key": k, **v} for k, v in sorted(self.representations_by_key.items())]

    @property
    def provenance(self) -> dict:
        return dict(self.index.get("provenance", {}))

    @property
    def authority(self) -> str:
        return self.index.get("authority", "canonical")

    @cached_property
    def digest(self) -> str:
        """Identity of the container's content: the graph and every payload hash."""
        h = hashlib.sha256()
        h.update(self.index.get("graph", {}).get("sha256", "").encode())
        for key, rep in sorted(self.representations_by_key.items()):
            h.update(f"{key}:{rep['payload_sha256']};".encode())
        return h.hexdigest()

    def objects(self) -> list[dict]:
        out = []
        for key, rep in sorted(self.representations_by_key.items()):
            seg = self.segments[rep["object"]]
            params = sum(math.prod(e.shape) for e in seg.entries.values())
            out.append({"object": rep["object"], "representation": key, "tensors": len(seg.entries), "parameters": params, "bytes": rep["payload_bytes"]})
        return out

    @property
    def derived(self) -> list[DerivedRow]:
        """Derived representations recorded in index.json (feature metadata, ...), each with its
        provenance; ``fresh`` is False when the container changed since it was built."""
        rows = []
        for key, e in sorted((self.index.get("derived") or {}).items()):
            if not isinstance(e, dict):
                continue
            files = e.get("files") or {}
            rows.append(DerivedRow(
                key=key, kind=str(e.get("kind", key)), version=e.get("version"), authority=str(e.get("authority", "derived")),
                method=e.get("method"), params=dict(e.get("params") or {}), source_digest=e.get("source_digest"),
                fresh=e.get("source_digest") == self.digest, files=len(files),
                bytes=sum(int(f.get("bytes", 0)) for f in files.values() if isinstance(f, dict)), summary=e.get("summary"),
            ))
        return rows

    @property
    def weight_bytes(self) -> int:
        return sum(r["payload_bytes"] for r in self.representations_by_key.values())

    # -- capabilities --------------------------------------------------------------------------
    @property
    def has_tokenizer(self) -> bool:
        return (self.path / "tokenizer.json").exists()

    @cached_property
    def tokenizer(self):
        from .tokenizer import Tokenizer

        return Tokenizer.from_container(self.path)

    # -- plans -------------------------------------------------------------------------------
    @cached_property
    def _op_plan(self):
        from .opplan import build_op_plan

        return build_op_plan(self.graph, {o: s.entries for o, s in self.segments.items()})

    def op_plan(self):
        return self._op_plan

    def continuation(self):
        """Per-layer continuation geometry, from the plan."""
        return [lo.geometry for lo in self._op_plan.layers]

    def plan_slice(self, sl: ExecutionSlice | None = None):
        from .exec.slice import Full, plan_slice

        return plan_slice(self._op_plan, sl or Full())

    def tensor_source(self) -> SegmentSource:
        """Where an executor reads this container's operands: its mapped segments."""
        return SegmentSource(self.segments)

    def executor(self, slice: ExecutionSlice | None = None, intervention: Intervention | None = None, *,
                 shards=None) -> Executor:
        """An executor for ``slice`` (default Full()) over this container's segments;
        ``intervention`` (e.g. a `vindex3.exec.intervention.FeatureAblation`) changes what every
        pass computes. With ``shards`` (a count, a ranges string "0-14,15-29" or a list of
        LayerRanges) the layers run as Ray actors and the ends here: a
        `vindex3.shards.ShardedExecutor`, byte-identical to one process (docs/distributed.md)."""
        from .exec.engine import Executor
        from .exec.slice import Full

        if shards is not None:
            if intervention is not None:
                raise SliceError("an intervention cannot run over shards in this build (the actors run the "
                                 "container's own weights)", hint="run the intervention in one process")
            from .shards import sharded

            return sharded(self, shards).executor(slice or Full())
        return Executor(self._op_plan, self.tensor_source(), slice or Full(), intervention)

    # -- integrity -------------------------------------------------------------------------
    def verify(self) -> VerifyReport:
        return verify(self.path)

    def rewrite_index(self, **updates) -> None:
        """Rewrite index.json with ``updates`` applied; unknown keys survive; generation + 1."""
        rewrite_index(self.path, **updates)
        self.index = read_index(self.path)


class SegmentSource:
    """Operands as weight objects over memory-mapped segments, keyed by object."""

    def __init__(self, segments: dict[str, Segment]):
        self._segments = segments

    def weight(self, ref):
        return self._segments[ref.object].weight(ref.tensor)


def rewrite_index(path: Path, **updates) -> None:
    index = read_index(Path(path))
    index.update(updates)
    index["generation"] = int(index.get("generation", 1)) + 1
    jsonio.write_atomic(Path(path) / INDEX, index)


def verify(path: str | Path) -> VerifyReport:
    """Re-hash every segment, the graph and every capability file against the index."""
    path = Path(path)
    index = read_index(path)
    problems: list[str] = []
    checked = 0

    def check_file(rel: str, want: str | None, want_bytes: int | None = None, what: str = "") -> None:
        nonlocal checked
        fp = path / rel
        if not fp.exists():
            problems.append(f"{rel}: missing ({what} named by index.json)")
            return
        checked += 1
        if want_bytes is not None and fp.stat().st_size != want_bytes:
            problems.append(f"{rel}: size {fp.stat().st_size} bytes, index records {want_bytes} (truncated or extended)")
        got = sha256_file(fp)
        if want is not None and got != want:
            problems.append(f"{rel}: sha256 {got[:16]}… differs from the index's {want[:16]}…")

    g = index.get("graph")
    if not isinstance(g, dict) or not g.get("sha256"):
        problems.append(f"{INDEX}: records no graph hash, so {GRAPH} cannot be verified")
        g = {}
    check_file(g.get("path", GRAPH), g.get("sha256"), None, "the graph")
    for key, rep in sorted(index.get("representations", {}).items()):
        before = len(problems)
        check_file(rep["segment"], rep.get("segment_sha256"), rep.get("segment_bytes"), f"segment of {key}")
        if len(problems) == before and (path / rep["segment"]).exists():
            try:
                seg = Segment(path / rep["segment"])
                ph = sha256_file(path / rep["segment"], skip=seg.payload_start)
                if ph != rep.get("payload_sha256"):
                    problems.append(f"{rep['segment']}: payload sha256 differs from the index ({key})")
            except IntegrityError as e:
                problems.append(str(e))
    for name, cap in sorted(index.get("capabilities", {}).items()):
        check_file(name, cap.get("sha256"), cap.get("bytes"), "a capability sidecar")
    for key, e in sorted((index.get("derived") or {}).items()):
        for rel, f in sorted(((e or {}).get("files") or {}).items()):
            check_file(rel, f.get("sha256"), f.get("bytes"), f"a file of the derived representation {key!r}")
    return VerifyReport(path=str(path), ok=not problems, checked=checked, problems=problems)


def open(path: str | Path) -> Container:
    return Container(path)
