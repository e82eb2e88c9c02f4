"""Statement text in, rendered text out, on the pure Mamba2 and the Granite hybrid fixture
containers: STATS says what the continuation holds (recurrent only; KV per position plus fixed
recurrent bytes), EXPLAIN lists the mamba2 ops with operands and buffer shapes.

The cases live in lql_cases/mamba2.txt and lql_cases/hybrid.txt (format: lql_fixtures.py)."""

from __future__ import annotations

import pytest
from lql_fixtures import HERE, check_case, read_cases, run_case

FILES = {"mamba2": HERE / "lql_cases" / "mamba2.txt", "granitemoehybrid": HERE / "lql_cases" / "hybrid.txt"}
CASES = [(family, case) for family, path in FILES.items() for case in read_cases(path)]


@pytest.mark.parametrize("family, case", CASES, ids=[f"{f}: {c.name}" for f, c in CASES])
def test_statement_renders(family, case, containers, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    container = containers(family)
    got = run_case(case.text.replace("<container>", str(container)), container, tmp_path)
    check_case(case, got, FILES[family])


def test_case_names_are_unique():
    for path in FILES.values():
        names = [c.name for c in read_cases(path)]
        assert len(names) == len(set(names))


def test_json_keeps_an_infinite_time_step_limit(containers):
    """--json output is strict JSON; an infinite Δ limit is written in the tagged spelling,
    never as null (absence) or a bare Infinity."""
    import json
    import math

    import lql
    from lql import render
    from vindex3 import jsonio

    s = lql.Session()
    s.execute(f"OPEN '{containers('mamba2')}'")
    (r,) = s.execute("EXPLAIN DRAFT DEPTH 1")
    text = render.dumps_json(render.to_json(r))
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert '"time_step_limit": [0.0, {"__float__": "Infinity"}]' in text
    mixer = next(op for st in jsonio.loads(text)["result"]["steps"] for op in st["ops"] if op["kind"] == "mamba2")
    assert mixer["params"]["time_step_limit"] == [0.0, math.inf]
