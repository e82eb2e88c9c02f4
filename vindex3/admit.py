"""Admission: grade every config key of a checkpoint and lower it to a schema-6 graph plus a
tensor plan (which source tensor goes to which object, under which operand role).

This is the import boundary: model_type and Hugging Face spellings are known here (and in
vindex3.families / vindex3.sources) and nowhere downstream. Admission reads headers only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel

from .errors import AdmissionError
from .sources import CheckpointSource, open_source

# Grades a key can receive.
CONSUMED = "consumed"  # lowered into the graph
METADATA = "metadata"  # kept as a fact about the model, no effect on execution
IGNORED = "ignored"  # known safe to ignore for inference (training-only and the like)
DEFAULTED = "reference_default"  # absent, and the reference implementation fixes its value
UNKNOWN = "unknown"  # blocks
UNSUPPORTED = "unsupported"  # a known key with a value we cannot execute; blocks
STRUCTURE = "structure"  # a defect in the tensors or the layout; blocks


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


class AdmissionPlan(BaseModel):
    """Plain data; its text layout is lql.render.admission_text (the one renderer)."""

    source: str
    source_kind: str
    model_type: str | None
    family: str | None
    admissible: bool
    findings: list[Finding]
    layers: int | None = None
    operator_mix: list[tuple[str, int]] = []
    tensors: int | None = None
    parameters: int | None = None

    def blocking(self) -> list[Finding]:
        return [f for f in self.findings if f.blocks]


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
        self.graded.add(key)
        self.findings.append(Finding(category=category, key=key, value=_jsonable(self.config.get(key)), message=message, blocks=True))

    def finish(self) -> None:
        for key in self.config:
            if key in self.graded:
                continue
            if key in self.GENERIC_METADATA:
                self._grade(key, METADATA, "recorded as a fact about the model")
            elif key in self.GENERIC_IGNORED:
                self._grade(key, IGNORED, self.GENERIC_IGNORED[key])
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


FamilyBuilder = Callable[[ConfigReader, CheckpointSource], "Lowering | None"]
_FAMILIES: dict[str, tuple[str, FamilyBuilder]] = {}


def register_family(model_type: str, family: str, builder: FamilyBuilder) -> None:
    _FAMILIES[model_type] = (family, builder)


def supported_model_types() -> list[str]:
    _load_families()
    return sorted(_FAMILIES)


def _load_families() -> None:
    from . import families  # noqa: F401  (registers on import)


def lower(source: CheckpointSource) -> tuple[AdmissionPlan, Lowering | None]:
    _load_families()
    cfg = source.config
    reader = ConfigReader(cfg)
    model_type = cfg.get("model_type")
    family = None
    lowering = None
    if model_type not in _FAMILIES:
        reader.refuse(
            "model_type",
            f"model_type {model_type!r} is not registered (supported: {', '.join(sorted(_FAMILIES))}); "
            "an unregistered model is refused, never served as a Llama by default",
        )
    else:
        family, builder = _FAMILIES[model_type]
        reader._grade("model_type", CONSUMED, f"selects the {family} lowering")
        lowering = builder(reader, source)
        reader.finish()
        if lowering is not None:
            from .errors import GraphSchemaError
            from .graph import Graph

            try:
                mix = Graph(lowering.graph).operator_mix()
            except GraphSchemaError as e:  # the lowering itself is inconsistent: a defect, named
                reader.refuse("graph", f"the lowered graph is not valid: {e.message}", category=STRUCTURE)
                lowering = None
    blocks = any(f.blocks for f in reader.findings)
    plan = AdmissionPlan(
        source=source.name,
        source_kind=source.kind,
        model_type=model_type if isinstance(model_type, str) else None,
        family=family,
        admissible=not blocks and lowering is not None,
        findings=reader.findings,
    )
    if lowering is not None:
        plan.layers = len(lowering.graph["layers"])
        plan.operator_mix = mix
        specs = source.tensor_specs()
        plan.tensors = len(lowering.placements)
        plan.parameters = sum(math.prod(specs[p.source_name].shape) for p in lowering.placements)
    return plan, (lowering if plan.admissible else None)


def admit(src: str | Path | CheckpointSource) -> AdmissionPlan:
    """Grade a checkpoint (HF directory or .gguf) from headers only."""
    source = src if isinstance(src, CheckpointSource) else open_source(src)
    plan, _ = lower(source)
    return plan


def require_admissible(plan: AdmissionPlan) -> None:
    if not plan.admissible:
        blocking = plan.blocking()
        names = "; ".join(f"{f.key} ({f.category}: {f.message})" for f in blocking[:6])
        more = f" and {len(blocking) - 6} more" if len(blocking) > 6 else ""
        raise AdmissionError(f"{plan.source} is not admissible: {names}{more}", blocking)
