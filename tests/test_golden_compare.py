"""The golden-text comparison (lql_fixtures.same_output) allows what differs between CPUs, one unit
of a printed decimal's last digit, and nothing else; and a failing case shows a unified diff."""

from __future__ import annotations

import pytest
from lql_fixtures import Case, check_case, same_output


@pytest.mark.parametrize(("expected", "got"), [
    ("logit  17.3713", "logit  17.3713"),
    ("logit  17.3713", "logit  17.3714"),  # a rounding boundary: one unit of the last digit
    ("share  16.4%", "share  16.3%"),
    ("KL  1.68e-06", "KL  1.69e-06"),
    ("a  -0.0000  b", "a   0.0000  b"),  # the sign of a zero, and the column it shifts
    ("x  1,234.5", "x  1,234.6"),
])
def test_one_unit_of_the_last_digit_is_the_same_output(expected, got):
    assert same_output(expected, got)


@pytest.mark.parametrize(("expected", "got"), [
    ("logit  17.3713", "logit  17.3715"),  # two units: a real change
    ("logit  17.3713", "logit  17.371"),  # fewer digits printed
    ("rank  4315", "rank  4316"),  # whole numbers are exact
    ("top-1  ' a'", "top-1  ' the'"),
    ("KL  1.68e-06", "KL  1.68e-07"),
    ("a  1.0  b  2.0", "a  1.0  b"),
])
def test_anything_else_is_a_different_output(expected, got):
    assert not same_output(expected, got)


def test_a_failing_case_shows_the_unified_diff(tmp_path):
    path = tmp_path / "cases.txt"
    path.write_text("")
    case = Case("demo", "STATS;", "layers  4\nmodel  llama", 1)
    with pytest.raises(AssertionError) as e:
        check_case(case, "layers  5\nmodel  llama", path)
    msg = str(e.value)
    assert "-layers  4" in msg and "+layers  5" in msg and " model  llama" in msg
