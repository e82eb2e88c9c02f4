"""A progress bar for encodes that take more than a moment: prompt_toolkit's, on a terminal
only (never in JSON mode, never when stderr is not a terminal), with the time elapsed and an
estimate of the time left."""

from __future__ import annotations

import datetime
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[int, int, str], None]


def formatters() -> list:
    """The bar's columns: label, percentage, bar, done/total, elapsed, estimated time left."""
    from prompt_toolkit.shortcuts.progress_bar import formatters as f

    return [f.Label(), f.Text(" "), f.Percentage(), f.Text(" "), f.Bar(), f.Text(" "), f.Progress(), f.Text(" "),
            f.TimeElapsed(), f.Text(" elapsed, eta ", style="class:time-left"), f.TimeLeft(), f.Text(" ")]


@contextmanager
def terminal_progress(title: str, enabled: bool = True, delay: float = 0.5) -> Iterator[Progress | None]:
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from prompt_toolkit.output import create_output
    from prompt_toolkit.shortcuts import ProgressBar

    state: dict = {"bar": None, "counter": None, "t0": time.monotonic(), "start": datetime.datetime.now()}

    def cb(done: int, total: int, label: str) -> None:
        if state["bar"] is None:
            if time.monotonic() - state["t0"] < delay and done < total:
                return
            bar = ProgressBar(title=title, formatters=formatters(), output=create_output(stdout=sys.stderr))
            bar.__enter__()
            state["bar"] = bar
            state["counter"] = bar(total=total, label="tensors")
            state["counter"].start_time = state["start"]  # elapsed counts the moments before the bar showed
        counter = state["counter"]
        counter.total = total
        counter.items_completed = done  # set, not counted: a call may repeat or skip a step
        state["bar"].invalidate()

    try:
        yield cb
    finally:
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)
