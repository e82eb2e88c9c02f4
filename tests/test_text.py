"""vindex3.text.runs: the run formatter every vindex3 message uses, checked by reading its text
back (a property, not examples copied from its output)."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from vindex3.text import runs


def _read_back(text: str) -> list[int]:
    out: list[int] = []
    for part in filter(None, text.split(", ")):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


@given(st.lists(st.integers(0, 200), unique=True).map(sorted))
def test_runs_reads_back_to_the_same_layers_and_collapses_every_run(xs):
    text = runs(xs)
    assert _read_back(text) == xs
    # no two adjacent parts could have been one run
    parts = [p.partition("-") for p in filter(None, text.split(", "))]
    for (a1, _, b1), (a2, _, _) in itertools.pairwise(parts):
        assert int(a2) > int(b1 or a1) + 1


def test_runs_of_nothing_is_empty():
    assert runs([]) == ""
