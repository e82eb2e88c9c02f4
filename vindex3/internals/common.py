"""What every internals result shares: token readouts, skipped layers, prompts, layer choices and
the output-file rules. Results are pydantic models: plain data a renderer shows and JSON carries
whole."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import BaseModel

from ..errors import OutputRefused, QueryRefused


class TokenLogit(BaseModel):
    """A vocabulary entry and the logit something gives it."""

    id: int
    text: str | None  # None when the container carries no tokenizer
    logit: float


class SkippedLayer(BaseModel):
    """A layer a statement did not look at, and why (a mixer-only layer has no FFN features)."""

    layer: int
    operator: str
    reason: str


class Prompt(BaseModel):
    text: str | None  # None when given as token ids
    ids: list[int]
    tokens: list[str | None]


def layer_list(layers: Iterable[int] | None, n: int, what: str) -> list[int]:
    """The chosen layers in order (all ``n`` when None); refuses any outside ``[0, n)``."""
    if layers is None:
        return list(range(n))
    out = []
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int):
            raise QueryRefused(f"{what}: layer {i!r} is not an integer")
        if not 0 <= i < n:
            raise QueryRefused(f"{what}: layer {i} is outside the model's layers 0..{n - 1}")
        if i not in out:
            out.append(i)
    if not out:
        raise QueryRefused(f"{what}: the layer choice is empty")
    return sorted(out)


def span_text(layers: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, xs, i = [], list(layers), 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ", ".join(out)


def inside_container(path: Path) -> Path | None:
    """The VINDEX3 container directory that holds ``path``, if any."""
    from ..container import FORMAT, INDEX
    from ..jsonio import load

    for d in [path.parent, *path.parent.parents]:
        ip = d / INDEX
        if ip.is_file():
            try:
                found = load(ip).get("format") == FORMAT
            except Exception:  # noqa: BLE001 - an unreadable index.json is not our container
                found = False
            if found:
                return d
    return None


def output_path(path: str | os.PathLike, *, suffix: str, what: str, overwrite: bool) -> Path:
    """Check where an output file may go: the named suffix, not an existing file unless
    ``overwrite``, an existing directory, and never inside a container (whose files are its
    index's to name); then vindex3's path helper (`vindex3.paths.output_file`: a file name, a
    regular file if anything is there, never a FIFO or a device)."""
    from ..paths import check_text, output_file

    p = check_text(path, what)
    if p.suffix != suffix:
        raise OutputRefused(f"{what}: {p.name} must end in {suffix}")
    if p.is_dir():
        raise OutputRefused(f"{what}: {p} is a directory")
    if p.exists() and not overwrite:
        raise OutputRefused(f"{what}: {p.name} already exists", hint="choose another file, or overwrite it explicitly")
    if not p.parent.is_dir():
        raise OutputRefused(f"{what}: the directory {p.parent} does not exist")
    c = inside_container(p.resolve())
    if c is not None:
        raise OutputRefused(f"{what}: {p.name} would be written inside the container {c.name}; a container holds only "
                            "what its index.json names", hint="write it outside the container directory")
    return output_file(p, what, overwrite=overwrite)
