"""The statement catalogue and the settings: one table each, so that HELP, the docs test and
the REPL's completion all read the same source and cannot drift from each other."""

from __future__ import annotations

import difflib
import math
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
    StatementDoc("STATS", "STATS ['path'] [AT n POSITIONS]",
                 "the container's facts: layers, operator mix, objects, continuation state in bytes",
                 "STATS AT 4096 POSITIONS;"),
    StatementDoc("EXPLAIN", "EXPLAIN [DRAFT DEPTH n] | EXPLAIN INFER ... | EXPLAIN INFER ... FEATURES [TOP n] [LAYERS a-b]",
                 "the plan without running a token (of the very INFER given): ops, operands, state, bytes read; "
                 "... FEATURES: the FFN features most active in the run",
                 "EXPLAIN DRAFT DEPTH 2;"),
    StatementDoc("SHOW LAYERS", "SHOW LAYERS [[RANGE] a-b]", "the per-layer policy and continuation geometry",
                 "SHOW LAYERS RANGE 0-1;"),
    StatementDoc("SHOW COMPONENTS", "SHOW COMPONENTS", "the graph's components and their roles", "SHOW COMPONENTS;"),
    StatementDoc("SHOW REPRESENTATIONS", "SHOW REPRESENTATIONS ['filter']",
                 "physical representations: segment files, tensor counts, bytes, hashes",
                 "SHOW REPRESENTATIONS 'embedding';"),
    StatementDoc("SHOW PROVENANCE", "SHOW PROVENANCE", "where the container came from", "SHOW PROVENANCE;"),
    StatementDoc("SHOW OPERANDS", "SHOW OPERANDS [LAYER n]", "the tensors each op reads, with dtype, shape and bytes",
                 "SHOW OPERANDS LAYER 0;"),
    StatementDoc("SHOW EXPERTS", "SHOW EXPERTS [AT LAYER n]",
                 "each routed layer's expert bank: experts, top k, router, bytes per expert, always-read bytes",
                 "SHOW EXPERTS AT LAYER 0;"),
    StatementDoc("SHOW SETTINGS", "SHOW SETTINGS", "the session's settings", "SHOW SETTINGS;"),
    StatementDoc("INFER", "INFER 'prompt' | TOKENS (ids) [TOP n] [GENERATE n [EXACTLY]] [DRAFT DEPTH n] "
                 "[SPECULATE DEPTH d [LOOKAHEAD k]] [CHAT] [ABLATE FEATURES (L:f, ...)]",
                 "next-token distribution (TOP), greedy continuation (GENERATE), self-speculative decoding",
                 "INFER 'The capital of France is' TOP 3;"),
    StatementDoc("TRACE", "TRACE 'prompt' | TOKENS (ids) [DRAFT DEPTH n] [EXPERTS [AT LAYER n]] "
                 "[ABLATE FEATURES (L:f, ...)] | "
                 "TRACE 'prompt' FOR 'token' [LAYERS a-b] [POSITIONS LAST | ALL] [DECOMPOSE] [SAVE [INTO] 'trace.npz'] "
                 "[DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)]",
                 "which layers ran at each position, and the next token there; with EXPERTS, each routed "
                 "layer's experts and their weights; FOR 'token': the token's rank per layer (logit lens), "
                 "DECOMPOSE: its logit split exactly over every write",
                 "TRACE 'The capital of France is' FOR ' Paris' DECOMPOSE;"),
    StatementDoc("DRAFT DEPTH", "DRAFT DEPTH n | DRAFT OFF",
                 "set (or clear) the session's default draft depth for INFER, TRACE, EXPLAIN, DUMP LOGITS",
                 "DRAFT DEPTH 2;"),
    StatementDoc("DRAFT LADDER", "DRAFT LADDER DEPTHS (d, ...) ON 'prompts.jsonl' [INTO 'ladder.json'] "
                 "[PLOT INTO 'ladder.png']",
                 "score each draft depth against the full model over a prompt bank",
                 "DRAFT LADDER DEPTHS (1, 2, 4) ON 'prompts.jsonl';"),
    StatementDoc("DUMP LOGITS", "DUMP LOGITS 'prompt' | TOKENS (ids) [DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)] "
                 "INTO 'file.f32'",
                 "write raw float32 logits [positions, vocab] and a provenance sidecar",
                 "DUMP LOGITS 'Hello' DRAFT DEPTH 2 INTO 'draft.f32';"),
    StatementDoc("SCORE DRAFT", "SCORE DRAFT 'draft.f32' AGAINST 'target.f32'",
                 "compare a draft's logit dump with the full model's: KL, top-1, ranks",
                 "SCORE DRAFT 'draft.f32' AGAINST 'full.f32';"),
    StatementDoc("WALK", "[EXPLAIN] WALK 'text' | TOKENS (ids) [TOP n] [LAYERS a-b | ALL] [MODE pure] [VERBOSE]",
                 "per FFN layer, the features whose gates answer the last token's embedding, and what they write",
                 "WALK 'The capital of France is' TOP 3;"),
    StatementDoc("DESCRIBE", "DESCRIBE 'entity' [LAYERS a-b | AT LAYER n | ALL LAYERS | SYNTAX | KNOWLEDGE | OUTPUT] [TOP n] "
                 "[VERBOSE | BRIEF | RAW]",
                 "edges entity -> token through the features the entity's embedding opens (SET threshold)",
                 "DESCRIBE 'France';"),
    StatementDoc("SELECT", "SELECT layer, feature, token, score | * FROM FEATURES [AT LAYER n | LAYERS a-b] "
                 "[NEAREST TO 'text' [AT LAYER n]] [WHERE column op value [AND ...]] [ORDER BY column [ASC | DESC]] [LIMIT n]",
                 "query the FFN features as a table (op: =, !=, <, <=, >, >=, IN (v, ...), and LIKE for token)",
                 "SELECT layer, feature, token, score FROM FEATURES NEAREST TO 'Paris' LIMIT 5;"),
    StatementDoc("SHOW FEATURES", "SHOW FEATURES [AT LAYER] n [WHERE ...] [LIMIT n]",
                 "a layer's features in order, each with the top tokens its down column writes",
                 "SHOW FEATURES AT LAYER 0 LIMIT 5;"),
    StatementDoc("BUILD FEATURES", "BUILD FEATURES [LAYERS a-b]",
                 "build (or check) the feature metadata now: the tokens each FFN feature writes, kept as derived data",
                 "BUILD FEATURES;"),
    StatementDoc("OBSERVE", "OBSERVE 'prompt' | TOKENS (ids) [GENERATE n] [LENS ('token', ...)] [DRAFT DEPTH n] "
                 "[ABLATE FEATURES (L:f, ...)] RECORD INTO 'run.jsonl'",
                 "a JSON-lines record of every write and token of a run, with a receipt (vindex3 record verify)",
                 "OBSERVE 'Hello' GENERATE 4 RECORD INTO 'run.jsonl';"),
    StatementDoc("VERIFY", "VERIFY", "re-hash every file of the bound container against its index", "VERIFY;"),
    StatementDoc("PLAN", "PLAN 'checkpoint'", "admission: would this checkpoint encode, and what was judged",
                 "PLAN 'path/to/hf-checkpoint';"),
    StatementDoc("ENCODE", "ENCODE 'checkpoint' INTO 'dir'", "encode an HF directory or .gguf into a container",
                 "ENCODE 'path/to/hf-checkpoint' INTO 'model.vindex3';"),
    StatementDoc("REPRESENT", "REPRESENT INTO 'dir' ENCODING 'bf16' | 'f16' | 'int8' | 'q4' | 'f32'",
                 "write the bound container in another weight encoding: same graph and objects, new segments, "
                 "fidelity per tensor in provenance",
                 "REPRESENT INTO 'model-int8.vindex3' ENCODING 'int8';"),
    StatementDoc("SCORE REPRESENTATION", "SCORE REPRESENTATION 'candidate' AGAINST 'reference' ON 'prompts.jsonl' [GREEDY n]",
                 "a representation's behaviour against the same model: KL p50/p95, top-1, greedy-n agreement; "
                 "stored in the candidate's provenance",
                 "SCORE REPRESENTATION 'model-int8.vindex3' AGAINST 'model.vindex3' ON 'prompts.jsonl';"),
    StatementDoc("COMPACT", "COMPACT INTO 'dir'",
                 "copy the bound container's referenced files byte for byte; list every file left behind",
                 "COMPACT INTO 'clean.vindex3';"),
    StatementDoc("DIFF", "DIFF 'a' 'b' | DIFF 'b' [LAYER n] [LIMIT n] [PHYSICAL]",
                 "how two containers differ: logically (graph, objects, operators), physically (encodings, "
                 "segments), in metadata; DIFF 'b' compares the bound container with b",
                 "DIFF 'model.vindex3' 'model-int8.vindex3';"),
    # the reference dialect (issue 19): its own spellings, and the knowledge edits refused by name
    StatementDoc("USE MODEL", "USE MODEL 'checkpoint dir' [AUTO_EXTRACT]",
                 "encode a local checkpoint into a container beside it (once) and bind it; a model hub id is "
                 "refused by name: nothing is downloaded",
                 "USE MODEL 'path/to/hf-checkpoint';"),
    StatementDoc("EXTRACT", "EXTRACT MODEL 'checkpoint' INTO 'dir' [WITH INFERENCE | ALL | WEIGHTS] [FORMAT vindex3]",
                 "ENCODE by the reference dialect's name; COMPONENTS and LAYERS, which narrow what is carried, are "
                 "refused by name",
                 "EXTRACT MODEL 'path/to/hf-checkpoint' INTO 'model.vindex3';"),
    StatementDoc("COMPILE", "COMPILE CURRENT | 'path' INTO VINDEX 'dir' [ON CONFLICT name]",
                 "write the container again with its patch overlay folded in; with no patch overlay in this build, "
                 "a verified copy that keeps every index field; COMPILE ... INTO MODEL is refused by name",
                 "COMPILE CURRENT INTO VINDEX 'copy.vindex3';"),
    StatementDoc("SHOW MODELS", "SHOW MODELS", "the containers in the current directory", "SHOW MODELS;"),
    StatementDoc("SHOW PATCHES", "SHOW PATCHES",
                 "the patch overlay's patches: none, this build has no patch overlay", "SHOW PATCHES;"),
    StatementDoc("SHOW COMPACT STATUS", "SHOW COMPACT STATUS",
                 "edits waiting to be compacted: none, this build has no patch overlay", "SHOW COMPACT STATUS;"),
    StatementDoc("SHOW ENTITIES", "SHOW ENTITIES [n | AT LAYER n] [LIMIT n]",
                 "refused: the reference system's knowledge-graph entities; this build keeps FFN features "
                 "(SHOW FEATURES n, DESCRIBE)", "SHOW FEATURES 0 LIMIT 5;"),
    StatementDoc("SHOW RELATIONS", "SHOW RELATIONS [AT LAYER n] [WITH EXAMPLES] [VERBOSE | BRIEF | RAW]",
                 "refused: this build's feature metadata carries no relation labels", "DESCRIBE 'France';"),
    StatementDoc("INSERT", "INSERT INTO EDGES (columns) VALUES (values) [AT LAYER n] [CONFIDENCE x] [ALPHA x] "
                 "[MODE KNN | COMPOSE]",
                 "refused: INSERT edits knowledge through a patch overlay, which this build does not have yet",
                 "SHOW PATCHES;"),
    StatementDoc("DELETE", "DELETE FROM EDGES WHERE ...",
                 "refused: DELETE edits knowledge through a patch overlay, which this build does not have yet",
                 "SHOW PATCHES;"),
    StatementDoc("UPDATE", "UPDATE EDGES SET column = value, ... WHERE ...",
                 "refused: UPDATE edits knowledge through a patch overlay, which this build does not have yet",
                 "SHOW PATCHES;"),
    StatementDoc("MERGE", "MERGE 'source' [INTO 'target'] [ON CONFLICT name]",
                 "refused: MERGE merges another set of edits through a patch overlay, which this build does not "
                 "have yet", "SHOW PATCHES;"),
    StatementDoc("BEGIN PATCH", "BEGIN PATCH 'file' | SAVE PATCH | APPLY PATCH 'file' | REMOVE PATCH 'file'",
                 "refused: patches are a patch overlay, which this build does not have yet", "SHOW PATCHES;"),
    StatementDoc("REBALANCE", "REBALANCE [options]",
                 "refused: REBALANCE rebalances the edits held in a patch overlay, which this build does not have yet",
                 "SHOW PATCHES;"),
    StatementDoc("COMPACT MINOR", "COMPACT MINOR | MAJOR [options]",
                 "refused: COMPACT MINOR | MAJOR fold a patch overlay's edits into the base model, which this build "
                 "does not have yet (COMPACT INTO 'dir' is this build's COMPACT)", "SHOW COMPACT STATUS;"),
    StatementDoc("SET", "SET name = value", "change a setting (see SHOW SETTINGS)", "SET timing = off;"),
    StatementDoc("HELP", "HELP [statement]", "this help, or one statement's", "HELP INFER;"),
)

