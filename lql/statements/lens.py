"""TRACE ... FOR 'token': the token's rank at every layer through the model's own head (the
logit lens), DECOMPOSE its logit exactly over every write, SAVE the residual stream; and the
reference dialect's TRACE without FOR."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import BuildError, Children, Clause

fam = family("lens", module=__name__, statements=("trace_for_stmt", "trace_ref_stmt"), path_keywords=("INTO",),
             grammar=r"""
// TRACE 'text' FOR 'token': the logit lens per layer, DECOMPOSE the token's logit exactly.
trace_for_stmt: TRACE prompt FOR token_ref trace_for_option*

?trace_for_option: layers_clause
                 | positions_clause
                 | decompose_clause
                 | save_clause
                 | draft_clause
                 | ablate_clause
                 | save_file_clause

positions_clause: POSITIONS (LAST | ALL)
decompose_clause: DECOMPOSE
save_clause: SAVE INTO STRING
save_file_clause: SAVE STRING            // the reference's SAVE 'f' (needs POSITIONS ALL there and here)

// TRACE 'text' [DECOMPOSE] [LAYERS a-b] [POSITIONS ...] [SAVE 'f'] without FOR: the reference
// traces the predicted token; the options are the TRACE ... FOR ones
trace_ref_stmt: TRACE prompt trace_ref_option+

?trace_ref_option: layers_clause
                 | positions_clause
                 | decompose_clause
                 | save_clause
                 | save_file_clause
""")


def _trace_fields(c: Children, statement: str) -> dict:
    """TRACE options, with the reference's SAVE 'f' (save_file) folded into save."""
    fields = c.options(statement)
    if "save_file" in fields:
        if "save" in fields:
            raise BuildError(f"SAVE is given twice in one {statement}", c.first, hint="keep one SAVE clause")
        fields["save"], fields["save_file"] = fields.pop("save_file"), True
    return fields


@fam.rule
def trace_for_stmt(c: Children) -> ast.TraceFor:
    return ast.TraceFor(prompt=c.get("TRACE"), token=c.get("FOR"), **_trace_fields(c, "TRACE ... FOR"))


@fam.rule
def trace_ref_stmt(c: Children) -> ast.TraceFor:
    return ast.TraceFor(prompt=c.get("TRACE"), token=None, **_trace_fields(c, "TRACE"))


@fam.rule
def positions_clause(c: Children) -> Clause:
    return c.clause("positions", c.which("LAST", "ALL"))


@fam.rule
def decompose_clause(c: Children) -> Clause:
    return c.clause("decompose", True)


@fam.rule
def save_clause(c: Children) -> Clause:
    return c.clause("save", c.string("SAVE", "INTO"), "SAVE INTO")


@fam.rule
def save_file_clause(c: Children) -> Clause:
    return c.clause("save_file", c.string("SAVE"))
