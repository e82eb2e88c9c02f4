"""Completion for the REPL, from the grammar.

Two questions kept apart (as pgcli does): *what kind of thing fits at the cursor* — decided
by `context_at`, which asks the LALR parser (Lark's interactive parser, ``accepts()``) what may
come next in the statement under the cursor — and *which candidates exist* for that kind:
keywords (matched by prefix, else fuzzily: ``SHOW opd`` offers OPERANDS), whole numbers where
the grammar takes one (layer numbers after LAYER and RANGE, draft depths 1..L after DEPTH and
in DEPTHS (...), usual TOP / GENERATE / LOOKAHEAD / AT values), file-system paths (inside the
string of OPEN, USE, PLAN, ENCODE ... INTO and the other statements that take a path; a file
closes the quote; SCORE DRAFT skips ``.meta.json`` sidecars), setting names after SET,
statement names after HELP, and meta commands after a backslash.

In SELECT ... FROM FEATURES the column names (and ``*`` after SELECT) are offered where the
grammar takes a column: the select list, WHERE and ORDER BY; layer numbers after LAYERS, AT
LAYER and inside ABLATE FEATURES (...).

Two keyword rules the grammar does not state: LOOKAHEAD is offered only once SPECULATE is in
the INFER, and a clause a statement already has (INFER's TOP, GENERATE, DRAFT, SPECULATE,
LOOKAHEAD, CHAT, ABLATE; WALK's TOP, LAYERS; ...) is not offered again (the parser would refuse
it twice)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from lark.exceptions import LarkError
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document

from . import catalog, parser

#: Keywords after which a string is a file-system path (OPEN 'p', PLAN 'ckpt', ENCODE 'ckpt'
#: INTO 'dir', DUMP LOGITS ... INTO 'f', SCORE DRAFT 'a' AGAINST 'b', DRAFT LADDER ... ON 'f').
PATH_KEYWORDS = frozenset({"OPEN", "USE", "PLAN", "ENCODE", "INTO", "AGAINST", "ON", "DRAFT"})

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")
_NUMBER = re.compile(r"[0-9]+$")

#: INFER's clauses: each may be given once.
INFER_CLAUSES = frozenset({"TOP", "GENERATE", "DRAFT", "SPECULATE", "LOOKAHEAD", "CHAT", "ABLATE"})

#: Statements whose clauses come in any order, each once: the statement's first keyword -> the
#: keyword that begins each clause.
CLAUSES: dict[str, frozenset[str]] = {
    "INFER": INFER_CLAUSES,
    "WALK": frozenset({"TOP", "LAYERS"}),
    "DESCRIBE": frozenset({"TOP", "LAYERS"}),
    "TRACE": frozenset({"DRAFT", "ABLATE", "LAYERS", "POSITIONS", "DECOMPOSE", "SAVE"}),
    "OBSERVE": frozenset({"GENERATE", "LENS", "DRAFT", "ABLATE"}),
    "DUMP": frozenset({"DRAFT", "ABLATE"}),
}

#: Usual values where the grammar takes a count (not a layer or a depth).
USUAL_NUMBERS: dict[str, tuple[int, ...]] = {
    "TOP": (1, 3, 5, 10, 20),
    "GENERATE": (10, 20, 50, 100),
    "LOOKAHEAD": (2, 3, 4, 6, 8),
    "AT": (512, 1024, 2048, 4096, 8192, 32768),
    "LIMIT": (5, 10, 20, 50, 100),
}


@dataclass(frozen=True)
class SettingInfo:
    """What the completer knows about a setting: its name, a line of meaning, and the values
    it takes when they form a small closed set."""

    name: str
    description: str = ""
    choices: tuple[str, ...] = ()


@dataclass
class Context:
    """What fits at the cursor. ``kind`` is one of ``keyword``, ``integer``, ``path``,
    ``setting``, ``setting_value``, ``column``, ``help``, ``meta``, ``meta_path`` or ``none``;
    ``word`` is the text being completed (the part a candidate replaces)."""

    kind: str
    word: str = ""
    keywords: tuple[str, ...] = ()  # for "keyword": the keywords the parser accepts next
    number: str | None = None  # for "integer": what the number is (LAYER, DEPTH, TOP, ...)
    statement: str | None = None  # for "path": the statement's first keyword (SCORE, OPEN...)
    taken: tuple[int, ...] = ()  # for "integer" in DEPTHS (...): depths already listed
    help_words: tuple[str, ...] = ()  # for "help": the topic words already typed; "column": columns listed
    setting: str | None = None  # for "setting_value"
    accepts: frozenset[str] = field(default_factory=frozenset)


def _significant(text: str) -> list:
    return [t for t in parser.lex(text) if t.type not in ("WS", "COMMENT")]


def current_statement(text: str) -> str:
    """The text of the statement the cursor is in: everything after the last ';' that ends a
    statement (a ';' inside a string or comment does not)."""
    cut = 0
    for tok in parser.lex(text):
        if tok.type == "_SEMI":
            cut = tok.start_pos + 1
    return text[cut:]


def _accepts(text: str) -> frozenset[str] | None:
    """Terminals the parser accepts after ``text``, or None when ``text`` is not a prefix of
    any LQL (nothing sensible to offer)."""
    try:
        return frozenset(parser.interactive(text).accepts())
    except LarkError:
        return None


def context_at(text_before_cursor: str) -> Context:
    """Decide what kind of thing fits at the end of ``text_before_cursor``."""
    stripped = text_before_cursor.lstrip()
    if stripped.startswith("\\"):
        m = re.match(r"\\(\S*)(\s+)?(.*)$", stripped, re.DOTALL)
        assert m is not None
        if m.group(2) is None:
            return Context("meta", word=stripped)
        if m.group(1) in ("i", "include"):
            return Context("meta_path", word=m.group(3))
        return Context("none")

    stmt = current_statement(text_before_cursor)
    toks = list(parser.lex(stmt))
    last = toks[-1] if toks else None

    # inside a string that is still open at the cursor
    if (
        last is not None
        and last.type == "ERROR"
        and last.value[:1] in "'\""
        and "\n" not in last.value
    ):
        before = stmt[: last.start_pos]
        acc = _accepts(before)
        prev = _significant(before)
        if acc and "STRING" in acc and prev and prev[-1].type in PATH_KEYWORDS:
            return Context("path", word=last.value[1:], accepts=acc, statement=prev[0].type)
        return Context("none")
    if last is not None and last.type in ("STRING", "COMMENT", "ERROR"):
        return Context("none")  # just after a closed string or inside a comment

    n = _NUMBER.search(stmt)
    if n is not None:
        head = stmt[: n.start()]
        if not head or head[-1].isspace() or head[-1] in "(,-":
            num = _integer_context(head, n.group(0))
            if num is not None:
                return num
    m = _WORD.search(stmt)
    word = m.group(0) if m else ""
    head = stmt[: len(stmt) - len(word)]
    if head and not head[-1].isspace() and head[-1] not in "(,;=-":
        return Context("none")  # '10ab', 'TOP 3|': a keyword here would run into the token
    acc = _accepts(head)
    if acc is None:
        return Context("none", word=word)
    prev = _significant(head)
    prev_kinds = [t.type for t in prev]

    if prev_kinds and prev_kinds[0] == "HELP":
        return Context(
            "help", word=word, help_words=tuple(t.value.upper() for t in prev[1:]), accepts=acc
        )
    if prev_kinds == ["SET"]:
        return Context("setting", word=word, accepts=acc)
    if len(prev_kinds) == 3 and prev_kinds[0] == "SET" and prev_kinds[2] == "_EQ":
        return Context(
            "setting_value",
            word=word,
            setting=prev[1].value.lower(),
            accepts=acc,
            keywords=tuple(sorted(n for n in acc if n in parser.KEYWORDS)),
        )
    if "INT" in acc and not word:
        num = _integer_context(head, "")
        if num is not None and num.number is not None:
            return num
    if "NAME" in acc and prev_kinds and prev_kinds[0] == "SELECT":
        # a column of FEATURES: the select list, WHERE, ORDER BY
        # the columns listed so far (the highlighting lexer reads `layer` as a keyword: take the words)
        listed = () if "FROM" in prev_kinds else tuple(t.value.lower() for t in prev[1:] if t.type != "_COMMA")
        return Context("column", word=word, accepts=acc, keywords=("*",) if "STAR" in acc else (),
                       help_words=listed)
    kws = tuple(sorted(parser.KEYWORDS[n] for n in acc if n in parser.KEYWORDS))
    return Context("keyword", word=word, keywords=keyword_rules(kws, prev_kinds), accepts=acc)


def _clause_list(prev_kinds: Sequence[str]) -> tuple[frozenset[str], list[str]] | None:
    """The clause keywords of the statement being typed and the tokens of its clause list so
    far (EXPLAIN INFER ... FEATURES has its own list after FEATURES)."""
    if not prev_kinds:
        return None
    kinds = list(prev_kinds)
    for i in range(len(kinds) - 1, 0, -1):
        if kinds[i] == "FEATURES" and kinds[i - 1] != "ABLATE" and kinds[0] == "EXPLAIN":
            return frozenset({"TOP", "LAYERS"}), kinds[i + 1:]
    if kinds[0] == "EXPLAIN" and "INFER" in kinds:
        return CLAUSES["INFER"], kinds[kinds.index("INFER") + 1:]
    clauses = CLAUSES.get(kinds[0])
    if clauses is None:
        return None
    return clauses, kinds[1:]


def keyword_rules(keywords: Sequence[str], prev_kinds: Sequence[str]) -> tuple[str, ...]:
    """The grammar's candidates, less what it allows but would be refused or meaningless:
    LOOKAHEAD before SPECULATE, a clause given already."""
    found = _clause_list(prev_kinds)
    if found is None:
        return tuple(keywords)
    clauses, body = found
    used = set(body)
    out = []
    for kw in keywords:
        if kw == "LOOKAHEAD" and "SPECULATE" not in used:
            continue
        if kw in clauses and kw in used:
            continue
        out.append(kw)
    return tuple(out)


def _integer_context(head: str, word: str) -> Context | None:
    """What a whole number at the cursor means, from the token before it."""
    acc = _accepts(head)
    if acc is None or "INT" not in acc:
        return None
    prev = _significant(head)
    if not prev:
        return None
    kinds = [t.type for t in prev]
    last = kinds[-1]
    if last == "DEPTH":
        return Context("integer", word=word, number="DEPTH", accepts=acc)
    if last in ("LAYER", "RANGE", "LAYERS"):
        return Context("integer", word=word, number="LAYER", accepts=acc)
    if last in ("_LPAR", "_COMMA") and len(kinds) >= 2 and "ABLATE" in kinds and kinds[-2:] != ["ABLATE", "FEATURES"] \
            and _in_ablate(kinds):
        return Context("integer", word=word, number="LAYER", accepts=acc)
    if last == "_MINUS" and len(prev) >= 2 and prev[-2].type == "INT":
        return Context("integer", word=word, number="LAYER_END", accepts=acc, taken=(int(prev[-2].value),))
    if last in ("_LPAR", "_COMMA") and "DEPTHS" in kinds:
        listed = tuple(int(t.value) for t in prev[kinds.index("DEPTHS"):] if t.type == "INT")
        return Context("integer", word=word, number="DEPTHS", accepts=acc, taken=listed)
    if last in USUAL_NUMBERS:
        return Context("integer", word=word, number=last, accepts=acc)
    return Context("integer", word=word, number=None, accepts=acc)


def _in_ablate(kinds: Sequence[str]) -> bool:
    """The cursor is inside the parentheses of ABLATE FEATURES (...)."""
    for i in range(len(kinds) - 1, -1, -1):
        if kinds[i] == "_RPAR":
            return False
        if kinds[i] == "ABLATE":
            return True
    return False


def integer_candidates(ctx: Context, layers: int | None) -> list[tuple[int, str]]:
    """(value, meaning) for an integer context; layers and depths need the bound model's
    layer count (``layers``), and are not guessed without it."""
    kind = ctx.number
    if kind in ("DEPTH", "DEPTHS"):
        if not layers:
            return []
        return [(d, "full model" if d == layers else f"layers 0-{d - 1}" if d > 1 else "layer 0")
                for d in range(1, layers + 1) if d not in ctx.taken]
    if kind == "LAYER":
        return [(i, "layer") for i in range(layers)] if layers else []
    if kind == "LAYER_END":
        start = ctx.taken[0] if ctx.taken else 0
        return [(i, "last layer") for i in range(start, layers)] if layers else []
    if kind in USUAL_NUMBERS:
        return [(v, kind.lower()) for v in USUAL_NUMBERS[kind]]
    return []


def fuzzy_matches(word: str, candidates: Iterable[str]) -> list[str]:
    """Candidates that start with ``word``; when none does, those that hold its letters in
    order (``opd`` → OPERANDS), the tightest match first."""
    w = word.upper()
    cands = list(candidates)
    prefix = [c for c in cands if c.startswith(w)]
    if prefix or not w:
        return prefix
    scored = []
    for c in cands:
        pos, first, ok = -1, None, True
        for ch in w:
            pos = c.find(ch, pos + 1)
            if pos < 0:
                ok = False
                break
            first = pos if first is None else first
        if ok:
            scored.append((pos - (first or 0), first or 0, c))
    return [c for _, _, c in sorted(scored)]


def _cased(candidate: str, typed: str) -> str:
    """Keywords follow the case the user started typing in (all lower stays lower)."""
    return candidate.lower() if typed and typed.islower() else candidate


def help_topics() -> list[str]:
    """Statement names HELP has an entry for (see `lql.statements.help.topics`)."""
    from .statements.help import topics

    return topics()


def path_completions(typed: str, *, quote: str | None = None, skip_suffixes: Sequence[str] = (),
                     close: bool = False) -> Iterator[Completion]:
    """Files and directories whose path starts with ``typed`` (``~`` expanded). Directories
    complete with a trailing '/', so that the next Tab goes inside. Hidden entries only when
    the typed name starts with '.'. ``quote``: the quote character of the enclosing string,
    escaped in candidates that contain it, and (with ``close``) written after a file's name
    to close the string. Names ending in one of ``skip_suffixes`` are not offered."""
    expanded = os.path.expanduser(typed)
    directory, prefix = os.path.split(expanded)
    try:
        entries = sorted(os.listdir(directory or "."))
    except OSError:
        return
    for name in entries:
        if not name.startswith(prefix) or (name.startswith(".") and not prefix.startswith(".")):
            continue
        if any(name.endswith(sfx) for sfx in skip_suffixes):
            continue
        full = os.path.join(directory, name)
        is_dir = os.path.isdir(full)
        text = name + ("/" if is_dir else "")
        if quote:
            text = text.replace("\\", "\\\\").replace(quote, "\\" + quote)
            if close and not is_dir:
                text += quote
        yield Completion(
            text,
            start_position=-len(prefix),
            display=text[:-1] if close and quote and text.endswith(quote) and not is_dir else text,
            display_meta="directory" if is_dir else "file",
        )


class LqlCompleter(Completer):
    """The REPL's completer. ``settings`` and ``meta_commands`` are callables so that the
    candidates follow the live session (settings it knows, commands registered)."""

    def __init__(
        self,
        settings: Callable[[], Sequence[SettingInfo]] = lambda: (),
        meta_commands: Callable[[], Iterable[tuple[str, str]]] = lambda: (),
        model_layers: Callable[[], int | None] = lambda: None,
    ):
        self._settings = settings
        self._meta = meta_commands
        self._layers = model_layers

    def get_completions(
        self, document: Document, complete_event: CompleteEvent | None = None
    ) -> Iterator[Completion]:
        try:
            yield from self._completions(document, complete_event)
        except Exception:  # noqa: BLE001 - a completer bug must not take the prompt down
            return

    def _completions(
        self, document: Document, complete_event: CompleteEvent | None
    ) -> Iterator[Completion]:
        ctx = context_at(document.text_before_cursor)
        word = ctx.word
        asked = complete_event is None or complete_event.completion_requested
        if not asked and not word and ctx.kind not in ("path", "meta_path", "meta"):
            return  # while typing, offer words once one is begun; Tab offers everything
        if ctx.kind == "keyword":
            for kw in fuzzy_matches(word, ctx.keywords):
                yield Completion(
                    _cased(kw, word), start_position=-len(word), display_meta="keyword"
                )
        elif ctx.kind == "integer":
            for value, meaning in integer_candidates(ctx, self._layers()):
                if str(value).startswith(word):
                    yield Completion(str(value), start_position=-len(word), display_meta=meaning)
        elif ctx.kind == "path":
            quote = _open_quote(document.text_before_cursor, word)
            skip = (".meta.json",) if ctx.statement == "SCORE" else ()
            yield from path_completions(word, quote=quote, skip_suffixes=skip, close=True)
        elif ctx.kind == "meta_path":
            yield from path_completions(word)
        elif ctx.kind == "column":
            for name in [*ctx.keywords, *catalog.FEATURE_COLUMNS]:
                if name.startswith(word.lower()) and name not in ctx.help_words:  # a column listed already
                    yield Completion(name, start_position=-len(word),
                                     display_meta=catalog.FEATURE_COLUMN_MEANINGS.get(name, "every column"))
        elif ctx.kind == "setting":
            for s in self._settings():
                if s.name.lower().startswith(word.lower()):
                    yield Completion(
                        s.name, start_position=-len(word), display_meta=s.description or "setting"
                    )
        elif ctx.kind == "setting_value":
            info = {s.name.lower(): s for s in self._settings()}.get(ctx.setting or "")
            choices = info.choices if info else ()
            for c in choices:
                if c.lower().startswith(word.lower()):
                    yield Completion(c, start_position=-len(word), display_meta="value")
        elif ctx.kind == "help":
            yield from _help_completions(ctx.help_words, word)
        elif ctx.kind == "meta":
            for name, help_line in self._meta():
                if name.startswith(word):
                    yield Completion(name, start_position=-len(word), display_meta=help_line)


def _open_quote(text_before_cursor: str, body: str) -> str | None:
    pos = len(text_before_cursor) - len(body) - 1
    return text_before_cursor[pos] if pos >= 0 and text_before_cursor[pos] in "'\"" else None


def _help_completions(typed_words: Sequence[str], word: str) -> Iterator[Completion]:
    """After HELP: whole statement names; after HELP SHOW: the words that finish one."""
    seen: set[str] = set()
    n = len(typed_words)
    for topic in help_topics():
        parts = topic.split()
        if len(parts) <= n or [p.upper() for p in parts[:n]] != list(typed_words):
            continue
        rest = " ".join(parts[n:])
        if rest.startswith(word.upper()) and rest not in seen:
            seen.add(rest)
            yield Completion(
                _cased(rest, word), start_position=-len(word), display_meta="statement"
            )
