"""Completion for the REPL, from the grammar.

Two questions kept apart (as pgcli does): *what kind of thing fits at the cursor* — decided
by `context_at`, which asks the LALR parser (Lark's interactive parser, ``accepts()``) what may
come next in the statement under the cursor — and *which candidates exist* for that kind:
keywords, file-system paths (inside the string of OPEN, USE, PLAN, ENCODE ... INTO and the
other statements that take a path), setting names after SET, statement names after HELP, and
meta commands after a backslash."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from lark.exceptions import LarkError
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document

from . import ast, catalog, parser

#: Keywords after which a string is a file-system path (OPEN 'p', PLAN 'ckpt', ENCODE 'ckpt'
#: INTO 'dir', DUMP LOGITS ... INTO 'f', SCORE DRAFT 'a' AGAINST 'b', DRAFT LADDER ... ON 'f').
PATH_KEYWORDS = frozenset({"OPEN", "USE", "PLAN", "ENCODE", "INTO", "AGAINST", "ON", "DRAFT"})

_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class SettingInfo:
    """What the completer knows about a setting: its name, a line of meaning, and the values
    it takes when they form a small closed set."""

    name: str
    description: str = ""
    choices: tuple[str, ...] = ()


@dataclass
class Context:
    """What fits at the cursor. ``kind`` is one of ``keyword``, ``path``, ``setting``,
    ``setting_value``, ``help``, ``meta``, ``meta_path`` or ``none``; ``word`` is the text
    being completed (the part a candidate replaces)."""

    kind: str
    word: str = ""
    keywords: tuple[str, ...] = ()  # for "keyword": the keywords the parser accepts next
    help_words: tuple[str, ...] = ()  # for "help": the topic words already typed
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
            return Context("path", word=last.value[1:], accepts=acc)
        return Context("none")
    if last is not None and last.type in ("STRING", "COMMENT", "ERROR"):
        return Context("none")  # just after a closed string or inside a comment

    m = _WORD.search(stmt)
    word = m.group(0) if m else ""
    head = stmt[: len(stmt) - len(word)]
    if head and not head[-1].isspace() and head[-1] not in "(,;=":
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
    kws = tuple(sorted(parser.KEYWORDS[n] for n in acc if n in parser.KEYWORDS))
    return Context("keyword", word=word, keywords=kws, accepts=acc)


def _cased(candidate: str, typed: str) -> str:
    """Keywords follow the case the user started typing in (all lower stays lower)."""
    return candidate.lower() if typed and typed.islower() else candidate


def help_topics() -> list[str]:
    """Statement names HELP has an entry for: the catalogue's (``SHOW LAYERS``, ``DRAFT
    DEPTH``...) and every statement's own name that HELP resolves (``USE``, ``DRAFT OFF``)."""
    names = {d.name for d in catalog.STATEMENTS}
    names |= {cls.keyword for cls in ast.STATEMENT_CLASSES if cls.keyword}
    names.add("USE")
    return sorted(n for n in names if catalog.find_statement(n) is not None)


def path_completions(typed: str, *, quote: str | None = None) -> Iterator[Completion]:
    """Files and directories whose path starts with ``typed`` (``~`` expanded). Directories
    complete with a trailing '/', so that the next Tab goes inside. Hidden entries only when
    the typed name starts with '.'. ``quote``: the quote character of the enclosing string,
    escaped in candidates that contain it."""
    expanded = os.path.expanduser(typed)
    directory, prefix = os.path.split(expanded)
    try:
        entries = sorted(os.listdir(directory or "."))
    except OSError:
        return
    for name in entries:
        if not name.startswith(prefix) or (name.startswith(".") and not prefix.startswith(".")):
            continue
        full = os.path.join(directory, name)
        is_dir = os.path.isdir(full)
        text = name + ("/" if is_dir else "")
        if quote:
            text = text.replace("\\", "\\\\").replace(quote, "\\" + quote)
        yield Completion(
            text,
            start_position=-len(prefix),
            display=text,
            display_meta="directory" if is_dir else "file",
        )


class LqlCompleter(Completer):
    """The REPL's completer. ``settings`` and ``meta_commands`` are callables so that the
    candidates follow the live session (settings it knows, commands registered)."""

    def __init__(
        self,
        settings: Callable[[], Sequence[SettingInfo]] = lambda: (),
        meta_commands: Callable[[], Iterable[tuple[str, str]]] = lambda: (),
    ):
        self._settings = settings
        self._meta = meta_commands

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
            for kw in ctx.keywords:
                if kw.startswith(word.upper()):
                    yield Completion(
                        _cased(kw, word), start_position=-len(word), display_meta="keyword"
                    )
        elif ctx.kind == "path":
            quote = _open_quote(document.text_before_cursor, word)
            yield from path_completions(word, quote=quote)
        elif ctx.kind == "meta_path":
            yield from path_completions(word)
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
