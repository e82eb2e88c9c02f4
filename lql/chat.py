"""Chat templates: the small part of Jinja that model chat templates are written in, rendered
the way Hugging Face renders them (``trim_blocks`` and ``lstrip_blocks`` on), with no
dependency. Anything outside that part is refused by name (`ChatTemplateError`), never
approximated.

Supported: text, ``{{ expr }}``, ``{% if %}/{% elif %}/{% else %}/{% endif %}``,
``{% for x in expr %}/{% endfor %}`` (with ``loop.first``, ``loop.last``, ``loop.index``,
``loop.index0``, ``loop.length``), ``{% set name = expr %}``, comments, whitespace control
(``{%- -%}``). Expressions: string, number, boolean and none literals, lists, names, ``a.b``,
``a['b']``, ``a[0]``, ``+``, ``~``, ``==``, ``!=``, ``<``, ``>``, ``<=``, ``>=``, ``in``,
``not in``, ``and``, ``or``, ``not``, ``is [not] defined|none|string``, the filters ``trim``
and ``length``, and ``raise_exception(message)``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .errors import LqlError


class ChatTemplateError(LqlError):
    """The model's chat template uses Jinja that this renderer does not implement, or raised."""


class _Undefined:
    def __bool__(self) -> bool:
        return False

    def __str__(self) -> str:
        return ""

    def __getattr__(self, name: str) -> _Undefined:
        return self

    def __getitem__(self, key: Any) -> _Undefined:
        return self


UNDEFINED = _Undefined()

_TAG = re.compile(r"(\{\{-?|\{%-?|\{#)(.*?)(-?\}\}|-?%\}|#\})", re.DOTALL)


@dataclass
class _Tok:
    kind: str  # "text" | "expr" | "stmt"
    value: str
    lstrip: bool = False  # "-" on the left: strip whitespace before
    rstrip: bool = False  # "-" on the right: strip whitespace after


def _lex(src: str) -> list[_Tok]:
    out: list[_Tok] = []
    pos = 0
    for m in _TAG.finditer(src):
        if m.start() > pos:
            out.append(_Tok("text", src[pos : m.start()]))
        opener, body, closer = m.group(1), m.group(2), m.group(3)
        pos = m.end()
        if opener == "{#":
            out.append(_Tok("comment", "", False, False))
            continue
        kind = "expr" if opener.startswith("{{") else "stmt"
        out.append(_Tok(kind, body.strip(), opener.endswith("-"), closer.startswith("-")))
    if pos < len(src):
        out.append(_Tok("text", src[pos:]))
    # whitespace control, then Hugging Face's trim_blocks / lstrip_blocks for block tags
    for i, t in enumerate(out):
        if t.kind == "text":
            continue
        if i > 0 and out[i - 1].kind == "text":
            prev = out[i - 1]
            if t.lstrip:
                prev.value = prev.value.rstrip()
            elif t.kind in ("stmt", "comment"):  # lstrip_blocks: spaces from the line start to the tag
                line_start = prev.value.rfind("\n") + 1
                if prev.value[line_start:].strip(" \t") == "":
                    prev.value = prev.value[:line_start]
        if i + 1 < len(out) and out[i + 1].kind == "text":
            nxt = out[i + 1]
            if t.rstrip:
                nxt.value = nxt.value.lstrip()
            elif t.kind in ("stmt", "comment") and nxt.value.startswith("\n"):  # trim_blocks
                nxt.value = nxt.value[1:]
    return [t for t in out if t.kind != "comment"]


# ---- expressions -----------------------------------------------------------------------

_EXPR_TOKEN = re.compile(r"""
    \s*(?:
      (?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
    | (?P<num>\d+)
    | (?P<op>==|!=|<=|>=|[-+~<>()\[\].,|])
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    )""", re.VERBOSE)

_ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"'}


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _EXPR_TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ChatTemplateError(f"the chat template has an expression this renderer does not read: {text!r}",
                                    hint="leave CHAT out (SET chat = off) to run the text as it is")
        kind = m.lastgroup
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


def _unquote(s: str) -> str:
    body, out, i = s[1:-1], [], 0
    while i < len(body):
        if body[i] == "\\" and i + 1 < len(body):
            out.append(_ESC.get(body[i + 1], "\\" + body[i + 1]))
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


