"""Writing index.json again, and writing a container derived from another one.

Every tool that rewrites an index — `vindex3 label`, REPRESENT, COMPACT, the evidence SCORE
REPRESENTATION stores, and COMPILE (issue 19) — builds the new index with `rewritten`: a deep
copy of the old one with only the named keys changed, so every key this build does not
understand survives at every nesting level (top level, inside ``model``, inside
``provenance``, inside a derived entry; representations, segments, capabilities and the graph
reference are typed strictly at OPEN, so an unknown key there never opens in the first place),
``generation`` bumped by one, and the index sealed (`vindex3.manifest.seal`) when the old one
was (an index from before the hashes stays unsealed: hashes come all together or not at all).

`ContainerWriter` is the one way a tool writes a new container: into a temporary sibling
directory (named like an encode's, with its marker, so a killed writer is cleaned by the next
encode or rewrite into the same parent), nothing written inside the source, ``index.json``
last, the result opened (every check OPEN makes, operand closure included) before a single
rename makes it real. Any failure removes the temporary directory.
"""

from __future__ import annotations

import copy
import os
import shutil
import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Self

from . import jsonio
from .errors import EncodeError, PathRefused, VindexError
from .manifest import INDEX_HASH, seal

INDEX = "index.json"


def rewritten(index: Mapping[str, Any], *, replace: Mapping[str, Any] | None = None, drop: Iterable[str] = (),
              provenance: Mapping[str, Any] | None = None, sealed: bool | None = None) -> dict:
    """A new index from ``index``: top-level keys in ``replace`` set (deep-copied), keys in
    ``drop`` removed, entries of ``provenance`` set inside ``provenance`` (its other entries kept),
    ``generation`` + 1, sealed when ``sealed`` (default: when ``index`` was). Everything else is
    copied as it is, unknown keys at any depth included."""
    new = copy.deepcopy(dict(index))
    for k in drop:
        new.pop(k, None)
    for k, v in (replace or {}).items():
        new[k] = copy.deepcopy(v)
    if provenance:
        prov = dict(new.get("provenance") or {})
        for k, v in provenance.items():
            prov[k] = copy.deepcopy(v)
        new["provenance"] = prov
    new["generation"] = int(index.get("generation", 1)) + 1
    if sealed is None:
        sealed = INDEX_HASH in index
    new.pop(INDEX_HASH, None)
    return seal(new) if sealed else new


class ContainerWriter:
    """Write a new container at ``out`` atomically::

        with ContainerWriter(out, "represent output", forbid_inside=[src.path]) as w:
            ... write files under w.tmp ...
            w.finish(index)          # index.json last, opened and checked, then one rename

    ``out`` must not exist, its parent must, and it may not lie inside any directory of
    ``forbid_inside`` (the source container: nothing is written inside it). Leaving the block
    without ``finish`` (an exception, Ctrl-C) removes the temporary directory."""

    def __init__(self, out: str | Path, what: str, *, forbid_inside: Iterable[str | Path] = ()):
        from .encode import MARKER, TMP_INFIX, clean_stale_temporaries
        from .paths import output_dir

        try:
            self.out = output_dir(out, what, forbid_inside=list(forbid_inside))
        except PathRefused as e:
            if e.reason == "exists":
                raise EncodeError(f"{what} {out} already exists; refusing to overwrite it (remove it or choose another path)") from None
            if e.reason == "parent_missing":
                raise EncodeError(f"{what}: the parent directory {Path(out).parent} does not exist") from None
            raise EncodeError(e.message) from None
        self.what = what
        self.cleaned = clean_stale_temporaries(self.out.parent)
        self.tmp = self.out.parent / f".{self.out.name}{TMP_INFIX}{os.getpid()}"
        self._marker = MARKER
        self.done = False

    def __enter__(self) -> Self:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        jsonio.write_atomic(self.tmp / self._marker, {"pid": os.getpid(), "host": socket.gethostname()})
        (self.tmp / "segments").mkdir()
        return self

    def finish(self, index: dict) -> Path:
        """Write ``index`` (already sealed as it should be) last, open the result (every check
        OPEN makes), and rename it into place."""
        from .container import Container

        jsonio.write_atomic(self.tmp / INDEX, index)
        (self.tmp / self._marker).unlink()
        Container(self.tmp)  # what was written opens: typed index, hashes, headers, closure
        if self.out.exists():
            raise EncodeError(f"{self.what} {self.out} appeared while writing; refusing to overwrite it")
        os.replace(self.tmp, self.out)
        self.done = True
        return self.out

    def __exit__(self, et, e, tb) -> bool:
        if not self.done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if e is not None and not isinstance(e, (VindexError, KeyboardInterrupt, SystemExit)):
                raise EncodeError(f"{self.what} {self.out.name} failed ({type(e).__name__}: {e}); nothing was written") from e
        return False
