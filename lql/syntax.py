"""From a parse tree to typed values, by name: what a statement family's grammar rules become.

Every rule of the grammar (the core's in grammar/lql.lark and each family's fragment) has one
function registered here by the rule's name (or its alias): ``@rule`` for the core's, a family's
``fam.rule`` for its own. The function gets a `Children` view of the rule's children after their
own rules ran: keyword tokens are not values but labels, and a value is asked for by the keywords
that introduce it (``c.string("INTO")``, ``c.int("SHARDS")``, ``c.get("INFER")`` for the prompt
after INFER), so an optional clause added to a rule shifts nothing. A clause is a small rule that
returns a `Clause` (name, value, token); ``c.options("INFER")`` gathers a statement's clauses into
fields, each at most once. Literals are decoded and refused here (`literal_string`,
`literal_int`), positioned at their token.

This module knows no statement: it imports the core AST only for the core rules (prompts,
columns, conditions) at the bottom."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lark import Token

from . import ast

# ---- literals -------------------------------------------------------------------------

_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}

#: The longest string literal, in characters between the quotes. A prompt or a path longer than
#: this is refused by the parser before its text is decoded (a megabyte of prompt is already far
#: past any context length; the limit keeps hostile input from costing memory).
MAX_STRING_CHARS = 1 << 20

#: The largest whole number LQL reads (a signed 64-bit integer): every count, depth, layer and
#: token id fits, and nothing downstream can overflow a fixed-width integer.
MAX_INT = 2**63 - 1

_BAD_CHAR = re.compile("[\x00\ud800-\udfff]")
_NUL_HINT = "LQL strings cannot hold NUL (U+0000): no path can, and a prompt should not"


class BuildError(Exception):
    """Raised by a rule function; carries the token it is about (the parser turns it into a
    positioned `LqlSyntaxError`)."""

    def __init__(self, message: str, token: Token | None, hint: str | None = None, offset: int = 0):
        super().__init__(message)
        self.message, self.token, self.hint, self.offset = message, token, hint, offset


def _bad_char(tok: Token, ch: str, offset: int) -> BuildError:
    if ch == "\0":
        return BuildError("a string cannot hold a NUL character", tok, offset=offset, hint=_NUL_HINT)
    return BuildError(f"a string cannot hold a lone surrogate (U+{ord(ch):04X}): it is not a character", tok,
                      offset=offset, hint="write the character itself, or \\U0001F600 for one outside the BMP")


def literal_string(tok: Token) -> str:
    """The text of a string literal, escapes decoded. Refused (positioned): a literal longer than
    MAX_STRING_CHARS, a NUL or a lone surrogate (written as is or as an escape), a \\U escape
    above U+10FFFF, an unknown escape. A \\uD83D\\uDE00 pair of escapes is one character."""
    n = len(tok.value) - 2
    if n > MAX_STRING_CHARS:
        raise BuildError(f"a string of {n:,} characters is longer than LQL reads ({MAX_STRING_CHARS:,})", tok,
                         hint="give a long prompt as token ids, or shorten it; no path is this long")
    body = tok.value[1:-1]
    bad = _BAD_CHAR.search(body)
    if bad is not None:
        raise _bad_char(tok, bad.group(0), bad.start() + 1)
    if "\\" not in body:
        return body
    out: list[str] = []
    i = 0
    while True:
        j = body.find("\\", i)
        if j < 0:
            out.append(body[i:])
            break
        out.append(body[i:j])
        ch, i = _escape(tok, body, j)
        out.append(ch)
    return "".join(out)


def _escape(tok: Token, body: str, i: int) -> tuple[str, int]:
    """The character of the escape at ``body[i]`` (a backslash) and the index after it."""
    esc = body[i + 1]  # the lexer guarantees a character after every backslash
    if esc in _ESCAPES:
        return _ESCAPES[esc], i + 2
    if esc == "0":
        raise BuildError("a string cannot hold a NUL character (\\0)", tok, offset=i + 1, hint=_NUL_HINT)
    if esc not in "uU":
        raise BuildError(
            f"unknown escape \\{esc} in a string", tok, offset=i + 1,
            hint="known escapes are \\n \\t \\r \\\\ \\' \\\" \\uXXXX \\UXXXXXXXX; write \\\\ for a backslash",
        )
    width = 4 if esc == "u" else 8
    digits = body[i + 2 : i + 2 + width]
    if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
        raise BuildError(f"\\{esc} needs {width} hex digits", tok, offset=i + 1,
                         hint=f"write \\{esc}{'0' * (width - 2)}41 for 'A'")
    code = int(digits, 16)
    end = i + 2 + width
    if code > 0x10FFFF:
        raise BuildError(f"\\{esc}{digits} is above U+10FFFF, the last Unicode code point", tok, offset=i + 1,
                         hint="a code point is at most \\U0010FFFF")
    if code == 0:
        raise BuildError(f"a string cannot hold a NUL character (\\{esc}{digits})", tok, offset=i + 1, hint=_NUL_HINT)
    if 0xD800 <= code <= 0xDBFF and body[end : end + 2] == "\\u":
        low = body[end + 2 : end + 6]
        if len(low) == 4 and all(c in "0123456789abcdefABCDEF" for c in low) and 0xDC00 <= int(low, 16) <= 0xDFFF:
            return chr(0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)), end + 6
    if 0xD800 <= code <= 0xDFFF:
        raise BuildError(f"\\{esc}{digits} is a lone surrogate, not a character", tok, offset=i + 1,
                         hint="write a character outside the BMP as \\U0001F600 (or a \\uD83D\\uDE00 pair)")
    return chr(code), end


def quote(text: str) -> str:
    """``text`` as an LQL string literal that reads back as ``text`` (`literal_string`)."""
    body = text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f"'{body}'"


def literal_int(tok: Token) -> int:
    """A whole-number literal, refused (positioned) above MAX_INT; its digits are never handed
    to int() when they are too many (Python refuses over 4,300 digits, in a ValueError)."""
    digits = tok.value.lstrip("0") or "0"
    if len(digits) > len(str(MAX_INT)) or int(digits) > MAX_INT:
        shown = digits if len(digits) <= 24 else f"{digits[:12]}…{digits[-6:]} ({len(digits):,} digits)"
        raise BuildError(f"the number {shown} is too large: LQL reads whole numbers up to {MAX_INT:,}", tok,
                         hint="no count, depth, layer or token id is this large")
    return int(digits)


def literal_float(tok: Token) -> float:
    v = float(tok.value)
    if not math.isfinite(v):
        raise BuildError(f"the number {tok.value[:24]} is too large for a 64-bit float", tok)
    return v


# ---- clauses and the children view ------------------------------------------------------


@dataclass(frozen=True)
class Clause:
    """What a clause rule becomes: the field it sets, its value, the token it starts at (None:
    a "given twice" refusal points at the statement), and how a user writes it (for that
    refusal; default the name in capitals)."""

    name: str
    value: Any
    token: Token | None = None
    word: str | None = None


def _is_keyword(x: Any) -> bool:
    return isinstance(x, Token) and x.type in _KEYWORDS


_KEYWORDS: frozenset[str] = frozenset()  # set by the parser for the grammar it built


def set_keywords(names: frozenset[str]) -> None:
    global _KEYWORDS
    _KEYWORDS = names


class Children:
    """A rule's children, read by name. Keyword tokens label the values after them: each value
    belongs to the run of keywords just before it. Placeholders of absent optional parts (None)
    are no values; `Clause` children are read with `options`."""

    def __init__(self, children: list, meta, pos: Callable[[], dict]):
        self.raw = children
        self.meta = meta
        self._pos = pos
        self.keywords: list[Token] = [x for x in children if _is_keyword(x)]
        self.clauses: list[Clause] = [x for x in children if isinstance(x, Clause)]
        runs: list[tuple[tuple[str, ...], list]] = []
        label: list[str] = []  # the keywords since the last value
        follows = False  # whether the last child was a value (a bare value then joins its run)
        for x in children:
            if _is_keyword(x):
                label.append(x.type)
                follows = False
            elif isinstance(x, Clause):
                label, follows = [], False
            elif x is not None:
                if follows and not label:
                    runs[-1][1].append(x)
                else:
                    runs.append((tuple(label), [x]))
                label, follows = [], True
        self._runs = runs

    # ---- where the rule is
    @property
    def first(self) -> Token | None:
        """The rule's first token (its first keyword, for a clause)."""
        for x in self.raw:
            if isinstance(x, Token):
                return x
        return None

    @property
    def pos(self) -> dict:
        """The statement position fields (line, column, offsets, source) of this rule."""
        return self._pos()

    # ---- values
    def values(self, n: int | None = None) -> list:
        """Every value, in order; with ``n``, exactly that many (a rule whose shape changed is a
        bug, said here rather than shifting its values)."""
        out = [v for _, vs in self._runs for v in vs]
        if n is not None and len(out) != n:
            raise AssertionError(f"rule {getattr(self.meta, 'rule', '?')}: expected {n} values, got {len(out)}")
        return out

    def all(self, *keywords: str) -> list:
        """The values after the run of keywords ending with ``keywords`` (an exact run wins over
        one that only ends with them); [] when absent."""
        exact = [vs for k, vs in self._runs if k == keywords]
        if exact:
            return [v for vs in exact for v in vs]
        ends = [vs for k, vs in self._runs if len(k) >= len(keywords) and k[len(k) - len(keywords):] == keywords]
        if len(ends) > 1:
            raise AssertionError(f"{' '.join(keywords)} labels {len(ends)} places in one rule")
        return list(ends[0]) if ends else []

    def get(self, *keywords: str, exact: bool = False) -> Any:
        """The one value after ``keywords`` (None when absent); with ``exact``, only after exactly
        that run of keywords (INTO, not PLOT INTO)."""
        vs = [v for k, vs in self._runs if k == keywords for v in vs] if exact else self.all(*keywords)
        if len(vs) > 1:
            raise AssertionError(f"{' '.join(keywords)} labels {len(vs)} values")
        return vs[0] if vs else None

    def string(self, *keywords: str, exact: bool = False) -> str | None:
        tok = self.get(*keywords, exact=exact)
        return None if tok is None else literal_string(tok)

    @staticmethod
    def string_of(tok: Token | None) -> str | None:
        """A STRING token's text (None for None)."""
        return None if tok is None else literal_string(tok)

    def int(self, *keywords: str) -> int | None:
        tok = self.get(*keywords)
        return None if tok is None else literal_int(tok)

    # ---- keywords
    def has(self, *names: str) -> bool:
        """Whether one of the keywords ``names`` was written."""
        return any(k.type in names for k in self.keywords)

    def which(self, *names: str) -> str | None:
        """Which of the keywords ``names`` was written, lower-cased (None: none)."""
        for k in self.keywords:
            if k.type in names:
                return k.type.lower()
        return None

    def keyword(self, name: str) -> Token | None:
        for k in self.keywords:
            if k.type == name:
                return k
        return None

    # ---- clauses
    def clause(self, name: str, value: Any, word: str | None = None) -> Clause:
        """A clause of this rule starting at its first token."""
        return Clause(name, value, self.first, word)

    def options(self, statement: str, *, first: Token | None = None) -> dict:
        """The clauses given, name -> value, each at most once: a second one is refused, pointing
        at it (or at ``first``, the statement's first token, for a clause without a token)."""
        fields: dict = {}
        for cl in self.clauses:
            if cl.name in fields:
                word = cl.word or cl.name.upper()
                raise BuildError(f"{word} is given twice in one {statement}", cl.token or first or self.first,
                                 hint=f"keep one {word} clause")
            fields[cl.name] = cl.value
        return fields


