"""The settings: one table, so that SET, SHOW SETTINGS, HELP SET, the docs test and the REPL's
completion all read the same source and cannot drift from each other. (The statements' HELP
entries are their families', `lql.registry`.)"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

PositiveInt = Annotated[int, Field(ge=1)]
NonNegativeInt = Annotated[int, Field(ge=0)]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def settings_text() -> str:
    """Every setting with its default, as HELP SET lists them (SHOW SETTINGS shows the values)."""
    width = max(len(s.name) for s in SETTINGS)
    lines = ["  settings (default):"]
    for s in SETTINGS:
        default = s.show(s.default) if s.show is not None else (
            ("on" if s.default else "off") if isinstance(s.default, bool) else s.default)
        lines.append(f"    {s.name.ljust(width)}  ({default}) {s.description}")
    return "\n".join(lines)


# ---- settings -------------------------------------------------------------------------


@dataclass(frozen=True)
class SettingDoc:
    name: str
    type: Any  # the value's type, as the typed `Settings` model holds it
    default: Any
    description: str
    parse: Callable[[Any], Any]  # raises ValueError with a message naming what is accepted
    show: Callable[[Any], Any] | None = None  # the value as SHOW SETTINGS writes it (default: on/off, as is)


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if isinstance(v, str) and v.lower() in options:
            return v.lower()
        raise ValueError(f"takes one of {', '.join(options)}")

    parse.choices = options  # type: ignore[attr-defined]  (read by the REPL's completer)
    return parse


def _switch(v: Any) -> bool:
    if isinstance(v, str) and v.lower() in ("on", "true", "yes"):
        return True
    if isinstance(v, str) and v.lower() in ("off", "false", "no"):
        return False
    raise ValueError("takes on or off")


def _count(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return v
    raise ValueError("takes a whole number of at least 1")


def _number(v: Any) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    raise ValueError("takes a finite number, e.g. 3.0")


def _count0(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise ValueError("takes a whole number (0 for none)")


_UNITS = {"b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_bytes(v: Any) -> int:
    """A byte count: a whole number of bytes, or a string with a unit ('8 GiB', '512MiB',
    '2GB'; binary KiB..TiB, decimal KB..TB)."""
    if isinstance(v, int) and not isinstance(v, bool):
        n = v
    elif isinstance(v, str):
        import re

        m = re.fullmatch(r"\s*([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([A-Za-z]{1,3})?\s*", v)
        unit = (m.group(2) or "b").lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError("takes a byte count: a whole number of bytes, or e.g. '8 GiB', '512 MiB', '2 GB'")
        from decimal import Decimal

        n = int(Decimal(m.group(1)) * _UNITS[unit])
    else:
        raise ValueError("takes a byte count: a whole number of bytes, or e.g. '8 GiB', '512 MiB', '2 GB'")  # noqa: TRY004 - the parse contract
    if n < 1:
        raise ValueError("takes a byte count of at least 1")
    return n


def show_bytes(n: int) -> str:
    """A byte count as SHOW SETTINGS writes it: '4 GiB' when it is a whole number of a binary
    unit, else the bytes with their size ('2,000,000,000 bytes (1.9 GiB)')."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % size == 0 and n // size < 10240:
            return f"{n // size} {unit}"
    from .text import fmt_bytes

    return fmt_bytes(n)


MODEL = "model"  # max_positions = model: the model's own context length


def _positions(v: Any) -> int | None:
    if isinstance(v, str) and v.lower() == MODEL:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
        return v
    raise ValueError("takes a whole number of at least 1, or model (the model's context length)")


def _show_positions(v: int | None) -> Any:
    return MODEL if v is None else v


DEFAULT = "default"  # templates = default: INSERT's built-in relation templates only


def _templates(v: Any) -> str | None:
    if isinstance(v, str) and v.lower() == DEFAULT:
        return None
    if isinstance(v, str) and v.strip():
        return v
    raise ValueError("takes a JSON file's path ({\"relation\": \"The {entity} is ...\"}), or default")


def _show_templates(v: str | None) -> Any:
    return DEFAULT if v is None else v


MEASURED = "measured"  # verify_cost = measured: this process's pass timings (vindex3.draft.costs)


def _verify_cost(v: Any) -> float | None:
    if isinstance(v, str) and v.lower() == MEASURED:
        return None
    if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1:
        return float(v)
    raise ValueError("takes measured, or a number of decode steps in (0, 1) that each verified position costs")


def _show_verify_cost(v: float | None) -> Any:
    return MEASURED if v is None else v


