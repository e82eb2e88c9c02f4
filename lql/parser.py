"""Text → typed statements. One Lark instance (LALR, contextual lexer, positions kept), one
Transformer, and the translation of Lark's exceptions into `LqlSyntaxError`s that read well.

Reachable from here for the REPL: ``LARK`` (the Lark instance), ``interactive(text)`` (Lark's
interactive parser fed with ``text``, whose ``accepts()`` names the terminals that may come
next), ``lex(text)`` (a tolerant token stream for highlighting), ``KEYWORDS`` (terminal name →
keyword) and ``describe_terminal`` (terminal name → words)."""

from __future__ import annotations

import difflib
import importlib.resources
import math
import re
from collections.abc import Iterator
from pathlib import Path

from lark import Lark, Token, Transformer, v_args
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)

from . import ast
from .errors import LqlSyntaxError


def grammar_text() -> str:
    """The grammar source. Installed, it ships as package ``lql.grammar``; in a source tree it
    is read from ``grammar/`` beside ``lql/``."""
    try:
        return (importlib.resources.files("lql.grammar") / "lql.lark").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parent.parent / "grammar" / "lql.lark").read_text(encoding="utf-8")


LARK = Lark(
    grammar_text(),
    parser="lalr",
    lexer="contextual",
    propagate_positions=True,
    maybe_placeholders=True,
)

#: Terminal name → the keyword as users write it (upper case), for every keyword terminal.
KEYWORDS: dict[str, str] = {
    t.name: t.name
    for t in LARK.terminals
    if t.pattern.type == "re" and t.pattern.value.endswith(r"\b") and t.name.isupper() and not t.name.startswith("_")
}

#: Keywords that begin a statement (what the parser accepts at the start of a script).
STATEMENT_KEYWORDS: tuple[str, ...] = tuple(
    sorted(n for n in LARK.parse_interactive("").accepts() if n in KEYWORDS)
)

_WORDS = {
    "STRING": "a quoted string",
    "INT": "a whole number",
    "FLOAT": "a number",
    "NAME": "a name",
    "_SEMI": "';'",
    "_PIPE": "'|>'",
    "_LPAR": "'('",
    "_RPAR": "')'",
    "_COMMA": "','",
    "_EQ": "'='",
    "_MINUS": "'-'",
    "_COLON": "':'",
    "STAR": "'*'",
    "CMP": "a comparison (!=, <, <=, >, >=)",
    "$END": "end of input",
}


def describe_terminal(name: str) -> str:
    """A terminal in words: ``STRING`` → 'a quoted string', ``OPEN`` → 'OPEN'."""
    if name in KEYWORDS:
        return KEYWORDS[name]
    return _WORDS.get(name, name)


def interactive(text: str = ""):
    """Lark's interactive parser after feeding ``text`` (lexing errors propagate as Lark's
    own exceptions). ``.accepts()`` gives the terminal names allowed next."""
    ip = LARK.parse_interactive(text)
    ip.exhaust_lexer()
    return ip


def _tolerant_lexer():
    """The grammar's basic lexer that keeps comments and whitespace, built once (Lark builds a
    new one, compiling every terminal, on each ``Lark.lex(..., dont_ignore=True)`` call)."""
    global _TOLERANT
    if _TOLERANT is None:
        _TOLERANT = LARK._build_lexer(dont_ignore=True)
    return _TOLERANT


_TOLERANT = None


def lex(text: str) -> Iterator[Token]:
    """Every token of ``text``, comments and whitespace included, never raising: characters
    no terminal matches come out as ``ERROR`` tokens (an unterminated string runs to the end
    of its line). For syntax highlighting and for cutting text into statements. Linear in the
    text however many characters are in error: the lexer resumes where it stopped."""
    from lark.lexer import LexerState

    lexer = _tolerant_lexer()
    state = LexerState(_text_slice(text))
    while True:
        try:
            yield from lexer.lex(state, None)
            return
        except UnexpectedCharacters as e:
            start = e.pos_in_stream
            if text[start] in "'\"":
                stop = text.find("\n", start)
                stop = len(text) if stop < 0 else stop
            else:
                stop = start + 1
            line, col = state.line_ctr.line, state.line_ctr.column
            yield Token("ERROR", text[start:stop], start_pos=start, line=line, column=col)
            state.line_ctr.feed(text[start:stop])


def _text_slice(text: str):
    try:
        from lark.utils import TextSlice
    except ImportError:  # lark before 1.2.2 lexes plain strings
        return text
    return TextSlice(text, 0, len(text))


def _line_col(text: str, pos: int) -> tuple[int, int]:
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


# ---- tree → AST -----------------------------------------------------------------------

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


class _BuildError(Exception):
    """Raised inside the transformer; carries the token it is about."""

    def __init__(self, message: str, token: Token, hint: str | None = None, offset: int = 0):
        super().__init__(message)
        self.message, self.token, self.hint, self.offset = message, token, hint, offset


def _bad_char(tok: Token, ch: str, offset: int) -> _BuildError:
    if ch == "\0":
        return _BuildError("a string cannot hold a NUL character", tok, offset=offset, hint=_NUL_HINT)
    return _BuildError(f"a string cannot hold a lone surrogate (U+{ord(ch):04X}): it is not a character", tok,
                       offset=offset, hint="write the character itself, or \\U0001F600 for one outside the BMP")


