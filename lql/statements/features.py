"""Looking inside the FFN as a database of features: WALK, DESCRIBE, SELECT ... FROM FEATURES,
SHOW FEATURES, EXPLAIN INFER ... FEATURES (the features most active in a real run), and BUILD
FEATURES (the feature metadata, derived data kept in the container)."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import BuildError, Children, Clause

fam = family("features", module=__name__, statements=(
    "walk_stmt", "explain_walk", "describe_stmt", "select_stmt", "show_features_stmt", "show_features_ref",
    "explain_features_stmt", "explain_infer_ref", "build_features_stmt"), grammar=r"""
walk_stmt: WALK prompt walk_option*

?walk_option: top_clause
            | layers_clause
            | layers_all_clause
            | mode_clause
            | compare_clause
            | detail_clause

explain_walk: EXPLAIN walk_stmt

describe_stmt: DESCRIBE STRING describe_option*

?describe_option: top_clause
                | layers_clause
                | band_clause
                | at_layer_clause
                | relations_only_clause
                | detail_clause

// SELECT columns FROM FEATURES, SQL's clause order; columns and conditions are typed by the
// planner (FEATURE_COLUMNS below), an unknown column is refused by name.
select_stmt: SELECT select_list FROM FEATURES [feature_scope] [nearest_clause] [where_clause] [order_clause] [limit_clause]

?feature_scope: AT LAYER INT             -> at_layer
             | layers_clause

show_features_stmt: SHOW FEATURES AT LAYER INT [limit_clause]
show_features_ref: SHOW FEATURES INT [where_clause] [limit_clause]   // the reference's SHOW FEATURES n

// EXPLAIN INFER ... FEATURES: the features most active at the last position of a real run.
explain_features_stmt: EXPLAIN infer_stmt FEATURES features_option*

?features_option: top_clause
                | layers_clause

// the reference's EXPLAIN INFER options, onto ... FEATURES
explain_infer_ref: EXPLAIN infer_stmt explain_ref_option+

?explain_ref_option: layers_clause
                   | verbose_clause
                   | band_clause
                   | relations_only_clause
                   | with_attention_clause
                   | top_clause

with_attention_clause: WITH ATTENTION

