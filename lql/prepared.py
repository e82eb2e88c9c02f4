"""Opened containers shared by the sessions of one process.

Every session that OPENs the same container (the same directory, unchanged on disk) holds the
same `PreparedModel`: one `vindex3.Container`, so one memory map of each segment and one set of
first-use checks (each tensor hashed and scanned once, however many sessions read it). What a
session changes stays its own: its executors (prepared per session over the shared weights; an
executor remembers the stream it ran last), its draft depth, its settings, its internals. A
session that closes, or binds another model, lets go of its reference; the model is forgotten
when no session holds it, and the others keep running on it.

A ceiling (a server's ``--memory-ceiling``) bounds the weight bytes of the models held open in
the process. An OPEN of a model that is not open yet is refused by name, before anything is
opened, when its weights would take the total past the ceiling; the refusal states what the
model needs, what is in use and the ceiling. An OPEN of a model that is already open needs
nothing more, and is never refused for memory.

The identity of a model is its resolved directory, its ``index.json`` as it was when opened
(size, times, inode), and its graph and segments unchanged since (`Container.check_unchanged`).
A container changed on disk is opened afresh for the next OPEN; the sessions still holding
the old one are refused by name at their next statement."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from pathlib import Path

from .errors import LimitError

__all__ = ["MemoryCeiling", "PreparedModel", "acquire", "check", "held", "in_use", "needs"]


class MemoryCeiling(LimitError):
    """An OPEN would take the weights held open past the configured memory ceiling."""


class PreparedModel:
    """One opened container, shared read-only by the sessions that opened it."""

    def __init__(self, key: str, container, needs: int, index_stamp):
        self.key = key  # the resolved container directory
        self.container = container
        self.needs = needs  # its weights' bytes (the representations' payload bytes)
        self.index_stamp = index_stamp

    def current(self) -> bool:
        """Whether this is still the container on disk (no data read: a few stat calls)."""
        from vindex3.errors import VindexError

        if _index_stamp(self.key) != self.index_stamp:
            return False
        try:
            self.container.check_unchanged()
        except VindexError:
            return False
        return True

    def __repr__(self) -> str:
        return f"PreparedModel({self.container.name!r}, {self.key!r}, needs={self.needs})"


def _index_stamp(key: str):
    try:
        st = os.stat(Path(key) / "index.json")
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def needs(path: str | Path) -> int:
    """The bytes of a container's weights, from its index alone (no segment is opened): the sum
    of its representations' payload bytes. A damaged index is refused here as OPEN would."""
    from vindex3.container import INDEX, read_index
    from vindex3.manifest import parse_index

    p = Path(path)
    index = parse_index(read_index(p), f"{p.name}/{INDEX}")
    return int(sum(r.payload_bytes for r in index.representations.values()))


class _Registry:
    def __init__(self):
        self._lock = threading.Lock()
        self._by_key: dict[str, weakref.ref[PreparedModel]] = {}  # the current model of each directory
        self._live: weakref.WeakSet[PreparedModel] = weakref.WeakSet()  # every model still held (stale ones too)

    def held(self) -> list[PreparedModel]:
        return list(self._live)

    def in_use(self) -> int:
        return sum(m.needs for m in self._live)

    def _current(self, key: str) -> PreparedModel | None:
        ref = self._by_key.get(key)
        m = ref() if ref is not None else None
        if m is not None and not m.current():
            del self._by_key[key]  # changed on disk: the next OPEN verifies what is there now
            return None
        return m

    @staticmethod
    def _key(path: str | Path) -> str:
        from vindex3.errors import ContainerNotFound

        try:
            return os.path.realpath(os.fspath(path))
        except (OSError, ValueError) as e:  # a name the OS will not resolve: refused by name as open would
            raise ContainerNotFound(f"{path} cannot be opened ({e})") from None

    def _fits(self, need: int, ceiling: int | None, what: str | None) -> None:
        if ceiling is None:
            return
        used = self.in_use()
        if used + need > ceiling:
            gc.collect()  # sessions dropped without close() (a server's expired ones) let go here
            used = self.in_use()
        if used + need > ceiling:
            from .text import fmt_bytes

            n = len(self._live)
            raise MemoryCeiling(
                f"{what or 'OPEN'}: the model needs {fmt_bytes(need)} for its weights, {fmt_bytes(used)} "
                f"{'is' if used else 'are'} in use by {n} open model{'s' if n != 1 else ''}, and the memory "
                f"ceiling is {fmt_bytes(ceiling)}",
                hint="open a model that is already open (it is shared), wait for sessions to close, or run "
                     "the server with a higher --memory-ceiling")

    def check(self, path: str | Path, *, ceiling: int | None, what: str | None = None) -> None:
        """Refuse (`MemoryCeiling`) as `acquire` would, opening nothing."""
        key = self._key(path)
        with self._lock:
            if self._current(key) is None:
                self._fits(needs(path), ceiling, what)

    def acquire(self, path: str | Path, *, ceiling: int | None = None, what: str | None = None) -> PreparedModel:
        import vindex3

        key = self._key(path)
        with self._lock:
            m = self._current(key)
            if m is not None:
                return m
            stamp = _index_stamp(key)  # before the index is read: a rewrite after it is seen as one
            need = needs(path)
            self._fits(need, ceiling, what)
            m = PreparedModel(key, vindex3.open(path), need, stamp)
            for k in [k for k, r in self._by_key.items() if r() is None]:  # directories nobody holds now
                del self._by_key[k]
            self._by_key[key] = weakref.ref(m)
            self._live.add(m)
            return m


_REGISTRY = _Registry()


def acquire(path: str | Path, *, ceiling: int | None = None, what: str | None = None) -> PreparedModel:
    """The process's `PreparedModel` of the container at ``path``: the one sessions already
    hold if it is still what is on disk, else newly opened — refused by name (`MemoryCeiling`)
    before anything is opened when ``ceiling`` is given and the weights held open would pass
    it. The caller keeps the model alive by holding the returned object."""
    return _REGISTRY.acquire(path, ceiling=ceiling, what=what)


def check(path: str | Path, *, ceiling: int | None, what: str | None = None) -> None:
    """Refuse by name (`MemoryCeiling`) what `acquire` would refuse for memory; opens nothing."""
    _REGISTRY.check(path, ceiling=ceiling, what=what)


def in_use() -> int:
    """The weight bytes of every model held open in this process (each counted once)."""
    return _REGISTRY.in_use()


def held() -> list[PreparedModel]:
    """The models held open in this process."""
    return _REGISTRY.held()
