"""The grammar and parser: text → typed statements with positions, and syntax errors that read
well (the line, a caret, what was expected in words, a hint). No container needed."""

from __future__ import annotations

import lql_fixtures  # noqa: F401  (puts the source tree on sys.path)
import pytest

from lql import parser as P
from lql.errors import LqlSyntaxError

POSITIONS = {"line", "column", "end_line", "end_column", "start_pos", "end_pos", "source"}


def _without_dialect_defaults(node, d: dict) -> dict:
    """Leave out the reference dialect's fields (ast.dialect) while they hold their default:
    the cases below predate them."""
    for name, f in type(node).model_fields.items():
        if (f.json_schema_extra or {}).get("dialect") and d.get(name) == f.default:
            d.pop(name, None)
    return d


# the intervention clauses (PATCH, STEER) every statement that runs the model takes, and INFER's
# lookup corpus: left out while absent, as the cases below predate them (the intervention and
# lookup tests parse them given)
INTERVENTION_FIELDS = ("patch", "steer", "steer_vector", "lookup_corpus")


def _without_absent_interventions(d: dict) -> dict:
    for name in INTERVENTION_FIELDS:
        if name in d and d[name] is None:
            d.pop(name)
    return d


def one(text: str) -> dict:
    s = P.parse_one(text)
    d = _without_absent_interventions(_without_dialect_defaults(s, s.model_dump(exclude=POSITIONS)))
    if d.get("infer"):  # EXPLAIN INFER: the INFER statement it explains, positions aside
        d["infer"] = _without_absent_interventions(
            _without_dialect_defaults(s.infer, {k: v for k, v in d["infer"].items() if k not in POSITIONS}))
    return d


