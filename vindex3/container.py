"""Opening a VINDEX3 container: index first (format version before anything else, then every key
typed), then the graph (schema 6, typed, its hash checked against the index), then segment
headers (paths confined to the container, regular files only, headers validated and their hashes
checked), then operand closure. Opening reads no tensor data.

Tensor data is checked on first use: the first time an executor reads a tensor, its bytes are
hashed against the index (``tensor_sha256``; a container without it has its whole segment
hashed against ``segment_sha256`` instead) and scanned (vindex3.scan: NaN, infinity, and a magnitude
no float32 run survives). ``verify`` checks
everything at once. See docs/container.md#integrity."""

from __future__ import annotations

import hashlib
import math
import os
import stat
import time
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
    PathRefused,
    SliceError,
    VindexError,
)
from .graph import Graph
from .manifest import (
    INDEX_HASH,
    CapabilityRef,
    GraphRef,
    IndexFile,
    Representation,
    index_digest,
    parse_index,
    problems,
)
from .paths import check_text, confined, existing_file, read_regular
from .segments import Segment, sha256_file_and_tail

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


MAX_INDEX_BYTES = 64 << 20
MAX_GRAPH_BYTES = 64 << 20
MAX_CAPABILITY_BYTES = 512 << 20
REENCODE = "re-encode the container from its checkpoint with `vindex3 encode SRC OUT`"


