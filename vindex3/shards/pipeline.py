"""The driver side of sharded execution: the ends (embedding, final norm, head) run here, each
layer range runs in a `ShardWorker` Ray actor, and hidden states pass shard to shard as Ray
object references (the driver does not fetch the intermediate ones).

    model = vindex3.shards.shard(container, 2)          # or open_set(OUT) for a shard set on disk
    ex = model.executor()                                # Full(); model.executor(Draft(d)) too
    st = ex.start(); st.prefill(ids); st.step(tok)       # the token Stream API
    st.snapshot() / st.restore(s) / st.truncate(p); st.trace; ex.placement()

`ShardedModel` is also a container view (graph, op_plan, plan_slice, digest, tokenizer ...), so
`vindex3.draft.speculative_generate(model, ...)` runs over shards unchanged."""

from __future__ import annotations

import contextlib
import itertools
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel

from ..continuation import TRUNCATE
from ..errors import SliceError, StateError, VindexError
from ..exec.engine import (
    Executor,
    PreparedOperands,
    _small_pass_limit,
    decode_threads,
    pass_threads,
    prepare_ends,
)
from ..exec.slice import Draft, Full, LayerRange, plan_slice
from ..exec.trace import ExecutionTrace
from ..limits import check_context, context_limit
from . import split
from .errors import ShardError, ShardFailed, ShardTimeout
from .worker import ShardWorker, blas_facts

F32 = np.float32
DEFAULT_TIMEOUT = 120.0  # seconds a pass (or a state call) may take before its shard is reported


def _ray():
    try:
        import ray
    except ImportError as e:
        raise ShardError(f"sharded execution runs layer ranges as Ray actors, and Ray is not installed ({e})",
                         hint="from a clone of the source: pip install -e '.[ray]'") from None
    return ray


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Connect to a Ray cluster: ``address`` when given ("auto" or host:port), else the one this
    process already joined, else a local one on the loopback interface."""
    import logging
    import os

    if not address:
        loopback_only()
    ray = _ray()
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        return
    ray.init(num_cpus=num_cpus or os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
             logging_level=logging.WARNING, log_to_driver=False)


def loopback_only() -> None:
    """Make a local Ray cluster started by this process take 127.0.0.1 as its node address, so
    that its processes talk over the loopback interface only (Ray's own default is the host's
    routable address). Ray reads this switch when it is imported; set it before, and in the
    already-imported module too."""
    import os
    import sys

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if "ray" in sys.modules:
        from ray._private import ray_constants

        ray_constants.ENABLE_RAY_CLUSTER = False


def driver_blas_threads() -> int:
    counts = [b["threads"] for b in blas_facts() if b["threads"]]
    return max(counts) if counts else 1


# ---- the ends, in the driver ------------------------------------------------------------------


class Ends:
    """Embedding, final norm and head, prepared from the driver's source. The arithmetic is the
    executor's own (`Executor._embed` / `_logits`), under the same BLAS thread regime."""

    _embed = Executor._embed
    _logits = Executor._logits

    def __init__(self, plan, source):
        t0 = time.perf_counter()
        W = PreparedOperands(source)
        self._emb, self._emb_mult, self.readout = prepare_ends(plan, W)
        pos = plan.embedding.operands.get("positions")
        self._pos = W.weight(pos) if pos is not None else None
        self.reads, self.bytes = W.reads, W.bytes
        self.prepare_seconds = time.perf_counter() - t0

    def logits(self, h: np.ndarray, positions: int, last_only: bool) -> np.ndarray:
        rows = h[-1:] if last_only else h
        with _small_pass_limit(pass_threads(positions)):
            return self._logits(rows)


# ---- shards ------------------------------------------------------------------------------------


