"""A progress bar for encodes that take more than a moment: prompt_toolkit's, on a terminal
only (never in JSON mode, never when stderr is not a terminal)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Progress = Callable[[int, int, str], None]


@contextmanager
def terminal_progress(title: str, enabled: bool = True, delay: float = 0.5) -> Iterator[Progress | None]:
    if not enabled or not sys.stderr.isatty():
        yield None
        return
    from prompt_toolkit.output import create_output
    from prompt_toolkit.shortcuts import ProgressBar

    state: dict = {"bar": None, "counter": None, "t0": time.monotonic()}

    def cb(done: int, total: int, label: str) -> None:
        if state["bar"] is None:
            if time.monotonic() - state["t0"] < delay and done < total:
                state["pending"] = done
                return
            bar = ProgressBar(title=title, output=create_output(stdout=sys.stderr))
            bar.__enter__()
            state["bar"] = bar
            state["counter"] = bar(total=total, label="tensors")
            for _ in range(state.get("pending", 0)):
                state["counter"].item_completed()
        state["counter"].item_completed()

    try:
        yield cb
    finally:
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)