SETTINGS: tuple[SettingDoc, ...] = (
    SettingDoc("format", Literal["text", "json", "csv", "tsv", "markdown", "jsonl"], "text", "output format: text, json, csv, tsv, markdown or jsonl",
               _choice("text", "json", "csv", "tsv", "markdown", "jsonl")),
    SettingDoc("timing", bool, True, "show timings: wall time per statement, prepare, prefill, tok/s", _switch),
    SettingDoc("top", PositiveInt, 5, "candidates INFER shows when neither TOP nor GENERATE is given", _count),
    SettingDoc("lookahead", PositiveInt, 4, "draft tokens SPECULATE proposes per round when LOOKAHEAD is not given", _count),
    SettingDoc("verify_cost", float | None, None,
               "what DRAFTER LOOKUP counts each further drafted position's check as: measured (this process's pass timings, "
               "followed as it runs) or a number c in (0, 1), a pass over T positions costing 1 + c(T - 1) steps "
               "(proposals then do not depend on the machine)", _verify_cost, _show_verify_cost),
    SettingDoc("shards", NonNegativeInt, 0, "run the layers as this many Ray actors (0: in this process); applies to the bound model",
               _count0),
    SettingDoc("compare", bool, True, "SPECULATE also runs plain greedy decoding to check and time it", _switch),
    SettingDoc("chat", bool, False, "INFER wraps text prompts in the model's chat template (as CHAT does)", _switch),
    SettingDoc("expanded", Literal["on", "off", "auto"], "off", "tables one field per line: on, off, or auto (when too wide)",
               _choice("on", "off", "auto")),
    SettingDoc("pager", bool, True, "in the shell, page output longer than the screen ($PAGER, else less -SRXF)", _switch),
    SettingDoc("threshold", FiniteFloat, 3.0, "DESCRIBE keeps features whose gate score exceeds this (3: a SiLU gate 95% open)",
               _number),
    SettingDoc("activations", Literal["exact", "q8"], "exact",
               "int8 and q4 products, decode and prefill: exact float32 activations, or q8 (per-block int8 activations and "
               "integer dot products, as llama.cpp; faster, less faithful: docs/container.md)", _choice("exact", "q8")),
    SettingDoc("templates", str | None, None,
               "INSERT's relation -> prompt templates: a JSON file {relation: 'The {entity} is located in'} read at "
               "each INSERT, over the built-in ones; default: the built-in ones only", _templates, _show_templates),
    SettingDoc("stale", Literal["rebuild", "refuse"], "rebuild", "feature metadata built from another state of the container: rebuild it, or refuse",
               _choice("rebuild", "refuse")),
    # ---- what a statement may do (issue 10): named limits, each refused by name before any work
    SettingDoc("overwrite", bool, False, "writing INTO an existing file replaces it (as OVERWRITE does); off: refused",
               _switch),
    SettingDoc("max_positions", PositiveInt | None, None, "positions a run may use (prompt + generated); model: the context length",
               _positions, _show_positions),
    SettingDoc("max_generate", PositiveInt, 4096, "most tokens GENERATE may ask for", _count),
    SettingDoc("max_lookahead", PositiveInt, 64, "most tokens LOOKAHEAD may ask the draft to propose per round", _count),
    SettingDoc("max_prompts", PositiveInt, 1000, "most prompts a DRAFT LADDER bank may hold", _count),
    SettingDoc("memory_limit", PositiveInt, 4 << 30, "refuse a run whose arrays would need more memory (bytes, or e.g. '8 GiB')",
               parse_bytes, show_bytes),
)


# ---- the FEATURES relation (SELECT ... FROM FEATURES) -------------------------------------

#: Column -> its type, as SELECT ... FROM FEATURES reads it (vindex3.internals.select.COLUMNS).
FEATURE_COLUMNS: dict[str, type] = {"layer": int, "feature": int, "token": str, "score": float}

#: What each column means, for HELP, the docs and the REPL's completion.
FEATURE_COLUMN_MEANINGS: dict[str, str] = {
    "layer": "the FFN layer",
    "feature": "the feature's index in its layer",
    "token": "the token its down column writes most",
    "score": "gate score against NEAREST TO, else the logit of that token",
}

#: The comparisons each column takes.
FEATURE_COLUMN_OPS: dict[str, tuple[str, ...]] = {
    "layer": ("=", "!=", "<", "<=", ">", ">=", "IN"), "feature": ("=", "!=", "<", "<=", ">", ">=", "IN"),
    "score": ("=", "!=", "<", "<=", ">", ">=", "IN"), "token": ("=", "!=", "LIKE", "IN"),
}


class _SettingsBase(BaseModel):
    """Behaviour of the generated `Settings` model."""

    model_config = ConfigDict(validate_assignment=True, extra="forbid")

    def __getitem__(self, name: str) -> Any:
        if name not in type(self).model_fields:
            raise KeyError(f"there is no setting named {name!r}")
        return getattr(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        if name not in type(self).model_fields:
            raise KeyError(f"there is no setting named {name!r}")
        setattr(self, name, value)

    def get(self, name: str) -> Any:
        """The value of the setting ``name`` (every setting has one: its default until SET)."""
        return self[name]


#: The session's settings as one typed model, generated from `SETTINGS`: a field per setting, of
#: its type, with its default. Nothing else states a default.
Settings = create_model("Settings", __base__=_SettingsBase,
                        **{s.name: (s.type, Field(s.default, description=s.description)) for s in SETTINGS})


#: The settings that bound what a statement may do: a server session may lower them, never raise
#: them past the value the server started the session with (what guards the server guards it).
LIMIT_SETTINGS = ("max_positions", "max_generate", "max_lookahead", "max_prompts", "memory_limit")
# settings whose value names a file the session reads: a server refuses them (a statement's own
# paths are confined to its data directory; a setting's value is not a statement's path)
FILE_SETTINGS = ("templates",)


def setting(name: str) -> SettingDoc | None:
    for s in SETTINGS:
        if s.name == name:
            return s
    return None
