"""Typed refusals of sharded execution. Each names the shard (and its layers) it is about."""

from __future__ import annotations

from ..errors import SliceError, VindexError


class ShardError(VindexError):
    """A shard set, a shard or its Ray runtime cannot do what was asked."""


class SplitError(SliceError):
    """A split of the layers into shards that skips, repeats, reorders or overruns a layer."""


class ShardFailed(ShardError):
    """A shard's actor died (or could not be reached) during a call."""

    def __init__(self, message: str, *, shard: str, layers: tuple[int, int], hint: str | None = None):
        super().__init__(message, hint=hint)
        self.shard, self.layers = shard, layers


class ShardTimeout(ShardFailed):
    """A shard did not answer within the time limit; it was stopped, not waited on."""