# statement text → the fields of its AST node
CASES = [
    ("OPEN 'm.vindex3'", {"kind": "open", "path": "m.vindex3", "default": False, "shards": None}),
    ('use "m"', {"kind": "open", "path": "m", "default": False, "shards": None}),
    ("OPEN DEFAULT", {"kind": "open", "path": None, "default": True, "shards": None}),
    ("OPEN 'm' SHARDS 2", {"kind": "open", "path": "m", "default": False, "shards": 2}),
    ("open default shards 3", {"kind": "open", "path": None, "default": True, "shards": 3}),
    ("STATS", {"kind": "stats", "positions": None}),
    ("STATS AT 4096 POSITIONS", {"kind": "stats", "positions": 4096}),
    ("EXPLAIN", {"kind": "explain", "prompt": None, "depth": None, "infer": None}),
    ("EXPLAIN DRAFT DEPTH 2", {"kind": "explain", "prompt": None, "depth": 2, "infer": None}),
    ("EXPLAIN INFER 'hi' DRAFT DEPTH 3",
     {"kind": "explain", "prompt": {"kind": "text", "text": "hi"}, "depth": 3,
      "infer": {"kind": "infer", "prompt": {"kind": "text", "text": "hi"}, "top": None, "generate": None, "depth": 3,
                "speculate": None, "lookahead": None, "vocab_top": None, "adapter": False, "exactly": False, "chat": None, "ablate": None}}),
    ("EXPLAIN INFER 'hi' GENERATE 5 EXACTLY CHAT",
     {"kind": "explain", "prompt": {"kind": "text", "text": "hi"}, "depth": None,
      "infer": {"kind": "infer", "prompt": {"kind": "text", "text": "hi"}, "top": None, "generate": 5, "depth": None,
                "speculate": None, "lookahead": None, "vocab_top": None, "adapter": False, "exactly": True, "chat": True, "ablate": None}}),
    ("SHOW LAYERS", {"kind": "show_layers", "start": None, "end": None}),
    ("SHOW LAYERS RANGE 0-7", {"kind": "show_layers", "start": 0, "end": 7}),
    ("SHOW LAYERS RANGE 3", {"kind": "show_layers", "start": 3, "end": 3}),
    ("SHOW COMPONENTS", {"kind": "show_components"}),
    ("SHOW REPRESENTATIONS", {"kind": "show_representations", "filter": None}),
    ("SHOW REPRESENTATIONS 'emb'", {"kind": "show_representations", "filter": "emb"}),
    ("SHOW PROVENANCE", {"kind": "show_provenance"}),
    ("SHOW OPERANDS LAYER 2", {"kind": "show_operands", "layer": 2}),
    ("SHOW SETTINGS", {"kind": "show_settings"}),
    ("INFER 'x' TOP 3 GENERATE 4 DRAFT DEPTH 2",
     {"kind": "infer", "prompt": {"kind": "text", "text": "x"}, "top": 3, "generate": 4, "depth": 2,
      "speculate": None, "lookahead": None, "vocab_top": None, "adapter": False, "exactly": False, "chat": None, "ablate": None}),
    ("INFER TOKENS (1, 2, 3) GENERATE 20 SPECULATE DEPTH 2 LOOKAHEAD 4",
     {"kind": "infer", "prompt": {"kind": "tokens", "ids": [1, 2, 3]}, "top": None, "generate": 20,
      "depth": None, "speculate": 2, "lookahead": 4, "vocab_top": None, "adapter": False, "exactly": False, "chat": None, "ablate": None}),
    ("INFER TOKENS (1, 2) GENERATE 20 SPECULATE DEPTH 8 VOCAB TOP 8192",
     {"kind": "infer", "prompt": {"kind": "tokens", "ids": [1, 2]}, "top": None, "generate": 20,
      "depth": None, "speculate": 8, "lookahead": None, "vocab_top": 8192, "adapter": False, "exactly": False, "chat": None, "ablate": None}),
    ("INFER TOKENS (1, 2) GENERATE 20 SPECULATE DEPTH 8 WITH ADAPTER",
     {"kind": "infer", "prompt": {"kind": "tokens", "ids": [1, 2]}, "top": None, "generate": 20,
      "depth": None, "speculate": 8, "lookahead": None, "vocab_top": None, "adapter": True, "exactly": False,
      "chat": None, "ablate": None}),
    ("INFER TOKENS (1, 2) GENERATE 20 SPECULATE DEPTH 8 VOCAB TOP 64 WITH ADAPTER",
     {"kind": "infer", "prompt": {"kind": "tokens", "ids": [1, 2]}, "top": None, "generate": 20,
      "depth": None, "speculate": 8, "lookahead": None, "vocab_top": 64, "adapter": True, "exactly": False,
      "chat": None, "ablate": None}),
    ("INFER TOKENS (1, 2) GENERATE 20 SPECULATE DRAFTER LOOKUP NGRAM 2 LOOKAHEAD 8",
     {"kind": "infer", "prompt": {"kind": "tokens", "ids": [1, 2]}, "top": None, "generate": 20,
      "depth": None, "speculate": {"ngram": 2}, "lookahead": 8, "vocab_top": None, "adapter": False, "exactly": False, "chat": None,
      "ablate": None}),
    ("DRAFT DEPTH 2", {"kind": "draft_depth", "depth": 2, "adapter": False}),
    ("DRAFT DEPTH 2 WITH ADAPTER", {"kind": "draft_depth", "depth": 2, "adapter": True}),
    ("DRAFT OFF", {"kind": "draft_off"}),
    ("DRAFT LADDER DEPTHS (1, 2, 4) ON 'p.jsonl'",
     {"kind": "draft_ladder", "depths": [1, 2, 4], "prompts": "p.jsonl", "into": None, "plot": None,
      "overwrite": False, "adapter": False}),
    ("DRAFT LADDER DEPTHS (1) ON 'p.jsonl' INTO 'l.json'",
     {"kind": "draft_ladder", "depths": [1], "prompts": "p.jsonl", "into": "l.json", "plot": None, "overwrite": False, "adapter": False}),
    ("DRAFT LADDER DEPTHS (1) ON 'p.jsonl' INTO 'l.json' PLOT INTO 'l.svg' overwrite",
     {"kind": "draft_ladder", "depths": [1], "prompts": "p.jsonl", "into": "l.json", "plot": "l.svg", "overwrite": True, "adapter": False}),
    ("DRAFT LADDER DEPTHS (1, 2) ON 'p.jsonl' WITH ADAPTER INTO 'l.json'",
     {"kind": "draft_ladder", "depths": [1, 2], "prompts": "p.jsonl", "into": "l.json", "plot": None,
      "overwrite": False, "adapter": True}),
    ("DRAFT LADDER DEPTHS (1) ON 'p.jsonl' PLOT INTO 'l.svg'",
     {"kind": "draft_ladder", "depths": [1], "prompts": "p.jsonl", "into": None, "plot": "l.svg", "overwrite": False, "adapter": False}),
    ("TRACE 'x' DRAFT DEPTH 1", {"kind": "trace", "prompt": {"kind": "text", "text": "x"}, "depth": 1, "ablate": None,
                                 "experts": None}),
    ("TRACE 'x' EXPERTS", {"kind": "trace", "prompt": {"kind": "text", "text": "x"}, "depth": None, "ablate": None,
                           "experts": {"layer": None}}),
    ("trace tokens (1, 2) draft depth 2 experts at layer 1",
     {"kind": "trace", "prompt": {"kind": "tokens", "ids": [1, 2]}, "depth": 2, "ablate": None, "experts": {"layer": 1}}),
    ("SHOW EXPERTS", {"kind": "show_experts", "layer": None}),
    ("show experts at layer 3", {"kind": "show_experts", "layer": 3}),
    ("DUMP LOGITS 'x' INTO 'f.f32'",
     {"kind": "dump_logits", "prompt": {"kind": "text", "text": "x"}, "depth": None, "ablate": None, "into": "f.f32",
      "overwrite": False, "adapter": False}),
    ("DUMP LOGITS 'x' INTO 'f.f32' OVERWRITE",
     {"kind": "dump_logits", "prompt": {"kind": "text", "text": "x"}, "depth": None, "ablate": None, "into": "f.f32",
      "overwrite": True, "adapter": False}),
    ("DUMP LOGITS TOKENS (5) DRAFT DEPTH 2 INTO 'f.f32'",
     {"kind": "dump_logits", "prompt": {"kind": "tokens", "ids": [5]}, "depth": 2, "ablate": None, "into": "f.f32",
      "overwrite": False, "adapter": False}),
    ("DUMP LOGITS 'x' ABLATE FEATURES (3:17, 0:2) DRAFT DEPTH 2 INTO 'f.f32'",
     {"kind": "dump_logits", "prompt": {"kind": "text", "text": "x"}, "depth": 2, "ablate": ((3, 17), (0, 2)),
      "into": "f.f32", "overwrite": False, "adapter": False}),
    ("DUMP LOGITS TOKENS (5) DRAFT DEPTH 2 WITH ADAPTER INTO 'f.f32'",
     {"kind": "dump_logits", "prompt": {"kind": "tokens", "ids": [5]}, "depth": 2, "ablate": None, "into": "f.f32",
      "overwrite": False, "adapter": True}),
    ("INFER TOKENS (1, 2) GENERATE 4 SPECULATE DRAFTER MTP LOOKAHEAD 2",
     {"kind": "infer", "prompt": {"kind": "tokens", "ids": [1, 2]}, "top": None, "generate": 4, "depth": None,
      "speculate": {"drafter": "mtp"}, "lookahead": 2, "vocab_top": None, "adapter": False, "exactly": False,
      "chat": None, "ablate": None}),
    ("TRACE 'x' ABLATE FEATURES (1:2)", {"kind": "trace", "prompt": {"kind": "text", "text": "x"}, "depth": None,
                                        "ablate": ((1, 2),), "experts": None}),
    # looking inside (issue 15)
    ("WALK 'The capital' TOP 3 LAYERS 2-5",
     {"kind": "walk", "prompt": {"kind": "text", "text": "The capital"}, "top": 3, "layers": (2, 5)}),
    ("walk tokens (4, 5) layers 7", {"kind": "walk", "prompt": {"kind": "tokens", "ids": [4, 5]}, "top": None,
                                     "layers": (7, 7)}),
    ("DESCRIBE 'France' LAYERS 0-3 TOP 4", {"kind": "describe", "entity": "France", "top": 4, "layers": (0, 3)}),
    ("SELECT * FROM FEATURES",
     {"kind": "select_features", "columns": None, "layers": None, "at_layer": False, "nearest": None, "where": [],
      "order_by": None, "descending": None, "limit": None}),
    (("SELECT Layer, token FROM FEATURES AT LAYER 3 NEAREST TO 'Paris' WHERE token LIKE 'P%' AND score >= -1.5 "
      "AND feature <> 2 ORDER BY score ASC LIMIT 10"),
     {"kind": "select_features",
      "columns": [{"name": "layer", "line": 1, "column": 8}, {"name": "token", "line": 1, "column": 15}],
      "layers": (3, 3), "at_layer": True, "nearest": "Paris",
      "where": [{"column": {"name": "token", "line": 1, "column": 71}, "op": "LIKE", "value": "P%"},
                {"column": {"name": "score", "line": 1, "column": 91}, "op": ">=", "value": -1.5},
                {"column": {"name": "feature", "line": 1, "column": 109}, "op": "!=", "value": 2}],
      "order_by": {"name": "score", "line": 1, "column": 131}, "descending": False, "limit": 10}),
    ("SELECT feature FROM FEATURES LAYERS 1-2 WHERE layer = 1 ORDER BY feature",
     {"kind": "select_features", "columns": [{"name": "feature", "line": 1, "column": 8}], "layers": (1, 2),
      "at_layer": False, "nearest": None, "where": [{"column": {"name": "layer", "line": 1, "column": 47}, "op": "=",
                                                     "value": 1}],
      "order_by": {"name": "feature", "line": 1, "column": 66}, "descending": None, "limit": None}),
    ("SHOW FEATURES AT LAYER 2 LIMIT 5", {"kind": "show_features", "layer": 2, "limit": 5}),
    ("EXPLAIN INFER 'x' DRAFT DEPTH 2 ABLATE FEATURES (1:1) FEATURES TOP 3 LAYERS 0-1",
     {"kind": "explain_features",
      "infer": {"kind": "infer", "prompt": {"kind": "text", "text": "x"}, "top": None, "generate": None, "depth": 2,
                "speculate": None, "lookahead": None, "vocab_top": None, "adapter": False, "exactly": False, "chat": None, "ablate": ((1, 1),)},
      "top": 3, "layers": (0, 1)}),
    ("TRACE 'x' FOR ' Paris' LAYERS 1-2 POSITIONS ALL DECOMPOSE SAVE INTO 't.npz' DRAFT DEPTH 3 ABLATE FEATURES (0:1)",
     {"kind": "trace_for", "prompt": {"kind": "text", "text": "x"}, "token": " Paris", "layers": (1, 2),
      "positions": "all", "decompose": True, "save": "t.npz", "depth": 3, "ablate": ((0, 1),), "overwrite": False,
      "lens": None}),
    ("TRACE TOKENS (1, 2) FOR 42",
     {"kind": "trace_for", "prompt": {"kind": "tokens", "ids": [1, 2]}, "token": 42, "layers": None,
      "positions": None, "decompose": False, "save": None, "depth": None, "ablate": None, "overwrite": False,
      "lens": None}),
    ("OBSERVE 'x' GENERATE 4 LENS (' Paris', 7) ABLATE FEATURES (2:3) RECORD INTO 'run.jsonl'",
     {"kind": "observe", "prompt": {"kind": "text", "text": "x"}, "generate": 4, "lens": [" Paris", 7], "depth": None,
      "ablate": ((2, 3),), "into": "run.jsonl", "overwrite": False}),
    ("BUILD FEATURES", {"kind": "build_features", "layers": None}),
    ("BUILD FEATURES LAYERS 0-2", {"kind": "build_features", "layers": (0, 2)}),
    ("SCORE DRAFT 'a.f32' AGAINST 'b.f32'", {"kind": "score_draft", "draft": "a.f32", "target": "b.f32"}),
    ("VERIFY", {"kind": "verify"}),
    ("PLAN 'ckpt'", {"kind": "plan", "path": "ckpt"}),
    ("ENCODE 'ckpt' INTO 'out'", {"kind": "encode", "checkpoint": "ckpt", "into": "out", "overwrite": False}),
    ("ENCODE 'ckpt' INTO 'out' OVERWRITE", {"kind": "encode", "checkpoint": "ckpt", "into": "out", "overwrite": True}),
    ("REPRESENT INTO 'o' ENCODING 'int8'", {"kind": "represent", "into": "o", "encoding": "int8"}),
    ("represent into 'o' encoding 'q4'", {"kind": "represent", "into": "o", "encoding": "q4"}),
    ("COMPACT INTO 'c'", {"kind": "compact", "into": "c"}),
    ("DIFF 'a' 'b'", {"kind": "diff", "a": "a", "b": "b"}),
    ("DIFF 'b'", {"kind": "diff", "a": "b", "b": None}),
    ("DIFF CURRENT", {"kind": "diff_current", "layer": None, "limit": None}),
    ("diff current layer 2 limit 3", {"kind": "diff_current", "layer": 2, "limit": 3}),
    ("SCORE REPRESENTATION 'c' AGAINST 'r' ON 'p.jsonl'",
     {"kind": "score_representation", "candidate": "c", "reference": "r", "prompts": "p.jsonl", "greedy": None}),
    ("SCORE REPRESENTATION 'c' AGAINST 'r' ON 'p.jsonl' GREEDY 8",
     {"kind": "score_representation", "candidate": "c", "reference": "r", "prompts": "p.jsonl", "greedy": 8}),
    ("SCORE REPRESENTATION 'c' AGAINST DEFAULT ON 'p.jsonl'",
     {"kind": "score_representation", "candidate": "c", "reference": None, "reference_default": True,
      "prompts": "p.jsonl", "greedy": None}),
    ("HELP", {"kind": "help", "topic": None}),
    ("help show layers", {"kind": "help", "topic": "SHOW LAYERS"}),
    ("SET format = json", {"kind": "set", "name": "format", "value": "json"}),
    ("SET timing = OFF", {"kind": "set", "name": "timing", "value": "off"}),
    ("SET top = 7", {"kind": "set", "name": "top", "value": 7}),
    ("SET x = 0.5", {"kind": "set", "name": "x", "value": 0.5}),
    ("SET x = 'A b'", {"kind": "set", "name": "x", "value": "A b"}),
    ("USE REMOTE 'http://127.0.0.1:8088'", {"kind": "use_remote", "url": "http://127.0.0.1:8088", "model": None}),
    ("use remote 'http://h:1' model 'tiny'", {"kind": "use_remote", "url": "http://h:1", "model": "tiny"}),
    # the reference dialect (issue 19)
    ("USE MODEL 'ckpt' AUTO_EXTRACT",
     {'kind': 'use_model', 'model': 'ckpt', 'auto_extract': True}),
    ('SHOW MODELS',
     {'kind': 'show_models'}),
    ('SHOW PATCHES',
     {'kind': 'show_patches'}),
    ('SHOW COMPACT STATUS',
     {'kind': 'show_compact_status'}),
    ('SHOW ENTITIES AT LAYER 2 LIMIT 5',
     {'kind': 'show_entities', 'layer': 2, 'limit': 5}),
    ('SHOW RELATIONS AT LAYER 1 WITH EXAMPLES BRIEF',
     {'kind': 'show_relations', 'layer': 1, 'examples': True, 'detail': 'brief'}),
    ("SELECT entity, target FROM EDGES WHERE relation = 'capital' LIMIT 3",
     {'kind': 'select_graph', 'table': 'edges', 'columns': [{'name': 'entity', 'line': 1, 'column': 8}, {'name': 'target', 'line': 1, 'column': 16}], 'nearest': None, 'nearest_layer': None, 'where': [{'column': {'name': 'relation', 'line': 1, 'column': 40}, 'op': '=', 'value': 'capital'}], 'order_by': None, 'descending': None, 'limit': 3}),
    ("EXTRACT MODEL 'ckpt' INTO 'o.vindex3' WITH ALL FORMAT vindex3",
     {'kind': 'extract', 'checkpoint': 'ckpt', 'into': 'o.vindex3', 'components': None, 'layers': None, 'level': 'all', 'format': 'vindex3'}),
    ("COMPILE CURRENT INTO VINDEX 'c.vindex3' ON CONFLICT last_wins",
     {'kind': 'compile', 'path': None, 'into': 'c.vindex3', 'target': 'vindex', 'on_conflict': 'last_wins', 'format': None, 'overwrite': False}),
    ("INSERT INTO EDGES (entity, relation, target) VALUES ('France', 'capital', 'Paris') AT LAYER 3 CONFIDENCE 0.9",
     {'kind': 'insert_edges', 'columns': [{'name': 'entity', 'line': 1, 'column': 20}, {'name': 'relation', 'line': 1, 'column': 28}, {'name': 'target', 'line': 1, 'column': 38}], 'values': ['France', 'capital', 'Paris'], 'layer': 3, 'layers': None, 'confidence': 0.9, 'alpha': None, 'mode': None, 'template': None, 'corpus': None, 'preserve': None}),
    ("SCORE EDITS ON 'e.jsonl' MODE MEMIT LAYERS 18-22",
     {'kind': 'score_edits', 'path': 'e.jsonl', 'layer': None, 'layers': (18, 22), 'confidence': None, 'alpha': None, 'mode': 'memit', 'template': None, 'corpus': None, 'preserve': None}),
    ("DELETE FROM EDGES WHERE entity = 'France'",
     {'kind': 'delete_edges', 'where': [{'column': {'name': 'entity', 'line': 1, 'column': 25}, 'op': '=', 'value': 'France'}]}),
    ("UPDATE EDGES SET confidence = 0.5 WHERE target = 'Paris'",
     {'kind': 'update_edges', 'assignments': [({'name': 'confidence', 'line': 1, 'column': 18}, 0.5)], 'where': [{'column': {'name': 'target', 'line': 1, 'column': 41}, 'op': '=', 'value': 'Paris'}]}),
    ("MERGE 'a.vlp' INTO 'b' ON CONFLICT fail",
     {'kind': 'merge', 'src': 'a.vlp', 'into': 'b', 'on_conflict': 'fail'}),
    ("BEGIN PATCH 'p.vlp'",
     {'kind': 'begin_patch', 'path': 'p.vlp'}),
    ('SAVE PATCH',
     {'kind': 'save_patch', 'into': None, 'overwrite': False}),
    ("APPLY PATCH 'p.vlp'",
     {'kind': 'apply_patch', 'path': 'p.vlp'}),
    ("REMOVE PATCH 'p.vlp'",
     {'kind': 'remove_patch', 'path': 'p.vlp'}),
    ('REBALANCE AT LAYER 2 max_iters 5',
     {'kind': 'rebalance', 'options': [{'name': 'layer', 'value': 2}, {'name': 'max_iters', 'value': 5}]}),
    ('COMPACT MINOR',
     {'kind': 'compact_level', 'level': 'minor', 'options': []}),
    ('stats "m.vindex3"',
     {'kind': 'stats', 'positions': None, 'path': 'm.vindex3'}),
    ('SHOW LAYERS 0-1',
     {'kind': 'show_layers', 'start': 0, 'end': 1}),
    ('SHOW FEATURES 1 LIMIT 2',
     {'kind': 'show_features', 'layer': 1, 'limit': 2}),
    ("WALK 'x' LAYERS ALL MODE Pure",
     {'kind': 'walk', 'prompt': {'kind': 'text', 'text': 'x'}, 'top': None, 'layers': None, 'mode': 'pure'}),
    ("EXPLAIN WALK 'x' VERBOSE",
     {'kind': 'walk', 'prompt': {'kind': 'text', 'text': 'x'}, 'top': None, 'layers': None, 'detail': 'verbose', 'explain': True}),
    ("DESCRIBE 'France' SYNTAX AT LAYER 1 RAW",
     {'kind': 'describe', 'entity': 'France', 'top': None, 'layers': None, 'band': 'syntax', 'at_layer': 1, 'detail': 'raw'}),
    ("EXPLAIN INFER 'x' LAYERS 0-1 KNOWLEDGE TOP 3",
     {'kind': 'explain_features', 'infer': {'kind': 'infer', 'prompt': {'kind': 'text', 'text': 'x'}, 'top': None, 'generate': None, 'depth': None, 'speculate': None, 'lookahead': None, 'vocab_top': None, 'adapter': False, 'exactly': False, 'chat': None, 'ablate': None}, 'top': 3, 'layers': (0, 1), 'band': 'knowledge', 'reference': True}),
    ("TRACE 'x' FOR 'y' POSITIONS ALL SAVE 't.npz'",
     {'kind': 'trace_for', 'prompt': {'kind': 'text', 'text': 'x'}, 'token': 'y', 'layers': None, 'positions': 'all', 'decompose': False, 'save': 't.npz', 'depth': None, 'ablate': None, 'overwrite': False, 'save_file': True, 'lens': None}),
    ("DIFF 'a' 'b' LAYER 2 LIMIT 5 PHYSICAL",
     {'kind': 'diff', 'a': 'a', 'b': 'b', 'layer': 2, 'limit': 5, 'physical': True}),
    ("DIFF 'a' 'b' INTO PATCH 'p.vlp'", {'kind': 'diff', 'a': 'a', 'b': 'b', 'into_patch': 'p.vlp'}),
    ("SELECT * FROM FEATURES WHERE layer IN (0, 1) AND token IN ('a', 'b')",
     {'kind': 'select_features', 'columns': None, 'layers': None, 'at_layer': False, 'nearest': None, 'where': [{'column': {'name': 'layer', 'line': 1, 'column': 30}, 'op': 'IN', 'value': [0, 1]}, {'column': {'name': 'token', 'line': 1, 'column': 50}, 'op': 'IN', 'value': ['a', 'b']}], 'order_by': None, 'descending': None, 'limit': None}),
    ("PATCH SWEEP 'a' FROM 'b' FOR 'c' SITE RESIDUAL POST LAYERS 0-1",
     {'kind': 'patch_sweep', 'corrupted': {'kind': 'text', 'text': 'a'}, 'clean': {'kind': 'text', 'text': 'b'}, 'token': 'c', 'site': 'residual_post', 'layers': (0, 1), 'depth': None, 'plot': None, 'overwrite': False}),
    ("CAPTURE 'x' SITES RESIDUAL, FFN DRAFT DEPTH 2 INTO 'a.npz' OVERWRITE",
     {'kind': 'capture', 'prompt': {'kind': 'text', 'text': 'x'}, 'sites': ['residual', 'ffn'], 'layers': None, 'depth': 2, 'into': 'a.npz', 'overwrite': True}),
    ("FIT ADAPTER AT DEPTH 16 ON 'corpus.jsonl' RIDGE 0.5",
     {'kind': 'fit_adapter', 'depth': 16, 'corpus': 'corpus.jsonl', 'ridge': 0.5}),
    ("FIT VOCAB CUT TOP 8192 ON 'corpus.jsonl'",
     {'kind': 'fit_vocab_cut', 'k': 8192, 'corpus': 'corpus.jsonl'}),
    ("SHOW ATTENTION 'x' AT LAYER 3 HEAD 2",
     {'kind': 'show_attention', 'prompt': {'kind': 'text', 'text': 'x'}, 'layer': 3, 'head': 2, 'depth': None}),
]


