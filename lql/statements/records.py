"""OBSERVE: a JSON-lines record of every write and token of a run, with a receipt."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children, Clause

fam = family("records", module=__name__, statements=("observe_stmt",), path_keywords=("INTO",), grammar=r"""
// OBSERVE: a JSON-lines record of every write of a run, with a receipt.
observe_stmt: OBSERVE prompt observe_option* RECORD INTO STRING

?observe_option: generate_clause
               | lens_clause
               | draft_clause
               | ablate_clause

lens_clause: LENS _LPAR token_ref (_COMMA token_ref)* _RPAR
""")

fam.doc('OBSERVE',
        "OBSERVE 'prompt' | TOKENS (ids) [GENERATE n] [LENS ('token', ...)] [DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)] RECORD INTO 'run.jsonl'",
        'a JSON-lines record of every write and token of a run, with a receipt (vindex3 record verify)',
        "OBSERVE 'Hello' GENERATE 4 RECORD INTO 'run.jsonl';", order=220)


@fam.rule
def observe_stmt(c: Children) -> ast.Observe:
    fields = c.options("OBSERVE")
    if "generate" in fields:
        fields["generate"] = fields["generate"][0]  # OBSERVE always generates n tokens; EXACTLY says so
    return ast.Observe(prompt=c.get("OBSERVE"), into=c.string("RECORD", "INTO"), **fields)


@fam.rule
def lens_clause(c: Children) -> Clause:
    return c.clause("lens", c.values(), "LENS")
