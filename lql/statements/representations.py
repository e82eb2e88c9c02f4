"""Representations and maintenance: REPRESENT (the bound container in another weight encoding),
COMPACT (its referenced files only), DIFF (how two containers differ), SCORE REPRESENTATION
(a representation's behaviour against the same model)."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children, Clause

fam = family("representations", module=__name__, statements=("represent_stmt", "compact_stmt", "diff_stmt",
                                                              "diff_ref", "score_representation_stmt"),
             path_keywords=("INTO", "AGAINST", "ON"), grammar=r"""
represent_stmt: REPRESENT INTO STRING ENCODING STRING

compact_stmt: COMPACT INTO STRING

diff_stmt: DIFF STRING [STRING]
diff_ref: DIFF STRING (STRING | CURRENT) diff_option+
?diff_option: diff_layer_clause
            | limit_clause
            | physical_clause
            | into_patch_clause
diff_layer_clause: LAYER INT
physical_clause: PHYSICAL
into_patch_clause: INTO PATCH STRING

score_representation_stmt: SCORE REPRESENTATION STRING AGAINST STRING ON STRING [GREEDY INT]
""")


@fam.rule
def represent_stmt(c: Children) -> ast.Represent:
    return ast.Represent(into=c.string("INTO"), encoding=c.string("ENCODING"))


@fam.rule
def compact_stmt(c: Children) -> ast.Compact:
    return ast.Compact(into=c.string("INTO"))


@fam.rule
def diff_stmt(c: Children) -> ast.Diff:
    a, b = (c.all("DIFF") + [None])[:2]
    return ast.Diff(a=c.string_of(a), b=c.string_of(b))


@fam.rule
def diff_ref(c: Children) -> ast.Diff:
    # DIFF STRING (STRING | CURRENT) diff_option+
    a, b = (c.all("DIFF") + [None])[:2]
    current = c.has("CURRENT")
    return ast.Diff(a=c.string_of(a), b=None if current else c.string_of(b), b_current=current, **c.options("DIFF"))


@fam.rule
def diff_layer_clause(c: Children) -> Clause:
    return c.clause("layer", c.int("LAYER"))


@fam.rule
def physical_clause(c: Children) -> Clause:
    return c.clause("physical", True)


@fam.rule
def into_patch_clause(c: Children) -> Clause:
    return c.clause("into_patch", c.string("INTO", "PATCH"))


@fam.rule
def score_representation_stmt(c: Children) -> ast.ScoreRepresentation:
    return ast.ScoreRepresentation(candidate=c.string("SCORE", "REPRESENTATION"), reference=c.string("AGAINST"),
                                   prompts=c.string("ON"), greedy=c.int("GREEDY"))