class Shard:
    """One layer range and the actor that runs it; recreated when it dies or stalls."""

    def __init__(self, model: ShardedModel, k: int, rng: LayerRange, spec: dict):
        self.model, self.index, self.range, self.spec = model, k, rng, spec
        self.name = spec["name"]
        self.actor = None
        self.facts: dict = {}
        self.generation = 0  # bumped each time the actor is (re)created; streams remember it
        self.lost: str | None = None  # why the last actor was dropped

    @property
    def label(self) -> str:
        return f"{self.name} ({split.describe(self.range)})"

    def ensure(self) -> None:
        """A live, opened actor; create (or recreate) one if needed and check its facts."""
        if self.actor is not None:
            return
        ray = _ray()
        m = self.model
        actor = m._remote_cls.options(**m.ray_options).remote()
        try:
            facts = ray.get(actor.open.remote(self.spec), timeout=m.open_timeout)
        except ray.exceptions.RayError as e:
            ray.kill(actor, no_restart=True)
            raise self._translate(e, "opening", m.open_timeout) from None
        want = m.blas
        got = [{k: b[k] for k in ("api", "version", "architecture", "threads")} for b in facts["blas"]]
        if got != want or facts["decode_threads"] != m.decode_threads:
            ray.kill(actor, no_restart=True)
            raise ShardError(
                f"{self.label} runs BLAS {got} with {facts['decode_threads']} decode thread(s); the driver runs {want} "
                f"with {m.decode_threads}: outputs would not be byte-identical to one process",
                hint="run every shard on a host with the same numpy/BLAS build and kernel as the driver")
        self.actor, self.facts = actor, facts
        self.generation += 1

    def drop(self, why: str) -> None:
        """Stop the actor (if it still runs) so that no late work can change state; the next
        call recreates it."""
        if self.actor is not None:
            with contextlib.suppress(Exception):  # already gone
                _ray().kill(self.actor, no_restart=True)
        self.actor, self.lost = None, why

    def _translate(self, e: BaseException, doing: str, limit: float | None = None) -> VindexError:
        """A Ray failure as a typed refusal naming this shard and its layers."""
        ray = _ray()
        if isinstance(e, ray.exceptions.GetTimeoutError):
            limit = self.model.timeout if limit is None else limit
            return ShardTimeout(f"{self.label} did not answer within {limit:g} s while {doing}; it was "
                                "stopped; the next call recreates it and replays the stream onto it", shard=self.name,
                                layers=(self.range.start, self.range.end))
        if isinstance(e, ray.exceptions.RayTaskError):
            cause = getattr(e, "cause", None)
            if isinstance(cause, VindexError):
                return cause
            return ShardError(f"{self.label} failed while {doing}: {type(cause).__name__ if cause else 'error'}: {cause or e}")
        if isinstance(e, (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)):
            return ShardFailed(f"{self.label} died while {doing} (its actor is gone: {type(e).__name__}); the next call "
                               "recreates it and replays the stream onto it", shard=self.name,
                               layers=(self.range.start, self.range.end), hint="retry the call (or the statement)")
        if isinstance(e, VindexError):
            return e
        return ShardError(f"{self.label} failed while {doing}: {type(e).__name__}: {e}")


class ShardPlacement(BaseModel):
    name: str
    layers: list[int]  # [first, last] held
    source: str  # "container" | "shard container"
    path: str  # the container's or member's directory name
    actor: str | None  # Ray actor id, once started
    node: str | None
    pid: int | None
    weight_bytes: int
    state_bytes_per_position: int
    fixed_state_bytes: int
    state_bytes: int  # at ``positions``


class Placement(BaseModel):
    """Where a sharded model's parts run, and what crosses between them (plain data for STATS
    and EXPLAIN)."""

    model: str
    slice: str
    positions: int
    hidden_size: int
    driver: dict  # {"holds": [...], "weight_bytes": n}
    shards: list[ShardPlacement]  # the shards this slice calls, in pipeline order
    untouched: list[str]  # shards this slice never calls (a draft above them)
    hops_per_position: int  # driver -> shard 0 -> ... -> driver
    bytes_per_hop_per_position: int  # hidden_size * 4
    bytes_between_shards_per_position: int  # (shards - 1) * hidden_size * 4
    bytes_moved_per_position: int  # hops * hidden_size * 4
    blas: dict


# ---- the model view -----------------------------------------------------------------------------


