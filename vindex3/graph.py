"""The model graph (schema 6): components, objects, the per-layer policy and the execution
surface. This module reads and validates a graph dict; it never looks at model families.

Validation happens once, when the graph loads: the core surface (hidden size, embedding,
residual, norms, head) is parsed into typed models here, and each layer's operators parse their
own parameters (vindex3.operators). A missing or ill-typed fact is a named refusal, never a
default."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import operators as ops_registry
from .errors import ComponentError, GraphSchemaError

GRAPH_SCHEMA = 6
# The schema's operator vocabulary, with the top-level surface group each one reads. A name here
# that no registered operator executes is *described*: it opens, STATS and EXPLAIN show it, and
# preparing it is refused by name. Registered operators add their own names.
SCHEMA_OPERATORS: dict[str, str | None] = {
    "softmax": "attention", "mla": "attention", "gated_delta": None, "mamba2": None, "kda": None, "recurrent": None,
}
SCHEMA_FFNS: dict[str, str | None] = {"dense": "ffn", "routed": "ffn"}
ROLES = ("primary_text", "perception", "drafter")
PLACEMENTS = ("pre_only", "pre_post", "post_only", "pre_mixer", "parallel", "parallel_shared")
OBJECT_KINDS = ("embedding", "position_embedding", "decoder_stack", "final_norm", "output_head", "expert_bank")
CORE_SURFACE = ("hidden_size", "embedding", "residual", "norms", "head", "operators", "context_length")
GRAPH_KEYS = ("schema", "model", "components", "objects", "layers", "surface")


class _Spec(BaseModel):
    # strict: a number spelled as a string ("1e-5") or a bool where an integer belongs is refused
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


def _not_zero(v: float, what: str) -> float:
    if v == 0:
        raise ValueError(f"a{what} multiplier of 0 erases what it scales")
    return v


class EmbeddingSpec(_Spec):
    multiplier: float = Field(allow_inf_nan=False)
    # "learned": a position_embedding object's row p is added at position p (GPT-2). Graphs
    # written before this fact existed have no key: no position is added to the embedding.
    positions: Literal["learned"] | None = None

    @field_validator("multiplier")
    @classmethod
    def _nonzero(cls, v: float) -> float:
        return _not_zero(v, "n embedding")


class ResidualSpec(_Spec):
    multiplier: float = Field(allow_inf_nan=False)
    fp32: bool | None = None  # a statement about the reference's residual dtype; this executor is float32 throughout

    @field_validator("multiplier")
    @classmethod
    def _nonzero(cls, v: float) -> float:
        return _not_zero(v, " residual")


class NormsSpec(_Spec):
    kind: Literal["rms", "layer"]  # layer: LayerNorm, (x - mean) / sqrt(var + eps) * w + b
    eps: float = Field(ge=0, allow_inf_nan=False)
    weight_offset: float = Field(allow_inf_nan=False)
    placement: Literal["pre_only", "pre_post", "post_only", "pre_mixer", "parallel", "parallel_shared"]
    # Every norm (layers and final) has a bias. Stated for LayerNorm; graphs written before this
    # fact existed have RMS norms only and no key (no bias).
    bias: bool | None = None

    @model_validator(mode="after")
    def _kind(self) -> NormsSpec:
        if self.kind == "layer" and self.bias is None:
            raise ValueError("a LayerNorm states whether it has a bias (norms.bias)")
        if self.kind == "rms" and self.bias:
            raise ValueError("an RMS norm with a bias has no executor")
        if self.kind == "layer" and self.weight_offset != 0:
            raise ValueError("a LayerNorm's weight has no offset")
        return self


class HeadSpec(_Spec):
    vocab: int = Field(gt=0)
    tied: bool
    multiplier: float = Field(allow_inf_nan=False)
    softcap: float | None = Field(gt=0, allow_inf_nan=False)
    # the head adds a bias (Phi-2's lm_head); graphs written before this fact have no key: none
    bias: bool | None = None

    @field_validator("multiplier")
    @classmethod
    def _nonzero(cls, v: float) -> float:
        if v == 0:
            raise ValueError("a head multiplier of 0 erases every logit")
        return v


class CoreSurface(_Spec):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)  # operator groups are checked apart
    hidden_size: int = Field(gt=0, strict=True)
    embedding: EmbeddingSpec
    residual: ResidualSpec
    norms: NormsSpec
    head: HeadSpec
    operators: dict[str, Any]
    # Positions the model was trained for (max_position_embeddings, a GGUF context_length), as
    # admission recorded it. null: the checkpoint states none (a pure recurrence, say). Graphs
    # written before this fact was recorded lack the key; see Graph.context_length.
    context_length: int | None = Field(default=None, gt=0, strict=True)


class LayerEntry(_Spec):
    """One entry of ``layers``: every key is known, so a renamed key is a missing key."""

    index: int = Field(strict=True)
    operator: str = Field(strict=True)
    span: Literal["full", "sliding"] | None
    window: int | None = Field(gt=0, strict=True)
    position: dict[str, Any] | None
    ffn: str | None = Field(strict=True)
    operands: dict[str, str]


class ComponentEntry(_Spec):
    name: str = Field(min_length=1, strict=True)
    role: str = Field(strict=True)
    objects: list[str]


class ObjectEntry(_Spec):
    model_config = ConfigDict(frozen=True, extra="allow", strict=True)  # perception objects may carry more
    kind: str = Field(strict=True)
    operands: dict[str, str] | None = None
    layers: int | None = Field(default=None, ge=1, strict=True)


class GraphFile(_Spec):
    """The top level of system_graph.json, typed (the surface is typed by CoreSurface and the
    operators; the layers by LayerEntry)."""

    schema_: int = Field(alias="schema", strict=True)
    model: dict[str, Any]
    components: list[ComponentEntry]
    objects: dict[str, ObjectEntry]
    layers: list[Any]
    surface: dict[str, Any]


def _graph_problems(e: ValidationError, prefix: str) -> str:
    out = []
    for err in e.errors():
        key = prefix + ".".join(str(x) for x in err["loc"])
        if err["type"] == "missing":
            out.append(f"{key} is missing (absence is not a default)")
        elif err["type"] == "extra_forbidden":
            out.append(f"{key} is not a known key")
        else:
            found = err.get("input")
            shown = repr(found) if not isinstance(found, (dict, list)) else type(found).__name__
            out.append(f"{key}: {err['msg'].lower()} (found {shown[:80]})")
    return "; ".join(out[:8]) + (f" (and {len(out) - 8} more)" if len(out) > 8 else "")


def _problems(e: ValidationError) -> str:
    out = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"])
        if err["type"] == "missing":
            out.append(f"surface.{key} is missing (absence is not a default)")
        elif err["type"] == "extra_forbidden":
            out.append(f"surface.{key} is not a known key")
        else:
            out.append(f"surface.{key} {err['msg'].lower()} (found {err.get('input')!r})")
    return "; ".join(out)


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
    ffn: str | None  # the FFN kind ("dense", ...) or None (no FFN in this layer)
    operands: dict[str, str] = field(default_factory=dict)  # role -> tensor name in decoder_stack

    def label(self) -> str:
        if self.span:
            return f"{self.operator} ({self.span})"
        return self.operator


class Graph:
    """A validated schema-6 graph.

    ``layer_params[i]`` maps each slot ("mixer", "ffn") of layer i to its operator's typed
    parameters, for every layer whose operator this build registers; ``operator(i, slot)`` is
    that operator (None for a described one)."""

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
        try:
            top = GraphFile.model_validate(raw)
        except ValidationError as e:
            raise GraphSchemaError(f"system_graph.json: {_graph_problems(e, '')}") from None
        self.model: dict = top.model
        self.components = [Component(c.name, c.role, tuple(c.objects)) for c in top.components]
        for c in self.components:
            if c.role not in ROLES:
                raise GraphSchemaError(f"component {c.name!r} has unknown role {c.role!r} (known: {', '.join(ROLES)})")
            missing = [o for o in c.objects if o not in raw["objects"]]
            if missing:
                raise GraphSchemaError(f"system_graph.json: component {c.name!r} names object {missing[0]!r}, which objects does not declare")
        self.objects: dict[str, dict] = raw["objects"]
        for name, obj in top.objects.items():
            if obj.kind not in OBJECT_KINDS:
                raise GraphSchemaError(f"object {name!r} has unknown kind {obj.kind!r} (known: {', '.join(OBJECT_KINDS)})")
        self.surface: dict = raw["surface"]
        try:
            self.core = CoreSurface.model_validate(self.surface)
        except ValidationError as e:
            raise GraphSchemaError(f"system_graph.json: {_problems(e)}") from None
        learned = self.core.embedding.positions == "learned"
        if learned != ("position_embedding" in self.objects):
            raise GraphSchemaError("system_graph.json: a position_embedding object exists exactly when "
                                   f"surface.embedding.positions is 'learned' (positions: {self.core.embedding.positions!r})")
        if self.core.head.bias and self.core.head.tied:
            raise GraphSchemaError("system_graph.json: a head bias needs an untied output_head to hold it")
        layers = raw["layers"]
        if not layers:
            raise GraphSchemaError("system_graph.json: layers must be a non-empty list")
        stack = top.objects.get("decoder_stack")
        if stack is not None and stack.layers is not None and stack.layers != len(layers):
            raise GraphSchemaError(f"system_graph.json: objects.decoder_stack declares {stack.layers} layers, "
                                   f"but layers lists {len(layers)}")
        self.layers: list[LayerPolicy] = [self._layer(i, entry) for i, entry in enumerate(layers)]
        self._operators: list[dict[str, Any]] = []
        self.layer_params: list[dict[str, Any]] = []
        for lp in self.layers:
            chosen, params = {}, {}
            for slot, value in ((ops_registry.MIXER, lp.operator), (ops_registry.FFN, lp.ffn)):
                if value is None:
                    continue
                op = ops_registry.selected(slot, value)
                chosen[slot] = op
                if op is not None:
                    params[slot] = op.params(self.surface, lp)
            self._operators.append(chosen)
            self.layer_params.append(params)
        self._check_groups()

    def _layer(self, i: int, entry: Any) -> LayerPolicy:
        if not isinstance(entry, dict):
            raise GraphSchemaError(f"system_graph.json: layer entry {i} is not an object")
        op = entry.get("operator")
        if op is None:
            raise GraphSchemaError(f"layer {i} has no explicit operator (absence is not softmax)")
        try:
            LayerEntry.model_validate(entry)
        except ValidationError as e:
            raise GraphSchemaError(f"system_graph.json: {_graph_problems(e, f'layers[{i}].')}") from None
        known = set(SCHEMA_OPERATORS) | {o.selects for o in ops_registry.all_operators() if o.slot == ops_registry.MIXER}
        if op not in known:
            raise GraphSchemaError(f"layer {i} has unknown operator {op!r} (known: {', '.join(sorted(known))})")
        if entry.get("index") != i:
            raise GraphSchemaError(f"layer entry {i} carries index {entry.get('index')!r}")
        ffn = entry.get("ffn")
        ffns = set(SCHEMA_FFNS) | {o.selects for o in ops_registry.all_operators() if o.slot == ops_registry.FFN}
        if ffn is not None and ffn not in ffns:
            raise GraphSchemaError(f"layer {i} has unknown ffn kind {ffn!r} (known: {', '.join(sorted(ffns))}, or null)")
        window = entry.get("window")
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise GraphSchemaError(f"layer {i} has window {window!r}; a window is a positive number of keys")
        operands = entry.get("operands", {})
        if not isinstance(operands, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in operands.items()):
            raise GraphSchemaError(f"layer {i}: operands must map role names to tensor names")
        pos = entry.get("position")
        if pos is not None and not isinstance(pos, dict):
            raise GraphSchemaError(f"layer {i}: position must be an object or null, found {pos!r}")
        if isinstance(pos, dict) and pos.get("kind") == "rope":
            theta = pos.get("theta")
            if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
                raise GraphSchemaError(f"layer {i}: rope theta must be a positive finite number, found {theta!r}")
        return LayerPolicy(i, op, entry.get("span"), window, pos, ffn, dict(operands))

    def _check_groups(self) -> None:
        """A top-level surface group exists exactly when some layer's operator reads it, and
        every group under surface.operators is read by some layer."""
        needed: dict[str, list[int]] = {}
        op_groups: set[str] = set()
        for i, lp in enumerate(self.layers):
            for slot, value in ((ops_registry.MIXER, lp.operator), (ops_registry.FFN, lp.ffn)):
                if value is None:
                    continue
                op = self._operators[i].get(slot)
                if op is not None:
                    groups, under_operators = op.reads_groups(self.layer_params[i][slot])
                else:
                    described = (SCHEMA_OPERATORS if slot == ops_registry.MIXER else SCHEMA_FFNS).get(value)
                    groups, under_operators = ((described,) if described else ()), (value,)  # a described operator may keep its facts there
                for group in groups:
                    needed.setdefault(group, []).append(i)
                op_groups.update(under_operators)
        known_groups = set(CORE_SURFACE) | {"attention", "ffn"} | {o.surface_group for o in ops_registry.all_operators() if o.surface_group}
        for key in self.surface:
            if key not in known_groups:
                raise GraphSchemaError(f"system_graph.json: surface.{key} is not a known group (known: {', '.join(sorted(known_groups))})")
        for group in sorted(known_groups - set(CORE_SURFACE)):
            present = group in self.surface
            users = needed.get(group, [])
            if present != bool(users):
                what = f"layers {users[:6]} read it" if users else "no layer reads it"
                raise GraphSchemaError(
                    f"surface.{group} must exist exactly when some layer's operator reads it ({what}; group present: {present})"
                )
        unused = sorted(set(self.core.operators) - op_groups)
        if unused:
            raise GraphSchemaError(f"surface.operators.{unused[0]} is read by no layer's operator")

    # -- facts -----------------------------------------------------------------------------
    def operator(self, layer: int, slot: str):
        """The registered operator in ``slot`` of ``layer``, or None (described, or no such slot)."""
        return self._operators[layer].get(slot)

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
        return self.core.hidden_size

    @property
    def context_length(self) -> int | None:
        """Positions the model was trained for, as admission recorded it; None when the
        checkpoint states none or the graph predates the fact (`context_length_recorded`)."""
        return self.core.context_length

    @property
    def context_length_recorded(self) -> bool:
        """Whether the graph carries the fact at all (graphs encoded before it was recorded do not)."""
        return "context_length" in self.surface

    @property
    def vocab_size(self) -> int:
        return self.core.head.vocab
