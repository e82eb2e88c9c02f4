"""The model graph (schema 6): components, objects, the per-layer policy and the execution
surface. This module reads and validates a graph dict; it never looks at model families."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .errors import ComponentError, GraphSchemaError

GRAPH_SCHEMA = 6
OPERATORS = ("softmax", "gated_delta", "mamba2", "kda", "mla", "recurrent")
ROLES = ("primary_text", "perception", "drafter")
PLACEMENTS = ("pre_only", "pre_post", "post_only", "pre_mixer")
OBJECT_KINDS = ("embedding", "decoder_stack", "final_norm", "output_head", "expert_bank")


@dataclass(frozen=True)
class Component:
    name: str
    role: str
    objects: tuple[str, ...]


@dataclass(frozen=True)
class LayerPolicy:
    index: int
    operator: str
    span: str | None  # "full" | "sliding" for softmax layers
    window: int | None
    position: dict | None  # {"kind": "rope", theta, rotary_dims, scaling} | {"kind": "none"}
    ffn: str | None  # "dense" or None (no FFN in this layer)
    operands: dict[str, str] = field(default_factory=dict)  # role -> tensor name in decoder_stack

    def label(self) -> str:
        if self.operator == "softmax" and self.span:
            return f"softmax ({self.span})"
        return self.operator


def _req(d: dict, key: str, where: str) -> Any:
    if key not in d:
        raise GraphSchemaError(f"system_graph.json: {where} has no '{key}'")
    return d[key]


class Graph:
    """A validated schema-6 graph."""

    def __init__(self, raw: dict):
        if not isinstance(raw, dict):
            raise GraphSchemaError("system_graph.json is not a JSON object")
        schema = raw.get("schema")
        if schema != GRAPH_SCHEMA:
            raise GraphSchemaError(
                f"system_graph.json is at schema {schema!r}; this build reads schema {GRAPH_SCHEMA} only",
                hint="re-encode the container from its checkpoint with `vindex3 encode SRC OUT`",
            )
        self.raw = raw
        self.model: dict = raw.get("model", {})
        comps = _req(raw, "components", "the graph")
        self.components = [
            Component(_req(c, "name", "a component"), _req(c, "role", "a component"), tuple(c.get("objects", ())))
            for c in comps
        ]
        for c in self.components:
            if c.role not in ROLES:
                raise GraphSchemaError(f"component {c.name!r} has unknown role {c.role!r} (known: {', '.join(ROLES)})")
        self.objects: dict[str, dict] = _req(raw, "objects", "the graph")
        for name, obj in self.objects.items():
            if obj.get("kind") not in OBJECT_KINDS:
                raise GraphSchemaError(f"object {name!r} has unknown kind {obj.get('kind')!r}")
        self.surface: dict = _req(raw, "surface", "the graph")
        layers = _req(raw, "layers", "the graph")
        self.layers: list[LayerPolicy] = []
        for i, l in enumerate(layers):
            op = l.get("operator")
            if op is None:
                raise GraphSchemaError(f"layer {i} has no explicit operator (absence is not softmax)")
            if op not in OPERATORS:
                raise GraphSchemaError(f"layer {i} has unknown operator {op!r} (known: {', '.join(OPERATORS)})")
            if l.get("index") != i:
                raise GraphSchemaError(f"layer entry {i} carries index {l.get('index')!r}")
            self.layers.append(
                LayerPolicy(i, op, l.get("span"), l.get("window"), l.get("position"), l.get("ffn"), dict(l.get("operands", {})))
            )
        norms = self.surface.get("norms")
        if norms is not None and norms.get("placement") not in PLACEMENTS:
            raise GraphSchemaError(f"norm placement {norms.get('placement')!r} is not one of {', '.join(PLACEMENTS)}")
        uses_attention = any(l.operator in ("softmax", "mla") for l in self.layers)
        if uses_attention != ("attention" in self.surface):
            raise GraphSchemaError(
                "surface.attention must exist exactly when some layer runs softmax or MLA "
                f"(layers with attention: {uses_attention}, group present: {'attention' in self.surface})"
            )
        uses_ffn = any(l.ffn for l in self.layers)
        if uses_ffn != ("ffn" in self.surface):
            raise GraphSchemaError(
                f"surface.ffn must exist exactly when some layer has an FFN (layers with FFN: {uses_ffn}, "
                f"group present: {'ffn' in self.surface})"
            )

    # -- facts -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def component(self) -> Component:
        """The one executable primary_text component, or a named refusal."""
        prim = [c for c in self.components if c.role == "primary_text"]
        if not prim:
            roles = ", ".join(f"{c.name} ({c.role})" for c in self.components) or "none"
            raise ComponentError(f"the graph has no primary_text component (components: {roles})")
        if len(prim) > 1:
            names = ", ".join(c.name for c in prim)
            raise ComponentError(f"the graph has {len(prim)} primary_text components ({names}); exactly one is required")
        return prim[0]

    def operator_mix(self) -> list[tuple[str, int]]:
        counts: dict[str, int] = {}
        for l in self.layers:
            counts[l.label()] = counts.get(l.label(), 0) + 1
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))

    def operator_mix_text(self) -> str:
        return " / ".join(f"{n} {label}" for label, n in self.operator_mix())

    @property
    def hidden_size(self) -> int:
        return int(self.surface["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.surface["head"]["vocab"])
