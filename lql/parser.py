"""Text → typed statements. One Lark instance (LALR, contextual lexer, positions kept) built
from the core grammar and every statement family's fragment (`lql.registry`), one Transformer
that hands each rule's children to that rule's function (`lql.syntax`), and the translation of
Lark's exceptions into `LqlSyntaxError`s that read well.

Reachable from here for the REPL: ``lark()`` (the Lark instance, rebuilt when a family is
registered; ``LARK`` names the current one), ``interactive(text)`` (Lark's interactive parser
fed with ``text``, whose ``accepts()`` names the terminals that may come next), ``lex(text)`` (a
tolerant token stream for highlighting), ``KEYWORDS`` (terminal name → keyword) and
``describe_terminal`` (terminal name → words)."""

from __future__ import annotations

import difflib
import importlib.resources
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from lark import Lark, Token, Transformer
from lark.exceptions import (
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedInput,
    UnexpectedToken,
    VisitError,
)

from . import ast, registry, syntax
from .errors import LqlSyntaxError
from .syntax import MAX_INT, MAX_STRING_CHARS, BuildError, Children  # noqa: F401  (re-exported)


def grammar_text() -> str:
    """The core grammar's source. Installed, it ships as package ``lql.grammar``; in a source
    tree it is read from ``grammar/`` beside ``lql/``."""
    try:
        return (importlib.resources.files("lql.grammar") / "lql.lark").read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError):
        return (Path(__file__).resolve().parent.parent / "grammar" / "lql.lark").read_text(encoding="utf-8")


# A terminal's definition at the start of a line (``NAME:``, ``FLOAT.3:``), a name in capitals
# anywhere (once strings, regexes and comments are taken out).
_TERMINAL_DEF = re.compile(r"^\s*([A-Z_][A-Z0-9_]*)(?:\.\d+)?\s*:", re.MULTILINE)
_CAPS = re.compile(r"\b[A-Z][A-Z0-9_]*\b")
_NOT_NAMES = re.compile(r'//[^\n]*|"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*')


def compose(families: list[registry.Family] | None = None) -> str:
    """The whole grammar: the core, each family's fragment, ``_statement`` as the alternatives
    the families name, a keyword terminal for every name in capitals no terminal defines, and
    ``_keyword`` (every keyword, so that HELP takes any statement's name as a topic)."""
    fams = registry.families() if families is None else families
    parts = [grammar_text()]
    statements: list[str] = []
    for f in fams:
        parts.append(f"// ---- family {f.name} ({f.module})\n{f.grammar.strip()}\n")
        statements += f.statements
    parts.append("_statement: " + "\n          | ".join(statements) + "\n")
    text = "\n".join(parts)
    defined = set(_TERMINAL_DEF.findall(text)) | {"WS"}
    bare = _NOT_NAMES.sub(" ", text)
    keywords = sorted({n for n in _CAPS.findall(bare) if n not in defined and not n.startswith("_")})
    table = "\n".join(f"{k}.2: /{k.lower()}\\b/i" for k in keywords)
    return f"{text}\n// ---- the keyword table\n{table}\n\n_keyword: " + "\n        | ".join(keywords) + "\n"


@dataclass(frozen=True)
class _Grammar:
    generation: int
    lark: Lark
    keywords: dict[str, str]
    statement_keywords: tuple[str, ...]


_BUILT: _Grammar | None = None


def _grammar() -> _Grammar:
    """The Lark parser for the registered families, built once per registry generation."""
    global _BUILT, _TOLERANT
    registry.discover()
    if _BUILT is None or _BUILT.generation != registry.generation:
        generation = registry.generation
        lk = Lark(compose(), parser="lalr", lexer="contextual", propagate_positions=True, maybe_placeholders=True)
        kws = {t.name: t.name for t in lk.terminals
               if t.pattern.type == "re" and t.pattern.value.endswith(r"\b") and t.name.isupper()
               and not t.name.startswith("_")}
        syntax.set_keywords(frozenset(kws))
        starts = tuple(sorted(n for n in lk.parse_interactive("").accepts() if n in kws))
        _BUILT, _TOLERANT = _Grammar(generation, lk, kws, starts), None
    return _BUILT


def lark() -> Lark:
    return _grammar().lark


