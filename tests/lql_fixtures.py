"""Helpers for the LQL tests: statement-in, rendered-text-out cases, and output normalisation.

A case file holds blocks like::

    -- case: a name
    STATS AT 10 POSITIONS;
    ----
    <the exact text the statements render to>
    ====

Each case runs in a fresh session that has already opened the tiny fixture container. Results
render with timings off; a failing statement renders as ``error: <message>`` and stops the case.
The container's path is written ``<container>`` and the working directory ``<tmp>``.

Regenerate expectations after an intended change with ``LQL_REGEN=1`` and read the diff.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # the package may not be installed in a source checkout
    sys.path.insert(0, str(ROOT))

import lql  # noqa: E402
from lql.errors import LqlError  # noqa: E402


@dataclass
class Case:
    name: str
    text: str
    expected: str
    line: int  # where the case starts in its file


def read_cases(path: Path) -> list[Case]:
    cases: list[Case] = []
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"-- case: (.+)$", lines[i])
        if not m:
            i += 1
            continue
        start = i + 1
        j = start
        while lines[j] != "----":
            j += 1
        k = j + 1
        while lines[k] != "====":
            k += 1
        cases.append(Case(m.group(1).strip(), "\n".join(lines[start:j]), "\n".join(lines[j + 1:k]), start))
        i = k + 1
    return cases


def write_cases(path: Path, cases: list[Case]) -> None:
    header = path.read_text(encoding="utf-8").split("-- case:")[0]
    body = "".join(f"-- case: {c.name}\n{c.text}\n----\n{c.expected}\n====\n\n" for c in cases)
    path.write_text(header + body, encoding="utf-8")


def normalise(text: str, container: Path | str, cwd: Path | str | None = None) -> str:
    out = text.replace(str(container), "<container>")
    if cwd is not None:
        out = out.replace(str(cwd), "<tmp>")
    return out


def run_case(text: str, container: Path, cwd: Path | None = None) -> str:
    """Open the container, run ``text``, return every result's text (timings off)."""
    s = lql.Session()
    s.execute(f"OPEN '{container}'")
    chunks: list[str] = []
    try:
        for out in s.run(text):
            if out.error is not None:
                chunks.append(f"error: {out.error}")
                break
            chunks.append(out.result.to_text(timing=False))
    except LqlError as e:  # a syntax error
        chunks.append(f"error: {e}")
    return normalise("\n\n".join(chunks), container, cwd)


def regen() -> bool:
    return os.environ.get("LQL_REGEN") == "1"


# Timings and other machine-dependent values in text output: a number followed by a unit.
_TIMING = re.compile(r"\d[\d,]*(?:\.\d+)?\s?(?:ms|s|tok/s|x)\b")


def mask_timings(text: str) -> str:
    """Mask timings and collapse runs of spaces (timing widths shift table columns)."""
    text = _TIMING.sub("<t>", text)
    return "\n".join(re.sub(r" {2,}", "  ", line.rstrip()) for line in text.split("\n"))


def check_case(case: Case, got: str, path: Path) -> None:
    """Assert that ``got`` is the case's expected text; with LQL_REGEN=1 write ``got`` into
    ``path`` instead (only when it differs) and skip, saying so."""
    import pytest

    if regen() and got != case.expected:
        cases = read_cases(path)
        for c in cases:
            if c.name == case.name:
                c.expected = got
        write_cases(path, cases)
        pytest.skip("expectation regenerated")
    assert got == case.expected, f"case {case.name!r} ({path.parent.name}/{path.name} line {case.line})"