# ---- rule functions -----------------------------------------------------------------------

RuleFn = Callable[[Children], Any]

#: rule (or alias) name -> (its function, the family that owns it; "core" for grammar/lql.lark).
RULES: dict[str, tuple[RuleFn, str]] = {}


def register_rule(name: str, fn: RuleFn, owner: str) -> None:
    if name in RULES and RULES[name][0] is not fn:
        raise ValueError(f"grammar rule {name!r} has two functions ({RULES[name][1]} and {owner})")
    RULES[name] = (fn, owner)


def rule(fn: RuleFn) -> RuleFn:
    """Register a core rule's function under its own name."""
    register_rule(fn.__name__, fn, "core")
    return fn


# ---- the core rules (grammar/lql.lark) ------------------------------------------------------


@rule
def text_prompt(c: Children) -> ast.TextPrompt:
    return ast.TextPrompt(text=literal_string(c.values(1)[0]))


@rule
def token_prompt(c: Children) -> ast.TokenPrompt:
    return ast.TokenPrompt(ids=c.get("TOKENS"))


@rule
def int_list(c: Children) -> list[int]:
    return [literal_int(t) for t in c.values()]


@rule
def layer_range(c: Children) -> tuple[int, int]:
    ends = [literal_int(t) for t in c.values()]
    return (ends[0], ends[-1])


