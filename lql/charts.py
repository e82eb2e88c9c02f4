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


def sweep_figure(result):
    """A matplotlib Figure of a patch sweep: the recovered fraction as a heatmap, layers down,
    positions across (labelled with the corrupted prompt's tokens), diverging around 0; a cell
    with no fraction (clean and corrupted logits equal) is left blank."""
    require_matplotlib("plotting a patch sweep")
    import numpy as np
    from matplotlib.figure import Figure

    layers = list(result.layers)
    T = result.positions
    grid = np.full((len(layers), T), np.nan)
    labels = [""] * T
    row = {layer: k for k, layer in enumerate(layers)}
    for c in result.cells:
        if c.recovered is not None:
            grid[row[c.layer], c.position] = c.recovered
        labels[c.position] = f"{c.position} {c.token!r}" if getattr(c, "token", None) is not None else str(c.position)
    lim = max(1.0, float(np.nanmax(np.abs(grid)))) if np.isfinite(grid).any() else 1.0
    fig = Figure(figsize=(max(5.0, 0.55 * T + 2.5), max(3.0, 0.22 * len(layers) + 1.8)), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(grid, cmap="RdBu_r", vmin=-lim, vmax=lim, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(T), labels, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(layers)), [str(i) for i in layers], fontsize=7)
    ax.set_xlabel("position (corrupted prompt's token)")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, label="recovered = (patched - corrupted) / (clean - corrupted)")
    site = result.site.upper().replace("_", " ")
    target = repr(result.target) if getattr(result, "target", None) is not None else f"id {result.target_id}"
    ax.set_title(f"patch sweep of {site} for {target}")
    return fig


def check_chart_path(path: str, what: str = "PLOT INTO") -> None:
    """Refuse by name a chart file that is neither .png nor .svg."""
    from pathlib import Path

    from .errors import StatementError

    ext = Path(path).suffix.lower()
    if ext not in CHART_FORMATS:
        raise StatementError(f"{what} writes .png or .svg, not {Path(path).name!r}", hint="e.g. PLOT INTO 'chart.png'")


def save_figure(fig, path: str) -> None:
    """Write a figure as PNG or SVG, chosen by the file's extension."""
    from pathlib import Path

    check_chart_path(path)
    fig.savefig(path, format=Path(path).suffix.lower()[1:])
