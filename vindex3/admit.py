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
    STRUCTURE,
    ConfigReader,
    Finding,
    Lowering,
    registered_families,
)
from .sources import CheckpointSource, open_source


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
    tensors: int | None = None  # container tensors the encode writes
    source_tensors: int | None = None  # checkpoint tensors they are made from
    parameters: int | None = None

    def blocking(self) -> list[Finding]:
        return [f for f in self.findings if f.blocks]



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
        plan.source_tensors = len({n for p in lowering.placements for n in p.inputs})
        # transforms only move elements (a split cuts one source into pieces): the container holds
        # exactly the parameters of its tensors' shapes
        shapes = {n: tuple(s.shape) for n, s in specs.items()}
        plan.parameters = sum(math.prod(p.shape(shapes)) for p in lowering.placements)
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
