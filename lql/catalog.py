"""The statement catalogue and the settings: one table each, so that HELP, the docs test and
the REPL's completion all read the same source and cannot drift from each other."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StatementDoc:
    name: str  # the statement as written, e.g. "SHOW LAYERS"
    syntax: str
    summary: str
    example: str


STATEMENTS: tuple[StatementDoc, ...] = (
    StatementDoc("OPEN", "OPEN 'path' [SHARDS n] | USE 'path' | OPEN DEFAULT [SHARDS n]",
                 "bind a container (OPEN DEFAULT: the built-in default model, encoded on first use; "
                 "SHARDS n: its layers run as n Ray actors)",
                 "OPEN 'model.vindex3';"),
    StatementDoc("USE REMOTE", "USE REMOTE 'http://host:port' [MODEL 'id']",
                 "bind the session to an lql server: later statements run there and print here (OPEN comes back)",
                 "USE REMOTE 'http://127.0.0.1:8088';"),
    StatementDoc("STATS", "STATS [AT n POSITIONS]",
                 "the container's facts: layers, operator mix, objects, continuation state in bytes",
                 "STATS AT 4096 POSITIONS;"),
    StatementDoc("EXPLAIN", "EXPLAIN [DRAFT DEPTH n] | EXPLAIN INFER ...",
                 "the plan without running a token (of the very INFER given): ops, operands, state, bytes read",
                 "EXPLAIN DRAFT DEPTH 2;"),
    StatementDoc("SHOW LAYERS", "SHOW LAYERS [RANGE a-b]", "the per-layer policy and continuation geometry",
                 "SHOW LAYERS RANGE 0-1;"),
    StatementDoc("SHOW COMPONENTS", "SHOW COMPONENTS", "the graph's components and their roles", "SHOW COMPONENTS;"),
    StatementDoc("SHOW REPRESENTATIONS", "SHOW REPRESENTATIONS ['filter']",
                 "physical representations: segment files, tensor counts, bytes, hashes",
                 "SHOW REPRESENTATIONS 'embedding';"),
    StatementDoc("SHOW PROVENANCE", "SHOW PROVENANCE", "where the container came from", "SHOW PROVENANCE;"),
    StatementDoc("SHOW OPERANDS", "SHOW OPERANDS [LAYER n]", "the tensors each op reads, with dtype, shape and bytes",
                 "SHOW OPERANDS LAYER 0;"),
    StatementDoc("SHOW SETTINGS", "SHOW SETTINGS", "the session's settings", "SHOW SETTINGS;"),
    StatementDoc("INFER", "INFER 'prompt' | TOKENS (ids) [TOP n] [GENERATE n [EXACTLY]] [DRAFT DEPTH n] "
                 "[SPECULATE DEPTH d [LOOKAHEAD k]] [CHAT]",
                 "next-token distribution (TOP), greedy continuation (GENERATE), self-speculative decoding",
                 "INFER 'The capital of France is' TOP 3;"),
    StatementDoc("TRACE", "TRACE 'prompt' | TOKENS (ids) [DRAFT DEPTH n]",
                 "which layers ran at each position, and the next token there", "TRACE 'Water boils';"),
    StatementDoc("DRAFT DEPTH", "DRAFT DEPTH n | DRAFT OFF",
                 "set (or clear) the session's default draft depth for INFER, TRACE, EXPLAIN, DUMP LOGITS",
                 "DRAFT DEPTH 2;"),
    StatementDoc("DRAFT LADDER", "DRAFT LADDER DEPTHS (d, ...) ON 'prompts.jsonl' [INTO 'ladder.json'] "
                 "[PLOT INTO 'ladder.png']",
                 "score each draft depth against the full model over a prompt bank",
                 "DRAFT LADDER DEPTHS (1, 2, 4) ON 'prompts.jsonl';"),
    StatementDoc("DUMP LOGITS", "DUMP LOGITS 'prompt' | TOKENS (ids) [DRAFT DEPTH n] INTO 'file.f32'",
                 "write raw float32 logits [positions, vocab] and a provenance sidecar",
                 "DUMP LOGITS 'Hello' DRAFT DEPTH 2 INTO 'draft.f32';"),
    StatementDoc("SCORE DRAFT", "SCORE DRAFT 'draft.f32' AGAINST 'target.f32'",
                 "compare a draft's logit dump with the full model's: KL, top-1, ranks",
                 "SCORE DRAFT 'draft.f32' AGAINST 'full.f32';"),
    StatementDoc("VERIFY", "VERIFY", "re-hash every file of the bound container against its index", "VERIFY;"),
    StatementDoc("PLAN", "PLAN 'checkpoint'", "admission: would this checkpoint encode, and what was judged",
                 "PLAN 'path/to/hf-checkpoint';"),
    StatementDoc("ENCODE", "ENCODE 'checkpoint' INTO 'dir'", "encode an HF directory or .gguf into a container",
                 "ENCODE 'path/to/hf-checkpoint' INTO 'model.vindex3';"),
    StatementDoc("SET", "SET name = value", "change a setting (see SHOW SETTINGS)", "SET timing = off;"),
    StatementDoc("HELP", "HELP [statement]", "this help, or one statement's", "HELP INFER;"),
)

_ALIASES = {"USE": "OPEN", "DRAFT": "DRAFT DEPTH", "DRAFT OFF": "DRAFT DEPTH", "SHOW": None,
            "SPECULATE": "INFER", "GENERATE": "INFER", "DUMP": "DUMP LOGITS", "SCORE": "SCORE DRAFT",
            "CHAT": "INFER", "EXACTLY": "INFER", "PLOT": "DRAFT LADDER", "SETTINGS": "SET",
            "OVERWRITE": "SET", "LIMITS": "SET"}


def find_statement(topic: str) -> StatementDoc | None:
    topic = " ".join(topic.upper().split())
    topic = _ALIASES.get(topic, topic) or ""
    for d in STATEMENTS:
        if d.name == topic:
            return d
    return None


def closest_topics(topic: str) -> list[str]:
    return difflib.get_close_matches(topic.upper(), [d.name for d in STATEMENTS], n=3, cutoff=0.5)


def help_text(topic: str | None) -> str | None:
    """HELP's text; None when the topic names no statement."""
    if topic is None:
        width = max(len(d.name) for d in STATEMENTS)
        lines = ["LQL statements (HELP name for one; statements end with ';'; keywords are case-insensitive):", ""]
        lines += [f"  {d.name.ljust(width)}  {d.summary}" for d in STATEMENTS]
        return "\n".join(lines)
    if topic.upper().strip() == "SHOW":
        docs = [d for d in STATEMENTS if d.name.startswith("SHOW ")]
        return "\n".join(f"{d.syntax}\n  {d.summary}" for d in docs)
    d = find_statement(topic)
    if d is None:
        return None
    text = f"{d.syntax}\n  {d.summary}\n  example: {d.example}"
    if d.name == "SET":
        text += "\n" + settings_text()
    return text


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
    from .render import fmt_bytes

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


