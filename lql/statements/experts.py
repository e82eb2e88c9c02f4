"""SHOW EXPERTS: the expert bank of each routed layer, from the plan (no tensor data read)."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children

fam = family("experts", module=__name__, statements=("show_experts",), grammar=r"""
show_experts: SHOW EXPERTS [AT LAYER INT]     // the expert banks of routed layers
""")

fam.doc('SHOW EXPERTS',
        'SHOW EXPERTS [AT LAYER n]',
        "each routed layer's expert bank: experts, top k, router, bytes per expert, always-read bytes",
        'SHOW EXPERTS AT LAYER 0;', order=90, aliases=('EXPERTS',))


@fam.rule
def show_experts(c: Children) -> ast.ShowExperts:
    return ast.ShowExperts(layer=c.int("LAYER"))