def _unquote(tok: Token) -> str:
    """The text of a string literal, escapes decoded. Refused (positioned): a literal longer than
    MAX_STRING_CHARS, a NUL or a lone surrogate (written as is or as an escape), a \\U escape
    above U+10FFFF, an unknown escape. A \\uD83D\\uDE00 pair of escapes is one character."""
    n = len(tok.value) - 2
    if n > MAX_STRING_CHARS:
        raise _BuildError(f"a string of {n:,} characters is longer than LQL reads ({MAX_STRING_CHARS:,})", tok,
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
        raise _BuildError("a string cannot hold a NUL character (\\0)", tok, offset=i + 1, hint=_NUL_HINT)
    if esc not in "uU":
        raise _BuildError(
            f"unknown escape \\{esc} in a string", tok, offset=i + 1,
            hint="known escapes are \\n \\t \\r \\\\ \\' \\\" \\uXXXX \\UXXXXXXXX; write \\\\ for a backslash",
        )
    width = 4 if esc == "u" else 8
    digits = body[i + 2 : i + 2 + width]
    if len(digits) != width or not all(c in "0123456789abcdefABCDEF" for c in digits):
        raise _BuildError(f"\\{esc} needs {width} hex digits", tok, offset=i + 1,
                          hint=f"write \\{esc}{'0' * (width - 2)}41 for 'A'")
    code = int(digits, 16)
    end = i + 2 + width
    if code > 0x10FFFF:
        raise _BuildError(f"\\{esc}{digits} is above U+10FFFF, the last Unicode code point", tok, offset=i + 1,
                          hint="a code point is at most \\U0010FFFF")
    if code == 0:
        raise _BuildError(f"a string cannot hold a NUL character (\\{esc}{digits})", tok, offset=i + 1, hint=_NUL_HINT)
    if 0xD800 <= code <= 0xDBFF and body[end : end + 2] == "\\u":
        low = body[end + 2 : end + 6]
        if len(low) == 4 and all(c in "0123456789abcdefABCDEF" for c in low) and 0xDC00 <= int(low, 16) <= 0xDFFF:
            return chr(0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)), end + 6
    if 0xD800 <= code <= 0xDFFF:
        raise _BuildError(f"\\{esc}{digits} is a lone surrogate, not a character", tok, offset=i + 1,
                          hint="write a character outside the BMP as \\U0001F600 (or a \\uD83D\\uDE00 pair)")
    return chr(code), end


def _int(tok: Token) -> int:
    """A whole-number literal, refused (positioned) above MAX_INT; its digits are never handed
    to int() when they are too many (Python refuses over 4,300 digits, in a ValueError)."""
    digits = tok.value.lstrip("0") or "0"
    if len(digits) > len(str(MAX_INT)) or int(digits) > MAX_INT:
        shown = digits if len(digits) <= 24 else f"{digits[:12]}…{digits[-6:]} ({len(digits):,} digits)"
        raise _BuildError(f"the number {shown} is too large: LQL reads whole numbers up to {MAX_INT:,}", tok,
                          hint="no count, depth, layer or token id is this large")
    return int(digits)


def _float(tok: Token) -> float:
    v = float(tok.value)
    if not math.isfinite(v):
        raise _BuildError(f"the number {tok.value[:24]} is too large for a 64-bit float", tok)
    return v


class _Overwrite:
    """What ``overwrite_clause`` becomes in a statement's children."""

    def __repr__(self) -> str:
        return "OVERWRITE"


OVERWRITE = _Overwrite()


def _overwrites(children: list) -> bool:
    """Whether a writing statement's children hold its OVERWRITE clause (wherever the rule put it)."""
    return any(c is OVERWRITE for c in children)


#: A clause as a user writes it, for "given twice" refusals.
_CLAUSE_WORDS = {"depth": "DRAFT DEPTH", "speculate": "SPECULATE DEPTH", "ablate": "ABLATE FEATURES",
                 "save": "SAVE INTO", "lens": "LENS"}


