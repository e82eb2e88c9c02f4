"""Layer ranges in other processes: a model split into contiguous layer ranges, each run by a
Ray actor that opens the container (or its member of a shard set) itself and keeps its layers'
continuation state; the ends run in the driver. Outputs are byte-identical to one process.
See docs/distributed.md.

    ex = vindex3.open(p).executor(shards=2)                 # Container.executor(slice, shards=)
    model = vindex3.shards.shard(vindex3.open(p), [LayerRange(0, 10), LayerRange(10, 30)])
    model = vindex3.shards.open_set("out/")                  # written by `vindex3 shard SRC OUT --ranges`
    model.executor(Draft(8)).start().prefill(ids); model.placement()
"""

from __future__ import annotations

from pathlib import Path

from .errors import ShardError, ShardFailed, ShardTimeout, SplitError
from .pipeline import (
    DEFAULT_TIMEOUT,
    Placement,
    ShardedExecutor,
    ShardedModel,
    ShardedStream,
    ShardedTrace,
    ShardPlacement,
    ShardSnapshot,
    ensure_ray,
    loopback_only,
)
from .split import even, parse_ranges
from .store import ShardContainer, check_set, write_shards

__all__ = [
    "DEFAULT_TIMEOUT", "Placement", "ShardContainer", "ShardError", "ShardFailed", "ShardPlacement", "ShardSnapshot",
    "ShardTimeout", "ShardedExecutor", "ShardedModel", "ShardedStream", "ShardedTrace", "SplitError", "check_set",
    "ensure_ray", "even", "loopback_only", "open_set", "parse_ranges", "shard", "sharded", "write_shards",
]


def shard(container, shards, **options) -> ShardedModel:
    """A sharded model over an opened container: every actor opens the same container directory
    (checked by digest). ``shards``: a count (an even split), a ranges string ("0-14,15-29") or a
    list of `LayerRange`s, checked whole before anything runs. Options: ``timeout`` (seconds a
    call may take), ``address`` (a Ray cluster; default: the joined one, else a local one on
    loopback), ``ray_options`` (actor options, e.g. resources for placement)."""
    from . import split

    ranges = split.resolve(len(container.op_plan().layers), shards)
    path = str(Path(container.path).resolve())
    specs = [{"name": f"shard-{k}", "kind": "container", "path": path, "path_name": Path(path).name,
              "digest": container.digest, "layers": [r.start, r.end]} for k, r in enumerate(ranges)]
    return ShardedModel(container, ranges, specs, **options)


def open_set(path, **options) -> ShardedModel:
    """A sharded model over a shard set on disk: the manifest is checked against every member's
    index before anything runs; the driver opens the ends, each actor opens its own member and
    checks the manifest entry again before its first call."""
    from ..exec.slice import LayerRange

    out = Path(path).resolve()
    m = check_set(out)
    ends = ShardContainer(out / m["ends"]["path"])
    ranges = [LayerRange(*e["layers"]) for e in m["shards"]]
    specs = [{"name": e["name"], "kind": "shard", "set_path": str(out), "entry": e, "path_name": e["path"],
              "digest": m["parent"]["digest"], "layers": list(e["layers"])} for e in m["shards"]]
    return ShardedModel(ends, ranges, specs, **options)


def sharded(container, shards, **options) -> ShardedModel:
    """The sharded model of ``container`` for this split, made once per container object so that
    its Full and Draft executors share the same actors (what `Container.executor(shards=)` uses)."""
    from . import split

    ranges = split.resolve(len(container.op_plan().layers), shards)
    key = (tuple((r.start, r.end) for r in ranges), tuple(sorted(options.items())))
    per = container.__dict__.setdefault("_sharded_models", {})  # lives and dies with the container
    m = per.get(key)
    if m is None:
        m = per[key] = shard(container, ranges, **options)
    return m