class ShardedModel:
    """A model whose layer ranges run in Ray actors. Works as a container view: facts are the
    driver's container's (or the shard set's ends), executors are sharded."""

    def __init__(self, base: Any, ranges: list[LayerRange], specs: list[dict], *, timeout: float = DEFAULT_TIMEOUT,
                 address: str | None = None, ray_options: dict | None = None, open_timeout: float | None = None):
        self.base = base
        self.ranges = ranges
        self.timeout = float(timeout)
        self.open_timeout = float(open_timeout if open_timeout is not None else max(self.timeout, 300.0))
        self.ray_options = dict(ray_options or {"num_cpus": 0})
        self._plan = base.op_plan()
        self._ends: Ends | None = None
        self._address = address
        self.blas: list[dict] | None = None
        self.decode_threads: int | None = None
        self.shards = [Shard(self, k, r, specs[k]) for k, r in enumerate(ranges)]
        self._remote_cls = None

    # facts: the base container's
    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("base",):
            raise AttributeError(name)
        return getattr(self.base, name)

    def op_plan(self):
        return self._plan

    def plan_slice(self, sl=None):
        return plan_slice(self._plan, sl or Full())

    def _runtime(self) -> None:
        if self._remote_cls is None:
            ensure_ray(self._address)
            ray = _ray()
            self.blas = [{k: b[k] for k in ("api", "version", "architecture", "threads")} for b in blas_facts()]
            threads = driver_blas_threads()
            self.decode_threads = decode_threads()
            for s in self.shards:
                s.spec = {**s.spec, "blas_threads": threads, "decode_threads": self.decode_threads}
            self._remote_cls = ray.remote(ShardWorker)

    def start_shards(self, shards: list[Shard] | None = None) -> None:
        self._runtime()
        for s in shards or self.shards:
            s.ensure()

    @property
    def ends(self) -> Ends:
        if self._ends is None:
            self._ends = Ends(self._plan, self.base.tensor_source())
        return self._ends

    def executor(self, slice=None, intervention=None, max_positions=None) -> ShardedExecutor:
        if max_positions is not None:
            raise ShardError("an explicit position limit (max_positions) cannot run over shards in this build: each "
                             "actor holds the container's own context length", hint="run it in one process (SET shards = 0)")
        if intervention is not None:
            raise ShardError(f"an intervention ({intervention.describe()}) cannot run over shards in this build: "
                             "the actors run the container's own weights", hint="run it in one process (SET shards = 0)")
        return ShardedExecutor(self, slice or Full())

    def placement(self, slice=None, positions: int = 0) -> Placement:
        return placement(self, slice or Full(), positions)

    def close(self) -> None:
        """Stop every shard's actor."""
        for s in self.shards:
            s.drop("closed")

    def __repr__(self) -> str:
        parts = ", ".join(s.label for s in self.shards)
        return f"<ShardedModel {getattr(self.base, 'name', '?')}: {parts}>"


# ---- traces, snapshots, streams -------------------------------------------------------------------


@dataclass
class ShardedTrace(ExecutionTrace):
    """An ExecutionTrace plus which shard ran each executed layer, and the calls each shard got."""

    layer_shards: list[str] = field(default_factory=list)  # parallel to executed_layers
    shard_calls: dict[str, int] = field(default_factory=dict)  # every shard of the model, 0 if never called
    shard_seconds: dict[str, float] = field(default_factory=dict)  # in-actor compute seconds
    transfer_bytes: int = 0  # hidden-state bytes moved between driver and shards, and shard to shard
    replays: int = 0  # times the stream rebuilt its state on recreated shards after a fault


@dataclass(frozen=True, eq=False)
class ShardSnapshot:
    """A handle on a snapshot that lives in the shards (the state never leaves them)."""

    stream: str
    key: int
    position: int


class _Remote:
    """A stream's identity on the shards: its id there and the actors holding its state. When
    the stream is rebuilt on a recreated shard it gets a new id; finalizers hold this object, not
    the stream, so they release whatever the stream's state is at the time."""

    def __init__(self) -> None:
        self.sid = ""
        self.handles: list = []
        self.renew()

    def renew(self) -> None:
        _release(self, None)
        self.sid = uuid.uuid4().hex
        self.handles = []


def _release(remote: _Remote, key: int | None) -> None:
    import sys

    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():  # never start a runtime just to forget something
        return
    for actor in remote.handles:
        with contextlib.suppress(Exception):  # the actor is gone: nothing to release
            actor.release.remote(remote.sid, key)