@v_args(meta=True)
class ToAst(Transformer):
    """The one place a parse tree becomes typed statements."""

    def __init__(self, text: str, at: tuple[int, int, int] = (1, 1, 0)):
        super().__init__()
        self.text = text
        self.at = at  # (line, column, offset) of the text's first character in its script

    def _pos(self, meta) -> dict:
        line, column = _shift(self.at, meta.line, meta.column)
        end_line, end_column = _shift(self.at, meta.end_line, meta.end_column)
        off = self.at[2]
        return {
            "line": line, "column": column, "end_line": end_line, "end_column": end_column,
            "start_pos": meta.start_pos + off, "end_pos": meta.end_pos + off,
            "source": self.text[meta.start_pos : meta.end_pos],
        }

    def start(self, meta, children):
        return list(children)

    # prompts
    def text_prompt(self, meta, c):
        return ast.TextPrompt(text=_unquote(c[0]))

    def token_prompt(self, meta, c):
        return ast.TokenPrompt(ids=c[1])

    def int_list(self, meta, c):
        return [_int(t) for t in c]

    # statements
    def open_path(self, meta, c):
        return ast.Open(path=_unquote(c[1]), shards=_int(c[3]) if c[3] is not None else None, **self._pos(meta))

    def open_default(self, meta, c):
        return ast.Open(default=True, shards=_int(c[3]) if c[3] is not None else None, **self._pos(meta))

    def use_remote(self, meta, c):
        # USE REMOTE STRING [MODEL STRING]
        model = _unquote(c[4]) if c[4] is not None else None
        return ast.UseRemote(url=_unquote(c[2]), model=model, **self._pos(meta))

    def stats_stmt(self, meta, c):
        return ast.Stats(positions=_int(c[2]) if c[2] is not None else None, **self._pos(meta))

    def explain_stmt(self, meta, c):
        return ast.Explain(depth=c[1], **self._pos(meta))

    def explain_infer(self, meta, c):
        inf = c[1]
        return ast.Explain(prompt=inf.prompt, depth=inf.depth, infer=inf, **self._pos(meta))

    def draft_clause(self, meta, c):
        return _int(c[2])

    def layer_range(self, meta, c):
        a, b = _int(c[0]), (_int(c[1]) if c[1] is not None else None)
        return (a, a if b is None else b)

    def show_layers(self, meta, c):
        rng = c[3]
        start, end = rng if rng is not None else (None, None)
        return ast.ShowLayers(start=start, end=end, **self._pos(meta))

    def show_components(self, meta, c):
        return ast.ShowComponents(**self._pos(meta))

    def show_representations(self, meta, c):
        return ast.ShowRepresentations(filter=_unquote(c[2]) if c[2] is not None else None, **self._pos(meta))

    def show_provenance(self, meta, c):
        return ast.ShowProvenance(**self._pos(meta))

    def show_operands(self, meta, c):
        return ast.ShowOperands(layer=_int(c[3]) if c[3] is not None else None, **self._pos(meta))

    def show_experts(self, meta, c):
        # SHOW EXPERTS [AT LAYER INT]
        return ast.ShowExperts(layer=_int(c[4]) if c[4] is not None else None, **self._pos(meta))

    def show_settings(self, meta, c):
        return ast.ShowSettings(**self._pos(meta))

    def top_clause(self, meta, c):
        return ("top", _int(c[1]), c[0])

    def generate_clause(self, meta, c):
        return ("generate", (_int(c[1]), c[2] is not None), c[0])

    def chat_clause(self, meta, c):
        return ("chat", True, c[0])

    def speculate_clause(self, meta, c):
        return ("speculate", _int(c[2]), c[0])

    def lookahead_clause(self, meta, c):
        return ("lookahead", _int(c[1]), c[0])

    def _options(self, opts, statement: str, first: Token) -> dict:
        """Clauses that may come in any order, each at most once: name -> value."""
        fields: dict = {}
        for opt in opts:
            if isinstance(opt, int):  # a bare draft_clause
                opt = ("depth", opt, None)
            name, value, tok = opt
            if name in fields:
                word = _CLAUSE_WORDS.get(name, name.upper())
                raise _BuildError(f"{word} is given twice in one {statement}", tok or first,
                                  hint=f"keep one {word} clause")
            fields[name] = value
        return fields

    def infer_stmt(self, meta, c):
        fields = self._options(c[2:], "INFER", c[0])
        if "generate" in fields:
            fields["generate"], fields["exactly"] = fields["generate"]
        return ast.Infer(prompt=c[1], **fields, **self._pos(meta))

    def experts_clause(self, meta, c):
        # EXPERTS [AT LAYER INT]
        return ("experts", ast.ExpertsClause(layer=_int(c[3]) if c[3] is not None else None), c[0])

    def trace_stmt(self, meta, c):
        return ast.Trace(prompt=c[1], **self._options(c[2:], "TRACE", c[0]), **self._pos(meta))

    # looking inside
    def layers_clause(self, meta, c):
        return ("layers", c[1], c[0])

    def feature_ref(self, meta, c):
        return (_int(c[0]), _int(c[1]))

    def ablate_clause(self, meta, c):
        return ("ablate", tuple(c[2:]), c[0])

    def walk_stmt(self, meta, c):
        return ast.Walk(prompt=c[1], **self._options(c[2:], "WALK", c[0]), **self._pos(meta))

    def describe_stmt(self, meta, c):
        return ast.Describe(entity=_unquote(c[1]), **self._options(c[2:], "DESCRIBE", c[0]), **self._pos(meta))

    def select_all(self, meta, c):
        return None

    def select_columns(self, meta, c):
        return list(c)

    def column(self, meta, c):
        tok = c[0]
        return ast.Column(name=tok.value.lower(), line=tok.line, column=tok.column)

    def at_layer(self, meta, c):
        n = _int(c[2])
        return ("at_layer", (n, n), c[0])

    def nearest_clause(self, meta, c):
        # NEAREST TO 'text' [AT LAYER n]: the text, or (text, n) in the reference's order
        return _unquote(c[2]) if c[5] is None else (_unquote(c[2]), _int(c[5]))

    def where_clause(self, meta, c):
        return [x for x in c if isinstance(x, ast.Condition)]

    def condition(self, meta, c):
        return ast.Condition(column=c[0], op=c[1], value=c[2])

    def op_eq(self, meta, c):
        return "="

    def op_cmp(self, meta, c):
        return "!=" if c[0].value == "<>" else c[0].value

    def op_like(self, meta, c):
        return "LIKE"

    def string_literal(self, meta, c):
        return _unquote(c[0])

    def int_literal(self, meta, c):
        return _int(c[0])

    def negative_int_literal(self, meta, c):
        return -_int(c[0])

    def float_literal(self, meta, c):
        return float(c[0].value)

    def negative_float_literal(self, meta, c):
        return -float(c[0].value)

    def order_clause(self, meta, c):
        direction = c[3]
        return (c[2], None if direction is None else direction.type == "DESC")

    def limit_clause(self, meta, c):
        return _int(c[1])

    def select_stmt(self, meta, c):
        # SELECT list FROM FEATURES [scope] [nearest] [where] [order] [limit]
        scope, nearest, where, order, limit = c[4:9]
        if isinstance(nearest, tuple):
            nearest, layer = nearest
            if scope is not None:
                raise _BuildError("NEAREST TO ... AT LAYER n and a layer scope before it are both given", c[3],
                                  hint="keep one: SELECT ... FROM FEATURES NEAREST TO 'text' AT LAYER n")
            scope = ("at_layer", (layer, layer), None)
        fields: dict = {"columns": c[1], "nearest": nearest, "where": where or [], "limit": limit}
        if scope is not None:
            fields["layers"], fields["at_layer"] = scope[1], scope[0] == "at_layer"
        if order is not None:
            fields["order_by"], fields["descending"] = order
        return ast.SelectFeatures(**fields, **self._pos(meta))

    def show_features_stmt(self, meta, c):
        return ast.ShowFeatures(layer=_int(c[4]), limit=c[5], **self._pos(meta))

    def explain_features_stmt(self, meta, c):
        fields = self._options(c[3:], "EXPLAIN INFER ... FEATURES", c[2])
        return ast.ExplainFeatures(infer=c[1], **fields, **self._pos(meta))

    def token_text(self, meta, c):
        return _unquote(c[0])

    def token_id(self, meta, c):
        return _int(c[0])

    def positions_clause(self, meta, c):
        return ("positions", c[1].type.lower(), c[0])

    def decompose_clause(self, meta, c):
        return ("decompose", True, c[0])

    def save_clause(self, meta, c):
        return ("save", _unquote(c[2]), c[0])

    def trace_for_stmt(self, meta, c):
        fields = self._trace_fields(c[4:], "TRACE ... FOR", c[0])
        return ast.TraceFor(prompt=c[1], token=c[3], **fields, **self._pos(meta))

    def lens_clause(self, meta, c):
        return ("lens", list(c[1:]), c[0])

    def observe_stmt(self, meta, c):
        fields = self._options(c[2:-3], "OBSERVE", c[0])
        if "generate" in fields:
            fields["generate"] = fields["generate"][0]  # OBSERVE always generates n tokens; EXACTLY says so
        return ast.Observe(prompt=c[1], into=_unquote(c[-1]), **fields, **self._pos(meta))

    def build_features_stmt(self, meta, c):
        layers = c[2][1] if c[2] is not None else None
        return ast.BuildFeatures(layers=layers, **self._pos(meta))

    def draft_depth(self, meta, c):
        return ast.DraftDepth(depth=c[0], **self._pos(meta))

    def draft_off(self, meta, c):
        return ast.DraftOff(**self._pos(meta))

    def draft_ladder(self, meta, c):
        # DRAFT LADDER DEPTHS int_list ON STRING [INTO STRING] [PLOT INTO STRING] [OVERWRITE]
        into = _unquote(c[7]) if c[7] is not None else None
        plot = _unquote(c[10]) if c[10] is not None else None
        return ast.DraftLadder(depths=c[3], prompts=_unquote(c[5]), into=into, plot=plot, overwrite=_overwrites(c),
                               **self._pos(meta))

    def dump_stmt(self, meta, c):
        # DUMP LOGITS prompt dump_option* INTO STRING [OVERWRITE]
        opts = c[3:-3]
        fields = self._options(opts, "DUMP LOGITS", c[0])
        return ast.DumpLogits(prompt=c[2], into=_unquote(c[-2]), overwrite=_overwrites(c), **fields,
                              **self._pos(meta))

    def overwrite_clause(self, meta, c):
        return OVERWRITE

    def score_stmt(self, meta, c):
        return ast.ScoreDraft(draft=_unquote(c[2]), target=_unquote(c[4]), **self._pos(meta))

    def verify_stmt(self, meta, c):
        return ast.Verify(**self._pos(meta))

    def plan_stmt(self, meta, c):
        return ast.Plan(path=_unquote(c[1]), **self._pos(meta))

    def encode_stmt(self, meta, c):
        return ast.Encode(checkpoint=_unquote(c[1]), into=_unquote(c[3]), overwrite=_overwrites(c), **self._pos(meta))

    def represent_stmt(self, meta, c):
        # REPRESENT INTO STRING ENCODING STRING
        return ast.Represent(into=_unquote(c[2]), encoding=_unquote(c[4]), **self._pos(meta))

    def compact_stmt(self, meta, c):
        return ast.Compact(into=_unquote(c[2]), **self._pos(meta))

    def diff_stmt(self, meta, c):
        return ast.Diff(a=_unquote(c[1]), b=_unquote(c[2]) if c[2] is not None else None, **self._pos(meta))

    def score_representation_stmt(self, meta, c):
        # SCORE REPRESENTATION STRING AGAINST STRING ON STRING [GREEDY INT]
        greedy = _int(c[8]) if c[8] is not None else None
        return ast.ScoreRepresentation(candidate=_unquote(c[2]), reference=_unquote(c[4]), prompts=_unquote(c[6]),
                                       greedy=greedy, **self._pos(meta))

    def help_stmt(self, meta, c):
        words = [t.value.upper() for t in c[1:]]
        return ast.Help(topic=" ".join(words) if words else None, **self._pos(meta))

    def set_stmt(self, meta, c):
        return ast.Set(name=c[1].value.lower(), value=c[2], **self._pos(meta))

    def string_value(self, meta, c):
        return _unquote(c[0])

    def int_value(self, meta, c):
        return _int(c[0])

    def float_value(self, meta, c):
        return _float(c[0])

    def word_value(self, meta, c):
        return c[0].value.lower()


    # ---- the reference dialect (issue 19) ---------------------------------------------------

    def _trace_fields(self, opts, statement: str, first: Token) -> dict:
        """TRACE options, with the reference's SAVE 'f' (save_file) folded into save."""
        fields = self._options(opts, statement, first)
        if "save_file" in fields:
            if "save" in fields:
                raise _BuildError(f"SAVE is given twice in one {statement}", first, hint="keep one SAVE clause")
            fields["save"], fields["save_file"] = fields.pop("save_file"), True
        return fields

    def _clause(name):
        def method(self, meta, c):
            return (name, True, c[0])
        return method

    compare_clause = _clause("compare")
    relations_only_clause = _clause("relations_only")
    with_attention_clause = _clause("attention")
    with_examples_clause = _clause("examples")
    physical_clause = _clause("physical")
    del _clause

    def layers_all_clause(self, meta, c):
        return ("layers", None, c[0])

    def mode_clause(self, meta, c):
        return ("mode", c[1].value.lower(), c[0])

    def verbose_clause(self, meta, c):
        return ("detail", "verbose", c[0])

    def brief_clause(self, meta, c):
        return ("detail", "brief", c[0])

    def raw_clause(self, meta, c):
        return ("detail", "raw", c[0])

    def band_clause(self, meta, c):
        return ("band", c[0].type.lower(), c[0])

    def at_layer_clause(self, meta, c):
        return ("at_layer", _int(c[2]), c[0])

    def save_file_clause(self, meta, c):
        return ("save_file", _unquote(c[1]), c[0])

    def stats_path(self, meta, c):
        # STATS STRING [AT INT POSITIONS]
        return ast.Stats(path=_unquote(c[1]), positions=_int(c[3]) if c[3] is not None else None, **self._pos(meta))

    def explain_walk(self, meta, c):
        return c[1].model_copy(update={"explain": True, **self._pos(meta)})

    def explain_infer_ref(self, meta, c):
        inf = c[1]
        fields = self._options(c[2:], "EXPLAIN INFER", c[0])
        if inf.top is not None:
            if "top" in fields:
                raise _BuildError("TOP is given twice in one EXPLAIN INFER", c[0], hint="keep one TOP clause")
            fields["top"] = inf.top
            inf = inf.model_copy(update={"top": None})
        if "detail" in fields:
            fields["verbose"] = fields.pop("detail") == "verbose"
        return ast.ExplainFeatures(infer=inf, reference=True, **fields, **self._pos(meta))

    def trace_ref_stmt(self, meta, c):
        fields = self._trace_fields(c[2:], "TRACE", c[0])
        return ast.TraceFor(prompt=c[1], token=None, **fields, **self._pos(meta))

    def show_layers_bare(self, meta, c):
        start, end = c[2]
        return ast.ShowLayers(start=start, end=end, **self._pos(meta))

    def show_models(self, meta, c):
        return ast.ShowModels(**self._pos(meta))

    def show_patches(self, meta, c):
        return ast.ShowPatches(**self._pos(meta))

    def show_compact_status(self, meta, c):
        return ast.ShowCompactStatus(**self._pos(meta))

    def show_entities(self, meta, c):
        # SHOW ENTITIES [INT | AT LAYER INT] [limit_clause]
        ints = [t for t in c[2:] if isinstance(t, Token) and t.type == "INT"]
        limit = c[-1] if isinstance(c[-1], int) and not isinstance(c[-1], Token) else None
        return ast.ShowEntities(layer=_int(ints[0]) if ints else None, limit=limit, **self._pos(meta))

    def show_relations(self, meta, c):
        fields = self._options(c[2:], "SHOW RELATIONS", c[0])
        if "at_layer" in fields:
            fields["layer"] = fields.pop("at_layer")
        return ast.ShowRelations(**fields, **self._pos(meta))

    def show_features_ref(self, meta, c):
        # SHOW FEATURES INT [where_clause] [limit_clause]: the reference's SHOW FEATURES n
        layer, where, limit = _int(c[2]), c[3], c[4]
        if where is None:
            return ast.ShowFeatures(layer=layer, limit=limit, **self._pos(meta))
        return ast.SelectFeatures(layers=(layer, layer), at_layer=True, where=where, limit=limit, **self._pos(meta))

    def in_condition(self, meta, c):
        return ast.Condition(column=c[0], op="IN", value=list(c[2:]))

    def select_graph(self, meta, c):
        # SELECT list FROM EDGES | ENTITIES [nearest] [where] [order] [limit]
        nearest, where, order, limit = c[4:8]
        fields: dict = {"table": c[3].type.lower(), "columns": c[1], "where": where or [], "limit": limit}
        if isinstance(nearest, tuple):
            fields["nearest"], fields["nearest_layer"] = nearest
        else:
            fields["nearest"] = nearest
        if order is not None:
            fields["order_by"], fields["descending"] = order
        return ast.SelectGraph(**fields, **self._pos(meta))

    def use_model_stmt(self, meta, c):
        return ast.UseModel(model=_unquote(c[2]), auto_extract=c[3] is not None, **self._pos(meta))

    def components_clause(self, meta, c):
        names = [_unquote(t) if t.type == "STRING" else t.value for t in c[1:]]
        return ("components", names, c[0])

    def with_level_clause(self, meta, c):
        return ("level", c[1].type.lower(), c[0])

    def format_clause(self, meta, c):
        return ("format", c[1].value.lower(), c[0])

    def extract_stmt(self, meta, c):
        # EXTRACT MODEL STRING INTO STRING extract_option*
        fields = self._options(c[5:], "EXTRACT", c[0])
        return ast.Extract(checkpoint=_unquote(c[2]), into=_unquote(c[4]), **fields, **self._pos(meta))

    def on_conflict_clause(self, meta, c):
        return c[2].value.lower()

    def compile_stmt(self, meta, c):
        # COMPILE (CURRENT | STRING) INTO (VINDEX | MODEL) STRING [on_conflict_clause]
        path = None if c[1].type == "CURRENT" else _unquote(c[1])
        return ast.Compile(path=path, into=_unquote(c[4]), target=c[3].type.lower(), on_conflict=c[5],
                           **self._pos(meta))

    def diff_layer_clause(self, meta, c):
        return ("layer", _int(c[1]), c[0])

    def into_patch_clause(self, meta, c):
        return ("into_patch", _unquote(c[2]), c[0])

    def diff_ref(self, meta, c):
        # DIFF STRING (STRING | CURRENT) diff_option+
        opts = [("limit", o, None) if isinstance(o, int) and not isinstance(o, Token) else o for o in c[3:]]
        fields = self._options(opts, "DIFF", c[0])
        current = c[2].type == "CURRENT"
        return ast.Diff(a=_unquote(c[1]), b=None if current else _unquote(c[2]), b_current=current, **fields,
                        **self._pos(meta))

    def confidence_clause(self, meta, c):
        return ("confidence", float(c[1].value), c[0])

    def alpha_clause(self, meta, c):
        return ("alpha", float(c[1].value), c[0])

    def assignment(self, meta, c):
        return (c[0], c[1])

    def loose_option(self, meta, c):
        if isinstance(c[0], tuple):  # AT LAYER n
            return ast.LooseOption(name="layer", value=c[0][1])
        return ast.LooseOption(name=c[0].value.lower(), value=c[1])

    def insert_edges(self, meta, c):
        # INSERT INTO EDGES ( columns ) VALUES ( literals ) insert_option*
        at = next(i for i, x in enumerate(c) if isinstance(x, Token) and x.type == "VALUES")
        columns = list(c[3:at])
        values, opts = [], []
        for x in c[at + 1:]:
            (opts if isinstance(x, tuple) else values).append(x)
        fields = self._options(opts, "INSERT", c[0])
        if "at_layer" in fields:
            fields["layer"] = fields.pop("at_layer")
        if len(columns) != len(values):
            raise _BuildError(f"INSERT names {len(columns)} columns and gives {len(values)} values", c[at],
                              hint="give one value per column")
        return ast.InsertEdges(columns=columns, values=values, **fields, **self._pos(meta))

    def delete_edges(self, meta, c):
        return ast.DeleteEdges(where=c[3] or [], **self._pos(meta))

    def update_edges(self, meta, c):
        where = c[-1] if isinstance(c[-1], list) or c[-1] is None else None
        assigns = [x for x in c[3:] if isinstance(x, tuple)]
        return ast.UpdateEdges(assignments=assigns, where=where or [], **self._pos(meta))

    def merge_stmt(self, meta, c):
        # MERGE STRING [INTO STRING] [on_conflict_clause]
        return ast.Merge(src=_unquote(c[1]), into=_unquote(c[3]) if c[3] is not None else None, on_conflict=c[4],
                         **self._pos(meta))

    def begin_patch(self, meta, c):
        return ast.BeginPatch(path=_unquote(c[2]), **self._pos(meta))

    def save_patch(self, meta, c):
        return ast.SavePatch(**self._pos(meta))

    def apply_patch(self, meta, c):
        return ast.ApplyPatch(path=_unquote(c[2]), **self._pos(meta))

    def remove_patch(self, meta, c):
        return ast.RemovePatch(path=_unquote(c[2]), **self._pos(meta))

    def rebalance(self, meta, c):
        return ast.Rebalance(options=list(c[1:]), **self._pos(meta))

    def compact_level(self, meta, c):
        return ast.CompactLevel(level=c[1].type.lower(), options=list(c[2:]), **self._pos(meta))