@pytest.mark.parametrize("text,expected", CASES, ids=[c[0] for c in CASES])
def test_statement_parses_to_its_node(text, expected):
    assert one(text) == expected


def test_every_statement_class_is_reachable_from_the_grammar():
    kinds = {c[1]["kind"] for c in CASES}
    from lql import registry

    assert kinds == {cls.model_fields["kind"].default for cls in registry.statement_classes()}


def test_keywords_are_case_insensitive_and_strings_keep_case():
    assert one("oPeN 'My.Vindex3'") == one("OPEN 'My.Vindex3'")
    assert one("infer 'AbC' top 2")["prompt"]["text"] == "AbC"


def test_a_word_that_starts_with_a_keyword_is_not_that_keyword():
    with pytest.raises(LqlSyntaxError) as e:
        P.parse("openx 'a'")
    assert "found 'openx'" in e.value.message


def test_string_escapes():
    assert one(r"OPEN 'it\'s \"q\" \\ \t \u0041'")["path"] == "it's \"q\" \\ \t A"
    assert one(r'OPEN "say \"hi\""')["path"] == 'say "hi"'


def test_unknown_escape_is_refused_with_a_caret_under_it():
    with pytest.raises(LqlSyntaxError) as e:
        P.parse(r"OPEN 'C:\models'")
    assert str(e.value) == (
        "syntax error at line 1, column 9: unknown escape \\m in a string\n"
        "  OPEN 'C:\\models'\n"
        "          ^\n"
        "  hint: known escapes are \\n \\t \\r \\\\ \\' \\\" \\uXXXX \\UXXXXXXXX; write \\\\ for a backslash"
    )