// BUILD FEATURES: make the feature metadata (a derived representation) now.
build_features_stmt: BUILD FEATURES [layers_clause]
""")

fam.doc('WALK',
        "[EXPLAIN] WALK 'text' | TOKENS (ids) [TOP n] [LAYERS a-b | ALL] [MODE pure] [VERBOSE]",
        "per FFN layer, the features whose gates answer the last token's embedding, and what they write",
        "WALK 'The capital of France is' TOP 3;", order=170, aliases=('EXPLAIN WALK',))
fam.doc('DESCRIBE',
        "DESCRIBE 'entity' [LAYERS a-b | AT LAYER n | ALL LAYERS | SYNTAX | KNOWLEDGE | OUTPUT] [TOP n] [VERBOSE | BRIEF | RAW]",
        "edges entity -> token through the features the entity's embedding opens (SET threshold)",
        "DESCRIBE 'France';", order=180)
fam.doc('SELECT',
        "SELECT layer, feature, token, score | * FROM FEATURES [AT LAYER n | LAYERS a-b] [NEAREST TO 'text' [AT LAYER n]] [WHERE column op value [AND ...]] [ORDER BY column [ASC | DESC]] [LIMIT n]",
        'query the FFN features as a table (op: =, !=, <, <=, >, >=, IN (v, ...), and LIKE for token)',
        "SELECT layer, feature, token, score FROM FEATURES NEAREST TO 'Paris' LIMIT 5;", order=190, aliases=('SELECT FROM FEATURES', 'SELECT FROM EDGES', 'SELECT FROM ENTITIES'))
fam.doc('SHOW FEATURES',
        'SHOW FEATURES [AT LAYER] n [WHERE ...] [LIMIT n]',
        "a layer's features in order, each with the top tokens its down column writes",
        'SHOW FEATURES AT LAYER 0 LIMIT 5;', order=200, aliases=('FEATURES',))
fam.doc('BUILD FEATURES',
        'BUILD FEATURES [LAYERS a-b]',
        'build (or check) the feature metadata now: the tokens each FFN feature writes, kept as derived data',
        'BUILD FEATURES;', order=210, aliases=('BUILD',))


@fam.rule
def walk_stmt(c: Children) -> ast.Walk:
    return ast.Walk(prompt=c.get("WALK"), **c.options("WALK"))


@fam.rule
def explain_walk(c: Children) -> ast.Walk:
    return c.get("EXPLAIN").model_copy(update={"explain": True, **c.pos})


@fam.rule
def describe_stmt(c: Children) -> ast.Describe:
    return ast.Describe(entity=c.string("DESCRIBE"), **c.options("DESCRIBE"))


@fam.rule
def at_layer(c: Children) -> Clause:
    n = c.int("AT", "LAYER")
    return c.clause("at_layer", (n, n))


def select_fields(c: Children, opts: dict) -> dict:
    """The fields SELECT ... FROM FEATURES and FROM EDGES | ENTITIES share."""
    fields: dict = {"columns": c.get("SELECT"), "where": opts.get("where") or [], "limit": opts.get("limit")}
    if "order" in opts:
        fields["order_by"], fields["descending"] = opts["order"]
    return fields


@fam.rule
def select_stmt(c: Children) -> ast.SelectFeatures:
    # SELECT list FROM FEATURES [scope] [nearest] [where] [order] [limit]
    opts = c.options("SELECT")
    fields = select_fields(c, opts)
    nearest = opts.get("nearest")
    scope = ("at_layer", opts["at_layer"]) if "at_layer" in opts else ("layers", opts["layers"]) if "layers" in opts else None
    if isinstance(nearest, tuple):
        nearest, layer = nearest
        if scope is not None:
            raise BuildError("NEAREST TO ... AT LAYER n and a layer scope before it are both given", c.keyword("FEATURES"),
                             hint="keep one: SELECT ... FROM FEATURES NEAREST TO 'text' AT LAYER n")
        scope = ("at_layer", (layer, layer))
    fields["nearest"] = nearest
    if scope is not None:
        fields["layers"], fields["at_layer"] = scope[1], scope[0] == "at_layer"
    return ast.SelectFeatures(**fields)


@fam.rule
def show_features_stmt(c: Children) -> ast.ShowFeatures:
    return ast.ShowFeatures(layer=c.int("LAYER"), limit=c.options("SHOW FEATURES").get("limit"))


@fam.rule
def show_features_ref(c: Children) -> ast.ShowFeatures | ast.SelectFeatures:
    # SHOW FEATURES INT [where_clause] [limit_clause]: the reference's SHOW FEATURES n
    opts = c.options("SHOW FEATURES")
    layer, where, limit = c.int("FEATURES"), opts.get("where"), opts.get("limit")
    if where is None:
        return ast.ShowFeatures(layer=layer, limit=limit)
    return ast.SelectFeatures(layers=(layer, layer), at_layer=True, where=where, limit=limit)


@fam.rule
def explain_features_stmt(c: Children) -> ast.ExplainFeatures:
    fields = c.options("EXPLAIN INFER ... FEATURES", first=c.keyword("FEATURES"))
    return ast.ExplainFeatures(infer=c.get("EXPLAIN"), **fields)


@fam.rule
def with_attention_clause(c: Children) -> Clause:
    return c.clause("attention", True)


@fam.rule
def explain_infer_ref(c: Children) -> ast.ExplainFeatures:
    inf = c.get("EXPLAIN")
    fields = c.options("EXPLAIN INFER")
    if inf.top is not None:
        if "top" in fields:
            raise BuildError("TOP is given twice in one EXPLAIN INFER", c.first, hint="keep one TOP clause")
        fields["top"] = inf.top
        inf = inf.model_copy(update={"top": None})
    if "detail" in fields:
        fields["verbose"] = fields.pop("detail") == "verbose"
    return ast.ExplainFeatures(infer=inf, reference=True, **fields)


@fam.rule
def build_features_stmt(c: Children) -> ast.BuildFeatures:
    return ast.BuildFeatures(layers=c.options("BUILD FEATURES").get("layers"))
