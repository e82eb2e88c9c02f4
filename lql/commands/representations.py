"""Where the vindex3 command line finds its REPRESENT, COMPACT, DIFF and SCORE REPRESENTATION
reports (vindex3/cli.py): the representations family builds them."""

from __future__ import annotations

from ..statements.representations import compact_result, diff_result, represent_result, score_result

__all__ = ["compact_result", "diff_result", "represent_result", "score_result"]