# ---- parsing and syntax errors --------------------------------------------------------


def _shift(at: tuple[int, int, int], line: int, column: int) -> tuple[int, int]:
    """A (line, column) in a piece of text as a (line, column) in the script it starts at ``at``."""
    return line + at[0] - 1, column + (at[1] - 1 if line == 1 else 0)


def parse(text: str, *, at: tuple[int, int, int] = (1, 1, 0)) -> list[ast.Statement]:
    """Every statement of ``text``, in order, each knowing its line, column and source.
    Raises `LqlSyntaxError` for the first thing that is not LQL, including every literal the
    language does not read (a number over 2**63-1, a NUL, a lone surrogate, a string over
    MAX_STRING_CHARS characters), positioned at it. ``at`` is the (line, column, offset) of
    ``text`` in a longer script, so that positions are the script's.

    Anything else that fails inside the transformer is a bug, raised as itself (not as Lark's
    VisitError), for the front end's error boundary to report."""
    try:
        tree = LARK.parse(text)
    except UnexpectedInput as e:
        raise _located(_syntax_error(text, e), at) from None
    try:
        return ToAst(text, at).transform(tree)
    except VisitError as e:
        orig = e.orig_exc
        if isinstance(orig, _BuildError):
            tok = orig.token
            line, col = tok.line, tok.column + orig.offset
            err = LqlSyntaxError(orig.message, line=line, column=col, source_line=_source_line(text, line), hint=orig.hint)
            raise _located(err, at) from None
        raise orig from None


