"""Admission: grade every config key of a checkpoint and lower it to a schema-6 graph plus a
tensor plan (which source tensor goes to which object, under which operand role).

This is the import boundary: model_type and Hugging Face spellings are known here (and in
vindex3.families / vindex3.sources) and nowhere downstream. Admission reads headers only.
"""

from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel

from .errors import AdmissionError
from .families.base import (
    CONSUMED,
    DEFAULTED,
    IGNORED,
    METADATA,
    STRUCTURE,
    UNKNOWN,
    UNREAD,
    UNSUPPORTED,
    ConfigReader,
    Finding,
    Lowering,
    _jsonable,
    registered_families,
)
from .sources import CheckpointSource, open_source


class AdmissionPlan(BaseModel):
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

    def to_text(self) -> str:
        lines = [
            f"source      {self.source} ({self.source_kind})",
            f"model_type  {self.model_type}",
            f"family      {self.family}",
            f"admissible  {'yes' if self.admissible else 'NO'}",
        ]
        if self.layers is not None:
            mix = " / ".join(f"{n} {label}" for label, n in self.operator_mix)
            lines.append(f"layers      {self.layers} ({mix})")
        if self.tensors is not None:
            lines.append(f"tensors     {self.tensors} ({self.parameters:,} parameters)")
        groups: dict[str, list[Finding]] = {}
        for f in self.findings:
            groups.setdefault(f.category, []).append(f)
        for cat in (UNKNOWN, UNSUPPORTED, STRUCTURE, DEFAULTED, CONSUMED, METADATA, IGNORED, UNREAD):
            fs = groups.get(cat)
            if not fs:
                continue
            lines.append(f"{cat} ({len(fs)}):")
            for f in fs:
                mark = "  ✗ " if f.blocks else "    "
                lines.append(f"{mark}{f.key} = {_jsonable(f.value)!r}: {f.message}")
        return "\n".join(lines)



def supported_model_types() -> list[str]:
    return sorted(_families())


def _families() -> dict:
    from . import families  # noqa: F401  (the built-in families register on import)

    return registered_families()


def lower(source: CheckpointSource) -> tuple[AdmissionPlan, Lowering | None]:
    families = _families()
    cfg = source.config
    reader = ConfigReader(cfg)
    model_type = cfg.get("model_type")
    family = None
    lowering = None
    if model_type not in families:
        reader.refuse(
            "model_type",
            f"model_type {model_type!r} is not registered (supported: {', '.join(sorted(families))}); "
            "an unregistered model is refused, never served as a Llama by default",
        )
    else:
        family, builder = families[model_type]
        reader._grade("model_type", CONSUMED, f"selects the {family} lowering")
        lowering = builder(reader, source)
        reader.finish(stopped=lowering is None and any(f.blocks for f in reader.findings))
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