def test_script_positions_comments_and_optional_last_semicolon():
    text = "-- header comment\nOPEN 'm';  -- trailing\n\n  STATS AT 10 POSITIONS;\nSHOW\n  LAYERS"
    stmts = P.parse(text)
    assert [type(s).__name__ for s in stmts] == ["Open", "Stats", "ShowLayers"]
    assert [(s.line, s.column) for s in stmts] == [(2, 1), (4, 3), (5, 1)]
    assert [s.source for s in stmts] == ["OPEN 'm'", "STATS AT 10 POSITIONS", "SHOW\n  LAYERS"]
    assert (stmts[2].end_line, stmts[2].end_column) == (6, 9)


def test_empty_text_and_stray_semicolons():
    assert P.parse("") == []
    assert P.parse("  -- only a comment\n") == []
    assert len(P.parse(";;STATS;;VERIFY;")) == 2


# text → the exact error as a user sees it
ERRORS = [
    ("OPEN model.vindex3",
     ("syntax error at line 1, column 6: expected a quoted string or DEFAULT, found 'model.vindex3'\n"
     "  OPEN model.vindex3\n"
     "       ^\n"
     "  hint: paths are strings: put it in quotes, e.g. 'model.vindex3'")),
    ("OPEN /tmp/m",
     ("syntax error at line 1, column 6: expected a quoted string or DEFAULT, found '/'\n"
     "  OPEN /tmp/m\n"
     "       ^\n"
     "  hint: paths are strings: put it in quotes, e.g. '/tmp/m'")),
    ("STATS;\nDRAFT DEPTH;",
     ("syntax error at line 2, column 12: expected a whole number, found ';'\n"
     "  DRAFT DEPTH;\n"
     "             ^\n"
     "  hint: DEPTH takes the number of layers to run, e.g. DRAFT DEPTH 2")),
    ("INFER 'x' DRAFT DEPTH",
     ("syntax error at line 1, column 22: expected a whole number, found end of input\n"
     "  INFER 'x' DRAFT DEPTH\n"
     "                       ^\n"
     "  hint: DEPTH takes the number of layers to run, e.g. DRAFT DEPTH 2")),
    ("STAST",
     ("syntax error at line 1, column 1: expected a statement (APPLY, BEGIN, BUILD, CAPTURE, COMPACT, COMPILE, DELETE, "
     "DESCRIBE, DIFF, DRAFT, DUMP, ENCODE, EXPLAIN, EXTRACT, FIT, HELP, INFER, INSERT, MERGE, OBSERVE, OPEN, PATCH, PLAN, "
     "REBALANCE, REMOVE, REPRESENT, SAVE, SCORE, SELECT, SET, SHOW, STATS, TRACE, UPDATE, USE, VERIFY, WALK) or "
     "';', found 'STAST'\n"
     "  STAST\n"
     "  ^\n"
     "  hint: did you mean STATS?")),
    ("INFER 'x' TOPP 3",
     ("syntax error at line 1, column 11: expected ';', '|>', ABLATE, CHAT, COMPARE, DRAFT, GENERATE, LOOKAHEAD, "
     "PATCH, SPECULATE, STEER or TOP, found 'TOPP'\n"
     "  INFER 'x' TOPP 3\n"
     "            ^\n"
     "  hint: did you mean TOP?")),
    ("SHOW LAYER",
     ("syntax error at line 1, column 6: expected ATTENTION, COMPACT, COMPONENTS, ENTITIES, EXPERTS, FEATURES, LAYERS, "
     "MODELS, OPERANDS, PATCHES, PROVENANCE, RELATIONS, REPRESENTATIONS or SETTINGS, found keyword LAYER\n"
     "  SHOW LAYER\n"
     "       ^\n"
     "  hint: did you mean LAYERS?")),
    ("STATS\nSHOW LAYERS",
     ("syntax error at line 2, column 1: expected a quoted string, ';', '|>', AT or DEFAULT, found keyword SHOW\n"
     "  SHOW LAYERS\n"
     "  ^\n"
     "  hint: end the previous statement with ';' before SHOW")),
    ("OPEN 'abc",
     ("syntax error at line 1, column 6: expected a quoted string or DEFAULT, found a string that is not closed on its line\n"
     "  OPEN 'abc\n"
     "       ^\n"
     "  hint: close the string with ' before the end of the line")),
    ("INFER hello",
     ("syntax error at line 1, column 7: expected a quoted string or TOKENS, found 'hello'\n"
     "  INFER hello\n"
     "        ^\n"
     "  hint: a prompt is a quoted string, or token ids as TOKENS (1, 2, 3)")),
    ("DRAFT 2",
     ("syntax error at line 1, column 7: expected DEPTH, LADDER or OFF, found '2'\n"
     "  DRAFT 2\n"
     "        ^\n"
     "  hint: write DRAFT DEPTH n (or SPECULATE DEPTH n), e.g. DRAFT DEPTH 2")),
    ("INFER TOKENS 1, 2",
     ("syntax error at line 1, column 14: expected '(', found '1'\n"
     "  INFER TOKENS 1, 2\n"
     "               ^\n"
     "  hint: put the ids in parentheses, e.g. TOKENS (1, 2, 3)")),
    ("SET format json",
     ("syntax error at line 1, column 12: expected '=', found 'json'\n"
     "  SET format json\n"
     "             ^\n"
     "  hint: SET takes name = value, e.g. SET format = json")),
    ("INFER 'x' DRAFT DEPTH 1.5",
     ("syntax error at line 1, column 24: expected ';', '|>', ABLATE, CHAT, COMPARE, DRAFT, GENERATE, LOOKAHEAD, "
     "PATCH, SPECULATE, STEER or TOP, found '.'\n"
     "  INFER 'x' DRAFT DEPTH 1.5\n"
     "                         ^\n"
     "  hint: only a whole number fits here, not 1.5")),
    ("INFER 'x' GENERATE",
     ("syntax error at line 1, column 19: expected a whole number, found end of input\n"
     "  INFER 'x' GENERATE\n"
     "                    ^\n"
     "  hint: GENERATE takes how many tokens to generate, e.g. GENERATE 20")),
    ("INFER 'x' TOP 3 TOP 4",
     ("syntax error at line 1, column 17: TOP is given twice in one INFER\n"
     "  INFER 'x' TOP 3 TOP 4\n"
     "                  ^\n"
     "  hint: keep one TOP clause")),
    ("DUMP LOGITS 'x' INTO out.f32",
     ("syntax error at line 1, column 22: expected a quoted string, found 'out.f32'\n"
     "  DUMP LOGITS 'x' INTO out.f32\n"
     "                       ^\n"
     "  hint: paths are strings: put it in quotes, e.g. 'out.f32'")),
]