class _Expr:
    """A recursive-descent parser that evaluates as it goes would evaluate untaken branches of
    ``and``/``or``; so expressions are parsed to closures and called later."""

    def __init__(self, text: str):
        self.text = text
        self.toks = _tokens(text)
        self.i = 0

    def peek(self, k: int = 0) -> tuple[str, str] | None:
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        t = self.peek()
        if t is None or (value is not None and t[1] != value):
            raise self.error(f"expected {value!r}" if value else "the expression ends too early")
        self.i += 1
        return t

    def error(self, what: str) -> ChatTemplateError:
        return ChatTemplateError(f"the chat template's expression {self.text!r} cannot be read here: {what}",
                                 hint="leave CHAT out (SET chat = off) to run the text as it is")

    def parse(self):
        fn = self.or_()
        if self.peek() is not None:
            raise self.error(f"unexpected {self.peek()[1]!r}")
        return fn

    def or_(self):
        left = self.and_()
        while self.peek() == ("name", "or"):
            self.take()
            right = self.and_()
            left = _or(left, right)
        return left

    def and_(self):
        left = self.not_()
        while self.peek() == ("name", "and"):
            self.take()
            right = self.not_()
            left = _and(left, right)
        return left

    def not_(self):
        if self.peek() == ("name", "not"):
            self.take()
            inner = self.not_()
            return lambda c: not inner(c)
        return self.compare()

    def compare(self):
        left = self.concat()
        while True:
            t = self.peek()
            if t is None:
                return left
            if t[1] in ("==", "!=", "<", ">", "<=", ">="):
                op = self.take()[1]
                right = self.concat()
                left = _binop(op, left, right)
            elif t == ("name", "in"):
                self.take()
                right = self.concat()
                left = _in(left, right, negate=False)
            elif t == ("name", "not") and self.peek(1) == ("name", "in"):
                self.take(), self.take()
                right = self.concat()
                left = _in(left, right, negate=True)
            elif t == ("name", "is"):
                self.take()
                neg = self.peek() == ("name", "not")
                if neg:
                    self.take()
                test = self.take()[1]
                left = _test(test, left, neg, self)
            else:
                return left

    def concat(self):
        left = self.postfix()
        while self.peek() is not None and self.peek()[1] in ("+", "~"):
            op = self.take()[1]
            right = self.postfix()
            if op == "~":
                left = _tilde(left, right)
            else:
                left = _plus(left, right)
        return left

    def postfix(self):
        fn = self.atom()
        while self.peek() is not None and self.peek()[1] in (".", "[", "|", "("):
            op = self.take()[1]
            if op == ".":
                name = self.take()[1]
                fn = _attr_of(fn, name)
            elif op == "[":
                key = self.or_()
                self.take("]")
                fn = _item_of(fn, key)
            elif op == "|":
                name = self.take()[1]
                fn = _filter(name, fn, self)
            else:
                args = []
                while self.peek() is not None and self.peek()[1] != ")":
                    args.append(self.or_())
                    if self.peek() is not None and self.peek()[1] == ",":
                        self.take()
                self.take(")")
                fn = _call_of(fn, args)
        return fn

    def atom(self):
        kind, value = self.take()
        if kind == "str":
            s = _unquote(value)
            return lambda c: s
        if kind == "num":
            n = int(value)
            return lambda c: n
        if value == "(":
            inner = self.or_()
            self.take(")")
            return inner
        if value == "[":
            items = []
            while self.peek() is not None and self.peek()[1] != "]":
                items.append(self.or_())
                if self.peek() is not None and self.peek()[1] == ",":
                    self.take()
            self.take("]")
            return lambda c: [f(c) for f in items]
        if kind == "name":
            if value in ("true", "True"):
                return lambda c: True
            if value in ("false", "False"):
                return lambda c: False
            if value in ("none", "None"):
                return lambda c: None
            if value == "raise_exception":
                return lambda c: _RAISE
            return lambda c: c.get(value, UNDEFINED)
        raise self.error(f"unexpected {value!r}")


_RAISE = object()


# Combinators: each returns a closure over already-parsed operands, evaluated on a context.
def _or(a, b):
    return lambda c: a(c) or b(c)


def _and(a, b):
    return lambda c: a(c) and b(c)


def _in(a, b, *, negate: bool):
    return (lambda c: a(c) not in b(c)) if negate else (lambda c: a(c) in b(c))


def _tilde(a, b):
    return lambda c: f"{a(c)}{b(c)}"


def _plus(a, b):
    return lambda c: a(c) + b(c)


def _attr_of(f, name: str):
    return lambda c: _attr(f(c), name)


def _item_of(f, key):
    return lambda c: _item(f(c), key(c))


def _call_of(f, args):
    return lambda c: _call(f, args, c)


def _binop(op: str, a, b):
    import operator

    fn = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, ">": operator.gt, "<=": operator.le,
          ">=": operator.ge}[op]
    return lambda c: fn(a(c), b(c))


def _test(name: str, fn, neg: bool, p: _Expr):
    tests = {"defined": lambda v: v is not UNDEFINED, "none": lambda v: v is None,
             "string": lambda v: isinstance(v, str)}
    if name not in tests:
        raise p.error(f"the test 'is {name}' is not implemented")
    t = tests[name]
    return (lambda c: not t(fn(c))) if neg else (lambda c: t(fn(c)))


def _filter(name: str, fn, p: _Expr):
    if name == "trim":
        return lambda c: str(fn(c)).strip()
    if name == "length":
        return lambda c: len(fn(c))
    raise p.error(f"the filter '|{name}' is not implemented")


