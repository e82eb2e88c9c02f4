"""The typed AST: one pydantic class per statement. Nodes know where they came from (line,
column, source text) and nothing else; downstream code takes nodes, never text."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


def dialect(default):
    """A field added for the reference dialect (issue 19) to a statement that had none: marked so
    that tests comparing whole nodes can leave it out while it holds its default."""
    return Field(default, json_schema_extra={"dialect": True})


class Node(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


# ---- prompts --------------------------------------------------------------------------


class TextPrompt(Node):
    """A prompt given as text; tokenised with the container's own tokenizer."""

    kind: Literal["text"] = "text"
    text: str

    def describe(self) -> str:
        return repr(self.text)


class TokenPrompt(Node):
    """A prompt given as token ids: ``TOKENS (1, 2, 3)``. Needs no tokenizer."""

    kind: Literal["tokens"] = "tokens"
    ids: list[int]

    def describe(self) -> str:
        return "TOKENS (" + ", ".join(str(i) for i in self.ids) + ")"


Prompt = Annotated[TextPrompt | TokenPrompt, Field(discriminator="kind")]

#: ABLATE FEATURES (layer:feature, ...) as written: (layer, feature) pairs in the order given.
Ablation = tuple[tuple[int, int], ...]

#: A layer range as written (LAYERS a-b, inclusive; LAYERS a is (a, a)).
LayerSpan = tuple[int, int]

#: The reference dialect's output detail and layer bands.
Detail = Literal["verbose", "brief", "raw"]
Band = Literal["all", "syntax", "knowledge", "output"]


# ---- statements -----------------------------------------------------------------------


#: Every concrete statement class by its name, filled as classes are defined (a family's module
#: defining one is what registers it; `lql.registry.statement_classes` lists them).
CLASSES: dict[str, type[Statement]] = {}


class Statement(Node):
    """Common to every statement: where it is in the script (1-based line and column of its
    first token, 0-based character offsets) and its own source text.

    What a statement class declares about itself (the server's policy, the planner's checks):

    * ``paths``: the fields that hold a file path the statement reads or writes (a server
      confines each to its data directory); ``None`` means undeclared, and a server refuses the
      statement by name rather than guess that it names no path.
    * ``read_only``: True when it only reads (the read-only profile allows it), else the reason
      it does not, in words; ``None`` is undeclared and refused like ``paths``.
    * ``needs_container``: refused (`NoContainer`) when nothing is bound, after ``check`` passes.
    * ``local_when_remote``: still runs here in a session bound to a server (USE REMOTE);
      ``remote_mirror``: runs on the server and here too (SET)."""

    keyword: ClassVar[str] = ""  # the statement's name as a user writes it, e.g. "SHOW LAYERS"
    paths: ClassVar[tuple[str, ...] | None] = None
    read_only: ClassVar[bool | str | None] = None
    needs_container: ClassVar[bool] = False
    local_when_remote: ClassVar[bool] = False
    remote_mirror: ClassVar[bool] = False
    never_on_server: ClassVar[tuple[str, str] | None] = None  # (why, hint): refused by every server

    line: int = 1
    column: int = 1
    end_line: int = 1
    end_column: int = 1
    start_pos: int = 0
    end_pos: int = 0
    source: str = ""

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        kind = cls.model_fields.get("kind")
        if kind is not None and isinstance(kind.default, str):
            if cls.__name__ in CLASSES and CLASSES[cls.__name__].__module__ != cls.__module__:
                raise TypeError(f"two statement classes are named {cls.__name__} "
                                f"({CLASSES[cls.__name__].__module__} and {cls.__module__})")
            CLASSES[cls.__name__] = cls

    def check(self) -> None:
        """The checks that need no container (a count of zero, a range that runs backwards),
        raised as `StatementError`s; run before the statement is bound."""

    def generates(self) -> int | None:
        """The tokens it asks to generate (GENERATE n), which a server's --max-tokens bounds; None
        when it generates none."""
        infer = getattr(self, "infer", None)  # EXPLAIN INFER ... [FEATURES] asks what its INFER asks
        return infer.generates() if isinstance(infer, Statement) else getattr(self, "generate", None)

    def check_on_server(self, config) -> None:
        """Refuse what this statement may not do on a server (``config``: its
        `lql.server.config.ServerConfig`) beyond its paths and profile; a `LqlError` naming why."""

    def refused_read_only(self) -> str | None:
        """Why the read-only profile refuses this statement (None: it only reads)."""
        if self.read_only is True:
            return None
        return self.read_only or "it is not a statement that only reads"

    def error(self, message: str, hint: str | None = None):
        """A refusal positioned at this statement."""
        from .errors import StatementError

        return StatementError(message, hint=hint, line=self.line, column=self.column, statement=self.source)


# ---- columns and conditions (SELECT ... FROM FEATURES, and the reference dialect's tables) --


class Column(Node):
    """A column named in SELECT, WHERE or ORDER BY, where it was written."""

    name: str  # lower-cased
    line: int = 1
    column: int = 1


class Condition(Node):
    """``column op value`` in WHERE: op is =, !=, <, <=, >, >= or LIKE (``<>`` is read as !=)."""

    column: Column
    op: str  # also IN, whose value is a list
    value: str | int | float | list[str | int | float]


