"""The container itself and checkpoints: VERIFY, PLAN (admission), ENCODE (and the reference's
EXTRACT), COMPILE (a verified copy)."""

from __future__ import annotations

from .. import ast
from ..registry import family
from ..syntax import Children, Clause, literal_string

fam = family("container", module=__name__, statements=("verify_stmt", "plan_stmt", "encode_stmt", "extract_stmt",
                                                        "compile_stmt"),
             path_keywords=("PLAN", "ENCODE", "INTO"), grammar=r"""
verify_stmt: VERIFY

plan_stmt: PLAN STRING

encode_stmt: ENCODE STRING INTO STRING [overwrite_clause]

// EXTRACT MODEL 'm' INTO 'o' ...: ENCODE by the reference's name
extract_stmt: EXTRACT MODEL STRING INTO STRING extract_option*
?extract_option: components_clause
               | layers_clause
               | with_level_clause
               | format_clause
components_clause: COMPONENTS _name_or_string (_COMMA _name_or_string)*
                 | COMPONENTS _LPAR _name_or_string (_COMMA _name_or_string)* _RPAR
_name_or_string: NAME | STRING
with_level_clause: WITH (INFERENCE | ALL | WEIGHTS)
format_clause: FORMAT NAME

// COMPILE CURRENT | 'p' INTO VINDEX 'o' | INTO MODEL 'o' [ON CONFLICT name]
compile_stmt: COMPILE (CURRENT | STRING) INTO (VINDEX | MODEL) STRING [on_conflict_clause]
""")

fam.doc('VERIFY',
        'VERIFY',
        're-hash every file of the bound container against its index',
        'VERIFY;', order=230)
fam.doc('PLAN',
        "PLAN 'checkpoint'",
        'admission: would this checkpoint encode, and what was judged',
        "PLAN 'path/to/hf-checkpoint';", order=240)
fam.doc('ENCODE',
        "ENCODE 'checkpoint' INTO 'dir'",
        'encode an HF directory or .gguf into a container',
        "ENCODE 'path/to/hf-checkpoint' INTO 'model.vindex3';", order=250)
fam.doc('EXTRACT',
        "EXTRACT MODEL 'checkpoint' INTO 'dir' [WITH INFERENCE | ALL | WEIGHTS] [FORMAT vindex3]",
        "ENCODE by the reference dialect's name; COMPONENTS and LAYERS, which narrow what is carried, are refused by name",
        "EXTRACT MODEL 'path/to/hf-checkpoint' INTO 'model.vindex3';", order=310)
fam.doc('COMPILE',
        "COMPILE CURRENT | 'path' INTO VINDEX 'dir' [ON CONFLICT name]",
        'write the container again with its patch overlay folded in; with no patch overlay in this build, a verified copy that keeps every index field; COMPILE ... INTO MODEL is refused by name',
        "COMPILE CURRENT INTO VINDEX 'copy.vindex3';", order=320)


@fam.rule
def verify_stmt(c: Children) -> ast.Verify:
    return ast.Verify()


@fam.rule
def plan_stmt(c: Children) -> ast.Plan:
    return ast.Plan(path=c.string("PLAN"))


@fam.rule
def encode_stmt(c: Children) -> ast.Encode:
    return ast.Encode(checkpoint=c.string("ENCODE"), into=c.string("INTO"),
                      overwrite="overwrite" in c.options("ENCODE"))


@fam.rule
def extract_stmt(c: Children) -> ast.Extract:
    return ast.Extract(checkpoint=c.string("EXTRACT", "MODEL"), into=c.string("INTO"), **c.options("EXTRACT"))


@fam.rule
def components_clause(c: Children) -> Clause:
    names = [literal_string(t) if t.type == "STRING" else t.value for t in c.values()]
    return c.clause("components", names)


@fam.rule
def with_level_clause(c: Children) -> Clause:
    return c.clause("level", c.which("INFERENCE", "ALL", "WEIGHTS"))


@fam.rule
def format_clause(c: Children) -> Clause:
    return c.clause("format", c.get("FORMAT").value.lower())


@fam.rule
def compile_stmt(c: Children) -> ast.Compile:
    # COMPILE (CURRENT | STRING) INTO (VINDEX | MODEL) STRING [on_conflict_clause]
    target = c.which("VINDEX", "MODEL")
    return ast.Compile(path=None if c.has("CURRENT") else c.string("COMPILE"), into=c.string(target.upper()),
                       target=target, on_conflict=c.options("COMPILE").get("on_conflict"))
