"""What every family lowering shares: the grades a config key can receive, the reader that grades
each key as it is read, the lowering a family produces (a graph plus tensor placements), and the
registry of families by ``model_type``.

Families (vindex3.families.*) and admission (vindex3.admit) both build on this module; it imports
neither of them, so there is no cycle between them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel

from ..sources import CheckpointSource

# Grades a key can receive.
CONSUMED = "consumed"  # lowered into the graph
METADATA = "metadata"  # kept as a fact about the model, no effect on execution
IGNORED = "ignored"  # known safe to ignore for inference (training-only and the like)
DEFAULTED = "reference_default"  # absent, and the reference implementation fixes its value
UNKNOWN = "unknown"  # blocks
UNSUPPORTED = "unsupported"  # a known key with a value we cannot execute; blocks
STRUCTURE = "structure"  # a defect in the tensors or the layout; blocks
UNREAD = "unread"  # not reached: the lowering stopped at a refusal (which blocks)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


class Finding(BaseModel):
    category: str
    key: str
    value: Any = None
    message: str
    blocks: bool

    def text(self) -> str:
        mark = "BLOCKS" if self.blocks else "ok"
        return f"[{mark}] {self.category}: {self.key} = {self.value!r} — {self.message}"


class ConfigReader:
    """Reads config keys and records a finding for each, so that nothing is silently ignored."""

    # Keys every Hugging Face config may carry that do not change inference.
    GENERIC_METADATA = {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
        "eos_token_id", "pad_token_id", "_name_or_path", "name_or_path", "max_position_embeddings",
        "use_cache", "initializer_range", "sep_token_id", "decoder_start_token_id",
    }
    GENERIC_IGNORED = {
        "attention_dropout": "dropout is a training-time setting",
        "hidden_dropout": "dropout is a training-time setting",
        "embd_pdrop": "dropout is a training-time setting",
        "resid_pdrop": "dropout is a training-time setting",
        "pretraining_tp": "tensor-parallel slicing used in pretraining; inference math is the same",
        "output_attentions": "an output option of the reference, not model math",
        "output_hidden_states": "an output option of the reference, not model math",
        "return_dict": "an output option of the reference, not model math",
        "id2label": "classification-head labels, unused by a causal LM",
        "label2id": "classification-head labels, unused by a causal LM",
        "problem_type": "classification-head setting, unused by a causal LM",
        "tokenizer_class": "the tokenizer is snapshotted from its own files",
        "chunk_size_feed_forward": "a memory option of the reference; same math",
        "torchscript": "an export option of the reference",
        "rescale_prenorm_residual": "an initialisation option, no effect on trained weights",
        "router_aux_loss_coef": "a training loss coefficient",
        "output_router_logits": "an output option of the reference",
    }

    def __init__(self, config: dict):
        self.config = config
        self.findings: list[Finding] = []
        self.graded: set[str] = set()

    def _grade(self, key: str, category: str, message: str, blocks: bool = False) -> None:
        self.graded.add(key)
        self.findings.append(Finding(category=category, key=key, value=_jsonable(self.config.get(key)), message=message, blocks=blocks))

    def has(self, key: str) -> bool:
        return key in self.config

    def take(self, key: str, message: str, *, default: Any = ..., default_reason: str = "") -> Any:
        """Consume a key into the graph. ``default`` is used only where the reference
        implementation fixes the value when the key is absent, and is recorded as such."""
        if key in self.config:
            self._grade(key, CONSUMED, message)
            return self.config[key]
        if default is ...:
            self.refuse(key, f"required key is absent: {message}", category=STRUCTURE)
            return None
        self.graded.add(key)
        self.findings.append(
            Finding(category=DEFAULTED, key=key, value=_jsonable(default), message=f"absent; {default_reason or 'the reference fixes this value'}", blocks=False)
        )
        return default

    def meta(self, key: str, message: str) -> Any:
        if key in self.config:
            self._grade(key, METADATA, message)
        return self.config.get(key)

    def ignore(self, key: str, message: str) -> None:
        if key in self.config:
            self._grade(key, IGNORED, message)

    def refuse(self, key: str, message: str, *, category: str = UNSUPPORTED) -> None:
        # A key refused after it was taken keeps one finding: the refusal replaces the grade.
        if key in self.graded:
            self.findings = [f for f in self.findings if f.key != key or f.blocks]
        self.graded.add(key)
        self.findings.append(Finding(category=category, key=key, value=_jsonable(self.config.get(key)), message=message, blocks=True))

    # -- typed takes: a value of the wrong type or out of range is refused by name -----------
    # Each returns the value, or None when the key is refused (or absent with a None default,
    # or null where ``nullable``); a refusal blocks admission, so a None never reaches a graph.

    def take_int(self, key: str, message: str, *, minimum: int = 1, nullable: bool = False, default: Any = ...,
                 default_reason: str = "") -> int | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if not present or (v is None and nullable):
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.refuse(key, f"expected an integer >= {minimum}{' or null' if nullable else ''}, found {v!r}")
            return None
        return v

    def take_number(self, key: str, message: str, *, minimum: float | None = None, nonzero: bool = False,
                    default: Any = ..., default_reason: str = "") -> float | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if not present:
            return None if v is None else float(v)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (minimum is None or v >= minimum) and not (nonzero and v == 0)
        if not ok:
            want = "a finite number" + (f" >= {minimum:g}" if minimum is not None else "") + (", not 0" if nonzero else "")
            self.refuse(key, f"expected {want}, found {v!r}")
            return None
        return float(v)

    def take_bool(self, key: str, message: str, *, default: Any = ..., default_reason: str = "") -> bool | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if present and not isinstance(v, bool):
            self.refuse(key, f"expected true or false, found {v!r}")
            return None
        return v

    def take_str(self, key: str, message: str, *, default: Any = ..., default_reason: str = "") -> str | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if present and not isinstance(v, str):
            self.refuse(key, f"expected a string, found {v!r}")
            return None
        return v

    def context_length(self) -> tuple[bool, int | None]:
        """``max_position_embeddings``: the positions the model was trained for, recorded in the
        graph as surface.context_length and enforced by the executor. Absent: the checkpoint
        states none (recorded as null; nothing is enforced). Returns (ok, value)."""
        key = "max_position_embeddings"
        if key in self.config and self.config[key] is None:
            self.take(key, "null: the checkpoint states no context length; none is enforced")
            return True, None
        v = self.take_int(key, "the context length: positions the executor allows",
                          default=None, default_reason="absent: the checkpoint states no context length; none is enforced")
        return (v is not None or key not in self.config), v

    def finish(self, stopped: bool = False) -> None:
        """Grade every key nothing read. ``stopped``: the lowering ended at a refusal, so a key it
        did not reach is reported as unread (not as unknown: it may be a key the lowering reads
        once the refusal is fixed)."""
        for key in self.config:
            if key in self.graded:
                continue
            if key in self.GENERIC_METADATA:
                self._grade(key, METADATA, "recorded as a fact about the model")
            elif key in self.GENERIC_IGNORED:
                self._grade(key, IGNORED, self.GENERIC_IGNORED[key])
            elif stopped:
                self._grade(key, UNREAD, "not read: admission stopped at an earlier refusal")
            else:
                self._grade(key, UNKNOWN, "not understood by this build; refusing rather than guessing", blocks=True)


@dataclass
class TensorPlacement:
    source_name: str
    object: str
    name: str  # relative to the object
    role: str
    layer: int | None


@dataclass
class Lowering:
    """What a family builder produces."""

    graph: dict
    placements: list[TensorPlacement]
    dropped: list[tuple[str, str]]  # (source tensor, why it is not encoded)


FamilyBuilder = Callable[[ConfigReader, CheckpointSource], Lowering | None]
_FAMILIES: dict[str, tuple[str, FamilyBuilder]] = {}


def register_family(model_type: str, family: str, builder: FamilyBuilder) -> None:
    _FAMILIES[model_type] = (family, builder)




def unregister_family(model_type: str) -> None:
    """Remove a registration (tests register toy families and clean up after themselves)."""
    _FAMILIES.pop(model_type, None)


def registered_families() -> dict[str, tuple[str, FamilyBuilder]]:
    """model_type -> (family, builder), as registered so far."""
    return dict(_FAMILIES)