def _located(err: LqlSyntaxError, at: tuple[int, int, int]) -> LqlSyntaxError:
    if at != (1, 1, 0):
        line = err.line
        err.line, err.column = _shift(at, line, err.column)
        if line == 1:
            err.source_line = " " * (at[1] - 1) + err.source_line
    return err


def parse_one(text: str) -> ast.Statement:
    """Exactly one statement (a trailing ';' is optional)."""
    stmts = parse(text)
    if len(stmts) != 1:
        raise LqlSyntaxError(
            f"expected exactly one statement, found {len(stmts)}", line=1, column=1,
            source_line=_source_line(text, 1),
        )
    return stmts[0]


def is_complete(text: str) -> bool:
    """True when ``text`` holds at least one statement and ends with ';' outside any string or
    comment — the REPL's signal that Enter should submit. Says nothing about validity."""
    last = None
    for tok in lex(text):
        if tok.type in ("WS", "COMMENT"):
            continue
        last = tok
    return last is not None and last.type == "_SEMI"


def _source_line(text: str, line: int) -> str:
    """Line ``line`` (1-based) of ``text``, counting only '\\n' as Lark does (a form feed or
    U+2028 inside a line must not shift the caret onto another line)."""
    lines = text.split("\n")
    return lines[line - 1].rstrip("\r") if 0 < line <= len(lines) else ""


