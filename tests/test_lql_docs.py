"""docs/lql.md stays honest: every ```lql example in it runs, in order, in one session, and
prints what the ```text block after it shows (timings and timestamps masked). Regenerate the
output blocks with LQL_REGEN=1 after an intended change, and read the diff."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from lql_fixtures import ROOT, mask_timings, regen, same_output, unified_diff

import lql
from lql import registry
from lql.errors import LqlError

DOC = ROOT / "docs" / "lql.md"
PAIR = re.compile(r"```lql\n(.*?)```\n\n```text\n(.*?)```", re.DOTALL)
_STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:\d\d|Z)?")
# OBSERVE's receipt: a fresh run id (and so a fresh SHA-256) every run
_RECEIPT = re.compile(r"sha256 [0-9a-f]{64}, run [0-9a-f]{32}")
# a fitted exit adapter's file digest (DRAFT DEPTH d WITH ADAPTER, EXPLAIN): a hash of float32
# arrays whose last bits follow the machine's float additions
_ADAPTER_SHA = re.compile(r"sha256 [0-9a-f]{12}…")


def _norm(text: str) -> str:
    text = _ADAPTER_SHA.sub("sha256 <digest>…", text)
    return mask_timings(_RECEIPT.sub("<receipt>", _STAMP.sub("<timestamp>", text))).strip("\n")


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


@pytest.fixture
def docs_dir(tmp_path, monkeypatch, tiny_llama_container, tiny_llama_dir, containers):
    # a copy: the examples build feature metadata, derived data kept inside the container
    shutil.copytree(tiny_llama_container, tmp_path / "tiny.vindex3")
    (tmp_path / "moe.vindex3").symlink_to(containers("qwen3_moe"))  # routed experts, for SHOW EXPERTS
    (tmp_path / "tiny-checkpoint").symlink_to(tiny_llama_dir)
    prompts = [{"id": "fact-01", "category": "fact", "text": "The capital of France is"},
               {"id": "code-01", "category": "code", "text": "def add(a, b):"},
               {"id": "story-01", "category": "narrative", "text": "Once upon a time"}]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    monkeypatch.setenv("VINDEX3_CACHE", str(tmp_path / "cache"))  # SHOW MODELS lists the cache too: an empty one
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_docs_examples_print_what_the_docs_show(docs_dir):
    doc = DOC.read_text(encoding="utf-8")
    pairs = list(PAIR.finditer(doc))
    assert len(pairs) >= 20
    s = lql.Session()
    failures, new_doc, last = [], [], 0
    for m in pairs:
        code, shown = m.group(1), m.group(2)
        got = _run(s, code).replace(str(docs_dir), ".")
        changed = not same_output(_norm(shown), _norm(got))
        if changed:
            failures.append(f"{code.strip()}\n" + unified_diff(_norm(shown), _norm(got), "docs"))
        # regenerate only what changed: timings of the other blocks stay as they are
        new_doc.append(doc[last:m.start(2)] + (got + "\n" if changed else shown))
        last = m.end(2)
    if regen() and failures:
        DOC.write_text("".join(new_doc) + doc[last:], encoding="utf-8")
        pytest.skip("docs output regenerated")
    assert not failures, "\n".join(failures)


def test_docs_cover_every_statement():
    doc = DOC.read_text(encoding="utf-8")
    for d in registry.docs():
        assert d.syntax.split(" |")[0].split(" [")[0] in doc, d.name
    examples = "\n".join(m.group(1) for m in PAIR.finditer(doc)).upper()
    for d in registry.docs():
        assert d.name in examples, f"no example of {d.name} in docs/lql.md"


# A path the docs name: a top-level folder of the checkout, then more path.
_CHECKOUT_PATH = re.compile(r"(?<![\w/~.-])((?:examples|tests|bench|docs|scripts|grammar|lql|vindex3)/[\w./*-]*[\w*/])")
_LINK = re.compile(r"\]\(([^)#\s]+)\)")


def test_docs_name_only_files_in_the_checkout():
    """Every file or folder the README and docs/*.md name exists in this checkout; nothing
    points outside it (``../``)."""
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text(encoding="utf-8")
        assert "../" not in text, f"{doc.name} points outside the checkout"
        names = set(_CHECKOUT_PATH.findall(text))
        names |= {(doc.parent / m).resolve().relative_to(ROOT).as_posix() for m in _LINK.findall(text)
                  if "://" not in m}
        for name in sorted(names):
            name = name.rstrip(".")
            if "*" in name:
                ok = any(ROOT.glob(name))
            else:
                ok = (ROOT / name).exists()
            if not ok:
                missing.append(f"{doc.relative_to(ROOT)}: {name}")
    assert not missing, "docs name files that are not in the checkout:\n" + "\n".join(missing)
