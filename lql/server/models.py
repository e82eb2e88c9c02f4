"""The models a server serves: each container opened once, with its own worker thread
(`lql.server.worker`), its catalog view and the executors prepared so far (one per draft
depth, shared by every session and completion on that model, used only on its worker)."""

from __future__ import annotations

from typing import Any

from ..binding import Catalog, slice_of
from .config import ModelSpec
from .worker import ModelWorker


class ModelHost:
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.id = spec.id
        from ..prepared import acquire

        # the process's one opened copy: a session that OPENs this container shares it
        self.prepared = acquire(spec.path)
        self.container = self.prepared.container
        self.catalog = Catalog(self.container)
        self.worker = ModelWorker(spec.id)
        self.executors: dict[int | None, Any] = {}
        self._internals = None  # vindex3.internals.Internals, shared by every session on the model
        self.info = self._info()

    def internals(self):
        """The model's `vindex3.internals.Internals`, made on first use (on the worker thread)."""
        if self._internals is None:
            from vindex3.internals import Internals

            self._internals = Internals(self.container)
        return self._internals

    def executor(self, depth: int | None):
        """The executor of a draft depth (None: the full model); on the worker thread only."""
        ex = self.executors.get(depth)
        if ex is None:
            ex = self.container.executor(slice=slice_of(depth))
            self.executors[depth] = ex
        return ex

    def _info(self) -> dict[str, Any]:
        """The /v1/models entry: OpenAI's fields and the model's own facts."""
        c = self.container
        g = c.graph
        encodings = sorted({key.split("@", 1)[1] for key in c.representations_by_key if "@" in key})
        return {
            "id": self.id,
            "object": "model",
            "created": int(c.path.stat().st_mtime),
            "owned_by": "lql",
            "name": c.name,
            "layers": int(g.num_layers),
            "operator_mix": [{"label": label, "count": int(n)} for label, n in g.operator_mix()],
            "encodings": encodings,
            "digest": str(c.digest),
            "tokenizer": bool(c.has_tokenizer),
            "chat_template": self.catalog.chat_template() is not None,
            "default_model": self.spec.default_model,
        }