@pytest.mark.parametrize("text,expected", ERRORS, ids=[e[0] for e in ERRORS])
def test_syntax_error_reads_well(text, expected):
    with pytest.raises(LqlSyntaxError) as e:
        P.parse(text)
    assert str(e.value) == expected


def test_syntax_error_carries_position_and_expectations():
    with pytest.raises(LqlSyntaxError) as e:
        P.parse("STATS;\n  OPEN x")
    err = e.value
    assert (err.line, err.column) == (2, 8)
    assert err.source_line == "  OPEN x"
    assert "a quoted string" in err.expected and "DEFAULT" in err.expected


def test_interactive_parser_tells_what_may_come_next():
    assert set(P.interactive("INFER 'x' ").accepts()) == {
        "TOP", "GENERATE", "DRAFT", "SPECULATE", "LOOKAHEAD", "CHAT", "ABLATE", "COMPARE", "PATCH", "STEER", "_SEMI", "_PIPE",
        "$END"}
    assert set(P.interactive("").accepts()) >= set(P.STATEMENT_KEYWORDS)
    assert "OPEN" in P.STATEMENT_KEYWORDS and "DEPTH" not in P.STATEMENT_KEYWORDS
    assert P.describe_terminal("STRING") == "a quoted string"
    assert P.describe_terminal("OPEN") == "OPEN"


