"""docs/internals.md stays honest: every ```lql example in it runs, in order, in one session on the
default model (SmolLM2-135M-Instruct), and prints what the ```text block after it shows (timings
masked). The feature metadata is built once per test run (the `smollm2_features` fixture; a run
that finds it in the container only reads it). Regenerate the blocks with LQL_REGEN=1 and read
the diff."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lql_fixtures import ROOT, mask_timings, regen, same_output, unified_diff

import lql
from lql.errors import LqlError

DOC = ROOT / "docs" / "internals.md"
PAIR = re.compile(r"```lql\n(.*?)```\n\n```text\n(.*?)```", re.DOTALL)


def _norm(text: str) -> str:
    return mask_timings(text).strip("\n")


def _run(session: lql.Session, text: str) -> str:
    chunks = []
    try:
        for out in session.run(text):
            if out.error is not None:
                chunks.append(f"error: {out.error}")
                break
            chunks.append(out.result.to_text())
    except LqlError as e:
        chunks.append(f"error: {e}")
    return "\n\n".join(chunks)


@pytest.mark.slow
def test_internals_doc_prints_what_smollm2_prints(smollm2_features, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cache = str(Path(smollm2_features).parent)
    doc = DOC.read_text(encoding="utf-8")
    pairs = list(PAIR.finditer(doc))
    assert len(pairs) >= 6
    s = lql.Session()
    failures, new_doc, last = [], [], 0
    for m in pairs:
        code, shown = m.group(1), m.group(2)
        got = _run(s, code).replace(cache, "<cache>")
        changed = not same_output(_norm(shown), _norm(got))
        if changed:
            failures.append(f"{code.strip()}\n" + unified_diff(_norm(shown), _norm(got), "docs"))
        new_doc.append(doc[last:m.start(2)] + (got + "\n" if changed else shown))
        last = m.end(2)
    if regen() and failures:
        DOC.write_text("".join(new_doc) + doc[last:], encoding="utf-8")
        pytest.skip("docs output regenerated")
    assert not failures, "\n".join(failures)


def test_internals_doc_is_linked_and_names_its_test():
    text = DOC.read_text(encoding="utf-8")
    assert "tests/test_internals_docs.py" in text and "bench/internals_smollm2.py" in text
    assert "internals.md" in (ROOT / "docs" / "lql.md").read_text(encoding="utf-8")
