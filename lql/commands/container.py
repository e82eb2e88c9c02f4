"""Where the vindex3 command line finds its PLAN and VERIFY reports (through
`lql.render.admission_text` and ``verify_text``): the container family builds them."""

from __future__ import annotations

from ..statements.container import plan_result, verify_result

__all__ = ["plan_result", "verify_result"]