def test_lexer_for_highlighting_never_raises():
    toks = [(t.type, t.value) for t in P.lex("OPEN 'x -- y\nstats; -- hi")]
    assert toks == [("OPEN", "OPEN"), ("WS", " "), ("ERROR", "'x -- y"), ("WS", "\n"), ("STATS", "stats"),
                    ("_SEMI", ";"), ("WS", " "), ("COMMENT", "-- hi")]
    assert [t.line for t in P.lex("a\nb")] == [1, 1, 2]


def test_is_complete_for_the_repl():
    assert P.is_complete("STATS; -- done")
    assert not P.is_complete("STATS")
    assert not P.is_complete("OPEN ';'")
    assert not P.is_complete("")


def test_lark_instance_is_reachable():
    assert P.LARK.options.parser == "lalr"
    assert P.LARK.options.lexer == "contextual"
    assert P.LARK.options.propagate_positions


# ---- literals the language does not read: positioned syntax errors, never a crash (issue 10) ----


def _refused(text: str) -> LqlSyntaxError:
    with pytest.raises(LqlSyntaxError) as e:
        P.parse(text)
    return e.value


@pytest.mark.parametrize("digits", ["9223372036854775808", "1" + "0" * 4400, "9" * 100_000])
def test_a_number_above_int64_is_a_positioned_syntax_error(digits):
    e = _refused(f"INFER 'x' TOP {digits}")
    assert (e.line, e.column) == (1, 15)
    assert "too large" in e.message and "9,223,372,036,854,775,807" in e.message
    assert len(e.message) < 200  # a long number is shown cut, never whole


