"""Charts: figures of results (matplotlib, an optional extra, refused by name when absent) and
writing them as PNG or SVG. Layout of data only: nothing here computes a fact."""

from __future__ import annotations

CHART_FORMATS = (".png", ".svg")


def require_matplotlib(what: str) -> None:
    """Refuse by name when matplotlib (an optional extra) is missing."""
    from .errors import NotAvailable

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise NotAvailable(f"{what} needs matplotlib, which is not installed",
                           hint="from a clone of the source: pip install -e '.[notebook]' (or pip install matplotlib)") from None


def ladder_figure(result):
    """A matplotlib Figure of a ladder: KL p50 and p90 (left axis, nats) and top-1 agreement
    (right axis) against draft depth."""
    require_matplotlib("plotting a ladder")
    from matplotlib.figure import Figure

    depths = [row["depth"] for row in result.rows]
    s = [row["summary"] for row in result.rows]
    fig = Figure(figsize=(7.0, 4.0), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(depths, [x["kl_p50"] for x in s], marker="o", label="KL p50")
    ax.plot(depths, [x["kl_p90"] for x in s], marker="o", linestyle="--", label="KL p90")
    ax.set_xlabel(f"draft depth (layers of {result.model_layers})")
    ax.set_ylabel("KL(target ‖ draft), nats")
    ax2 = ax.twinx()
    ax2.plot(depths, [x["top1"] for x in s], marker="s", color="tab:green", label="top-1 agreement")
    ax2.set_ylim(0.0, 1.05)
    ax2.set_ylabel("top-1 agreement")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper center")
    ax.set_title(f"depth ladder on {result.prompts_file}")
    return fig


def save_figure(fig, path: str) -> None:
    """Write a figure as PNG or SVG, chosen by the file's extension."""
    from pathlib import Path

    from .errors import StatementError

    ext = Path(path).suffix.lower()
    if ext not in CHART_FORMATS:
        raise StatementError(f"PLOT INTO writes .png or .svg, not {Path(path).name!r}",
                             hint="e.g. PLOT INTO 'ladder.png'")
    fig.savefig(path, format=ext[1:])