# Labelled examples of common mistakes, matched by parser state (Lark's match_examples).
_HINT_EXAMPLES: dict[str, list[str]] = {
    "quote_path": [
        "OPEN model.vindex3", "USE model", "OPEN /tmp/model", "PLAN ckpt", "PLAN /tmp/ckpt",
        "ENCODE ckpt INTO 'out'", "ENCODE /a INTO 'out'", "ENCODE 'ckpt' INTO out", "ENCODE 'a' INTO /tmp/o",
        "DUMP LOGITS 'x' INTO out.f32", "DUMP LOGITS 'x' INTO /tmp/o", "DUMP LOGITS 'x' DRAFT DEPTH 1 INTO out",
        "SCORE DRAFT a.f32 AGAINST 'b'", "SCORE DRAFT 'a' AGAINST b.f32", "SCORE DRAFT /a AGAINST 'b'",
        "SCORE DRAFT 'a' AGAINST /b", "DRAFT LADDER DEPTHS (1) ON prompts.jsonl",
        "DRAFT LADDER DEPTHS (1) ON /p", "DRAFT LADDER DEPTHS (1) ON 'p' INTO out",
        "DRAFT LADDER DEPTHS (1) ON 'p' INTO /o", "SHOW REPRESENTATIONS embedding",
        "TRACE 'x' FOR 'y' SAVE INTO t.npz", "TRACE 'x' FOR 'y' SAVE INTO /t", "OBSERVE 'x' RECORD INTO run.jsonl",
        "OBSERVE 'x' RECORD INTO /r",
    ],
    "quote_value": [
        "SELECT * FROM FEATURES WHERE token = Paris", "SELECT * FROM FEATURES WHERE token LIKE P",
        "SELECT * FROM FEATURES NEAREST TO Paris", "TRACE 'x' FOR Paris", "DESCRIBE France", "WALK hello",
    ],
    "feature_pairs": [
        "INFER 'x' ABLATE FEATURES 3:17", "INFER 'x' ABLATE FEATURES (3)", "INFER 'x' ABLATE FEATURES (3,",
        "TRACE 'x' ABLATE FEATURES 3:17", "INFER 'x' ABLATE (3:17)",
    ],
    "quote_prompt": [
        "INFER hello", "TRACE hello", "EXPLAIN INFER hello", "DUMP LOGITS hello INTO 'x'",
        "INFER [1]", "TRACE [1]", "DUMP LOGITS [1] INTO 'x'", "EXPLAIN INFER [1]",
    ],
    "depth_number": [
        "DRAFT DEPTH", "DRAFT DEPTH;", "DRAFT DEPTH x", "DRAFT DEPTH 'x'",
        "INFER 'x' DRAFT DEPTH", "INFER 'x' DRAFT DEPTH TOP 3", "INFER 'x' DRAFT DEPTH 'x'",
        "TRACE 'x' DRAFT DEPTH", "TRACE 'x' DRAFT DEPTH x", "EXPLAIN DRAFT DEPTH", "EXPLAIN DRAFT DEPTH x",
        "EXPLAIN INFER 'x' DRAFT DEPTH", "DUMP LOGITS 'x' DRAFT DEPTH INTO 'f'", "DUMP LOGITS 'x' DRAFT DEPTH x",
    ],
    "depth_word": [
        "DRAFT 2", "INFER 'x' DRAFT 2", "TRACE 'x' DRAFT 2", "EXPLAIN DRAFT 2",
        "DUMP LOGITS 'x' DRAFT 2", "INFER 'x' SPECULATE 2",
    ],
    "positions": ["STATS AT 4096", "STATS AT 4096;"],
    "tokens_parens": ["INFER TOKENS 1", "TRACE TOKENS 1", "DUMP LOGITS TOKENS 1", "EXPLAIN INFER TOKENS 1",
                      "DRAFT LADDER DEPTHS 1"],
    "set_equals": ["SET format json", "SET format 'json'", "SET format 1", "SET format"],
}


