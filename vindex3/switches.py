"""Process settings read from the environment: the compiled fast paths a process may turn off
(``VINDEX3_DECODE_KERNELS``, ``VINDEX3_PREFILL_KERNELS``, ``VINDEX3_FUSED_LAYERS``,
``VINDEX3_TEAMS``), how segments
hold their bytes (``VINDEX3_WEIGHTS``, `weights_mode`; ``VINDEX3_HUGE_PAGES``: a mapped segment
asked for in 2 MB pages, vindex3.segments), whether an executor sets the C allocator's thresholds
(``VINDEX3_MALLOC_TUNE``, vindex3.exec.heap), and the check that refuses a misspelt
``VINDEX3_*`` name (`check_all`).

A switch is ``1`` (on) or ``0`` (off); unset or empty leaves it on. Any other value is refused by
name (`ConfigError`) rather than guessed at. The variable is read at first use, not at import, so
a bad value surfaces as the error of the statement or call that first needs the path, which every
front end reports as a message, never as an import-time traceback.

    class _Switch:
        on = EnvSwitch("VINDEX3_FUSED_LAYERS")

After the first read ``on`` is a plain instance attribute (the descriptor has no ``__set__``, so
the instance's own value shadows it): the hot paths that test ``FUSED.on`` pay nothing for this.
``set_switch(obj, "on", None)`` forgets the value so the next use reads the environment again;
`check_all` reads every switch up front.
"""

from __future__ import annotations

import os

from .errors import ConfigError

ON, OFF = "1", "0"
NAMES = ("VINDEX3_DECODE_KERNELS", "VINDEX3_PREFILL_KERNELS", "VINDEX3_FUSED_LAYERS", "VINDEX3_TEAMS",
         "VINDEX3_HUGE_PAGES", "VINDEX3_MALLOC_TUNE")


def read_switch(name: str) -> bool:
    """The switch ``name`` from the environment: True when unset, empty or ``1``, False when ``0``;
    anything else refused by name."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() in ("", ON):
        return True
    if raw.strip() == OFF:
        return False
    raise ConfigError(f"{name}={raw!r} is not a switch value: set it to 0 (off) or 1 (on), or leave it unset (on)")


# Every environment variable this project reads; another VINDEX3_* name is most likely a
# misspelling of one of these (VINDEX3_FUSED_LAYER=0 would otherwise leave fused layers on).
KNOWN = (*NAMES, "VINDEX3_DECODE_THREADS", "VINDEX3_INTDOT_PATH", "VINDEX3_CACHE", "VINDEX3_WEIGHTS")
WEIGHTS = ("mapped", "resident")


def weights_mode() -> str:
    """``VINDEX3_WEIGHTS``: how segments hold their bytes. ``mapped`` (the default, also when
    unset or empty): the file is memory-mapped read-only and shares the page cache. ``resident``:
    each segment is read once into private anonymous memory asked for in huge pages
    (`vindex3.segments`), which a decode streams faster (measured in docs/container.md; fewer
    page-table walks is the likely cause, not measured) at the cost of a private copy. Anything else is refused by name."""
    raw = os.environ.get("VINDEX3_WEIGHTS")
    if raw is None or raw.strip() == "":
        return "mapped"
    if raw.strip() in WEIGHTS:
        return raw.strip()
    raise ConfigError(f"VINDEX3_WEIGHTS={raw!r} is not a way of holding weights: set it to {' or '.join(WEIGHTS)}")


def check_all() -> None:
    """Refuse a bad value of any switch now, and any VINDEX3_* variable this project does not
    read (an executor calls this when it is built, so a bad value is named even by a run whose
    model never reaches the path it turns off)."""
    unknown = sorted(k for k in os.environ if k.startswith("VINDEX3_") and k not in KNOWN)
    if unknown:
        import difflib

        near = difflib.get_close_matches(unknown[0], KNOWN, n=1)
        raise ConfigError(f"unknown environment variable {unknown[0]}" + (f" (did you mean {near[0]}?)" if near else ""),
                          hint=f"the variables vindex3 reads: {', '.join(KNOWN)}")
    for name in NAMES:
        read_switch(name)
    weights_mode()


class EnvSwitch:
    """A class attribute whose value, per instance, is `read_switch(env)` at first access."""

    def __init__(self, env: str):
        self.env = env
        self.attr = ""

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        value = read_switch(self.env)
        obj.__dict__[self.attr] = value
        return value


def set_switch(obj, attr: str, flag: bool | None) -> None:
    """Set ``obj.attr`` to ``flag``, or with None forget it so the environment is read again."""
    if flag is None:
        obj.__dict__.pop(attr, None)
    else:
        obj.__dict__[attr] = bool(flag)
