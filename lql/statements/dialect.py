"""The reference dialect's facts: SHOW MODELS, SHOW COMPACT STATUS, and its knowledge-graph
views (SHOW ENTITIES, SHOW RELATIONS, SELECT ... FROM EDGES | ENTITIES), refused by name where
this build has no honest meaning for them."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children, Clause
from .features import select_fields

fam = family("dialect", module=__name__, statements=("show_models", "show_compact_status", "show_entities",
                                                      "show_relations", "select_graph"), grammar=r"""
show_models: SHOW MODELS
show_compact_status: SHOW COMPACT STATUS
show_entities: SHOW ENTITIES [INT | AT LAYER INT] [limit_clause]
show_relations: SHOW RELATIONS relations_option*

?relations_option: at_layer_clause
                 | with_examples_clause
                 | detail_clause
with_examples_clause: WITH EXAMPLES

select_graph: SELECT select_list FROM (EDGES | ENTITIES) [nearest_clause] [where_clause] [order_clause] [limit_clause]
""")

fam.doc('SHOW MODELS',
        'SHOW MODELS',
        'the containers in the current directory',
        'SHOW MODELS;', order=330, aliases=('MODELS',))
fam.doc('SHOW COMPACT STATUS',
        'SHOW COMPACT STATUS',
        'edits waiting to be compacted: none, this build has no patch overlay',
        'SHOW COMPACT STATUS;', order=350)
fam.doc('SHOW ENTITIES',
        'SHOW ENTITIES [n | AT LAYER n] [LIMIT n]',
        "refused: the reference system's knowledge-graph entities; this build keeps FFN features (SHOW FEATURES n, DESCRIBE)",
        'SHOW FEATURES 0 LIMIT 5;', order=360)
fam.doc('SHOW RELATIONS',
        'SHOW RELATIONS [AT LAYER n] [WITH EXAMPLES] [VERBOSE | BRIEF | RAW]',
        "refused: this build's feature metadata carries no relation labels",
        "DESCRIBE 'France';", order=370)


@fam.rule
def show_models(c: Children) -> ast.ShowModels:
    return ast.ShowModels()


@fam.rule
def show_compact_status(c: Children) -> ast.ShowCompactStatus:
    return ast.ShowCompactStatus()


@fam.rule
def show_entities(c: Children) -> ast.ShowEntities:
    # SHOW ENTITIES [INT | AT LAYER INT] [limit_clause]
    layer = c.int("ENTITIES") if c.get("ENTITIES") is not None else c.int("LAYER")
    return ast.ShowEntities(layer=layer, limit=c.options("SHOW ENTITIES").get("limit"))


@fam.rule
def show_relations(c: Children) -> ast.ShowRelations:
    fields = c.options("SHOW RELATIONS")
    if "at_layer" in fields:
        fields["layer"] = fields.pop("at_layer")
    return ast.ShowRelations(**fields)


@fam.rule
def with_examples_clause(c: Children) -> Clause:
    return c.clause("examples", True)


@fam.rule
def select_graph(c: Children) -> ast.SelectGraph:
    # SELECT list FROM EDGES | ENTITIES [nearest] [where] [order] [limit]
    opts = c.options("SELECT")
    fields = select_fields(c, opts)
    nearest = opts.get("nearest")
    if isinstance(nearest, tuple):
        fields["nearest"], fields["nearest_layer"] = nearest
    else:
        fields["nearest"] = nearest
    return ast.SelectGraph(table=c.which("EDGES", "ENTITIES"), **fields)