SETTINGS: tuple[SettingDoc, ...] = (
    SettingDoc("format", "text", "output format: text, json, csv, tsv, markdown or jsonl",
               _choice("text", "json", "csv", "tsv", "markdown", "jsonl")),
    SettingDoc("timing", True, "show timings: wall time per statement, prepare, prefill, tok/s", _switch),
    SettingDoc("top", 5, "candidates INFER shows when neither TOP nor GENERATE is given", _count),
    SettingDoc("lookahead", 4, "draft tokens SPECULATE proposes per round when LOOKAHEAD is not given", _count),
    SettingDoc("shards", 0, "run the layers as this many Ray actors (0: in this process); applies to the bound model",
               _count0),
    SettingDoc("compare", True, "SPECULATE also runs plain greedy decoding to check and time it", _switch),
    SettingDoc("chat", False, "INFER wraps text prompts in the model's chat template (as CHAT does)", _switch),
    SettingDoc("expanded", "off", "tables one field per line: on, off, or auto (when too wide)",
               _choice("on", "off", "auto")),
    SettingDoc("pager", True, "in the shell, page output longer than the screen ($PAGER, else less -SRXF)", _switch),
    # ---- what a statement may do (issue 10): named limits, each refused by name before any work
    SettingDoc("overwrite", False, "writing INTO an existing file replaces it (as OVERWRITE does); off: refused",
               _switch),
    SettingDoc("max_positions", None, "positions a run may use (prompt + generated); model: the context length",
               _positions, _show_positions),
    SettingDoc("max_generate", 4096, "most tokens GENERATE may ask for", _count),
    SettingDoc("max_lookahead", 64, "most tokens LOOKAHEAD may ask the draft to propose per round", _count),
    SettingDoc("max_prompts", 1000, "most prompts a DRAFT LADDER bank may hold", _count),
    SettingDoc("memory_limit", 4 << 30, "refuse a run whose arrays would need more memory (bytes, or e.g. '8 GiB')",
               parse_bytes, show_bytes),
)


def setting(name: str) -> SettingDoc | None:
    for s in SETTINGS:
        if s.name == name:
            return s
    return None
