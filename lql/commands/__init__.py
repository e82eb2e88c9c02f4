"""Command modules: each executes plan nodes of one kind and returns a typed result.

A command is a function ``(session, node) -> Result`` registered for its plan node type with
``@command(planner.NodeType)``. Commands run vindex3 (through the session's executors and
`lql.binding`) and fill results; they never parse, plan or render. The session holds the state
they read and change (the bound container, the draft depth, the settings, the executors).

Adding a statement: grammar rule, AST node, planner case, a module here, a layout in render."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import planner

if TYPE_CHECKING:  # pragma: no cover
    from ..results import Result
    from ..session import Session

Command = Callable[["Session", Any], "Result"]

COMMANDS: dict[type[planner.Node], Command] = {}


def command(node_type: type[planner.Node]) -> Callable[[Command], Command]:
    """Register the decorated function as the command that executes ``node_type``."""

    def register(fn: Command) -> Command:
        if node_type in COMMANDS:
            raise ValueError(f"{node_type.__name__} has two commands")
        COMMANDS[node_type] = fn
        return fn

    return register


def execute(session: Session, node: planner.Node) -> Result:
    """Run one plan node: the runner its family registered for the node's class (for the
    identity plan, for the statement's class)."""
    from .. import registry

    key = type(node.statement) if type(node) is planner.Identity else type(node)
    fn = registry.runner_for(key) or COMMANDS.get(type(node))
    if fn is None:  # a planner case without a command is a bug
        raise NotImplementedError(f"no command executes {type(node).__name__}")
    return fn(session, node)


# Importing the modules registers their commands.
from . import (  # noqa: F401
    container,
    dialect,
    drafts,
    explain,
    infer,
    representations,
    trace,
)
