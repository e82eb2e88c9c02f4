"""HELP: the statement list, or one statement's entry, from every family's HELP text."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children

fam = family("help", module=__name__, statements=("help_stmt",), grammar=r"""
help_stmt: HELP help_word*

?help_word: NAME | _keyword
""")


@fam.rule
def help_stmt(c: Children) -> ast.Help:
    words = [t.value.upper() for t in c.raw[1:]]  # every word after HELP: the topic
    return ast.Help(topic=" ".join(words) if words else None)
