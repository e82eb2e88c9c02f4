"""Typed refusals. Every error a user can meet names the thing, where it was found,
and what would have been accepted. Nothing here ever carries a traceback to a user:
front ends print ``str(err)``."""

from __future__ import annotations


class VindexError(Exception):
    """Base of every refusal raised by vindex3."""

    def __init__(self, message: str, *, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  hint: {self.hint}"


class ContainerNotFound(VindexError):
    """The path is not a directory or holds no index.json."""


class FormatVersionError(VindexError):
    """index.json declares a format or version this build does not read."""


class GraphSchemaError(VindexError):
    """system_graph.json is missing, malformed or at another schema."""


class ComponentError(VindexError):
    """No, or more than one, executable primary_text component."""


class IntegrityError(VindexError):
    """A segment or sidecar does not match what the index records."""


class ConfigError(VindexError):
    """A config.json could not be read (malformed JSON, wrong types)."""


class AdmissionError(VindexError):
    """A checkpoint is not admissible; carries the blocking findings."""

    def __init__(self, message: str, findings: list | None = None, *, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.findings = list(findings or [])


class ClosureError(VindexError):
    """Operands do not close over the graph: unclassified, missing, duplicate, misshapen."""

    def __init__(self, message: str, defects: list[str] | None = None):
        super().__init__(message)
        self.defects = list(defects or [])

    def __str__(self) -> str:
        lines = [self.message] + [f"  - {d}" for d in self.defects]
        return "\n".join(lines)


class SliceError(VindexError):
    """An execution slice that the model cannot run (depth 0, deeper than the model...)."""


class UnsupportedOperator(VindexError):
    """A layer's operator has no executor (or no capability asked of it)."""


class StateError(VindexError):
    """A continuation state cannot hold what it was asked to, or is used out of order."""


class TokenizerMissing(VindexError):
    """The container carries no tokenizer, so text cannot be tokenised."""


class EncodeError(VindexError):
    """An encode failed; the output directory was not created."""


class UnsupportedEncoding(VindexError):
    """A representation's encoding has no codec in this build (it is carried, never decoded)."""


class QueryRefused(VindexError):
    """An internals query asked for something that does not exist or cannot be answered (an
    unknown column, a layer outside the model, a target that is not one token...)."""


class DerivedStale(VindexError):
    """A derived representation (feature metadata, ...) no longer matches its source container,
    and the caller asked for a refusal instead of a rebuild."""


class OutputRefused(VindexError):
    """An output file cannot be written where asked (it exists, or it lies inside a container)."""


class RecordError(VindexError):
    """An execution record cannot be written or read as one."""


class PathRefused(VindexError):
    """A path an operation cannot use as given (empty, NUL, not encodable, a name over 255 bytes,
    missing or already there, a directory where a file is needed, a FIFO or device, a symlink
    that leaves the directory it must stay in, inside an open container...). ``reason`` is a
    short stable code (see vindex3.paths)."""

    def __init__(self, message: str, *, reason: str, path: str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.reason = reason
        self.path = path


class InputError(VindexError):
    """Input text or numbers that cannot be used as given (a lone surrogate in a prompt...)."""


class LimitExceeded(VindexError):
    """A named limit would be exceeded (the context length, a memory limit...)."""


class ContextLengthExceeded(LimitExceeded):
    """More positions than the model's context length (or an explicit override) allows."""


class NonFiniteActivation(VindexError):
    """A run produced NaN or infinity (or a norm whose mean of squares overflowed float32): the
    weights or the input drive float32 past its range. Names the layer and the site where seen."""

    def __init__(self, message: str, *, layer: int | None = None, site: str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint or "the container's weights (or this input) overflow float32 here; "
                                               "`vindex3 verify` checks the stored bytes, and the model's source may be damaged")
        self.layer, self.site = layer, site

    def at(self, layer: int) -> NonFiniteActivation:
        """The same refusal, located at ``layer`` (when a kernel raised it without knowing)."""
        if self.layer is not None:
            return self
        return NonFiniteActivation(f"layer {layer}: {self.message}", layer=layer, site=self.site, hint=self.hint)
