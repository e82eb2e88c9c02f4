"""The statement families: one module each, registered here, and every list derived from them.

A family (``lql/statements/<name>.py``, or any module that calls `family`) holds everything about
its statements: the grammar fragment with the rules it owns and which of them are statements,
the function of each rule (parse tree -> AST, `lql.syntax`), its AST classes (subclasses of
`lql.ast.Statement`, carrying their HELP text, the paths they read and write and whether they
only read), ``plans`` (AST -> plan node; a statement with none gets the identity plan) and
``runs`` (plan node -> result), and its result classes (subclasses of `lql.results.Result` with
``layout`` and ``records``). The grammar, the statement union, HELP, the server's policy, the
REPL's completion and the renderer's dispatch are all read from here.

The built-in families are found by importing every module of `lql.statements` the first time
anything asks (`discover`): the one place lql imports its families, and only in this direction.
A family registered later (a test's toy, a plug-in) is one `family(...)` call away; the parser
rebuilds its grammar for it (`generation` counts registrations)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import syntax

#: Each registration adds one; the parser rebuilds its grammar when this moved.
generation = 0

FAMILIES: dict[str, Family] = {}

#: plan functions by AST class: (fn(stmt, ctx) -> node, family name)
PLANNERS: dict[type, tuple[Callable[..., Any], str]] = {}
#: run functions by plan-node class (or by AST class, for the identity plan): (fn(session, node), family)
RUNNERS: dict[type, tuple[Callable[..., Any], str]] = {}

_discovered = False


@dataclass(frozen=True)
class Doc:
    """One HELP entry: the statement as written, its syntax, what it does, an example that runs.
    ``order`` places it in HELP's list (a family's entries keep their own order after it)."""

    name: str
    syntax: str
    summary: str
    example: str
    order: float = 1000.0
    aliases: tuple[str, ...] = ()  # other topics HELP answers with this entry (USE for OPEN)


@dataclass
class Family:
    """A statement family (see the module docstring). Made by `family`."""

    name: str
    module: str
    grammar: str = ""
    statements: tuple[str, ...] = ()
    docs: list[Doc] = field(default_factory=list)
    #: keywords after which a quoted string is a file path (the REPL completes paths there)
    path_keywords: frozenset[str] = frozenset()
    #: labelled examples of common mistakes (Lark's match_examples) and the hint for each label
    hint_examples: dict[str, list[str]] = field(default_factory=dict)
    hints: dict[str, str] = field(default_factory=dict)
    #: what a whole number means after a keyword, for "expected a whole number" hints
    number_hints: dict[str, str] = field(default_factory=dict)

    def rule(self, fn_or_name: Callable | str):
        """Register the decorated function for the grammar rule (or alias) of its name, or of the
        name given: ``@fam.rule`` / ``@fam.rule("show_layers")``."""
        def register(fn: Callable, name: str | None = None) -> Callable:
            syntax.register_rule(name or fn.__name__, fn, self.name)
            _bump()
            return fn

        if callable(fn_or_name):
            return register(fn_or_name)
        return lambda fn: register(fn, fn_or_name)

    def plans(self, stmt_type: type):
        """Register the function that binds ``stmt_type`` into a plan node: ``fn(stmt, ctx)``."""
        def register(fn: Callable) -> Callable:
            _claim(PLANNERS, stmt_type, fn, self.name, "plan")
            return fn

        return register

    def runs(self, node_type: type):
        """Register the function that runs plan nodes of ``node_type`` (or, for a statement with
        the identity plan, its AST class): ``fn(session, node) -> Result``."""
        def register(fn: Callable) -> Callable:
            _claim(RUNNERS, node_type, fn, self.name, "runner")
            return fn

        return register

    def layout(self, result_type: type):
        """Make the decorated ``fn(result, timing) -> lines`` the text layout of ``result_type``."""
        def register(fn: Callable) -> Callable:
            result_type.layout = fn
            return fn

        return register

    def records(self, result_type: type):
        """Make the decorated ``fn(result) -> rows`` the rows of ``result_type``."""
        def register(fn: Callable) -> Callable:
            result_type.records = fn
            return fn

        return register

    def doc(self, name: str, syntax: str, summary: str, example: str, *, order: float | None = None,
            aliases: tuple[str, ...] = ()) -> Doc:
        d = Doc(name, syntax, summary, example, order if order is not None else 1000.0 + len(self.docs) / 100,
                tuple(aliases))
        self.docs.append(d)
        _bump()
        return d


def _bump() -> None:
    global generation
    generation += 1


def _claim(table: dict, key: type, fn: Callable, owner: str, what: str) -> None:
    if key in table and table[key][0] is not fn:
        raise ValueError(f"{key.__name__} has two {what}s ({table[key][1]} and {owner})")
    table[key] = (fn, owner)


def family(name: str, *, grammar: str = "", statements: tuple[str, ...] | list[str] = (), module: str | None = None,
           path_keywords: tuple[str, ...] = (), hint_examples: dict[str, list[str]] | None = None,
           hints: dict[str, str] | None = None, number_hints: dict[str, str] | None = None) -> Family:
    """Register a statement family. ``grammar`` is its Lark fragment; ``statements`` the rules of
    it that are whole statements (the alternatives of ``_statement``). A family's name is taken
    once."""
    if name in FAMILIES:
        raise ValueError(f"statement family {name!r} is registered twice")
    fam = Family(name=name, module=module or name, grammar=grammar, statements=tuple(statements),
                 path_keywords=frozenset(path_keywords), hint_examples=dict(hint_examples or {}),
                 hints=dict(hints or {}), number_hints=dict(number_hints or {}))
    FAMILIES[name] = fam
    _bump()
    return fam


def unregister(name: str) -> None:
    """Remove a family registered with `family` (a test's toy, a plug-in being unloaded): its
    grammar rules, plans, runners and HELP entries go with it; the parser rebuilds without it."""
    fam = FAMILIES.pop(name, None)
    if fam is None:
        raise KeyError(f"no statement family {name!r} is registered")
    for table in (PLANNERS, RUNNERS):
        for key in [k for k, (_fn, owner) in table.items() if owner == name]:
            del table[key]
    for rule in [r for r, (_fn, owner) in syntax.RULES.items() if owner == name]:
        del syntax.RULES[rule]
    _bump()


def discover() -> None:
    """Import every module of `lql.statements` once (each registers its family)."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    from . import statements

    for info in sorted(pkgutil.iter_modules(statements.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{statements.__name__}.{info.name}")


def families() -> list[Family]:
    discover()
    return list(FAMILIES.values())


def planner_for(stmt_type: type) -> Callable | None:
    discover()
    entry = PLANNERS.get(stmt_type)
    return entry[0] if entry else None


def runner_for(node_type: type) -> Callable | None:
    discover()
    entry = RUNNERS.get(node_type)
    return entry[0] if entry else None


def run(session, node):
    """Run one plan node: the runner its family registered for the node's class (for the
    identity plan, for the statement's class). A node no family runs is a bug, named."""
    key = type(node.statement) if getattr(type(node), "runs_statement", False) else type(node)
    fn = runner_for(key)
    if fn is None:
        raise NotImplementedError(f"no statement family runs {type(node).__name__}")
    return fn(session, node)


def docs() -> list[Doc]:
    """Every HELP entry, in HELP's order."""
    return sorted((d for f in families() for d in f.docs), key=lambda d: d.order)


def statement_classes() -> list[type]:
    """Every concrete statement class the families define, in definition order."""
    from .ast import CLASSES

    discover()
    modules = {f.module for f in FAMILIES.values()} | {"lql.ast"}
    return [c for c in CLASSES.values() if c.__module__ in modules]


def owner_of(cls: type) -> Family | None:
    """The family whose module defines ``cls``."""
    for f in families():
        if cls.__module__ == f.module:
            return f
    return None
