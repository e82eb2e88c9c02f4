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

fam.doc('REPRESENT',
        "REPRESENT INTO 'dir' ENCODING 'bf16' | 'f16' | 'int8' | 'q4' | 'f32'",
        'write the bound container in another weight encoding: same graph and objects, new segments, fidelity per tensor in provenance',
        "REPRESENT INTO 'model-int8.vindex3' ENCODING 'int8';", order=260)
fam.doc('SCORE REPRESENTATION',
        "SCORE REPRESENTATION 'candidate' AGAINST 'reference' ON 'prompts.jsonl' [GREEDY n]",
        "a representation's behaviour against the same model: KL p50/p95, top-1, greedy-n agreement; stored in the candidate's provenance",
        "SCORE REPRESENTATION 'model-int8.vindex3' AGAINST 'model.vindex3' ON 'prompts.jsonl';", order=270)
fam.doc('COMPACT',
        "COMPACT INTO 'dir'",
        "copy the bound container's referenced files byte for byte; list every file left behind",
        "COMPACT INTO 'clean.vindex3';", order=280)
fam.doc('DIFF',
        "DIFF 'a' 'b' | DIFF 'b' [LAYER n] [LIMIT n] [PHYSICAL]",
        "how two containers differ: logically (graph, objects, operators), physically (encodings, segments), in metadata; DIFF 'b' compares the bound container with b",
        "DIFF 'model.vindex3' 'model-int8.vindex3';", order=290)


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
