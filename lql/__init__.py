"""LQL: a query language for studying language models stored as VINDEX3 containers.

Embedding API::

    import lql
    s = lql.connect("model.vindex3")          # or lql.Session(); s.execute("OPEN '...'")
    results = s.execute("STATS; INFER 'x' TOP 3;")
    results[0].to_text(); results[0].to_dict(); results[0].to_records()
    r = s.execute_one("SHOW LAYERS"); r.to_pandas()   # pandas: the notebook extra
    s.run_file("examples/quickstart.lql")

Statements run in order up to the first failure. Parse errors raise `LqlSyntaxError`; refusals
raise `LqlError` subclasses whose message names what was refused.
"""

from __future__ import annotations

from pathlib import Path

from .errors import (
    EngineRefusal,
    LqlError,
    LqlSyntaxError,
    NoContainer,
    NotAvailable,
    StatementError,
)
from .parser import parse
from .results import Result
from .session import Session

__version__ = "0.1.0"


def connect(path: str | Path, **hooks) -> Session:
    """A session with the container at ``path`` open (refuses like OPEN does)."""
    return Session(path, **hooks)


__all__ = [
    "EngineRefusal",
    "LqlError",
    "LqlSyntaxError",
    "NoContainer",
    "NotAvailable",
    "Result",
    "Session",
    "StatementError",
    "__version__",
    "connect",
    "parse",
]