def read_index(path: Path) -> dict:
    """Read index.json and refuse an unknown format or version before anything else is read.
    Returns the raw dict (unknown keys kept); `parse_index` types it."""
    path = Path(path)
    try:
        check_text(path, "container path")
    except PathRefused as e:
        raise ContainerNotFound(e.message) from None
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        raise ContainerNotFound(f"{path} does not exist") from None
    except OSError as e:
        raise ContainerNotFound(f"{path} cannot be opened ({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ContainerNotFound(f"{path} is not a directory (a VINDEX3 container is a directory)")
    try:
        ip = confined(path, INDEX, f"{path.name}/{INDEX}")
        data = read_regular(ip, f"{path.name}/{INDEX}", max_bytes=MAX_INDEX_BYTES)
    except PathRefused as e:
        if e.reason == "missing":
            raise ContainerNotFound(f"{path} has no {INDEX}; it is not a VINDEX3 container (or its encode did not finish)") from None
        raise IntegrityError(e.message, hint=REENCODE) from None
    try:
        index = jsonio.loads(jsonio.decode_text(data, f"{path.name}/{INDEX}"), source=f"{path.name}/{INDEX}")
    except ConfigError as e:
        raise FormatVersionError(f"{path.name}/{INDEX} is unreadable: {e.message}") from None
    if not isinstance(index, dict):
        raise FormatVersionError(f"{path.name}/{INDEX} is not a JSON object")
    fmt, ver = index.get("format"), index.get("version")
    if fmt != FORMAT or ver != FORMAT_VERSION or isinstance(ver, bool):
        found = f"{fmt} version {ver}" if fmt else f"no format tag (version {ver!r})"
        if fmt in ("VINDEX2", "VINDEX") or ver == 2:
            found = f"VINDEX2 (format {fmt!r}, version {ver!r})"
        raise FormatVersionError(
            f"{path.name}: unsupported container format: found {found}, supported {FORMAT} version {FORMAT_VERSION}",
            hint=REENCODE,
        )
    return index


def _confined_file(root: Path, rel: str, what: str) -> Path:
    """A file named by the index: inside the container, a regular file (nothing is opened)."""
    try:
        return existing_file(rel, what, within=root)
    except PathRefused as e:
        raise IntegrityError(f"{INDEX} names {e.message}", hint=REENCODE) from None


def _value_problem(found, what: str, name: str) -> str | None:
    """What a tensor's scan (vindex3.scan.TensorScan) says is wrong with its values, or None."""
    from .scan import MAGNITUDE_BOUND, fmt_magnitude

    if found.nonfinite:
        return f"{what}: tensor {name} holds {found.nonfinite} NaN or infinite value(s)"
    if found.absurd:
        return (f"{what}: tensor {name} ({found.encoding}) decodes to a magnitude of {fmt_magnitude(found.max_abs)}, "
                f"past the {fmt_magnitude(MAGNITUDE_BOUND)} a weight may have (float32 arithmetic overflows on it)")
    return None


def _stamp(p: Path) -> tuple[int, int, int, int] | None:
    """(size, mtime_ns, inode, ctime_ns): ctime too, because a writer can put the modification
    time back (os.utime) and cannot put the change time back."""
    try:
        st = os.stat(p)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


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
        altered: list[str] = []  # files whose bytes differ from what the index records
        recorded = self.index.get(INDEX_HASH)
        if isinstance(recorded, str) and index_digest(self.index) != recorded:
            altered.append(f"{INDEX}: its content no longer has the sha256 it records ({recorded[:16]}…)")
        try:
            self.manifest: IndexFile = parse_index(self.index, f"{self.path.name}/{INDEX}")
            m = self.manifest
            try:
                gp = confined(self.path, GRAPH, "the graph")
                gbytes = read_regular(gp, f"{self.path.name}/{GRAPH}", max_bytes=MAX_GRAPH_BYTES)
            except PathRefused as e:
                if e.reason == "missing":
                    raise GraphSchemaError(f"{self.path.name} has no {GRAPH}", hint="re-encode the container") from None
                raise IntegrityError(e.message, hint=REENCODE) from None
            got = hashlib.sha256(gbytes).hexdigest()
            if got != m.graph.sha256:
                altered.append(f"{GRAPH}: sha256 {got[:16]}… differs from the index's {m.graph.sha256[:16]}…")
            self._open(gbytes, altered)
        except VindexError as e:
            if altered and e.hint is None:
                e.hint = f"{altered[0]}: the file was altered after encoding"
            raise
        if altered:
            raise IntegrityError(
                f"{self.path.name}: " + "; ".join(altered) + " (altered after encoding, or damaged)",
                hint="run `vindex3 verify` to list every difference; " + REENCODE,
            )
        # first-use checks: (object, tensor) already hashed and scanned; objects whose whole
        # segment was hashed (containers without per-tensor hashes)
        self._checked: set[tuple[str, str]] = set()
        self._segment_checked: set[str] = set()
        self._scans: dict[tuple[str, str], tuple] = {}  # (object, tensor) -> (TensorScan, seconds hashing)
        # what the executable files were when opened: (size, mtime_ns, inode, ctime_ns) each
        self._stamps = {p: _stamp(p) for p in self._executable_files()}

    def _executable_files(self) -> list[Path]:
        return [self.path / GRAPH] + [seg.path for seg in self.segments.values()]

    def check_unchanged(self) -> None:
        """Refuse by name when a file the model computes from (the graph or a segment) changed
        on disk since the container was opened (its size, modification or change time, or inode): the open
        container would compute with bytes nobody verified. A few stat calls; no data read."""
        for p, was in self._stamps.items():
            now = _stamp(p)
            if now != was:
                what = "is gone" if now is None else "was replaced" if now[2] != was[2] else "was modified"
                raise IntegrityError(f"{self.path.name}: {p.name} {what} on disk while the container was open; "
                                     "refusing to compute with bytes that were not verified",
                                     hint="open the container again (OPEN 'path') to verify and use what is there now")

    def _open(self, gbytes: bytes, altered: list[str]) -> None:
        m = self.manifest
        try:
            raw = jsonio.loads(jsonio.decode_text(gbytes, GRAPH), source=GRAPH)
        except ConfigError as e:
            raise GraphSchemaError(f"{GRAPH} is unreadable: {e.message}") from None
        self.graph = Graph(raw)
        _ = self.graph.component  # exactly one primary_text, or a named refusal
        if m.graph.schema_ != self.graph.raw["schema"]:
            raise IntegrityError(f"{INDEX}: graph.schema {m.graph.schema_} differs from the graph's own {self.graph.raw['schema']}")
        # object -> its one representation. A second representation of an object is refused by
        # name: it must never silently win over the first.
        self.segments: dict[str, Segment] = {}
        self._reps: dict[str, Representation] = {}
        chosen: dict[str, str] = {}
        for key, rep in sorted(m.representations.items()):
            obj = rep.object
            if obj in chosen:
                raise IntegrityError(
                    f"{INDEX}: object {obj!r} has two representations, {chosen[obj]!r} and {key!r}; this build executes "
                    "exactly one representation per object and will not pick one",
                    hint="keep one representation per object in a container (vindex3 represent writes a new container)",
                )
            chosen[obj] = key
        for key, rep in sorted(m.representations.items()):
            obj = rep.object
            if obj not in self.graph.objects:
                raise IntegrityError(f"{INDEX}: representation {key!r} is of object {obj!r}, which the graph does not declare")
            seg = Segment(_confined_file(self.path, rep.segment, f"segment {rep.segment!r} of {key}"),
                          what=f"segment {rep.segment} ({key})")
            self._check_header(key, rep, seg, altered)
            for name, perm in (rep.permutation or {}).items():
                e = seg.entries.get(name)
                if e is None or len(e.shape) != 3 or e.shape[0] != len(perm):
                    what = "no such tensor" if e is None else f"shape {list(e.shape)}"
                    raise IntegrityError(f"{INDEX}: representation {key!r} permutes {name!r} over {len(perm)} experts, "
                                         f"but its segment has {what} (a permutation orders a stacked bank [E, out, in])")
            self.segments[obj] = seg
            self._reps[obj] = rep
        for name, cap in sorted(m.capabilities.items()):
            if "/" in name or name in (".", ".."):
                raise IntegrityError(f"{INDEX}: capability {name!r} is not a file name in the container")
            fp = _confined_file(self.path, name, f"capability file {name!r}")
            size = fp.stat().st_size
            if size != cap.bytes:
                raise IntegrityError(f"{name}: {size} bytes, the index records {cap.bytes} (truncated, extended or replaced)",
                                     hint=REENCODE)
        tables = {o: {n: (e.dtype, e.shape) for n, e in s.entries.items()} for o, s in self.segments.items()}
        defects = closure.check(self.graph, tables)
        if defects:
            raise ClosureError(f"{self.path.name}: operands do not close over the graph ({len(defects)} defect(s))", defects)

    def _check_header(self, key: str, rep: Representation, seg: Segment, altered: list[str]) -> None:
        """What the index records about a segment against its header and size (no payload read)."""
        what = seg.what
        if rep.header_sha256 is not None and seg.header_sha256 != rep.header_sha256:
            altered.append(f"{what}: header sha256 {seg.header_sha256[:16]}… differs from the index's {rep.header_sha256[:16]}…")
        if seg.representation != key:
            raise IntegrityError(f"{what}: its header says it holds {seg.representation!r}, the index says {key!r} "
                                 "(segments swapped or renamed)", hint=REENCODE)
        if seg.size != rep.segment_bytes:
            raise IntegrityError(f"{what}: {seg.size} bytes, the index records {rep.segment_bytes} (truncated or extended)",
                                 hint=REENCODE)
        if seg.payload_start + rep.payload_bytes != seg.size:
            raise IntegrityError(f"{what}: header ({seg.payload_start} bytes) and payload ({rep.payload_bytes} bytes, "
                                 f"as the index records) do not add up to the file's {seg.size} bytes "
                                 "(the header length was changed)", hint=REENCODE)
        if len(seg.entries) != rep.tensors:
            raise IntegrityError(f"{what}: {len(seg.entries)} tensors in its header, the index records {rep.tensors}",
                                 hint=REENCODE)
        if rep.tensor_sha256 is not None and set(rep.tensor_sha256) != set(seg.entries):
            odd = sorted(set(rep.tensor_sha256) ^ set(seg.entries))
            raise IntegrityError(f"{what}: tensor {odd[0]!r} is in {'the header' if odd[0] in seg.entries else 'the index'} "
                                 "but not in the other (tensor names changed)", hint=REENCODE)

    # -- first use ---------------------------------------------------------------------------
    def check_tensor(self, obj: str, name: str) -> None:
        """On a tensor's first use: its stored bytes against the index's hash, and its values for
        NaN and infinity. Later uses cost nothing. Refuses with IntegrityError naming the tensor."""
        if (obj, name) in self._checked:
            return
        t0 = time.perf_counter()
        rep, seg = self._reps[obj], self.segments[obj]
        fix = "run `vindex3 verify` to list every difference; " + REENCODE
        if rep.tensor_sha256 is not None:
            want = rep.tensor_sha256[name]
            got = seg.tensor_sha256(name)
            if got != want:
                raise IntegrityError(f"{seg.what}: tensor {name}: its bytes hash to {got[:16]}…, the index records "
                                     f"{want[:16]}… (altered or damaged since encoding)", hint=fix)
        elif obj not in self._segment_checked:
            whole, _ = sha256_file_and_tail(seg.path, 0, seg.what)
            if whole != rep.segment_sha256:
                raise IntegrityError(f"{seg.what}: sha256 {whole[:16]}… differs from the index's "
                                     f"{rep.segment_sha256[:16]}… (altered or damaged since encoding)", hint=fix)
            self._segment_checked.add(obj)
        hashed = time.perf_counter()
        from . import codecs
        from .scan import scan

        # an encoding without a codec cannot be scanned (nor executed: preparing a slice that
        # reads it is refused by name); its bytes were still checked above, for tools that copy it
        if codecs.is_known(seg.entries[name].dtype):
            found = scan(seg.weight(name))
            self._scans[(obj, name)] = (found, hashed - t0)
            problem = _value_problem(found, seg.what, name)
            if problem:
                raise IntegrityError(problem + "; refusing to compute with it", hint=fix)
        self._checked.add((obj, name))

    def first_use_cost(self) -> list[dict]:
        """What the first-use checks of this opened container cost so far, per encoding: tensors
        checked, their stored bytes, seconds hashing and seconds scanning, and the largest
        magnitude the scan decoded (see vindex3.scan)."""
        rows: dict[str, dict] = {}
        for found, hash_s in self._scans.values():
            r = rows.setdefault(found.encoding, {"encoding": found.encoding, "tensors": 0, "bytes": 0, "values": 0,
                                                 "hash_seconds": 0.0, "scan_seconds": 0.0, "max_abs": 0.0})
            r["tensors"] += 1
            r["bytes"] += found.nbytes
            r["values"] += found.values
            r["hash_seconds"] += hash_s
            r["scan_seconds"] += found.seconds
            if found.max_abs is not None:
                r["max_abs"] = max(r["max_abs"], found.max_abs)
        return [rows[k] for k in sorted(rows)]

    # -- facts from the index ---------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.manifest.model.name

    @property
    def generation(self) -> int:
        return self.manifest.generation

    @property
    def representations_by_key(self) -> dict[str, dict]:
        # per-tensor hashes stay in self.manifest: hundreds of lines nobody reads in a listing
        return {k: r.model_dump(exclude_none=True, exclude={"tensor_sha256"}) for k, r in self.manifest.representations.items()}

    @property
    def representations(self) -> list[dict]:
        return [{"key": k, **v} for k, v in sorted(self.representations_by_key.items())]

    @property
    def provenance(self) -> dict:
        return dict(self.manifest.provenance)

    @property
    def authority(self) -> str:
        return self.manifest.authority

    @cached_property
    def digest(self) -> str:
        """Identity of the container's content: the graph and every payload hash."""
        h = hashlib.sha256()
        h.update(self.manifest.graph.sha256.encode())
        for key, rep in sorted(self.manifest.representations.items()):
            h.update(f"{key}:{rep.payload_sha256};".encode())
        return h.hexdigest()

    def objects(self) -> list[dict]:
        out = []
        for key, rep in sorted(self.manifest.representations.items()):
            seg = self.segments[rep.object]
            params = sum(math.prod(e.shape) for e in seg.entries.values())
            stored = sum(e.nbytes for e in seg.entries.values())
            encodings: dict[str, int] = {}
            for e in seg.entries.values():
                encodings[e.dtype] = encodings.get(e.dtype, 0) + 1
            out.append({"object": rep.object, "representation": key, "encoding": rep.encoding,
                        "tensors": len(seg.entries), "parameters": params, "bytes": rep.payload_bytes,
                        "encodings": dict(sorted(encodings.items(), key=lambda kv: (-kv[1], kv[0]))),
                        "bits_per_weight": round(8 * stored / params, 3) if params else 0.0})
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
        return sum(r.payload_bytes for r in self.manifest.representations.values())

    # -- capabilities --------------------------------------------------------------------------
    @property
    def has_tokenizer(self) -> bool:
        """Whether the index records a tokenizer (an unrecorded tokenizer.json is never used)."""
        return "tokenizer.json" in self.manifest.capabilities

    def capability_bytes(self, name: str) -> bytes:
        """A capability file's bytes, checked against the size and hash the index records."""
        cap = self.manifest.capabilities.get(name)
        if cap is None:
            raise IntegrityError(f"{self.path.name}: the index records no capability file {name!r}")
        try:
            data = read_regular(confined(self.path, name, f"capability file {name!r}"), f"{self.path.name}/{name}",
                                max_bytes=MAX_CAPABILITY_BYTES)
        except PathRefused as e:
            raise IntegrityError(f"{INDEX} names {e.message}", hint=REENCODE) from None
        got = hashlib.sha256(data).hexdigest()
        if len(data) != cap.bytes or got != cap.sha256:
            raise IntegrityError(f"{name}: {len(data)} bytes with sha256 {got[:16]}…, the index records {cap.bytes} bytes "
                                 f"with {cap.sha256[:16]}… (altered or damaged since encoding)", hint=REENCODE)
        return data

    @cached_property
    def tokenizer(self):
        from .errors import TokenizerMissing
        from .tokenizer import Tokenizer

        if not self.has_tokenizer:
            raise TokenizerMissing(
                f"container {self.path.name} carries no tokenizer (no tokenizer.json in its snapshot)",
                hint="pass token ids instead, e.g. INFER TOKENS (1, 2, 3)",
            )
        text = jsonio.decode_text(self.capability_bytes("tokenizer.json"), "tokenizer.json")
        cfg: dict = {}
        if "tokenizer_config.json" not in self.manifest.capabilities and (
                (self.path / "tokenizer_config.json").exists() or (self.path / "tokenizer_config.json").is_symlink()):
            raise IntegrityError(f"{self.path.name}: tokenizer_config.json is present but the index does not record it; "
                                 "an unrecorded file is never used (it would change how text is tokenized)",
                                 hint=REENCODE)
        if "tokenizer_config.json" in self.manifest.capabilities:
            data = self.capability_bytes("tokenizer_config.json")
            try:
                cfg = jsonio.loads(jsonio.decode_text(data, "tokenizer_config.json"), source="tokenizer_config.json")
            except ConfigError as e:
                raise IntegrityError(f"{self.path.name}: {e.message}") from None
        return Tokenizer.from_json(text, cfg, source=f"{self.path.name}/tokenizer.json")

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
        """Where an executor reads this container's operands: its mapped segments, each tensor
        checked on first use (`check_tensor`)."""
        return SegmentSource(self.segments, self.check_tensor,
                             {o: dict(r.permutation) for o, r in self._reps.items() if r.permutation})

    def executor(self, slice: ExecutionSlice | None = None, intervention: Intervention | None = None, *,
                 shards=None, max_positions: int | None = None, activations: str = "exact") -> Executor:
        """An executor for ``slice`` (default Full()) over this container's segments.
        ``intervention`` (e.g. a `vindex3.exec.intervention.FeatureAblation`) changes what every
        pass computes. Positions are limited to the graph's context length, or to
        ``max_positions`` when given (an explicit override, which may exceed the context length;
        see vindex3.limits). ``activations`` ('exact' | 'q8', vindex3.codecs.base.ACTIVATIONS) is how
        int8 and q4 decode products treat activations; the trace records it. With ``shards`` (a
        count, a ranges string "0-14,15-29" or a list of LayerRanges) the layers run as Ray actors and the ends here: a
        `vindex3.shards.ShardedExecutor`, byte-identical to one process (docs/distributed.md)."""
        from .exec.engine import Executor
        from .exec.slice import Full

        if shards is not None:
            if intervention is not None:
                raise SliceError("an intervention cannot run over shards in this build (the actors run the "
                                 "container's own weights)", hint="run the intervention in one process")
            if activations != "exact":
                raise SliceError(f"activations {activations!r} cannot run over shards in this build (the actors "
                                 "multiply with exact activations)", hint="run it in one process")
            from .shards import sharded

            return sharded(self, shards).executor(slice or Full())
        return Executor(self._op_plan, self.tensor_source(), slice or Full(), intervention, max_positions=max_positions,
                        activations=activations)

    def estimate_prefill(self, positions: int, slice: ExecutionSlice | None = None, *, start: int = 0,
                         last_only: bool = False):
        """Bytes of the arrays a prefill of ``positions`` positions (after ``start`` already held)
        needs: see vindex3.limits.estimate_prefill."""
        from .exec.slice import Full
        from .limits import estimate_prefill

        return estimate_prefill(self._op_plan, positions, slice or Full(), start=start, last_only=last_only)

    # -- integrity -------------------------------------------------------------------------
    def verify(self) -> VerifyReport:
        return verify(self.path)

    def rewrite_index(self, *, provenance: dict | None = None, **updates) -> None:
        """Rewrite index.json with ``updates`` applied (and ``provenance`` entries merged); unknown
        keys survive; generation + 1."""
        rewrite_index(self.path, provenance=provenance, **updates)
        self.index = read_index(self.path)
        self.manifest = parse_index(self.index, f"{self.path.name}/{INDEX}")


class SegmentSource:
    """Operands as weight objects over memory-mapped segments, keyed by object; ``check(object,
    tensor)`` runs before a tensor is first handed out."""

    def __init__(self, segments: dict[str, Segment], check=None, permutations: dict | None = None):
        self._segments = segments
        self._check = check
        self._perms = permutations or {}  # object -> tensor -> stored order of a permuted expert bank

    def weight(self, ref):
        if self._check is not None:
            self._check(ref.object, ref.tensor)
        w = self._segments[ref.object].weight(ref.tensor)
        perm = self._perms.get(ref.object, {}).get(ref.tensor)
        if perm is not None:
            from .codecs.permuted import PermutedBank

            w = PermutedBank(w, perm)
        return w

    def representation_key(self, obj: str) -> str:
        """The representation (``object@encoding``) the object's operands are read from."""
        return self._segments[obj].representation


def rewrite_index(path: Path, *, provenance: dict | None = None, **updates) -> None:
    """index.json of the container at ``path`` rewritten in place (`vindex3.rewrite.rewritten`):
    top-level ``updates`` set, ``provenance`` entries merged, unknown keys kept at every depth,
    generation + 1, sealed as before (a legacy index without hashes stays without)."""
    from .rewrite import rewritten

    index = read_index(Path(path))
    parse_index(index, f"{Path(path).name}/{INDEX}")  # never rewrite an index that does not validate
    index = rewritten(index, replace=updates, provenance=provenance)
    parse_index(index, f"{Path(path).name}/{INDEX} (as rewritten)")
    jsonio.write_atomic(Path(path) / INDEX, index)


def _index_parts(index: dict) -> tuple[GraphRef | None, dict[str, Representation], dict[str, CapabilityRef], list[str]]:
    """The parts of an index that validate on their own, and a named problem for every other:
    one broken representation does not stop the others from being verified."""
    from pydantic import ValidationError

    out: list[str] = []
    try:
        parse_index(index)
    except IntegrityError as e:
        out.append(e.message)
    graph = None
    try:
        graph = GraphRef.model_validate(index.get("graph"))
    except ValidationError:
        out.append(f"{INDEX}: records no graph hash, so {GRAPH} cannot be verified")
    reps: dict[str, Representation] = {}
    raw_reps = index.get("representations")
    if isinstance(raw_reps, dict):
        for key, raw in raw_reps.items():
            try:
                reps[key] = Representation.model_validate(raw)
            except ValidationError:
                pass
    caps: dict[str, CapabilityRef] = {}
    raw_caps = index.get("capabilities")
    if isinstance(raw_caps, dict):
        for name, raw in raw_caps.items():
            try:
                caps[name] = CapabilityRef.model_validate(raw)
            except ValidationError as e:
                out.append(f"{INDEX}: capabilities.{name}: " + "; ".join(problems(e)))
    return graph, reps, caps, out


def verify(path: str | Path) -> VerifyReport:
    """Check everything: the index typed, the graph and every capability file against their
    hashes, every segment whole, payload, header and tensor by tensor, every tensor's values for
    NaN and infinity, and that the container opens. A missing hash is a problem, never a skip."""
    path = Path(path)
    index = read_index(path)
    graph, reps, caps, problems_ = _index_parts(index)
    recorded = index.get(INDEX_HASH)
    if recorded is None:
        problems_.append(f"{INDEX} records no {INDEX_HASH}, so the index itself cannot be verified "
                         "(an older encode: re-encode the container)")
    elif not isinstance(recorded, str) or index_digest(index) != recorded:
        problems_.append(f"{INDEX}: its content no longer has the sha256 it records (altered after encoding)")
    checked = 0  # files the index names (the index itself is checked above, and not counted)

    def file_ok(rel: str, what: str, size: int | None) -> Path | None:
        nonlocal checked
        try:
            fp = existing_file(rel, what, within=path)
        except PathRefused as e:
            problems_.append(f"{rel}: missing ({what} named by {INDEX})" if e.reason == "missing"
                             else f"{INDEX} names {e.message}")
            return None
        checked += 1
        got = fp.stat().st_size
        if size is not None and got != size:
            problems_.append(f"{rel}: size {got} bytes, index records {size} (truncated or extended)")
        return fp

    if graph is not None and file_ok(graph.path, "the graph", None) is not None:
        try:
            data = read_regular(path / graph.path, graph.path, max_bytes=MAX_GRAPH_BYTES)
            got = hashlib.sha256(data).hexdigest()
            if got != graph.sha256:
                problems_.append(f"{graph.path}: sha256 {got[:16]}… differs from the index's {graph.sha256[:16]}…")
        except PathRefused as e:
            problems_.append(e.message)
    for key, rep in sorted(reps.items()):
        fp = file_ok(rep.segment, f"segment of {key}", rep.segment_bytes)
        if fp is None:
            continue
        try:
            seg = Segment(fp, what=f"segment {rep.segment} ({key})")
        except VindexError as e:
            problems_.append(str(e))
            seg = None
        try:
            whole, payload = sha256_file_and_tail(fp, seg.payload_start if seg is not None else 0, rep.segment)
        except PathRefused as e:
            problems_.append(e.message)
            continue
        if whole != rep.segment_sha256:
            problems_.append(f"{rep.segment}: sha256 {whole[:16]}… differs from the index's {rep.segment_sha256[:16]}…")
        if seg is None:
            continue
        if payload != rep.payload_sha256:
            problems_.append(f"{rep.segment}: payload sha256 differs from the index ({key})")
        for hkey in ("header_sha256", "tensor_sha256"):
            if getattr(rep, hkey) is None:
                problems_.append(f"{INDEX}: {key} records no {hkey}, so its {'header' if hkey[0] == 'h' else 'tensors'} "
                                 "cannot be verified on their own (an older encode: re-encode the container)")
        if rep.header_sha256 is not None and seg.header_sha256 != rep.header_sha256:
            problems_.append(f"{rep.segment}: header sha256 differs from the index ({key})")
        if seg.representation != key:
            problems_.append(f"{rep.segment}: its header says it holds {seg.representation!r}, the index says {key!r}")
        for name in sorted(seg.entries):
            want = (rep.tensor_sha256 or {}).get(name)
            if rep.tensor_sha256 is not None and want is None:
                problems_.append(f"{rep.segment}: tensor {name} has no hash in the index")
            elif want is not None and seg.tensor_sha256(name) != want:
                problems_.append(f"{rep.segment}: tensor {name}: bytes differ from the index's hash")
            try:
                from . import codecs

                if codecs.is_known(seg.entries[name].dtype):
                    from .scan import scan

                    problem = _value_problem(scan(seg.weight(name)), rep.segment, name)
                    if problem:
                        problems_.append(problem)
            except VindexError as e:
                problems_.append(str(e))
        for name in sorted(set(rep.tensor_sha256 or {}) - set(seg.entries)):
            problems_.append(f"{rep.segment}: the index hashes tensor {name}, which the header does not list")
    for name, cap in sorted(caps.items()):
        if "/" in name or name in (".", ".."):
            problems_.append(f"{INDEX}: capability {name!r} is not a file name in the container")
            continue
        fp = file_ok(name, "a capability sidecar", cap.bytes)
        if fp is None:
            continue
        try:
            got = hashlib.sha256(read_regular(fp, name, max_bytes=MAX_CAPABILITY_BYTES)).hexdigest()
        except PathRefused as e:
            problems_.append(e.message)
            continue
        if got != cap.sha256:
            problems_.append(f"{name}: sha256 {got[:16]}… differs from the index's {cap.sha256[:16]}…")
    derived = index.get("derived")
    for key, e in sorted((derived if isinstance(derived, dict) else {}).items()):
        files = e.get("files") if isinstance(e, dict) else None
        for rel, f in sorted((files if isinstance(files, dict) else {}).items()):
            fp = file_ok(rel, f"a file of the derived representation {key!r}", f.get("bytes") if isinstance(f, dict) else None)
            if fp is None:
                continue
            try:
                got = hashlib.sha256(read_regular(fp, rel, max_bytes=MAX_CAPABILITY_BYTES)).hexdigest()
            except PathRefused as err:
                problems_.append(err.message)
                continue
            if not isinstance(f, dict) or got != f.get("sha256"):
                problems_.append(f"{rel}: sha256 {got[:16]}… differs from the index's record (derived {key!r})")
    if not problems_:
        try:
            if isinstance(index.get("shard"), dict):  # a member of a shard set opens as one
                from .shards.store import ShardContainer

                ShardContainer(path)
            else:
                Container(path)
        except VindexError as e:
            problems_.append(f"the container does not open: {e}")
    return VerifyReport(path=str(path), ok=not problems_, checked=checked, problems=problems_)


def open(path: str | Path) -> Container:
    return Container(path)
