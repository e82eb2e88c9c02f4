"""The text of vindex3's own reports, for the ``vindex3`` command line. vindex3 knows nothing of
lql: its command line finds this function through the ``vindex3.reports`` entry point (declared
in pyproject.toml) and, where lql is not installed, prints the report's JSON instead. The text is
the one the matching LQL statement prints (PLAN, VERIFY, REPRESENT, COMPACT, DIFF, SCORE
REPRESENTATION), laid out by that statement's family."""

from __future__ import annotations

from typing import Any


def render(kind: str, report: Any, *, as_json: bool = False) -> str | dict:
    """``report`` (a vindex3 report object of ``kind``) as the text its LQL statement prints, or
    with ``as_json`` as the body of that statement's JSON result."""
    from .statements import container, representations

    builders = {
        "admission": container.plan_result,
        "verify": lambda r: container.verify_result(r, show_path=True),
        "represent": representations.represent_result,
        "compact": representations.compact_result,
        "diff": representations.diff_result,
        "score_representation": representations.score_result,
    }
    if kind not in builders:
        raise KeyError(f"lql lays out no vindex3 report of kind {kind!r}; it knows {', '.join(builders)}")
    res = builders[kind](report)
    return res.model_dump(mode="json", exclude={"statement", "kind"}) if as_json else res.to_text(timing=True)
