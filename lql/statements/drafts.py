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

fam.doc('DRAFT DEPTH',
        'DRAFT DEPTH n | DRAFT OFF',
        "set (or clear) the session's default draft depth for INFER, TRACE, EXPLAIN, DUMP LOGITS",
        'DRAFT DEPTH 2;', order=130, aliases=('DRAFT', 'DRAFT OFF'))
fam.doc('DRAFT LADDER',
        "DRAFT LADDER DEPTHS (d, ...) ON 'prompts.jsonl' [INTO 'ladder.json'] [PLOT INTO 'ladder.png']",
        'score each draft depth against the full model over a prompt bank',
        "DRAFT LADDER DEPTHS (1, 2, 4) ON 'prompts.jsonl';", order=140, aliases=('PLOT',))
fam.doc('DUMP LOGITS',
        "DUMP LOGITS 'prompt' | TOKENS (ids) [DRAFT DEPTH n] [ABLATE FEATURES (L:f, ...)] INTO 'file.f32'",
        'write raw float32 logits [positions, vocab] and a provenance sidecar',
        "DUMP LOGITS 'Hello' DRAFT DEPTH 2 INTO 'draft.f32';", order=150, aliases=('DUMP',))
fam.doc('SCORE DRAFT',
        "SCORE DRAFT 'draft.f32' AGAINST 'target.f32'",
        "compare a draft's logit dump with the full model's: KL, top-1, ranks",
        "SCORE DRAFT 'draft.f32' AGAINST 'full.f32';", order=160, aliases=('SCORE',))


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