def test_the_largest_int64_and_leading_zeros_are_read():
    assert one("INFER 'x' TOP 9223372036854775807")["top"] == 2**63 - 1
    assert one("INFER 'x' TOP " + "0" * 5000 + "7")["top"] == 7


@pytest.mark.parametrize("text, column, words", [
    (r"INFER 'ab\U00110000'", 10, "above U+10FFFF"),
    (r"INFER 'ab\UFFFFFFFF'", 10, "above U+10FFFF"),
    (r"INFER 'ab\uD800'", 10, "lone surrogate"),
    (r"INFER 'ab\uDC00\uD800'", 10, "lone surrogate"),
    (r"INFER 'ab\0'", 10, "NUL"),
    (r"INFER 'ab\u0000'", 10, "NUL"),
    (r"INFER 'ab\U00000000'", 10, "NUL"),
    ("INFER 'ab\ud800'", 10, "lone surrogate"),
    ("INFER 'ab\x00'", 10, "NUL"),
    ("OPEN 'ok';\n  INFER 'a\udfff'", 11, "lone surrogate"),
])
def test_characters_no_string_may_hold_are_positioned_syntax_errors(text, column, words):
    e = _refused(text)
    assert e.column == column and words in e.message
    assert e.line == text.count("\n") + 1


def test_an_escaped_surrogate_pair_is_one_character():
    assert one(r"INFER '\uD83D\uDE00'")["prompt"]["text"] == "\U0001F600"
    assert one(r"INFER '\U0001F600 \U0010FFFF'")["prompt"]["text"] == "\U0001F600 \U0010FFFF"


