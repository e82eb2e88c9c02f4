"""What the knowledge-edit tests share: a small key-covariance corpus standing in for the frozen
prompt bank (the whole bank costs minutes on the tiny fixtures), and file hashes to show that a
container was left as it was."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# the first prompts of some kinds in the frozen bank
BANK = [{"id": "fact-01", "category": "fact", "text": "The capital of France is"},
        {"id": "code-01", "category": "code", "text": "def add(a, b):"},
        {"id": "narr-01", "category": "narrative", "text": "Once upon a time, there was a small model"}]


@contextmanager
def small_bank(directory: Path, bank: list[dict] = BANK) -> Iterator[Path]:
    """``bank`` written as JSON lines under ``directory`` and used as the edits' default corpus
    while the context lasts."""
    from vindex3.edits import fit

    path = directory / "small-bank.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in bank))
    was, fit.DEFAULT_CORPUS = fit.DEFAULT_CORPUS, str(path)
    try:
        yield path
    finally:
        fit.DEFAULT_CORPUS = was


def hashes(d: Path) -> dict[str, str]:
    """sha256 of every file under ``d``, by relative path."""
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def two_edits(directory: Path, container: Path, *, layers: bool = True):
    """A copy of ``container`` in ``directory`` opened in a session whose patch 'facts' holds two
    edits: France's capital to ' Rome' (MEMIT) and Italy's capital to 'Paris' (COMPOSE), at
    layers 1-2 and 3 when ``layers``, else at each mode's default layers."""
    import shutil

    import lql

    shutil.copytree(container, directory / "tiny.vindex3")
    s = lql.Session(str(directory / "tiny.vindex3"))
    memit, compose = ("LAYERS 1-2 ", "AT LAYER 3 ") if layers else ("", "")
    s.execute("BEGIN PATCH 'facts'; "
              f"INSERT INTO EDGES (prompt, target) VALUES ('The capital of France is', ' Rome') {memit}MODE MEMIT; "
              f"INSERT INTO EDGES (entity, relation, target) VALUES ('Italy', 'capital', 'Paris') {compose}MODE COMPOSE")
    return s
