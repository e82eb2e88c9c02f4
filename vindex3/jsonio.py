"""The one boundary where JSON enters and leaves the project.

config.json files spell non-finite numbers two ways: bare ``Infinity``/``-Infinity``/``NaN``
(Python's json writer, older transformers) and the tagged object ``{"__float__": "Infinity"}``
(transformers 5.x). Both are read here into one judged representation, a Python float
``inf``/``-inf``/``nan`` — never a fabricated finite number. On write, non-finite floats are
emitted in the tagged spelling so that every file we write is strict JSON.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .errors import ConfigError

_TAGGED = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan, "+Infinity": math.inf}


def _hook(obj: dict) -> Any:
    if len(obj) == 1 and "__float__" in obj:
        raw = obj["__float__"]
        if isinstance(raw, str) and raw in _TAGGED:
            return _TAGGED[raw]
        if isinstance(raw, (int, float)):
            return float(raw)
        raise ValueError(f"unrecognised tagged float {raw!r}")
    return obj


def loads(text: str, *, source: str = "<json>") -> Any:
    """Parse JSON text, reading both non-finite spellings. Malformed text raises ConfigError
    naming the source, line and column."""
    try:
        return json.loads(text, object_hook=_hook)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{source}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise ConfigError(f"{source}: JSON nested too deeply to read") from None
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


MAX_JSON_BYTES = 64 << 20  # a config, index, graph or sidecar is far smaller


def decode_text(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{source}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def load(path: str | os.PathLike, *, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Read a JSON file: a regular file (a FIFO or device is refused, never read) of at most
    ``max_bytes`` bytes, UTF-8, parsed as `loads` does."""
    from .errors import PathRefused
    from .paths import read_regular

    p = Path(path)
    try:
        data = read_regular(p, p.name, max_bytes=max_bytes)
    except PathRefused as e:
        if e.reason == "missing":
            raise ConfigError(f"{p.name}: no such file at {p}") from None
        raise ConfigError(e.message) from None
    return loads(decode_text(data, p.name), source=p.name)


def _tag(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")}
    if isinstance(obj, dict):
        return {k: _tag(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_tag(v) for v in obj]
    return obj


def canonical(obj: Any) -> bytes:
    """One byte spelling of a JSON value whatever its formatting: sorted keys, no whitespace,
    tagged non-finite floats, UTF-8 (what a self-hash is computed over)."""
    return json.dumps(_tag(obj), sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode(
        "utf-8", "surrogatepass")


def dumps(obj: Any, *, indent: int | None = 2) -> str:
    """Strict JSON: non-finite floats use the tagged spelling."""
    return json.dumps(_tag(obj), indent=indent, allow_nan=False, ensure_ascii=False)


def write_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON to a sibling temporary file, fsync, then rename over the target."""
    p = Path(path)
    from .paths import hidden_sibling

    tmp = hidden_sibling(p, f".tmp-{os.getpid()}")
    text = dumps(obj) + "\n"
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ConfigError(f"{p.name} cannot be written: a value holds text that is not valid Unicode "
                          f"(a lone surrogate: {text[max(0, e.start - 20):e.end + 20]!r})") from None
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        tmp.unlink(missing_ok=True)  # never leave the temporary file behind
        raise