_HINTS = {
    "quote_path": "paths are strings: put it in quotes, e.g. {bare_quoted}",
    "quote_prompt": "a prompt is a quoted string, or token ids as TOKENS (1, 2, 3)",
    "depth_number": "DEPTH takes the number of layers to run, e.g. DRAFT DEPTH 2",
    "depth_word": "write DRAFT DEPTH n (or SPECULATE DEPTH n), e.g. DRAFT DEPTH 2",
    "tokens_parens": "put the ids in parentheses, e.g. TOKENS (1, 2, 3)",
    "set_equals": "SET takes name = value, e.g. SET format = json",
    "quote_value": "text is a quoted string, e.g. 'Paris'",
    "feature_pairs": "name features as layer:feature pairs in parentheses, e.g. ABLATE FEATURES (3:17, 5:2)",
    "positions": "write STATS AT n POSITIONS",
}


def _match_label(err: UnexpectedInput) -> str | None:
    """The label of a recorded mistake made in the same parser state (Lark's match_examples)."""
    try:
        return err.match_examples(LARK.parse, _HINT_EXAMPLES, use_accepts=True)
    except Exception:  # noqa: BLE001  a hint is a courtesy; never let it mask the syntax error itself
        return None


# What a whole number means after each keyword, for "expected a whole number" hints.
_NUMBER_AFTER = {
    "DEPTH": "the number of layers to run, e.g. DRAFT DEPTH 2",
    "TOP": "how many candidates to show, e.g. TOP 5",
    "GENERATE": "how many tokens to generate, e.g. GENERATE 20",
    "LOOKAHEAD": "how many tokens the draft proposes per step, e.g. LOOKAHEAD 4",
    "AT": "a context length, e.g. STATS AT 4096 POSITIONS",
    "LAYER": "a layer index, e.g. SHOW OPERANDS LAYER 3 or SHOW EXPERTS AT LAYER 3",
    "LAYERS": "a layer or an inclusive range of layers, e.g. LAYERS 0-7",
    "LIMIT": "how many rows to show, e.g. LIMIT 10",
    "_COLON": "a feature index after layer:, e.g. ABLATE FEATURES (3:17)",
    "RANGE": "a layer or an inclusive range of layers, e.g. RANGE 0-7",
    "_MINUS": "the last layer of the range, e.g. RANGE 0-7",
}


def _previous_token(text: str, pos: int) -> Token | None:
    toks = [t for t in lex(text[:pos]) if t.type not in ("WS", "COMMENT")]
    return toks[-1] if toks else None