class ShardedExecutor:
    """A Full() or Draft(d) slice over a sharded model: the ends here, the layers in the
    shards that hold layers below the slice's end (the others are never called)."""

    def __init__(self, model: ShardedModel, sl):
        if isinstance(sl, LayerRange) or not isinstance(sl, (Full, Draft)):
            raise SliceError(f"a sharded executor runs Full() or Draft(d); got {sl!r}",
                             hint="a layer range is what each shard runs; ask the model for Full() or a draft")
        t0 = time.perf_counter()
        self.model = model
        self.plan = model.op_plan()
        self.slice = sl
        self.slice_plan = plan_slice(self.plan, sl)  # refuses a bad depth before anything runs
        self.layers = self.slice_plan.executed_layers
        self.has_ends = True
        end = self.layers[-1] + 1
        self.hops = [(s, min(s.range.end, end)) for s in model.shards if s.range.start < end]
        self.untouched = [s for s in model.shards if s.range.start >= end]
        model.start_shards([s for s, _ in self.hops])
        ends = model.ends
        self.prepare_seconds = time.perf_counter() - t0
        self.operand_reads = self.slice_plan.total_reads
        self.bytes_read = self.slice_plan.total_bytes
        self.ends_reads = ends.reads
        self._last: ShardedStream | None = None
        # each actor holds the container's own context length (an explicit limit is refused above)
        self.max_positions, self.limit_source = context_limit(self.plan.context_length)

    def check_positions(self, total: int, what: str = "this run") -> None:
        """Refuse (ContextLengthExceeded) when ``total`` positions exceed the context length,
        before any shard is called (the executor's contract)."""
        check_context(total, self.max_positions, self.limit_source, what)

    def new_trace(self) -> ShardedTrace:
        return ShardedTrace(prepare_seconds=self.prepare_seconds, operand_reads=self.operand_reads,
                            bytes_read=self.bytes_read, shard_calls={s.name: 0 for s in self.model.shards},
                            shard_seconds={s.name: 0.0 for s in self.model.shards})

    @property
    def trace(self) -> ShardedTrace:
        return self._last.trace if self._last is not None else self.new_trace()

    @property
    def last_hidden(self):
        return self._last.last_hidden if self._last is not None else None

    def start(self) -> ShardedStream:
        return ShardedStream(self)

    def forward(self, token_ids) -> np.ndarray:
        return self.start().prefill(token_ids)

    def placement(self, positions: int = 0) -> Placement:
        return placement(self.model, self.slice, positions)


