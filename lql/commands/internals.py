"""Looking inside (issue 15): TRACE ... FOR and OBSERVE (WALK, DESCRIBE, SELECT ... FROM FEATURES,
SHOW FEATURES, EXPLAIN INFER ... FEATURES and BUILD FEATURES are the features family,
`lql.statements.features`), each one call on the session's
`vindex3.internals.Internals` (one per bound container), whose pydantic result becomes the LQL
result of the same shape (lql.results mirrors it field for field).

Feature metadata is built on demand (the REPL draws a progress bar through the session's
``on_progress``) and kept in the container as derived data; the ``stale`` setting says whether
metadata built from another state of the container is rebuilt or refused. Output files go
through vindex3's path helper before anything runs: never inside the open container, never over
an existing file unless the plan says ``overwrite``."""

from __future__ import annotations

from .. import planner
from .. import results as R
from ..binding import check_output, internals, internals_data, with_text
from . import command


@command(planner.Observe)
def observe(session, node: planner.Observe) -> R.ObserveResult:
    check_output(session, node.into, "OBSERVE ... RECORD INTO", node.overwrite)
    r = internals(session).observe(list(node.prompt.ids), node.into, generate=node.generate, lens_tokens=list(node.lens),
                             overwrite=node.overwrite, slice=node.slice.depth, intervention=node.intervention)
    return R.ObserveResult.model_validate(with_text(internals_data(r), node.prompt))


