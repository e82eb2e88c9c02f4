"""What every family's lowering shares: the schema-6 graph skeleton (components and objects)
and the placement of source tensors — each to an object by its longest matching prefix and, in
the decoder stack, to an operand role by exact suffix under its layer's operator. Anything
else is a blocking structure finding that names the tensor."""

from __future__ import annotations

from collections.abc import Callable

from .base import ConfigReader, Finding, TensorPlacement
from ..sources import CheckpointSource


def place_tensors(src: CheckpointSource, graph: dict, r: ConfigReader, tied: bool, prefixes,
                  layer_table: Callable[[int], tuple[str, dict[str, str]]]):
    """Assign every source tensor to an object (longest prefix) and, inside the decoder stack,
    a role by exact suffix from the table of the layer's operator. Anything else is a blocking
    structure finding that names the tensor and the operator it fell under."""
    placements: list[TensorPlacement] = []
    dropped: list[tuple[str, str]] = []
    L = len(graph["layers"])
    for name in sorted(src.tensor_specs()):
        match = max(((p, o) for p, o in prefixes if name.startswith(p)), key=lambda po: len(po[0]), default=None)
        if match is None:
            r.refuse(name, "tensor belongs to no object (no known prefix)", category="structure")
            continue
        prefix, obj = match
        rel = name[len(prefix):]
        if obj == "decoder_stack":
            idx, _, suffix = rel.partition(".")
            if not idx.isdigit() or int(idx) >= L:
                r.refuse(name, f"layer index {idx!r} is outside the {L} declared layers", category="structure")
                continue
            operator, table = layer_table(int(idx))
            role = table.get(suffix)
            if role is None:
                r.refuse(name, f"unclassified tensor suffix {suffix!r} under the {operator} operator of layer {idx} "
                               f"(known: {', '.join(sorted(table))})", category="structure")
                continue
            ops = graph["layers"][int(idx)]["operands"]
            if role in ops:
                r.refuse(name, f"duplicate operand: role {role} of layer {idx} is already {ops[role]!r}", category="structure")
                continue
            ops[role] = rel
            placements.append(TensorPlacement(name, obj, rel, role, int(idx)))
        else:
            if rel != "weight":
                r.refuse(name, f"unexpected tensor {rel!r} in {obj}", category="structure")
                continue
            if obj == "output_head" and tied:
                dropped.append((name, "the head is tied to the embedding; the separate copy is not encoded"))
                r.findings.append(Finding(category="metadata", key=name, value=None, message="tied head: duplicate lm_head not encoded", blocks=False))
                continue
            placements.append(TensorPlacement(name, obj, rel, "weight", None))
    return placements, dropped


def assemble_graph(name: str, family: str, tied: bool, layers: list[dict], surface: dict) -> dict:
    """The schema-6 graph of a single-component text model: embedding, decoder stack, final
    norm and, when the head is not tied, an output head."""
    objects = {
        "embedding": {"kind": "embedding", "operands": {"weight": "weight"}},
        "decoder_stack": {"kind": "decoder_stack", "layers": len(layers)},
        "final_norm": {"kind": "final_norm", "operands": {"weight": "weight"}},
    }
    if not tied:
        objects["output_head"] = {"kind": "output_head", "operands": {"weight": "weight"}}
    return {
        "schema": 6,
        "model": {"name": name, "family": family},
        "components": [{"name": "text", "role": "primary_text", "objects": list(objects)}],
        "objects": objects,
        "layers": layers,
        "surface": surface,
    }
