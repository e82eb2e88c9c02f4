"""Running the model: INFER (the next-token distribution, greedy generation, self-speculative
decoding), EXPLAIN (the plan of the model or of the very INFER given, without running a token)
and TRACE (which layers ran at each position, and with EXPERTS each routed layer's choice)."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children, Clause

fam = family("infer", module=__name__, statements=("infer_stmt", "explain_stmt", "explain_infer", "trace_stmt"),
             grammar=r"""
infer_stmt: INFER prompt infer_option*

?infer_option: top_clause
             | generate_clause
             | draft_clause
             | speculate_clause
             | lookahead_clause
             | chat_clause
             | ablate_clause
             | compare_clause

chat_clause: CHAT
speculate_clause: SPECULATE DEPTH INT
lookahead_clause: LOOKAHEAD INT

explain_stmt: EXPLAIN [draft_clause]
explain_infer: EXPLAIN infer_stmt

trace_stmt: TRACE prompt trace_option*

?trace_option: draft_clause
             | ablate_clause
             | experts_clause

// TRACE ... EXPERTS: the routing of each position (which experts, with what weights)
experts_clause: EXPERTS [AT LAYER INT]
""")

fam.doc('EXPLAIN',
        'EXPLAIN [DRAFT DEPTH n] | EXPLAIN INFER ... | EXPLAIN INFER ... FEATURES [TOP n] [LAYERS a-b]',
        'the plan without running a token (of the very INFER given): ops, operands, state, bytes read; ... FEATURES: the FFN features most active in the run',
        'EXPLAIN DRAFT DEPTH 2;', order=30)
fam.doc('INFER',
        "INFER 'prompt' | TOKENS (ids) [TOP n] [GENERATE n [EXACTLY]] [DRAFT DEPTH n] [SPECULATE DEPTH d [LOOKAHEAD k]] [CHAT] [ABLATE FEATURES (L:f, ...)]",
        'next-token distribution (TOP), greedy continuation (GENERATE), self-speculative decoding',
        "INFER 'The capital of France is' TOP 3;", order=110, aliases=('SPECULATE', 'GENERATE', 'CHAT', 'EXACTLY', 'ABLATE', 'ABLATE FEATURES'))
fam.doc('TRACE',
        "TRACE 'prompt' | TOKENS (ids) [DRAFT DEPTH n] [EXPERTS [AT LAYER n]] [ABLATE FEATURES (L:f, ...)] | TRACE 'prompt' FOR 'token' [LAYERS a-b] [POSITIONS LAST | ALL] [DECOMPOSE] [SAVE [INTO] 'trace.npz'] [DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)]",
        "which layers ran at each position, and the next token there; with EXPERTS, each routed layer's experts and their weights; FOR 'token': the token's rank per layer (logit lens), DECOMPOSE: its logit split exactly over every write",
        "TRACE 'The capital of France is' FOR ' Paris' DECOMPOSE;", order=120, aliases=('DECOMPOSE', 'TRACE FOR'))


@fam.rule
def infer_stmt(c: Children) -> ast.Infer:
    fields = c.options("INFER")
    if "generate" in fields:
        fields["generate"], fields["exactly"] = fields["generate"]
    return ast.Infer(prompt=c.get("INFER"), **fields)


@fam.rule
def chat_clause(c: Children) -> Clause:
    return c.clause("chat", True)


@fam.rule
def speculate_clause(c: Children) -> Clause:
    return c.clause("speculate", c.int("DEPTH"), "SPECULATE DEPTH")


@fam.rule
def lookahead_clause(c: Children) -> Clause:
    return c.clause("lookahead", c.int("LOOKAHEAD"))


@fam.rule
def explain_stmt(c: Children) -> ast.Explain:
    return ast.Explain(depth=c.options("EXPLAIN").get("depth"))


@fam.rule
def explain_infer(c: Children) -> ast.Explain:
    inf = c.get("EXPLAIN")
    return ast.Explain(prompt=inf.prompt, depth=inf.depth, infer=inf)


@fam.rule
def trace_stmt(c: Children) -> ast.Trace:
    return ast.Trace(prompt=c.get("TRACE"), **c.options("TRACE"))


@fam.rule
def experts_clause(c: Children) -> Clause:
    return c.clause("experts", ast.ExpertsClause(layer=c.int("LAYER")))
