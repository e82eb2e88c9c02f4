"""One helper for every path an operation reads or writes.

Each function checks what its operation needs *before any work is done* and refuses by name
(`vindex3.errors.PathRefused`, with a stable ``reason`` code) instead of letting an ``OSError``,
``ValueError`` or ``UnicodeEncodeError`` escape, or a FIFO block forever:

* `check_text`     the path itself: a str or PathLike, not empty, no NUL, valid Unicode (no lone
                   surrogates), at most 4095 bytes, every component at most 255 bytes;
* `existing_file`  must exist and be a regular file (a FIFO, device, socket or directory is
                   refused without being opened); optionally confined to a directory;
* `existing_dir`   must exist and be a directory;
* `output_file`    a file to write: its name is a file name (not '', '.', '..' or a trailing '/'),
                   its parent exists and is a directory, it is not inside a directory it must
                   stay out of (an open container), and if it exists it is a regular file and the
                   caller said ``overwrite=True``;
* `output_dir`     a directory to create (or reuse when ``exist_ok``), same rules;
* `confined`       a relative path read from a file (a segment path in index.json) that must
                   stay inside ``root``: absolute paths, '..' and symlinks resolving outside are
                   refused without opening anything;
* `open_regular` / `read_regular`  open without blocking (O_NONBLOCK), then refuse anything that
                   is not a regular file, so a FIFO planted where a file was expected cannot hang
                   the reader even if it appeared after the check;
* `file_component` a file-name-safe rendering of an identifier (a prompt id) that cannot escape
                   its directory;
* `hidden_sibling` the temporary name beside an output (``.<name>.tmp-<pid>``), kept within
                   NAME_MAX however long the output's own name is.

Reason codes: type, empty, nul, unencodable, too_long, name_too_long, not_a_file_name, missing,
exists, not_a_file, not_a_directory, special, parent_missing, inside, absolute, dotdot,
outside, loop, too_large, unreadable.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from .errors import PathRefused

NAME_MAX = 255  # bytes in one path component (Linux, macOS)
PATH_MAX = 4095  # bytes in a whole path

PathLike = str | os.PathLike


def _show(s: str) -> str:
    """A path as it appears in a message: quoted, escaped, shortened when very long."""
    if len(s) > 160:
        s = s[:100] + "…" + s[-40:]
    return repr(s)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "not a regular file"


def _refuse(what: str, s: str, message: str, reason: str, hint: str | None = None) -> PathRefused:
    return PathRefused(f"{what} {_show(s)}: {message}", reason=reason, path=s, hint=hint)


def _os_error(what: str, s: str, e: OSError) -> PathRefused:
    if e.errno == errno.ELOOP:
        return _refuse(what, s, "a symbolic link loop (too many levels of symbolic links)", "loop")
    if e.errno == errno.ENAMETOOLONG:
        return _refuse(what, s, "the name is too long for the file system", "name_too_long")
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return _refuse(what, s, "does not exist", "missing")
    if e.errno in (errno.EACCES, errno.EPERM):
        return _refuse(what, s, "permission denied", "unreadable")
    return _refuse(what, s, f"cannot be used ({e.strerror or e})", "unreadable")


def check_text(path: PathLike, what: str = "path") -> Path:
    """The path as text: a str or PathLike, non-empty, NUL-free, valid Unicode, at most
    PATH_MAX bytes with every component at most NAME_MAX bytes."""
    try:
        s = os.fspath(path)
    except TypeError:
        raise PathRefused(f"{what} must be a path (text), got {type(path).__name__}", reason="type") from None
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if not isinstance(s, str):
        raise PathRefused(f"{what} must be a path (text), got {type(s).__name__}", reason="type")
    if s == "":
        raise PathRefused(f"{what} is empty: a path names a file or a directory", reason="empty", path=s)
    if "\0" in s:
        raise _refuse(what, s, f"contains a NUL character (at index {s.index(chr(0))}); no file name can", "nul")
    try:
        b = s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _refuse(what, s, f"is not valid Unicode text (a lone surrogate at index {e.start})", "unencodable") from None
    if len(b) > PATH_MAX:
        raise _refuse(what, s, f"is {len(b)} bytes long; a path holds at most {PATH_MAX}", "too_long")
    for comp in s.split("/"):
        n = len(comp.encode("utf-8"))
        if n > NAME_MAX:
            raise _refuse(what, s, f"has a component of {n} bytes; a file name holds at most {NAME_MAX} bytes",
                          "name_too_long")
    return Path(s)


def is_within(child: PathLike, parent: PathLike) -> bool:
    """Whether ``child`` (after resolving symlinks) is ``parent`` or lies below it."""
    c, p = os.path.realpath(child), os.path.realpath(parent)
    try:
        return os.path.commonpath([c, p]) == p
    except ValueError:
        return False


def _stat(p: Path, what: str, s: str, follow: bool = True) -> os.stat_result | None:
    """stat, or None when nothing is there; other failures are named."""
    try:
        return os.stat(p) if follow else os.lstat(p)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise _os_error(what, s, e) from None


def existing_file(path: PathLike, what: str = "file", *, within: PathLike | None = None) -> Path:
    """A regular file that exists (symlinks followed). With ``within``, ``path`` is relative to
    it and must stay inside it (see `confined`). Nothing is opened."""
    p = confined(within, path, what) if within is not None else check_text(path, what)
    s = os.fspath(path)
    st = _stat(p, what, s)
    if st is None:
        raise _refuse(what, s, "does not exist", "missing")
    if not stat.S_ISREG(st.st_mode):
        kind = _kind(st.st_mode)
        reason = "not_a_file" if stat.S_ISDIR(st.st_mode) else "special"
        raise _refuse(what, s, f"is {kind}, not a regular file", reason)
    return p


def existing_dir(path: PathLike, what: str = "directory") -> Path:
    p = check_text(path, what)
    s = os.fspath(path)
    st = _stat(p, what, s)
    if st is None:
        raise _refuse(what, s, "does not exist", "missing")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, s, f"is {_kind(st.st_mode)}, not a directory", "not_a_directory")
    return p


def _check_parent(p: Path, what: str, s: str) -> None:
    parent = p.parent
    st = _stat(parent, what, s)
    if st is None:
        raise _refuse(what, s, f"its directory {_show(str(parent))} does not exist", "parent_missing")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, s, f"its parent {_show(str(parent))} is {_kind(st.st_mode)}, not a directory", "parent_missing")


def _check_outside(p: Path, what: str, s: str, forbid_inside: Iterable[PathLike]) -> None:
    # The parent resolved plus the name: a symlinked parent that leads into the container counts.
    target = os.path.join(os.path.realpath(p.parent), p.name)
    if os.path.islink(p):
        target = os.path.realpath(p)
    for d in forbid_inside:
        if d is not None and is_within(target, d):
            raise _refuse(what, s, f"is inside the open container {_show(os.fspath(d))}; nothing is written "
                          "inside a container except by an encode", "inside")


#: The files that make a directory a container (an index and its graph): nothing but the
#: container's own writer writes inside such a directory.
CONTAINER_MARKERS = ("index.json", "system_graph.json")


def _check_not_in_container(target: str, what: str, s: str) -> None:
    """Refuse a target inside any container directory (the open one or another), looking up the
    resolved directories above it."""
    d = os.path.dirname(target)
    for _ in range(256):  # a path has far fewer components; the bound keeps a cycle from looping
        if all(os.path.isfile(os.path.join(d, m)) for m in CONTAINER_MARKERS):
            raise _refuse(what, s, f"is inside the container {_show(d)}; nothing is written inside a container "
                          "except by its own writer (ENCODE, REPRESENT, BUILD FEATURES)", "inside_container",
                          hint="write it beside the container instead")
        parent = os.path.dirname(d)
        if parent == d:
            return
        d = parent


def output_file(path: PathLike, what: str = "output file", *, overwrite: bool = False,
                forbid_inside: Iterable[PathLike] = ()) -> Path:
    """A file about to be written: a file name under an existing directory, outside every
    directory in ``forbid_inside``; if something is there it must be a regular file (or a
    symlink to one) and ``overwrite`` must be True."""
    p = check_text(path, what)
    s = os.fspath(path)
    if s.endswith("/") or p.name in ("", ".", "..") or s in (".", ".."):
        raise _refuse(what, s, "names a directory, not a file", "not_a_file_name")
    _check_parent(p, what, s)
    _check_outside(p, what, s, forbid_inside)
    _check_not_in_container(os.path.realpath(p), what, s)
    lst = _stat(p, what, s, follow=False)
    if lst is None:
        return p
    st = lst
    if stat.S_ISLNK(lst.st_mode):
        st = _stat(p, what, s)
        if st is None:
            raise _refuse(what, s, "is a symbolic link to nothing (dangling); refusing to write through it", "special")
    if stat.S_ISDIR(st.st_mode):
        raise _refuse(what, s, "is a directory; a file name is needed here", "not_a_file")
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(what, s, f"is {_kind(st.st_mode)}; only a regular file is ever replaced", "special")
    if not overwrite:
        raise _refuse(what, s, "already exists; refusing to overwrite it", "exists",
                      hint="choose another name, or say OVERWRITE to replace it")
    return p


def output_dir(path: PathLike, what: str = "output directory", *, exist_ok: bool = False,
               forbid_inside: Iterable[PathLike] = ()) -> Path:
    """A directory about to be created (or, with ``exist_ok``, an existing directory to write
    into), under an existing parent, outside every directory in ``forbid_inside``."""
    p = check_text(path, what)
    s = os.fspath(path)
    if p.name in ("", ".", "..") and not exist_ok:
        raise _refuse(what, s, "names no new directory", "not_a_file_name")
    st = _stat(p, what, s)
    if st is not None:
        if not exist_ok:
            raise _refuse(what, s, "already exists; refusing to overwrite it", "exists",
                          hint="remove it or choose another path")
        if not stat.S_ISDIR(st.st_mode):
            raise _refuse(what, s, f"is {_kind(st.st_mode)}, not a directory", "not_a_directory")
    else:
        _check_parent(p, what, s)
    for d in forbid_inside:
        if d is not None and is_within(os.path.join(os.path.realpath(p.parent), p.name), d):
            raise _refuse(what, s, f"is inside the open container {_show(os.fspath(d))}", "inside")
    _check_not_in_container(os.path.join(os.path.realpath(p.parent), p.name), what, s)
    return p


def confined(root: PathLike, rel: PathLike, what: str = "path") -> Path:
    """``root / rel`` for a relative ``rel`` read from a file: refused when absolute, when it has
    a '..' component, or when it resolves (through symlinks) outside ``root``. Nothing is opened."""
    if not isinstance(rel, (str, os.PathLike)):
        raise PathRefused(f"{what} must be a relative path (text), got {type(rel).__name__}", reason="type")
    check_text(rel, what)
    s = os.fspath(rel)
    if isinstance(s, bytes):
        s = os.fsdecode(s)
    if os.path.isabs(s):
        raise _refuse(what, s, "is an absolute path; it must be relative to its container", "absolute")
    if ".." in PurePosixPath(s).parts:
        raise _refuse(what, s, "has a '..' component; it must stay inside its container", "dotdot")
    p = Path(root) / s
    if not is_within(p, root):
        raise _refuse(what, s, "resolves (through a symbolic link) outside its container", "outside")
    return p


def open_regular(path: PathLike, what: str = "file") -> BinaryIO:
    """Open for reading without ever blocking on a FIFO, and refuse anything but a regular file."""
    s = os.fspath(path)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        raise _os_error(what, s, e) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            reason = "not_a_file" if stat.S_ISDIR(st.st_mode) else "special"
            raise _refuse(what, s, f"is {_kind(st.st_mode)}, not a regular file", reason)
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: PathLike, what: str = "file", *, max_bytes: int) -> bytes:
    """The whole content of a regular file of at most ``max_bytes`` bytes."""
    with open_regular(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise _refuse(what, os.fspath(path), f"is {size:,} bytes; at most {max_bytes:,} are read here", "too_large")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _refuse(what, os.fspath(path), f"holds more than {max_bytes:,} bytes", "too_large")
    return data


_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def file_component(ident: str, max_len: int = 80) -> str:
    """A file-name-safe rendering of an identifier: characters outside [A-Za-z0-9._-] become
    '_', a leading '.' is escaped, and when anything changed (or the text was long) a short hash
    of the original keeps distinct identifiers distinct. Never empty, never '.' or '..', never
    contains '/', at most ``max_len`` + 9 characters."""
    text = str(ident)
    safe = _SAFE.sub("_", text)
    if safe.startswith("."):
        safe = "_" + safe[1:]
    changed = safe != text or len(safe) > max_len or not safe
    safe = safe[:max_len]
    if changed:
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]
        safe = f"{safe}~{digest}" if safe else digest
    return safe


def hidden_sibling(path: PathLike, tag: str) -> Path:
    """``.<name><tag>`` beside ``path`` (a temporary file or directory written before a rename):
    when that name would pass NAME_MAX bytes, the name is cut and a short hash of it keeps it
    distinct, so a long but valid output name never makes its temporary name invalid."""
    p = Path(path)
    name = f".{p.name}{tag}"
    if len(name.encode("utf-8", "surrogatepass")) <= NAME_MAX:
        return p.with_name(name)
    digest = hashlib.sha256(p.name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    room = NAME_MAX - len(f".~{digest}{tag}".encode())
    head = p.name.encode("utf-8", "surrogatepass")[:room].decode("utf-8", "ignore")
    return p.with_name(f".{head}~{digest}{tag}")
