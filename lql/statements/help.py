"""HELP: the statement list, or one statement's entry, from every family's HELP text."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import ClassVar, Literal

from .. import ast, catalog, registry
from ..errors import StatementError
from ..planner import Node
from ..registry import Doc, family
from ..results import Result
from ..syntax import Children

fam = family("help", module=__name__, statements=("help_stmt",), grammar=r"""
help_stmt: HELP help_word*

?help_word: NAME | _keyword
""")

fam.doc('HELP',
        'HELP [statement]',
        "this help, or one statement's",
        'HELP INFER;', order=460)


class Help(ast.Statement):
    keyword: ClassVar[str] = "HELP"
    paths: ClassVar[tuple[str, ...]] = ()
    read_only: ClassVar[bool] = True
    local_when_remote: ClassVar[bool] = True  # the statement catalogue is this client's
    kind: Literal["help"] = "help"
    topic: str | None = None  # upper-cased words, e.g. "SHOW LAYERS"


class HelpResult(Result):
    kind: Literal["help"] = "help"
    topic: str | None
    text: str

    def layout(self, timing: bool) -> list[str]:
        return self.text.rstrip("\n").split("\n")


@fam.rule
def help_stmt(c: Children) -> Help:
    words = [t.value.upper() for t in c.raw[1:]]  # every word after HELP: the topic
    return Help(topic=" ".join(words) if words else None)


@dataclass(frozen=True, eq=False)
class HelpText(Node):
    topic: str | None
    text: str


@fam.plans(Help)
def plan_help(s: Help, ctx) -> HelpText:
    text = help_text(s.topic)
    if text is None:
        close = closest_topics(s.topic)
        raise StatementError(
            f"HELP has no entry for {s.topic!r}",
            hint=(f"did you mean {' or '.join(close)}? " if close else "") + "HELP alone lists every statement",
        )
    return HelpText(s, topic=s.topic, text=text)


@fam.runs(HelpText)
def run_help(session, node: HelpText) -> HelpResult:
    return HelpResult(topic=node.topic, text=node.text)


# ---- the statement catalogue, from every family's HELP entries ----------------------------------


def find_statement(topic: str) -> Doc | None:
    """The HELP entry of a topic: a statement's name or one of its aliases, case and spacing
    aside. ``SHOW`` alone names no single entry."""
    topic = " ".join(topic.upper().split())
    docs = registry.docs()
    for d in docs:
        if d.name == topic:
            return d
    for d in docs:
        if topic in d.aliases:
            return d
    return None


def closest_topics(topic: str) -> list[str]:
    return difflib.get_close_matches(topic.upper(), [d.name for d in registry.docs()], n=3, cutoff=0.5)


def help_text(topic: str | None) -> str | None:
    """HELP's text; None when the topic names no statement."""
    docs = registry.docs()
    if topic is None:
        width = max(len(d.name) for d in docs)
        lines = ["LQL statements (HELP name for one; statements end with ';'; keywords are case-insensitive):", ""]
        lines += [f"  {d.name.ljust(width)}  {d.summary}" for d in docs]
        return "\n".join(lines)
    if topic.upper().strip() == "SHOW":
        return "\n".join(f"{d.syntax}\n  {d.summary}" for d in docs if d.name.startswith("SHOW "))
    d = find_statement(topic)
    if d is None:
        return None
    text = f"{d.syntax}\n  {d.summary}\n  example: {d.example}"
    if d.name == "SET":
        text += "\n" + catalog.settings_text()
    return text


def topics() -> list[str]:
    """Statement names HELP has an entry for (the REPL completes them): every entry's name
    (``SHOW LAYERS``, ``DRAFT DEPTH``...) and every statement's own name HELP resolves
    (``USE``, ``DRAFT OFF``)."""
    names = {d.name for d in registry.docs()}
    names |= {cls.keyword for cls in registry.statement_classes() if cls.keyword}
    names.add("USE")
    return sorted(n for n in names if find_statement(n) is not None)
