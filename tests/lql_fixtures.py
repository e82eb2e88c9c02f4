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

import lql
from lql.errors import LqlError


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


# A decimal number as text output prints it: sign, digits, a point, digits (an exponent after).
_DECIMAL = re.compile(r"-?\d[\d,]*\.\d+(?:e[-+]?\d+)?")


def _split_decimals(text: str) -> tuple[list[str], list[str]]:
    return _DECIMAL.split(text), _DECIMAL.findall(text)


def _last_digit_apart(a: str, b: str) -> bool:
    """Whether two printed decimals are the same rounding up to one unit of their last digit.
    A float32 result's last printed digit may differ between CPUs (vector width, BLAS kernels
    and numba's code change the order of additions), and a value near a rounding boundary then
    prints one unit apart; anything more is a real change."""
    if a == b:
        return True
    mant_a, _, exp_a = a.replace(",", "").partition("e")
    mant_b, _, exp_b = b.replace(",", "").partition("e")
    if exp_a != exp_b or len(mant_a.split(".")[1]) != len(mant_b.split(".")[1]):
        return False
    unit = 10.0 ** -len(mant_a.split(".")[1])
    return abs(float(mant_a) - float(mant_b)) <= unit * 1.000001


def same_output(expected: str, got: str) -> bool:
    """Golden-text equality: the same text, except that a printed decimal may be one unit of its
    last digit apart (see `_last_digit_apart`). Table columns may widen by a character when a
    number's width changes (``-0.0000`` against ``0.0000``), so runs of spaces compare as one."""
    if expected == got:
        return True
    squeeze = lambda t: "\n".join(re.sub(r" {2,}", "  ", line.rstrip()) for line in t.split("\n"))
    (text_e, num_e), (text_g, num_g) = _split_decimals(squeeze(expected)), _split_decimals(squeeze(got))
    return (len(num_e) == len(num_g) and [t.strip() for t in text_e] == [t.strip() for t in text_g]
            and all(_last_digit_apart(a, b) for a, b in zip(num_e, num_g, strict=True)))


def unified_diff(expected: str, got: str, name: str) -> str:
    import difflib

    return "\n".join(difflib.unified_diff(expected.split("\n"), got.split("\n"), f"{name} (expected)", f"{name} (got)",
                                           lineterm=""))


def check_case(case: Case, got: str, path: Path) -> None:
    """Assert that ``got`` is the case's expected text (`same_output`); with LQL_REGEN=1 write
    ``got`` into ``path`` instead (only when it differs) and skip, saying so. A failure shows the
    unified diff of expected and got."""
    import pytest

    if regen() and got != case.expected:
        cases = read_cases(path)
        for c in cases:
            if c.name == case.name:
                c.expected = got
        write_cases(path, cases)
        pytest.skip("expectation regenerated")
    where = f"{path.parent.name}/{path.name} line {case.line}"
    assert same_output(case.expected, got), (f"case {case.name!r} ({where}) prints otherwise:\n"
                                             + unified_diff(case.expected, got, where))
