"""Reduced-depth drafts: the session's DRAFT DEPTH (and DRAFT OFF), DUMP LOGITS with provenance,
SCORE DRAFT against the full model, and the DRAFT LADDER over a prompt bank."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children

fam = family("drafts", module=__name__, statements=("draft_depth", "draft_off", "draft_ladder", "dump_stmt", "score_stmt"),
             path_keywords=("INTO", "AGAINST", "ON", "DRAFT"), grammar=r"""
draft_depth: draft_clause
draft_off: DRAFT OFF
draft_ladder: DRAFT LADDER DEPTHS _LPAR int_list _RPAR ON STRING [INTO STRING] [PLOT INTO STRING] [overwrite_clause]

dump_stmt: DUMP LOGITS prompt dump_option* INTO STRING [overwrite_clause]

?dump_option: draft_clause
            | ablate_clause

score_stmt: SCORE DRAFT STRING AGAINST STRING
""")


@fam.rule
def draft_depth(c: Children) -> ast.DraftDepth:
    return ast.DraftDepth(depth=c.options("DRAFT DEPTH")["depth"])


@fam.rule
def draft_off(c: Children) -> ast.DraftOff:
    return ast.DraftOff()


@fam.rule
def draft_ladder(c: Children) -> ast.DraftLadder:
    return ast.DraftLadder(depths=c.get("DEPTHS"), prompts=c.string("ON"), into=c.string("INTO", exact=True),
                           plot=c.string("PLOT", "INTO"), overwrite="overwrite" in c.options("DRAFT LADDER"))


@fam.rule
def dump_stmt(c: Children) -> ast.DumpLogits:
    fields = c.options("DUMP LOGITS")
    overwrite = fields.pop("overwrite", False)
    return ast.DumpLogits(prompt=c.get("LOGITS"), into=c.string("INTO"), overwrite=overwrite, **fields)


@fam.rule
def score_stmt(c: Children) -> ast.ScoreDraft:
    return ast.ScoreDraft(draft=c.string("SCORE", "DRAFT"), target=c.string("AGAINST"))
