"""Every statement on the tiny fixture container: statement text in, rendered text out.

The cases live in lql_cases/statements.txt; adding a case is adding a block there."""

from __future__ import annotations

import pytest
from lql_fixtures import HERE, check_case, read_cases, run_case

CASES_FILE = HERE / "lql_cases" / "statements.txt"
CASES = read_cases(CASES_FILE)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_statement_renders(case, tiny_llama_container, tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = case.text.replace("<container>", str(tiny_llama_container)).replace("<checkpoint>", str(tiny_llama_dir))
    got = run_case(text, tiny_llama_container, tmp_path).replace(str(tiny_llama_dir), "<checkpoint>")
    check_case(case, got, CASES_FILE)


def test_case_names_are_unique():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names))
