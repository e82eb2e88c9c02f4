"""Syntax highlighting for the REPL, driven by the grammar's own lexer (`lql.parser.lex`):
what is coloured as a keyword is exactly what the parser will read as one.

Token classes: keywords, strings, numbers, comments, punctuation, names, lexer errors (text no
terminal matches, e.g. an unclosed string) and the token where a finished statement stops
being LQL. A line that is a meta command (``\\timing``) is coloured as one."""

from __future__ import annotations

from collections.abc import Callable

from lark.exceptions import UnexpectedInput, UnexpectedToken
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import StyleAndTextTuples
from prompt_toolkit.lexers import Lexer
from prompt_toolkit.styles import Style

from . import parser

#: The REPL's colours. Class names are ``lql.<kind>``; tests and users' styles key on them.
STYLE = Style.from_dict(
    {
        "lql.keyword": "bold ansiblue",
        "lql.string": "ansigreen",
        "lql.number": "ansicyan",
        "lql.comment": "italic ansibrightblack",
        "lql.punct": "",
        "lql.name": "",
        "lql.error": "bg:ansired ansiwhite",
        "lql.meta": "ansimagenta",
        "prompt": "bold",
        "prompt.continuation": "ansibrightblack",
        "bottom-toolbar": "noreverse bg:ansibrightblack ansiwhite",
        "bottom-toolbar.model": "bold",
        "bottom-toolbar.off": "italic",
        "error": "ansired",
        "error.caret": "bold ansired",
        "warning": "ansiyellow",
        "info": "ansibrightblack",
        "generated": "ansigreen",
    }
)

_PUNCT = {"_SEMI", "_LPAR", "_RPAR", "_COMMA", "_EQ", "_MINUS"}


def token_class(kind: str) -> str:
    """The style class of a token type from `lql.parser.lex`."""
    if kind in parser.KEYWORDS:
        return "class:lql.keyword"
    if kind == "STRING":
        return "class:lql.string"
    if kind in ("INT", "FLOAT"):
        return "class:lql.number"
    if kind == "COMMENT":
        return "class:lql.comment"
    if kind == "ERROR":
        return "class:lql.error"
    if kind in _PUNCT:
        return "class:lql.punct"
    if kind == "NAME":
        return "class:lql.name"
    return ""


def is_meta(text: str) -> bool:
    """A meta command: a backslash command, or a bare ``exit``/``quit`` (optionally with ';')."""
    s = text.strip()
    return s.startswith("\\") or s.rstrip(";").strip().lower() in ("exit", "quit")


def _parse_error_span(text: str) -> tuple[int, int] | None:
    """The characters of the token where ``text`` stops being LQL, unless the trouble is only
    that the text is unfinished (an unfinished statement is not an error while typing)."""
    try:
        parser.LARK.parse(text)
    except UnexpectedToken as e:
        tok = e.token
        if tok.type == "$END" or tok.start_pos is None:
            return None
        end = tok.start_pos + len(tok.value)
        if end == len(text) and tok.type == "NAME":
            return None  # a word still being typed: 'OPE' is not yet an error
        return tok.start_pos, end
    except UnexpectedInput:
        return None  # characters no terminal matches: the lexer already marks them
    return None


def highlight(text: str) -> list[tuple[str, str]]:
    """``text`` as (style, fragment) pairs covering every character, in order."""
    if is_meta(text):
        return [("class:lql.meta", text)] if text else []
    out: list[tuple[str, str]] = []
    bad = _parse_error_span(text)
    for tok in parser.lex(text):
        style = token_class(tok.type)
        start = tok.start_pos
        end = start + len(tok.value)
        if (
            bad is not None
            and start < bad[1]
            and end > bad[0]
            and tok.type not in ("WS", "COMMENT")
        ):
            style = "class:lql.error"
        elif tok.type == "ERROR" and tok.value[:1] in "'\"" and end == len(text):
            style = "class:lql.string"  # a string still being typed, not yet an unclosed one
        out.append((style, tok.value))
    return out


def _split_lines(fragments: list[tuple[str, str]]) -> list[StyleAndTextTuples]:
    lines: list[StyleAndTextTuples] = [[]]
    for style, frag in fragments:
        parts = frag.split("\n")
        for i, part in enumerate(parts):
            if i:
                lines.append([])
            if part:
                lines[-1].append((style, part))
    return lines


class LqlLexer(Lexer):
    """prompt_toolkit lexer over the whole buffer (a statement may span lines, and a string's
    or comment's meaning depends on what came before)."""

    def lex_document(self, document: Document) -> Callable[[int], StyleAndTextTuples]:
        try:
            fragments = highlight(document.text)
        except Exception:  # noqa: BLE001 - colour is a courtesy: never let it break typing
            fragments = [("", document.text)]
        lines = _split_lines(fragments)

        def get_line(lineno: int) -> StyleAndTextTuples:
            return lines[lineno] if 0 <= lineno < len(lines) else []

        return get_line
