"""Fuzzing LQL in the suite (issue 10): statements generated from the grammar, the documented
statements, and hostile mutations of both (unicode, NUL, lone surrogates, \\U escapes past
U+10FFFF, numbers of thousands of digits, megabyte strings, bad paths), run through the Python
API and through `lql`'s `main` in every output format on a tiny container, each case under a time
limit. Every case must end in a result or a named refusal: never an internal error, never past its
limit, never a file changed that the case did not say OVERWRITE for (nothing in the container,
ever), and the model must give the same logits afterwards.

The harness is tests/lql_fuzz.py (shared with bench/fuzz_lql.py, the 10,000-case run). Seeds are
fixed and hypothesis is derandomized, so a failure here reproduces; the failing statement is in
the assertion message."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="hypothesis (the dev extra) drives the grammar fuzzing")

import lql_fuzz as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import lql
from lql import render

LIMIT = 10.0  # seconds a case may take (issue 10: each case <= 10 s on a tiny container)


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, tiny_llama_container, tiny_llama_dir):
    sb = F.Sandbox(tmp_path_factory.mktemp("fuzz") / "sb", tiny_llama_container, tiny_llama_dir, limit=LIMIT)
    with F.hermetic(sb):
        sb.start()
        yield sb
        # after every case of the module: the same numbers as before the first
        sb.reset_session()
        with F._chdir(sb.root):
            assert np.array_equal(sb.reference(), sb._reference), "the model gives other logits after fuzzing"
        assert not sb.changed(), "a file of the sandbox is not as it was"


@pytest.fixture(scope="module")
def grammar():
    return F.Grammar()


@pytest.fixture(scope="module")
def docs():
    d = F.documented()
    assert len(d) >= 20, "the catalog examples and docs/lql.md's blocks should give a few dozen statements"
    return d


def _clean(counts: F.Counts) -> None:
    """Every case a result or a named refusal (the first few others are shown)."""
    assert counts.cases and not counts.bad, "\n\n".join(
        f"{f['outcome']} ({f['seconds']} s): {f['text']!r}\n{f['detail']}" for f in counts.failures[:5])
    assert counts.max_seconds <= LIMIT


def _run(sb: F.Sandbox, counts: F.Counts, text: str, *, cli_format: str | None = None, **cli) -> str:
    outcome, detail, secs = sb.run_api(text) if cli_format is None else sb.run_cli(text, cli_format, **cli)
    counts.add(outcome, text, secs, detail)
    return outcome


def test_the_generator_reaches_every_statement(grammar):
    """Every documented statement comes out of the generator (a statement added to the grammar
    is fuzzed as soon as it is merged), and generated text parses often enough to reach the
    planner."""
    import re

    from lql import registry
    from lql.errors import LqlSyntaxError
    from lql.parser import parse

    ch = F.RandomChooser(random.Random(7))
    parsed, seen = 0, []
    for _ in range(3000):  # ~60 statement rules, SHOW alone has ~15 alternatives
        text = grammar.statement(ch)
        try:
            parse(text)
            parsed += 1
        except LqlSyntaxError:
            continue
        seen.append(" ".join(re.sub(r"--[^\n]*", " ", text).split()).upper())
    def names(t: str, name: str) -> bool:  # the entry's words, first word first, in order ('TRACE FOR')
        words = name.split()
        if not t.startswith(words[0]):
            return False
        pos = 0
        for w in words:
            pos = t.find(w, pos)
            if pos < 0:
                return False
            pos += len(w)
        return True

    for d in registry.docs():
        assert any(names(t, d.name) for t in seen), f"{d.name} is not generated"
    assert parsed >= 1500, f"only {parsed} of 3000 generated statements parse: the generator drifted from the grammar"


def test_generated_and_documented_statements_through_the_api(sandbox, grammar, docs):
    """1,200 seeded cases: grammar-driven scripts and documented statements, half mutated."""
    ch = F.RandomChooser(random.Random(20260))
    counts = F.Counts()
    for _ in range(1200):
        _run(sandbox, counts, F.case(ch, grammar, docs=docs))
    _clean(counts)
    # the run reached past the parser: statements ran and the planner and engine refused things
    assert counts.outcomes.get("result", 0) >= 150, counts.outcomes
    assert len(set(counts.refusal_kinds) - {"LqlSyntaxError"}) >= 5, counts.refusal_kinds


@settings(max_examples=250, derandomize=True, deadline=None, database=None, print_blob=False,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_hypothesis_drives_the_generator(sandbox, grammar, docs, data):
    """The same generator with hypothesis choosing (derandomized: the same examples every run),
    so a failing case shrinks to a short statement."""
    text = F.case(F.DrawChooser(data.draw), grammar, docs=docs)
    counts = F.Counts()
    _run(sandbox, counts, text)
    _clean(counts)


# Hostile values in every slot of a few statement shapes: the literal problems the parser must
# position, the path problems every statement must name, the sizes the limits must refuse.
HOSTILE_STRINGS = [
    "\x00", "a\\u0000b", "\\0", "\ud800", "x\udfff", "\\uD800", "\\U00110000", "\\UFFFFFFFF", "é€😀\u202e\u0301",
    "\u2028\u2029\x85", "\x1b[31m", "", ".", "..", "/", "~", "n" * 300, "d/" * 3 + "e" * 256, "a" * 70000,
    "dir", "fifo", "link-out.txt", "dangling", "keep.txt", "tiny.vindex3/index.json",
    "tiny.vindex3/segments/embedding.bin", "/dev/null", "/etc/passwd", "nowhere/x.f32", "bank-big.jsonl",
    "bank-bad.jsonl", "http:// 127.0.0.1", "http://[::1", "x" * 200000,
]
HOSTILE_INTS = ["0", "-1", "9223372036854775807", "9223372036854775808", "9" * 4400, "1000000000", "1000000000000"]
SHAPES = [
    "OPEN {s}", "USE {s}", "USE REMOTE {s}", "INFER {s} TOP {n}", "INFER {s} GENERATE {n}", "TRACE {s}",
    "DUMP LOGITS {s} INTO {s2}", "DUMP LOGITS 'x' INTO {s}", "DUMP LOGITS 'x' DRAFT DEPTH {n} INTO 'new.f32'",
    "DRAFT LADDER DEPTHS ({n}) ON {s}", "DRAFT LADDER DEPTHS (1) ON 'prompts.jsonl' INTO {s}",
    "SCORE DRAFT {s} AGAINST {s2}", "PLAN {s}", "ENCODE {s} INTO {s2}", "ENCODE 'tiny-checkpoint' INTO {s}",
    "STATS AT {n} POSITIONS", "SHOW LAYERS RANGE {n}-{n}", "SHOW REPRESENTATIONS {s}", "SHOW OPERANDS LAYER {n}",
    "SET memory_limit = {s}", "SET max_generate = {n}", "SET max_positions = {n}", "INFER 'x' LOOKAHEAD {n}",
]


def _quoted(text: str) -> str:
    return "'" + text.replace("'", "\\'") + "'"


def test_hostile_values_in_every_slot(sandbox):
    rng = random.Random(31)
    counts = F.Counts()
    for shape in SHAPES:
        for value in HOSTILE_STRINGS if "{s" in shape else HOSTILE_INTS:
            other = _quoted(rng.choice(HOSTILE_STRINGS))
            text = shape.format(s=_quoted(value), s2=other, n=value if "{s" not in shape else rng.choice(HOSTILE_INTS))
            _run(sandbox, counts, text)
    _clean(counts)


def test_unterminated_and_oversized_literals_are_refused_cheaply(sandbox):
    """An unterminated string, a string over the lexer's limit, a 20,000-digit number: each a
    syntax error in well under the case limit (they cost the regex engine per character)."""
    from lql.errors import LqlSyntaxError

    s = sandbox
    s.reset_session()
    for text in ["INFER '" + "a" * (3 << 20), "INFER '" + "a" * ((1 << 20) + 1) + "'",
                 "INFER 'x' TOP " + "9" * 20000, "INFER '\\U00110000'", "INFER 'a\x00b'"]:
        with pytest.raises(LqlSyntaxError) as e, F.time_limit(LIMIT):
            s.session.execute(text)
        assert e.value.message and e.value.line >= 1


@pytest.mark.parametrize("fmt", list(render.FORMATS))
def test_lql_main_in_every_format(sandbox, grammar, docs, fmt):
    """``lql -c tiny.vindex3 --format FMT --execute TEXT``: exit 0, 1 or 2, never a traceback or
    an internal error, for generated, documented and mutated scripts."""
    ch = F.RandomChooser(random.Random(f"cli-{fmt}"))
    counts = F.Counts()
    for _ in range(30):
        _run(sandbox, counts, F.case(ch, grammar, docs=docs), cli_format=fmt)
    _clean(counts)
    assert counts.outcomes.get("result", 0) >= 1, counts.outcomes


def test_lql_main_reads_any_bytes_on_standard_input(sandbox, grammar, docs):
    """``lql -c tiny.vindex3 -`` with a script on stdin: UTF-8, lone surrogates as bytes, bytes
    that are not UTF-8 at all, with and without --keep-going; never a traceback."""
    ch = F.RandomChooser(random.Random("stdin"))
    counts = F.Counts()
    for i in range(60):
        text = F.case(ch, grammar, docs=docs)
        _run(sandbox, counts, text, cli_format=ch.pick(list(render.FORMATS)), stdin=F.as_stdin(ch, text),
             keep_going=bool(i % 2))
    outcome, detail, _ = sandbox.run_cli("STATS", stdin=b"STATS;\n\xff\xfe SHOW LAYERS;\n")
    assert outcome == "refusal" and detail == "exit 1", detail
    _clean(counts)


def test_the_harness_sees_what_it_must_fail(sandbox, monkeypatch):
    """The checks can fail: a changed file without OVERWRITE is an overwrite; an escaped exception
    is internal; a case past its limit is a timeout."""
    sb = sandbox
    with F._chdir(sb.root):
        (sb.root / "keep.txt").write_text("changed\n")
    outcome, detail = sb._after("STATS", "result", "")
    assert outcome == "overwrite" and "keep.txt" in detail
    assert (sb.root / "keep.txt").read_text() == "precious\n", "restore puts the file back"
    with F._chdir(sb.root):
        (sb.root / "tiny.vindex3" / "index.json").touch()
    outcome, _ = sb._after("DUMP LOGITS 'x' INTO 'tiny.vindex3/index.json' OVERWRITE", "result", "")
    assert outcome == "overwrite", "nothing in the open container may change, even with OVERWRITE"

    def boom(self, text):
        raise KeyError("planted")

    monkeypatch.setattr(lql.Session, "execute", boom)
    outcome, detail, _ = sb.run_api("STATS")
    assert outcome == "internal" and "planted" in detail

    def slow(self, text):
        time.sleep(5)

    monkeypatch.setattr(lql.Session, "execute", slow)
    monkeypatch.setattr(sb, "limit", 0.2)
    outcome, _, secs = sb.run_api("STATS")
    assert outcome == "timeout" and secs < 2