def test_a_string_longer_than_the_limit_is_refused_before_it_is_decoded():
    e = _refused("INFER '" + "a" * (P.MAX_STRING_CHARS + 1) + "'")
    assert (e.line, e.column) == (1, 7) and "longer than LQL reads" in e.message
    assert len(str(e)) < 1000  # the source line is shown cut around the caret
    assert one("INFER '" + "a" * P.MAX_STRING_CHARS + "'")["prompt"]["text"] == "a" * P.MAX_STRING_CHARS


def test_an_unterminated_string_costs_its_length_not_a_kilobyte_per_character():
    import tracemalloc

    text = "INFER '" + "a" * 200_000
    try:  # warm up: the first syntax error builds Lark's example tables once
        P.parse("INFER 'x")
    except LqlSyntaxError:
        pass
    tracemalloc.start()
    try:
        with pytest.raises(LqlSyntaxError) as e:
            P.parse(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "not closed" in e.value.message
    assert peak < 40 * len(text), f"{peak / len(text):.0f} bytes per character"


def test_a_float_that_overflows_is_a_syntax_error():
    e = _refused("SET top = 1.0e999")
    assert e.column == 11 and "too large" in e.message


def test_lexing_is_linear_in_the_characters_in_error():
    import time

    t0 = time.perf_counter()
    toks = list(P.lex("@a " * 20_000))
    assert len([t for t in toks if t.type == "ERROR"]) == 20_000
    assert time.perf_counter() - t0 < 5  # was ~1 ms per error: Lark built a new lexer each time


def test_a_transformer_bug_is_raised_as_itself_not_as_a_visit_error(monkeypatch):
    from lql import syntax

    def broken(c):
        raise ZeroDivisionError("a bug")

    monkeypatch.setitem(syntax.RULES, "verify_stmt", (broken, "test"))
    with pytest.raises(ZeroDivisionError):
        P.parse("VERIFY")


def test_positions_in_a_long_script_are_the_scripts():
    from lql import loop

    text = "HELP;\n" * 3 + "  STATS;  VERIFY;\nINFER\n 'x' TOP 99999999999999999999;"
    stmts, err = [], None
    for ch in loop.chunks(text):
        try:
            stmts += loop.parse_chunk(text, ch)
        except LqlSyntaxError as e:
            err = e
    assert [(s.keyword, s.line, s.column, text[s.start_pos:s.end_pos]) for s in stmts][-2:] == [
        ("STATS", 4, 3, "STATS"), ("VERIFY", 4, 11, "VERIFY")]
    assert (err.line, err.column, err.source_line) == (6, 10, " 'x' TOP 99999999999999999999;")
