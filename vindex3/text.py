"""Text that vindex3's messages and reports share (lql renders its own; `lql.render.fmt_layers`
is this function's counterpart there, kept in lql so importing lql does not import vindex3)."""

from __future__ import annotations

from collections.abc import Sequence


def runs(xs: Sequence[int]) -> str:
    """[0, 1, 2, 3, 7] -> '0-3, 7': consecutive integers collapsed into runs, in the given order;
    '' for none."""
    out: list[list[int]] = []
    for x in xs:
        x = int(x)
        if out and x == out[-1][1] + 1:
            out[-1][1] = x
        else:
            out.append([x, x])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in out)