def __getattr__(name: str):
    # the grammar is built from the registry, so these are read when asked, never frozen early
    if name == "LARK":
        return _grammar().lark
    if name == "KEYWORDS":
        return _grammar().keywords
    if name == "STATEMENT_KEYWORDS":
        return _grammar().statement_keywords
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    if name in _grammar().keywords:
        return _grammar().keywords[name]
    return _WORDS.get(name, name)


def interactive(text: str = ""):
    """Lark's interactive parser after feeding ``text`` (lexing errors propagate as Lark's
    own exceptions). ``.accepts()`` gives the terminal names allowed next."""
    ip = lark().parse_interactive(text)
    ip.exhaust_lexer()
    return ip


def _tolerant_lexer():
    """The grammar's basic lexer that keeps comments and whitespace, built once (Lark builds a
    new one, compiling every terminal, on each ``Lark.lex(..., dont_ignore=True)`` call)."""
    global _TOLERANT
    lk = lark()
    if _TOLERANT is None:
        _TOLERANT = lk._build_lexer(dont_ignore=True)
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


class ToAst(Transformer):
    """The one place a parse tree becomes typed statements: each rule's children go to the
    function registered for it (`lql.syntax.RULES`); a statement it returns without a position
    gets this rule's (line, column, offsets, source, shifted to the script)."""

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

    def start(self, children):
        return list(children)

    def __default__(self, data, children, meta):
        entry = syntax.RULES.get(data)
        if entry is None:  # a grammar rule without a function is a bug (the registry test names it)
            raise NotImplementedError(f"grammar rule {data!r} has no function")
        out = entry[0](Children(children, meta, lambda: self._pos(meta)))
        if isinstance(out, ast.Statement) and not out.source:
            out = out.model_copy(update=self._pos(meta))
        return out


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
        tree = lark().parse(text)
    except UnexpectedInput as e:
        raise _located(_syntax_error(text, e), at) from None
    try:
        return ToAst(text, at).transform(tree)
    except BuildError as e:
        raise _located(_build_error(text, e), at) from None
    except VisitError as e:  # a rule raised inside a method Lark wraps (start)
        if isinstance(e.orig_exc, BuildError):
            raise _located(_build_error(text, e.orig_exc), at) from None
        raise e.orig_exc from None


def _build_error(text: str, e: BuildError) -> LqlSyntaxError:
    tok = e.token
    line, col = tok.line, tok.column + e.offset
    return LqlSyntaxError(e.message, line=line, column=col, source_line=_source_line(text, line), hint=e.hint)


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
        return err.match_examples(lark().parse, _HINT_EXAMPLES, use_accepts=True)
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
    if tok.type in _grammar().keywords and bare[len(tok.value) : len(tok.value) + 1] in tuple("./\\-"):
        return repr(_short(bare)), bare  # a path that begins with a keyword (model.vindex3), not the keyword
    if tok.type in _grammar().keywords:
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
    stmt_starts = names & set(_grammar().statement_keywords)
    parts: list[str] = []
    if len(stmt_starts) == len(_grammar().statement_keywords):
        names -= stmt_starts
        parts.append("a statement (" + ", ".join(_grammar().statement_keywords) + ")")
    kws = sorted(n for n in names if n in _grammar().keywords)
    others = sorted((n for n in names if n not in _grammar().keywords), key=lambda n: list(_WORDS).index(n) if n in _WORDS else 99)
    parts += [describe_terminal(n) for n in others] + [_grammar().keywords[n] for n in kws]
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
    expected_kws = [_grammar().keywords[n] for n in names if n in _grammar().keywords]
    if word and expected_kws:
        close = difflib.get_close_matches(word.group(0).upper(), expected_kws, n=1, cutoff=0.6)
        if close and close[0] != word.group(0).upper():
            return f"did you mean {close[0]}?"
    if "_SEMI" in names and isinstance(err, UnexpectedToken) and err.token.type in _grammar().statement_keywords:
        return f"end the previous statement with ';' before {err.token.value.upper()}"
    label = _match_label(err)
    if label is not None:
        quoted = "'" + bare.replace("\\", "\\\\").replace("'", "\\'") + "'" if bare else "'...'"
        return _HINTS[label].format(bare_quoted=quoted)
    if names - {"ALL"} == {"INT"} and prev is not None and prev.type in _NUMBER_AFTER:  # LAYERS ALL: the reference's
        word = prev.value.upper() if prev.type in _grammar().keywords else "-"
        return f"{word} takes {_NUMBER_AFTER[prev.type]}"
    return None