_ALIASES = {"USE": "OPEN", "DRAFT": "DRAFT DEPTH", "DRAFT OFF": "DRAFT DEPTH", "SHOW": None,
            "SPECULATE": "INFER", "GENERATE": "INFER", "DUMP": "DUMP LOGITS", "SCORE": "SCORE DRAFT",
            "CHAT": "INFER", "EXACTLY": "INFER", "PLOT": "DRAFT LADDER", "ABLATE": "INFER",
            "EXPERTS": "SHOW EXPERTS",
            "ABLATE FEATURES": "INFER", "BUILD": "BUILD FEATURES", "FEATURES": "SHOW FEATURES",
            "SELECT FROM FEATURES": "SELECT", "DECOMPOSE": "TRACE", "TRACE FOR": "TRACE",
            "SAVE PATCH": "BEGIN PATCH", "APPLY PATCH": "BEGIN PATCH", "REMOVE PATCH": "BEGIN PATCH",
            "PATCH": "BEGIN PATCH", "COMPACT MAJOR": "COMPACT MINOR", "SELECT FROM EDGES": "SELECT",
            "SELECT FROM ENTITIES": "SELECT", "EXPLAIN WALK": "WALK", "MODELS": "SHOW MODELS",
            "SETTINGS": "SET", "OVERWRITE": "SET", "LIMITS": "SET"}


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
    SettingDoc("threshold", 3.0, "DESCRIBE keeps features whose gate score exceeds this (3: a SiLU gate 95% open)",
               _number),
    SettingDoc("stale", "rebuild", "feature metadata built from another state of the container: rebuild it, or refuse",
               _choice("rebuild", "refuse")),
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


def setting(name: str) -> SettingDoc | None:
    for s in SETTINGS:
        if s.name == name:
            return s
    return None