def _err_pos(text: str, err: UnexpectedInput) -> int:
    """Offset of the offending input; Lark puts an end-of-input token at the last token."""
    if isinstance(err, UnexpectedToken) and err.token.type == "$END" or err.pos_in_stream is None:
        return len(text)
    return err.pos_in_stream


# A run of text up to a blank or ';' (at most 200 characters: it is only ever shown), a word.
_BARE = re.compile(r"[^\s;]{0,200}")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}")


def _short(s: str, n: int = 60) -> str:
    """Text shown in a message, cut to about ``n`` characters."""
    return s if len(s) <= n else s[: n - 20] + "…" + s[-12:]


def _found(text: str, err: UnexpectedInput) -> tuple[str, str]:
    """(description of what was found, the bare run of text starting there)."""
    pos = _err_pos(text, err)
    bare = _BARE.match(text, pos).group(0) if pos < len(text) else ""
    if isinstance(err, UnexpectedToken) and err.token.type == "$END" or pos >= len(text):
        return "end of input", bare
    if isinstance(err, UnexpectedCharacters):
        ch = text[pos]
        if ch in "'\"":
            return "a string that is not closed on its line", bare
        word = _WORD.match(text, pos)
        if word:
            return repr(_short(word.group(0))), bare
        return repr(ch), bare
    tok = err.token
    if tok.type in KEYWORDS and bare[len(tok.value) : len(tok.value) + 1] in tuple("./\\-"):
        return repr(_short(bare)), bare  # a path that begins with a keyword (model.vindex3), not the keyword
    if tok.type in KEYWORDS:
        return f"keyword {tok.value.upper()}", bare
    if tok.type == "STRING":
        return f"the string {_short(tok.value)}", bare
    if tok.type == "NAME" and bare:
        return repr(_short(bare)), bare
    return repr(_short(str(tok.value))), bare


def _expected_names(text: str, err: UnexpectedInput) -> set[str]:
    if isinstance(err, UnexpectedToken):
        names = set(err.accepts or err.expected)
    elif isinstance(err, UnexpectedCharacters):
        # the lexer's allowed set is per LALR state and can be wider than what the parser
        # accepts here; feed the text before the error to the interactive parser instead
        try:
            names = set(interactive(text[: err.pos_in_stream]).accepts())
        except UnexpectedInput:
            names = set(err.allowed or ())
    elif isinstance(err, UnexpectedEOF):
        names = set(err.expected)
    else:
        names = set()
    return names


def expected_words(names: set[str]) -> str:
    """Terminal names → 'a quoted string or DEFAULT'. The start of a statement is named as
    such rather than listed keyword by keyword."""
    names = set(names)
    if "_SEMI" in names:
        names.discard("$END")
    stmt_starts = names & set(STATEMENT_KEYWORDS)
    parts: list[str] = []
    if len(stmt_starts) == len(STATEMENT_KEYWORDS):
        names -= stmt_starts
        parts.append("a statement (" + ", ".join(STATEMENT_KEYWORDS) + ")")
    kws = sorted(n for n in names if n in KEYWORDS)
    others = sorted((n for n in names if n not in KEYWORDS), key=lambda n: list(_WORDS).index(n) if n in _WORDS else 99)
    parts += [describe_terminal(n) for n in others] + [KEYWORDS[n] for n in kws]
    if not parts:
        return "nothing more"
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _syntax_error(text: str, err: UnexpectedInput) -> LqlSyntaxError:
    names = _expected_names(text, err)
    found, bare = _found(text, err)
    line = err.line if isinstance(err.line, int) and err.line > 0 else text.count("\n") + 1
    column = err.column if isinstance(err.column, int) and err.column > 0 else len(_source_line(text, line)) + 1
    if found == "end of input" and not isinstance(err, UnexpectedCharacters):
        # point just past the last token rather than at a phantom position
        stripped = text.rstrip()
        line, column = _line_col(text, len(stripped))
    message = f"expected {expected_words(names)}, found {found}"
    hint = _hint(text, err, names, found, bare)
    return LqlSyntaxError(message, line=line, column=column, source_line=_source_line(text, line),
                          expected=[describe_terminal(n) for n in sorted(names)], hint=hint)


def _hint(text: str, err: UnexpectedInput, names: set[str], found: str, bare: str) -> str | None:
    pos = _err_pos(text, err)
    if found == "a string that is not closed on its line":
        return f"close the string with {bare[:1]} before the end of the line"
    prev = _previous_token(text, pos)
    if (
        isinstance(err, UnexpectedCharacters)
        and text[pos] == "."
        and prev is not None
        and prev.type == "INT"
        and "FLOAT" not in names
    ):
        return f"only a whole number fits here, not {_short(prev.value + bare)}"
    word = re.match(r"[A-Za-z_][A-Za-z0-9_]*$", bare.rstrip("(),="))
    expected_kws = [KEYWORDS[n] for n in names if n in KEYWORDS]
    if word and expected_kws:
        close = difflib.get_close_matches(word.group(0).upper(), expected_kws, n=1, cutoff=0.6)
        if close and close[0] != word.group(0).upper():
            return f"did you mean {close[0]}?"
    if "_SEMI" in names and isinstance(err, UnexpectedToken) and err.token.type in STATEMENT_KEYWORDS:
        return f"end the previous statement with ';' before {err.token.value.upper()}"
    label = _match_label(err)
    if label is not None:
        quoted = "'" + bare.replace("\\", "\\\\").replace("'", "\\'") + "'" if bare else "'...'"
        return _HINTS[label].format(bare_quoted=quoted)
    if names - {"ALL"} == {"INT"} and prev is not None and prev.type in _NUMBER_AFTER:  # LAYERS ALL: the reference's
        word = prev.value.upper() if prev.type in KEYWORDS else "-"
        return f"{word} takes {_NUMBER_AFTER[prev.type]}"
    return None