def _call(f, args, c):
    target = f(c)
    if target is _RAISE:
        msg = args[0](c) if args else "the chat template refused the conversation"
        raise ChatTemplateError(f"the chat template refused: {msg}")
    raise ChatTemplateError("the chat template calls a function this renderer does not implement",
                            hint="leave CHAT out (SET chat = off) to run the text as it is")


def _attr(v: Any, name: str) -> Any:
    if isinstance(v, dict):
        return v.get(name, UNDEFINED)
    return getattr(v, name, UNDEFINED)


def _item(v: Any, key: Any) -> Any:
    try:
        return v[key]
    except (KeyError, IndexError, TypeError):
        return UNDEFINED


# ---- statements ------------------------------------------------------------------------


@dataclass
class _Loop:
    index0: int
    length: int

    @property
    def index(self) -> int:
        return self.index0 + 1

    @property
    def first(self) -> bool:
        return self.index0 == 0

    @property
    def last(self) -> bool:
        return self.index0 == self.length - 1


def _parse(toks: list[_Tok], i: int, stop: tuple[str, ...]) -> tuple[list, int, str | None]:
    """Nodes until a statement whose first word is in ``stop``; returns (nodes, index, word)."""
    nodes: list = []
    while i < len(toks):
        t = toks[i]
        if t.kind == "text":
            nodes.append(("text", t.value))
            i += 1
            continue
        if t.kind == "expr":
            nodes.append(("expr", _Expr(t.value).parse()))
            i += 1
            continue
        word = t.value.split(None, 1)[0] if t.value else ""
        if word in stop:
            return nodes, i, word
        if word == "if":
            branches = []
            cond = _Expr(t.value[2:]).parse()
            body, i, end = _parse(toks, i + 1, ("elif", "else", "endif"))
            branches.append((cond, body))
            while end == "elif":
                cond = _Expr(toks[i].value[4:]).parse()
                body, i, end = _parse(toks, i + 1, ("elif", "else", "endif"))
                branches.append((cond, body))
            if end == "else":
                body, i, end = _parse(toks, i + 1, ("endif",))
                branches.append((lambda c: True, body))
            if end != "endif":
                raise ChatTemplateError("the chat template has an {% if %} without {% endif %}")
            nodes.append(("if", branches))
            i += 1
            continue
        if word == "for":
            m = re.match(r"for\s+([A-Za-z_][A-Za-z0-9_]*)\s+in\s+(.+)$", t.value, re.DOTALL)
            if m is None:
                raise ChatTemplateError(f"the chat template's loop {t.value!r} is not one this renderer reads")
            body, i, end = _parse(toks, i + 1, ("endfor",))
            if end != "endfor":
                raise ChatTemplateError("the chat template has a {% for %} without {% endfor %}")
            nodes.append(("for", m.group(1), _Expr(m.group(2)).parse(), body))
            i += 1
            continue
        if word == "set":
            m = re.match(r"set\s+([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.+)$", t.value, re.DOTALL)
            if m is None:
                raise ChatTemplateError(f"the chat template's {{% {t.value} %}} is not one this renderer reads")
            nodes.append(("set", m.group(1), _Expr(m.group(2)).parse()))
            i += 1
            continue
        raise ChatTemplateError(f"the chat template uses {{% {word} %}}, which this renderer does not implement",
                                hint="leave CHAT out (SET chat = off) to run the text as it is")
    return nodes, i, None


def _run(nodes: list, ctx: dict) -> Iterator[str]:
    for node in nodes:
        kind = node[0]
        if kind == "text":
            yield node[1]
        elif kind == "expr":
            v = node[1](ctx)
            yield "" if v is None or v is UNDEFINED else str(v)
        elif kind == "if":
            for cond, body in node[1]:
                if cond(ctx):
                    yield from _run(body, ctx)
                    break
        elif kind == "for":
            _, name, seq, body = node
            items = list(seq(ctx) or [])
            saved = {k: ctx.get(k, UNDEFINED) for k in (name, "loop")}
            for n, item in enumerate(items):
                ctx[name], ctx["loop"] = item, _Loop(n, len(items))
                yield from _run(body, ctx)
            for k, v in saved.items():  # a loop's variables do not outlive it (Jinja scoping)
                if v is UNDEFINED:
                    ctx.pop(k, None)
                else:
                    ctx[k] = v
        elif kind == "set":
            ctx[node[1]] = node[2](ctx)


def render(template: str, messages: list[dict[str, str]], *, add_generation_prompt: bool = True,
           **variables: Any) -> str:
    """The template rendered for ``messages`` (``[{"role", "content"}]``), as Hugging Face's
    ``apply_chat_template(..., tokenize=False)`` renders it."""
    nodes, _, _ = _parse(_lex(template), 0, ())
    ctx: dict[str, Any] = {"messages": messages, "add_generation_prompt": add_generation_prompt, **variables}
    return "".join(_run(nodes, ctx))