class ShardedStream:
    """One token continuation over the shards, with the token `Stream` API.

    The stream keeps a log of the calls that completed (token prefills, snapshots, restores,
    truncations: ids and keys, no tensors). When a call fails in a shard (the actor died, stalled
    past the time limit, or refused), the error names the shard and the stream is marked stale;
    the next call rebuilds its state on fresh shard streams by replaying the log — the same
    passes in the same order, so the same bytes — and then runs. A failed call never counts:
    retrying it gives what it would have given."""

    def __init__(self, ex: ShardedExecutor):
        self.ex = ex
        self.id = uuid.uuid4().hex
        self.trace = ex.new_trace()
        self.last_hidden: np.ndarray | None = None
        self._position = 0
        self._keys = itertools.count()
        self._log: list[tuple] = []
        self._live: weakref.WeakValueDictionary[int, ShardSnapshot] = weakref.WeakValueDictionary()
        self._stale: str | None = None
        self._replaying = False
        # The actor generation each shard had when this stream's state was put there: a
        # recreated shard has lost it, and the stream rebuilds instead of computing from nothing.
        self._gen: dict[str, int] = {}
        self._remote = _Remote()
        weakref.finalize(self, _release, self._remote, None)

    @property
    def position(self) -> int:
        return self._position

    @property
    def sid(self) -> str:
        return self._remote.sid

    # -- plumbing -------------------------------------------------------------------------------
    def _ready(self) -> list[tuple[Shard, int]]:
        hops = self.ex.hops
        lost = [s for s, _ in hops if s.name in self._gen and (s.actor is None or s.generation != self._gen[s.name])]
        if (self._stale or lost) and not self._replaying:
            self._rebuild()
        for s, _ in hops:
            if s.actor is None:
                self.ex.model.start_shards([s])
            if s.name not in self._gen:
                self._gen[s.name] = s.generation
                self._remote.handles.append(s.actor)
        return hops

    def _rebuild(self) -> None:
        """Fresh shard streams, then every logged call again, in order."""
        self._remote.renew()
        self._gen = {}
        self._stale = None
        self._position = 0
        self._replaying = True
        try:
            for op, *args in self._log:
                if op == "prefill":
                    self._run(self.ex.model.ends._embed(args[0], self._position))
                elif op == "snapshot":
                    self._broadcast("snapshot", args[0])
                elif op == "restore":
                    self._broadcast("restore", args[0])
                    self._position = args[1]
                elif op == "truncate":
                    self._broadcast("truncate", args[0])
                    self._position = args[0]
        except BaseException:
            self._stale = self._stale or "its rebuild was interrupted"
            raise
        finally:
            self._replaying = False
        for key in {a[0] for op, *a in self._log if op == "snapshot"} - set(self._live.keys()):
            _release(self._remote, key)  # snapshots nobody holds any more
        self.trace.replays += 1

    def _limit(self) -> float:
        """Seconds one call may take: the model's per-pass limit, or, while a rebuild replays the
        log onto recreated shards, the open limit, because a fresh actor's first passes compile or
        load its kernels, which is part of starting it rather than a stall."""
        m = self.ex.model
        return m.open_timeout if self._replaying else m.timeout

    def _collect(self, refs: list, doing: str, deadline: float) -> list:
        """Results of one call per hop, in pipeline order; the first shard that failed or stalled
        is reported by name and the stream is marked stale (rebuilt on its next call)."""
        ray = _ray()
        out = []
        for (s, _), ref in zip(self.ex.hops, refs):
            try:
                out.append(ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except KeyboardInterrupt:
                self._stale = f"it was interrupted while {doing}"
                raise
            except ray.exceptions.RayError as e:
                err = s._translate(e, doing)
                if isinstance(err, ShardFailed):
                    s.drop("timed out" if isinstance(err, ShardTimeout) else "died")
                self._stale = f"{s.label} failed while {doing}"
                raise err from None
        return out

    def _collect_last(self, ref, deadline: float) -> np.ndarray:
        """The last shard's hidden states (its report already arrived, so this is a fetch)."""
        ray = _ray()
        s = self.ex.hops[-1][0]
        try:
            return ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.RayError as e:
            err = s._translate(e, "handing back its hidden states")
            if isinstance(err, ShardFailed):
                s.drop("timed out" if isinstance(err, ShardTimeout) else "died")
            self._stale = f"{s.label} failed while handing back its hidden states"
            raise err from None

    def _broadcast(self, method: str, *args) -> list:
        hops = self._ready()
        deadline = time.monotonic() + self._limit()
        refs = [getattr(s.actor, method).remote(self.sid, end, *args) for s, end in hops]
        for s, _ in hops:
            self.trace.shard_calls[s.name] += 1
        return self._collect(refs, method, deadline)

    def _run(self, h: np.ndarray) -> tuple[np.ndarray, list]:
        """Hidden states [T, H] through every hop; the last shard's output and the reports."""
        hops = self._ready()
        deadline = time.monotonic() + self._limit()
        x, infos = h, []
        for s, end in hops:
            x, info = s.actor.run.options(num_returns=2).remote(self.sid, end, x)
            infos.append(info)
            self.trace.shard_calls[s.name] += 1
        got = self._collect(infos, "running a pass", deadline)
        out = self._collect_last(x, deadline)
        layers = [i for info in got for i in info["layers"]]
        if layers != self.ex.layers:  # every layer once, in order: checked on every pass
            self._stale = "a pass ran the wrong layers"
            raise ShardError(f"sharded pass ran layers {layers}, but {self.ex.slice.describe()} runs {self.ex.layers}")
        self._position += h.shape[0]
        return out, got

    # -- the Stream API --------------------------------------------------------------------------
    def prefill(self, token_ids, last_only: bool = False) -> np.ndarray:
        ends = self.ex.model.ends
        h = ends._embed(token_ids, self._position)  # bad ids are refused here, before any shard is called
        T = h.shape[0]
        if T == 0:
            raise SliceError("no positions to run")
        t0 = time.perf_counter()
        h, got = self._run(h)
        self._log.append(("prefill", np.asarray(token_ids, dtype=np.int64).reshape(-1).tolist()))
        out = ends.logits(h, T, last_only)
        self.last_hidden = h
        tr = self.trace
        tr.executed_layers = [i for info in got for i in info["layers"]]
        tr.layer_shards = [s.name for (s, _), info in zip(self.ex.hops, got) for _ in info["layers"]]
        for (s, _), info in zip(self.ex.hops, got):
            tr.shard_seconds[s.name] += info["seconds"]
        tr.positions += T
        tr.step_seconds.append(time.perf_counter() - t0)
        tr.transfer_bytes += (len(self.ex.hops) + 1) * h.nbytes
        self.ex._last = self
        return out

    def step(self, token_id: int) -> np.ndarray:
        return self.prefill([int(token_id)])[0]

    def snapshot(self) -> ShardSnapshot:
        key = next(self._keys)
        self._broadcast("snapshot", key)
        self._log.append(("snapshot", key))
        snap = ShardSnapshot(self.id, key, self._position)
        self._live[key] = snap
        weakref.finalize(snap, _release, self._remote, key)
        return snap

    def restore(self, snap: Any) -> None:
        if not isinstance(snap, ShardSnapshot) or snap.stream != self.id:
            raise StateError("restore() takes a snapshot returned by snapshot() of this stream")
        self._broadcast("restore", snap.key)
        self._log.append(("restore", snap.key, snap.position))
        self._position = snap.position

    def truncate(self, position: int) -> None:
        if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= self._position:
            raise StateError(f"cannot truncate to position {position!r}: the state is at {self._position}")
        if position == self._position:
            return
        # Refused here, before any shard is asked, so that no shard truncates while another refuses.
        held = [i for i in self.ex.layers if self.ex.plan.layers[i].geometry.rollback != TRUNCATE]
        if held:
            more = "…" if len(held) > 4 else ""
            raise StateError(f"cannot truncate: layers {held[:4]}{more} keep recurrent state, which rolls back only "
                             "through snapshot() and restore()")
        self._broadcast("truncate", position)
        self._log.append(("truncate", position))
        self._position = position

    def state_bytes(self) -> dict[str, int]:
        """Live continuation bytes per shard for this stream (asks each shard)."""
        hops = self._ready()
        deadline = time.monotonic() + self._limit()
        got = self._collect([s.actor.state_bytes.remote(self.sid) for s, _ in hops], "reporting state", deadline)
        return {s.name: int(b) for (s, _), b in zip(hops, got)}


# ---- placement ------------------------------------------------------------------------------------


def placement(model: ShardedModel, sl, positions: int = 0) -> Placement:
    """Plain data from the plan (and actor ids where started); reads no tensor data, calls no
    actor."""
    plan = model.op_plan()
    sp = plan_slice(plan, sl)
    end = sp.executed_layers[-1] + 1
    H = plan.hidden_size
    rows = []
    for s in model.shards:
        if s.range.start >= end:
            continue
        hi = min(s.range.end, end)
        geo = [plan.layers[i].geometry for i in range(s.range.start, hi)]
        refs = [r for i in range(s.range.start, hi) for r in plan.layers[i].operands()]
        rows.append(ShardPlacement(
            name=s.name, layers=[s.range.start, hi - 1],
            source="container" if s.spec["kind"] == "container" else "shard container",
            path=s.spec.get("path_name", ""), actor=s.facts.get("actor") if s.actor is not None else None,
            node=s.facts.get("node") if s.actor is not None else None,
            pid=s.facts.get("pid") if s.actor is not None else None,
            weight_bytes=sum({r.label: r.nbytes for r in refs}.values()),
            state_bytes_per_position=sum(g.bytes_per_position for g in geo),
            fixed_state_bytes=sum(g.fixed_bytes for g in geo),
            state_bytes=sum(g.bytes_at(positions) for g in geo)))
    hops = len(rows) + 1
    return Placement(
        model=str(getattr(model.base, "name", "")), slice=sl.describe(), positions=positions, hidden_size=H,
        driver={"holds": ["embedding", "final_norm", "output_head" if not plan.head.params.tied else "head (tied)"],
                "weight_bytes": sp.ends_bytes},
        shards=rows, untouched=[s.name for s in model.shards if s.range.start >= end],
        hops_per_position=hops, bytes_per_hop_per_position=H * 4,
        bytes_between_shards_per_position=(len(rows) - 1) * H * 4, bytes_moved_per_position=hops * H * 4,
        blas={"driver": model.blas, "decode_threads": model.decode_threads,
              "large_pass_threads": max((b["threads"] for b in model.blas or [] if b["threads"]), default=None)},
    )