@rule
def draft_clause(c: Children) -> Clause:
    # no token: a second DRAFT DEPTH is refused at the statement's first token
    return Clause("depth", c.int("DEPTH"), None, "DRAFT DEPTH")


@rule
def top_clause(c: Children) -> Clause:
    return c.clause("top", c.int("TOP"))


@rule
def generate_clause(c: Children) -> Clause:
    return c.clause("generate", (c.int("GENERATE"), c.has("EXACTLY")))


@rule
def layers_clause(c: Children) -> Clause:
    return c.clause("layers", c.get("LAYERS"))


@rule
def feature_ref(c: Children) -> tuple[int, int]:
    layer, feature = c.values(2)
    return (literal_int(layer), literal_int(feature))


@rule
def ablate_clause(c: Children) -> Clause:
    return c.clause("ablate", tuple(c.values()), "ABLATE FEATURES")


@rule
def overwrite_clause(c: Children) -> Clause:
    return c.clause("overwrite", True)


@rule
def select_all(c: Children) -> None:
    return None


@rule
def select_columns(c: Children) -> list[ast.Column]:
    return c.values()


@rule
def column(c: Children) -> ast.Column:
    tok = c.first
    return ast.Column(name=tok.value.lower(), line=tok.line, column=tok.column)


@rule
def nearest_clause(c: Children) -> Clause:
    # NEAREST TO 'text' [AT LAYER n]: the text, or (text, n) in the reference's order
    text, layer = c.string("NEAREST", "TO"), c.int("AT", "LAYER")
    return c.clause("nearest", text if layer is None else (text, layer))


