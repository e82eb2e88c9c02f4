"""Splits of a model's layers into contiguous ranges, one per shard. A split is checked whole,
before anything runs: every layer in exactly one range, in order, nothing past the model."""

from __future__ import annotations

from collections.abc import Sequence

from ..exec.slice import LayerRange
from .errors import SplitError


def even(num_layers: int, n: int) -> list[LayerRange]:
    """``n`` contiguous ranges whose sizes differ by at most one (the first ones are larger)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SplitError(f"shards must be a positive integer; got {n!r}")
    if n > num_layers:
        raise SplitError(f"{n} shards cannot split a model of {num_layers} layers: each shard holds at least one layer "
                         f"(valid shard counts: 1..{num_layers})")
    q, r = divmod(num_layers, n)
    out, a = [], 0
    for k in range(n):
        b = a + q + (1 if k < r else 0)
        out.append(LayerRange(a, b))
        a = b
    return out


def parse_ranges(text: str) -> list[LayerRange]:
    """``"0-14,15-29"`` (inclusive layer numbers, as people write them) -> ranges [0,15), [15,30).
    A single layer is written ``"7"``."""
    out = []
    for item in str(text).split(","):
        s = item.strip()
        if not s:
            raise SplitError(f"--ranges {text!r}: an empty range between commas (write ranges like 0-14,15-29)")
        lo, sep, hi = s.partition("-")
        try:
            a = int(lo)
            b = int(hi) if sep else a
        except ValueError:
            raise SplitError(f"--ranges {text!r}: {s!r} is not a layer range (write FIRST-LAST, e.g. 0-14)") from None
        if b < a:
            raise SplitError(f"--ranges {text!r}: {s!r} ends before it starts")
        out.append(LayerRange(a, b + 1))
    return out


def describe(r: LayerRange) -> str:
    return f"layers {r.start}..{r.end - 1}" if r.end - r.start > 1 else f"layer {r.start}"


def resolve(num_layers: int, shards: int | str | Sequence[LayerRange]) -> list[LayerRange]:
    """A shard count, a ranges string or an explicit list of `LayerRange`s -> the checked split."""
    if isinstance(shards, bool):
        raise SplitError(f"shards is a count, a ranges string or a list of LayerRange; got {shards!r}")
    if isinstance(shards, int):
        return even(num_layers, shards)
    ranges = parse_ranges(shards) if isinstance(shards, str) else list(shards)
    check(num_layers, ranges)
    return ranges


def check(num_layers: int, ranges: Sequence[LayerRange]) -> None:
    """Refuse by name a split that skips, repeats, reorders or overruns a layer."""
    if not ranges:
        raise SplitError("a split needs at least one layer range")
    for k, r in enumerate(ranges):
        if not isinstance(r, LayerRange):
            raise SplitError(f"shard-{k}: {r!r} is not a LayerRange(start, end)")
        if any(isinstance(v, bool) or not isinstance(v, int) for v in (r.start, r.end)):
            raise SplitError(f"shard-{k}: LayerRange bounds must be integers; got {r!r}")
        if r.start >= r.end:
            raise SplitError(f"shard-{k}: LayerRange({r.start}, {r.end}) holds no layer")
        if r.start < 0 or r.end > num_layers:
            raise SplitError(f"shard-{k}: LayerRange({r.start}, {r.end}) reaches past the model's layers [0, {num_layers})")
    nxt = 0
    for k, r in enumerate(ranges):
        if r.start > nxt:
            gap = LayerRange(nxt, r.start)
            raise SplitError(f"split skips {describe(gap)}: shard-{k} starts at layer {r.start} but no shard before it "
                             f"runs {describe(gap)}", hint="every layer must be in exactly one shard, in order")
        if r.start < nxt:
            dup = LayerRange(r.start, min(nxt, r.end))
            owner = next(j for j, q in enumerate(ranges[:k]) if q.start <= r.start < q.end)
            raise SplitError(f"split repeats {describe(dup)}: shard-{owner} and shard-{k} both hold it",
                             hint="every layer must be in exactly one shard, in order")
        nxt = r.end
    if nxt != num_layers:
        gap = LayerRange(nxt, num_layers)
        raise SplitError(f"split skips {describe(gap)}: the last shard ends at layer {nxt - 1} of a model with "
                         f"{num_layers} layers", hint="every layer must be in exactly one shard, in order")
