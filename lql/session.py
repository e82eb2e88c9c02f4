"""The session: the state statements run against — the bound container (and its catalog view),
the default draft depth, the settings, the executors prepared so far and the hooks a front end
listens on. Planning is `lql.planner`, execution `lql.commands`, the statement loop
`lql.loop`; the methods here are the embedding API over them.

Every refusal leaves as an `LqlError` positioned at its statement; vindex3's refusals pass
through with their own message (`EngineRefusal`). Anything else is a bug, and leaves as an
`InternalError` naming the statement (its ``original`` is the exception; front ends show one
line, and the traceback only when asked). Only an interrupt passes through as itself."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from . import ast, catalog, loop
from . import results as R
from .binding import Catalog, slice_of
from .errors import InternalError, LqlError, StatementError
from .loop import Outcome
from .planner import Context

TokenHook = Callable[[int, str | None], None]  # (token id, its text or None) as GENERATE emits it
ProgressHook = Callable[[int, int, str], None]  # (done, total, label) for ENCODE, DRAFT LADDER
NoticeHook = Callable[[str], None]  # one line a statement says while it runs (OPEN DEFAULT's rebuild)

__all__ = ["Outcome", "Session"]


class Session:
    """An LQL session. ``Session()`` starts unbound; ``Session(path)`` opens a container.

    ``on_token(id, text)`` is called for each token GENERATE produces, as it is produced;
    ``on_progress(done, total, label)`` during ENCODE, OPEN DEFAULT and DRAFT LADDER;
    ``on_notice(text)`` when a statement has something to say before it finishes (OPEN DEFAULT
    rebuilding a damaged cache)."""

    def __init__(self, path: str | Path | None = None, *, on_token: TokenHook | None = None,
                 on_progress: ProgressHook | None = None, on_notice: NoticeHook | None = None):
        self.container = None  # what statements run on: the container, or its sharded view
        self.base_container = None  # the opened container itself
        self.catalog: Catalog | None = None
        self.default_model = False
        self.draft_depth: int | None = None
        self.draft_adapter = False  # DRAFT DEPTH d WITH ADAPTER: the draft reads through its stored exit adapter
        self.remote = None  # lql.server.client.Remote after USE REMOTE: statements run there
        self.settings = catalog.Settings()  # typed, defaults from the catalogue
        self.on_token = on_token
        self.on_progress = on_progress
        self.on_notice = on_notice
        self._executors: dict[Any, Any] = {}
        # the opened container, shared with every session in this process that opened the same
        # one (lql.prepared); held here so that it lives as long as a session is bound to it
        self.prepared = None
        self.memory_ceiling: int | None = None  # a server's --memory-ceiling: a new OPEN past it is refused
        self._internals = None  # vindex3.internals.Internals of the bound container, made on first use
        self.shared_internals = None  # a server's maker of its model's shared Internals (None: the session's own)
        self.writes_derived = True  # feature metadata built here is kept in the container (False: in memory only)
        if path is not None:
            from .parser import parse_one
            from .syntax import quote

            self.execute_statement(parse_one(f"OPEN {quote(str(path))}"))

    # ---- running text -----------------------------------------------------------------

    def execute(self, text: str) -> list[R.Result]:
        """Run every statement of ``text``; return their results. The first failure raises
        (`LqlSyntaxError` for text that is not LQL, or an `LqlError` naming the statement); the
        results of the statements that ran before it are on the error as ``err.results``."""
        done: list[R.Result] = []
        for out in self.run(text):
            if out.error is not None:
                out.error.results = done
                raise out.error
            done.append(out.result)
        return done

    def execute_one(self, text: str) -> R.Result:
        """Run exactly one statement and return its result (a trailing ';' is optional)."""
        items = list(loop.chunks(text))
        if len(items) != 1:
            raise StatementError(f"execute_one takes exactly one statement, and the text holds {len(items)}",
                                 hint="use execute(text) for several")
        return self.execute(text)[0]

    def run(self, text: str, *, keep_going: bool = False) -> Iterator[Outcome]:
        """Run the statements of ``text`` one by one, yielding each outcome as it completes
        (see `lql.loop.run`): statements before a syntax error run; the first failure stops
        the rest unless ``keep_going``."""
        return loop.run(self, text, keep_going=keep_going)

    def run_file(self, path: str | Path) -> list[R.Result]:
        """Run a script file; like `execute`. The file is checked first (a regular file of UTF-8
        text: a directory, FIFO or device is refused by name, never read or waited on)."""
        from .files import read_script

        return self.execute(read_script(path))

    def execute_statement(self, stmt: ast.Statement) -> R.Result:
        """Plan and execute one parsed statement."""
        return loop.execute_statement(self, stmt)

    def plan(self, text: str):
        """The plan node of one statement, bound against the open container (nothing runs)."""
        from .parser import parse_one

        try:
            stmt = parse_one(text)
        except LqlError:
            raise
        except Exception as e:  # a bug in the parser
            raise InternalError.wrap(e, line=1, column=1, statement=text[:200]) from e
        return loop.plan_statement(self, stmt)

    # ---- state ------------------------------------------------------------------------

    @property
    def bound(self) -> bool:
        return self.container is not None

    def context(self) -> Context:
        """What the planner may know about this session."""
        return Context(catalog=self.catalog, draft_depth=self.draft_depth, draft_adapter=self.draft_adapter,
                       settings=self.settings.model_copy(),
                       remote=self.remote)

    def bind(self, container, *, default_model: bool = False, shards: int = 0, prepared=None) -> None:
        """Bind ``container``: a fresh catalog, no executors, no draft depth. ``shards`` > 0 runs
        its layers as that many Ray actors (vindex3.shards), with the same answers. ``prepared``
        (an `lql.prepared.PreparedModel` holding ``container``) is what keeps a shared container
        open for this session."""
        if prepared is None and container is not None and container is self.base_container:
            prepared = self.prepared  # the same container bound again (reshard): still held
        model = container
        if shards:
            from vindex3 import shards as vshards

            model = vshards.sharded(container, shards)
        old = self.container
        # One assignment, so an interrupt cannot leave old executors bound to the new container.
        self.container, self.base_container, self.catalog, self.default_model, self._executors, self.draft_depth, \
            self._internals, self.prepared = (model, container, Catalog(model), bool(default_model), {}, None, None,
                                              prepared)
        self.draft_adapter = False
        self.settings.shards = shards
        self.shared_internals = None  # another model: its own internals
        self.remote = None
        self._release(old)

    def reshard(self, shards: int) -> None:
        """Run the bound model in ``shards`` actors (0: in this process); the draft depth stays."""
        depth, adapter = self.draft_depth, self.draft_adapter
        self.bind(self.base_container, default_model=self.default_model, shards=shards)
        self.draft_depth, self.draft_adapter = depth, adapter

    def _release(self, old) -> None:
        from vindex3.shards import ShardedModel

        if isinstance(old, ShardedModel) and old is not self.container:
            old.close()

    def bind_remote(self, remote) -> None:
        """Bind a server (USE REMOTE): no local container; statements run there."""
        self.close()
        self.remote = remote

    def executor(self, depth: int | None, intervention: Any = None, adapter: dict[str, Any] | None = None
                 ) -> tuple[Any, bool]:
        """The executor for a depth, an intervention (ABLATE FEATURES), the position limit and the
        ``activations`` setting (prepared once per session), and whether it was prepared now. Its
        streams are limited to the model's context length, or to the ``max_positions`` setting
        when one is set (an explicit override). ``adapter`` (a stored exit adapter's component
        row, DRAFT DEPTH d WITH ADAPTER): the draft's final norm and head read through it, read
        from the container and checked (SHA-256, container, shape) when the executor is made."""
        limit = self.settings.max_positions
        activations = self.settings.activations
        # keyed by depth alone without an intervention, a limit, q8 activations or an adapter: a
        # server shares this table with its completions endpoint (lql.server.models.ModelHost.executors)
        plain = intervention is None and limit is None and activations == "exact" and adapter is None
        via = (adapter["key"], adapter.get("sha256")) if adapter is not None else None
        key = depth if plain else (depth, limit, intervention, activations, via)
        ex = self._executors.get(key)
        if ex is not None:
            return ex, False
        kw: dict[str, Any] = {}
        if intervention is not None:
            kw["intervention"] = intervention
        if limit is not None:
            kw["max_positions"] = limit
        if activations != "exact":
            from vindex3.shards import ShardedModel

            if isinstance(self.container, ShardedModel):
                raise StatementError("activations = 'q8' runs the integer kernels in this process, and the model runs "
                                     "as shards", hint="SET activations = 'exact', or SET shards = 0")
            kw["activations"] = activations
        ex = self.container.executor(slice=slice_of(depth), **kw)
        if adapter is not None:
            from vindex3.draft.adapter import AdaptedReadout
            from vindex3.draft.store import load_adapter

            if depth is None or getattr(ex, "readout", None) is None:
                raise StatementError("an exit adapter reads a draft's residual before the final norm and head, and "
                                     "this executor has no head of its own to read it", hint="DRAFT DEPTH d WITH ADAPTER "
                                     "on a model run in this process (SET shards = 0)")
            ex.readout = AdaptedReadout(ex.readout, load_adapter(self.base_container, depth))
        self._executors[key] = ex
        return ex, True

    def internals(self):
        """The bound container's `vindex3.internals.Internals` (made once per binding, or shared:
        a server hands every session on a served model the model's own, so feature metadata built
        for one request serves the next): feature metadata, the lens, records. Builds report
        progress through this session's ``on_progress``. A model run as shards is looked inside
        here, in this process, on the same weights."""

        def progress(done: int, total: int, label: str) -> None:
            if self.on_progress is not None:
                self.on_progress(done, total, label)

        if self._internals is None and self.shared_internals is not None:
            self._internals = self.shared_internals()
        if self._internals is None:
            from vindex3.internals import Internals

            self._internals = Internals(self.base_container, progress=progress)
        self._internals.metadata.progress = progress  # this session's hook, also on a shared one
        return self._internals

    def close(self) -> None:
        """Forget the bound container and every prepared executor."""
        old = self.container
        self.container = self.base_container = None
        self.prepared = None  # this session's hold on a shared container; the others keep theirs
        self._release(old)
        self.catalog = None
        self._executors = {}
        self._internals = None
        self.draft_depth = None
        self.draft_adapter = False
        self.remote = None