@rule
def where_clause(c: Children) -> Clause:
    return c.clause("where", c.values())


@rule
def condition(c: Children) -> ast.Condition:
    col, op, value = c.values(3)
    return ast.Condition(column=col, op=op, value=value)


@rule
def in_condition(c: Children) -> ast.Condition:
    col, *values = c.values()
    return ast.Condition(column=col, op="IN", value=values)


@rule
def op_eq(c: Children) -> str:
    return "="


@rule
def op_cmp(c: Children) -> str:
    tok = c.first
    return "!=" if tok.value == "<>" else tok.value


@rule
def op_like(c: Children) -> str:
    return "LIKE"


@rule
def string_literal(c: Children) -> str:
    return literal_string(c.first)


@rule
def int_literal(c: Children) -> int:
    return literal_int(c.first)


@rule
def negative_int_literal(c: Children) -> int:
    return -literal_int(c.first)


@rule
def float_literal(c: Children) -> float:
    return float(c.first.value)


@rule
def negative_float_literal(c: Children) -> float:
    return -float(c.first.value)


@rule
def order_clause(c: Children) -> Clause:
    direction = c.which("ASC", "DESC")
    return c.clause("order", (c.get("ORDER", "BY"), None if direction is None else direction == "desc"))


@rule
def limit_clause(c: Children) -> Clause:
    return c.clause("limit", c.int("LIMIT"))


@rule
def token_text(c: Children) -> str:
    return literal_string(c.first)


@rule
def token_id(c: Children) -> int:
    return literal_int(c.first)


@rule
def on_conflict_clause(c: Children) -> Clause:
    return c.clause("on_conflict", c.get("ON", "CONFLICT").value.lower())


# the reference dialect's clauses, shared by several of its statements
@rule
def layers_all_clause(c: Children) -> Clause:
    return c.clause("layers", None)


@rule
def mode_clause(c: Children) -> Clause:
    return c.clause("mode", c.get("MODE").value.lower())


@rule
def compare_clause(c: Children) -> Clause:
    return c.clause("compare", True)


@rule
def relations_only_clause(c: Children) -> Clause:
    return c.clause("relations_only", True)


@rule
def verbose_clause(c: Children) -> Clause:
    return c.clause("detail", "verbose")


@rule
def brief_clause(c: Children) -> Clause:
    return c.clause("detail", "brief")


@rule
def raw_clause(c: Children) -> Clause:
    return c.clause("detail", "raw")


@rule
def band_clause(c: Children) -> Clause:
    return c.clause("band", c.first.type.lower())


@rule
def at_layer_clause(c: Children) -> Clause:
    return c.clause("at_layer", c.int("AT", "LAYER"))
