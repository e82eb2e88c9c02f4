"""The few places where the draft engine touches the container/executor API, kept in one file so
that the rest of vindex3.draft reads as plain logic."""

from __future__ import annotations

import os
from typing import Any

from ..errors import SliceError


def open_container(container: Any) -> Any:
    """Accept an opened container or a path to one."""
    if isinstance(container, (str, os.PathLike)):
        import vindex3

        return vindex3.open(container)
    return container


def resolve_slice(container: Any, slice: Any) -> tuple[Any, int | None]:
    """Turn ``None`` (full), an int (draft depth) or a slice object into ``(slice, draft_depth)``,
    where draft_depth is None for the full model."""
    import vindex3

    if slice is None:
        return vindex3.Full(), None
    if isinstance(slice, bool):
        raise SliceError(f"a slice is Full(), Draft(n) or a depth; got {slice!r}")
    if isinstance(slice, int):
        return vindex3.Draft(slice), slice
    if isinstance(slice, vindex3.Full):
        return slice, None
    if isinstance(slice, vindex3.Draft):
        return slice, int(slice.end)
    raise SliceError(
        f"a dump runs Full() or Draft(n); got {type(slice).__name__}",
        hint="LayerRange has no embedding or head, so it yields no logits",
    )


def make_executor(container: Any, slice_obj: Any, intervention: Any = None,
                  max_positions: int | None = None, activations: str = "exact") -> tuple[Any, float]:
    """Prepare an executor for a slice (and intervention; positions limited to the model's
    context length, or to an explicit ``max_positions``); return it with the seconds
    preparation took."""
    kw = {}
    if activations != "exact":
        import inspect

        if "activations" not in inspect.signature(container.executor).parameters:
            from ..errors import SliceError

            raise SliceError(f"activations {activations!r} cannot run on {type(container).__name__} in this build "
                             "(its layers multiply with exact activations)", hint="run it in one process")
        kw["activations"] = activations
    ex = container.executor(slice=slice_obj, intervention=intervention, max_positions=max_positions, **kw)
    return ex, float(ex.prepare_seconds)


def container_facts(container: Any) -> dict[str, Any]:
    """Digest, component name and model depth, as a dump's sidecar records them."""
    graph = container.graph
    return {
        "digest": str(container.digest),
        "component": graph.component.name,
        "num_layers": int(graph.num_layers),
    }


def recurrent_layers(container: Any, executed: list[int]) -> list[tuple[int, str]]:
    """(layer, operator) of each executed layer whose state has a part that truncation cannot
    roll back (a fixed recurrence, which needs a snapshot)."""
    from ..continuation import TRUNCATE

    layers = container.op_plan().layers
    return [(i, layers[i].operator) for i in executed if layers[i].geometry.rollback != TRUNCATE]


def decode_thread_count() -> int | None:
    """Threads decode-sized passes use (the rows kernels and the products the executor splits;
    BLAS itself is held at one there, vindex3.exec.engine.pass_threads)."""
    from ..exec.engine import decode_threads

    return decode_threads()
