"""Every path LQL reads or writes, checked through `vindex3.paths` before any work: the paths a
statement names (OPEN, PLAN and ENCODE sources, DUMP LOGITS INTO, DRAFT LADDER ON / INTO / PLOT
INTO, SCORE DRAFT's dumps, ENCODE's output) and the files a shell command names (a script run by
``\\i`` or ``lql FILE``, an ``\\o`` / ``\\once`` target).

The rules (docs/lql.md, "Files"):

* a path is text a file system can hold: not empty, no NUL, no lone surrogate, no component over
  255 bytes (vindex3.paths.check_text);
* what is read exists and is what the statement needs: a directory for a container, a regular
  file for a dump, a prompt bank or a script — never a FIFO, a device or a socket (which could
  block a reader forever), never a directory where a file is expected;
* what is written has an existing parent directory, is a file name (not '', '.', '/'), is never
  inside the open container, and, if it exists, is a regular file replaced only when the
  statement says ``OVERWRITE`` or the session has ``SET overwrite = on``.

A refusal is vindex3's `PathRefused` (a statement shows it as an engine refusal of that kind,
with its stable ``reason``); the shell's helpers turn it into `FileRefusal` with the same words.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .errors import FileRefusal

#: The largest script ``\i`` or ``lql FILE`` reads (a script is text typed by people).
MAX_SCRIPT_BYTES = 64 << 20

OVERWRITE_HINT = "choose another name, add OVERWRITE to the statement, or SET overwrite = on"


def _paths():
    from vindex3 import paths

    return paths


def container_paths(container: Any) -> list[Path]:
    """The directories nothing may be written into while ``container`` is open."""
    if container is None:
        return []
    path = getattr(container, "path", None)
    return [Path(path)] if path is not None else []


def container_dir(path: str) -> Path:
    """OPEN's path as text a file system can hold (not empty, no NUL...). Whether it exists and
    is a container is vindex3.open's to judge, by name (ContainerNotFound), before it reads
    anything."""
    return _paths().check_text(path, "container path")


def default_container(session: Any) -> str:
    """The built-in default model's container, encoded into the cache on first use as OPEN DEFAULT
    encodes it: what DEFAULT names where a statement takes a container path (STATS, DIFF, COMPILE,
    SCORE REPRESENTATION). Called when the statement runs, never when it is planned (EXPLAIN and
    planning read nothing)."""
    from vindex3 import default_model

    return str(default_model.ensure(session.on_progress, notice=session.on_notice))


def container_or_default(session: Any, path: str | None) -> str:
    """``path``, or the default model's container when it is None (a plan's DEFAULT)."""
    return default_container(session) if path is None else path


def default_refusal(keyword: str) -> str:
    """Why the read-only profile refuses a statement that names DEFAULT for a container: it may
    encode the default model into the server's cache."""
    return f"{keyword} DEFAULT may encode the default model on the server; this server serves fixed models"


def source(path: str, what: str) -> Path:
    """A checkpoint to read (PLAN, ENCODE): a directory or a regular file (a .gguf) that exists."""
    paths = _paths()
    p = paths.check_text(path, what)
    if os.path.isdir(p):
        return p
    return paths.existing_file(path, what)


def input_file(path: str, what: str) -> Path:
    """A regular file that exists (a dump, a prompt bank)."""
    return _paths().existing_file(path, what)


def output_file(path: str, what: str, *, overwrite: bool, inside: Iterable[Path] = ()) -> Path:
    """A file about to be written (see the module's rules); the hint of an existing file names
    the statement's way to replace it."""
    paths = _paths()
    from vindex3.errors import PathRefused

    try:
        return paths.output_file(path, what, overwrite=overwrite, forbid_inside=list(inside))
    except PathRefused as e:
        if e.reason == "exists":
            e.hint = OVERWRITE_HINT
        raise


def output_dir(path: str, what: str, *, inside: Iterable[Path] = ()) -> Path:
    """A directory about to be created (ENCODE's output)."""
    return _paths().output_dir(path, what, forbid_inside=list(inside))


def read_script(path: str | os.PathLike, what: str = "script") -> str:
    """The text of a script file: a regular file of at most MAX_SCRIPT_BYTES, UTF-8. Refused
    by name (`FileRefusal`): a missing file, a directory, a FIFO or device, a bad name, bytes
    that are not UTF-8."""
    from vindex3.errors import PathRefused

    paths = _paths()
    try:
        p = paths.existing_file(os.fspath(path), what)
        data = paths.read_regular(p, what, max_bytes=MAX_SCRIPT_BYTES)
    except PathRefused as e:
        raise FileRefusal(e.message, hint=e.hint) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileRefusal(f"{what} {os.fspath(path)!r} is not UTF-8 text (byte {e.start}: {e.reason})") from None
    return text.removeprefix("\ufeff")  # a byte-order mark some editors write: not text


def shell_output(path: str, what: str, *, overwrite: bool, inside: Iterable[Path] = ()) -> Path:
    """A file a shell command writes (``\\o``, ``\\once``), as `output_file`, refusals as
    `FileRefusal` (the shell's own kind of error)."""
    from vindex3.errors import PathRefused

    try:
        return output_file(path, what, overwrite=overwrite, inside=inside)
    except PathRefused as e:
        hint = "choose another name, or SET overwrite = on" if e.reason == "exists" else e.hint
        raise FileRefusal(e.message, hint=hint) from None


def encode_target(path: str, *, overwrite: bool, inside: Iterable[Path] = ()) -> bool:
    """ENCODE's output directory. A new directory (its parent exists, it is not inside the open
    container): False. An existing one is refused unless ``overwrite``, and then only when it is
    a container (a directory holding index.json, not a symbolic link) that neither is nor holds
    the open container: True (the command replaces it once the new encode is complete)."""
    from vindex3.errors import PathRefused

    paths = _paths()
    inside = list(inside)
    p = paths.check_text(path, "ENCODE output")
    if not os.path.lexists(p):
        paths.output_dir(path, "ENCODE output", forbid_inside=inside)
        return False
    s = repr(os.fspath(path))
    if not overwrite:
        raise PathRefused(f"ENCODE output {s}: already exists; refusing to overwrite it", reason="exists", path=path,
                          hint="choose another path, or add OVERWRITE to replace an existing container")
    for d in inside:
        if paths.is_within(p, d) or paths.is_within(d, p):
            raise PathRefused(f"ENCODE output {s}: is or holds the open container {os.fspath(d)!r}; it cannot be "
                              "replaced while it is open", reason="inside", path=path,
                              hint="OPEN another container first, or choose another path")
    if os.path.islink(p) or not os.path.isdir(p) or not os.path.isfile(p / "index.json"):
        raise PathRefused(f"ENCODE output {s}: OVERWRITE replaces only a container (a directory holding index.json), "
                          "and this is not one", reason="not_a_container", path=path,
                          hint="remove it yourself, or choose another path")
    return True
