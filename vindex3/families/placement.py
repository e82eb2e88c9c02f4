"""What every family's lowering shares: the schema-6 graph skeleton (components and objects)
and the placement of source tensors — each to an object by its longest matching prefix and, in
the decoder stack, to an operand role by exact suffix under its layer's operator. Anything
else is a blocking structure finding that names the tensor.

A layer table maps an exact suffix to a role (the tensor is placed as it is), to a `Part` (the
tensor, of an exact shape, is one of several that one container tensor is assembled from, or a
single tensor that is transformed: experts stored one tensor per expert are stacked into one
bank [E, out, in]), or to a `Refusal` (a tensor known by name and refused, e.g. a low-bit
encoding this build does not read)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..sources import CheckpointSource
from .base import ConfigReader, Finding, TensorPlacement


@dataclass(frozen=True)
class Part:
    """Source tensor ``index`` of ``count`` that make the container tensor ``target`` (a name
    relative to the layer) under ``role``, assembled by ``transform`` (steps of
    `vindex3.families.base.TRANSFORMS`; with several sources the first step stacks them). The
    source must have exactly ``shape`` (None: a quantized part, a block scale, whose shape the
    codec checks when it packs it)."""

    role: str
    target: str
    index: int
    count: int
    shape: tuple[int, ...] | None
    transform: tuple[str, ...] = ()
    codec: str = ""  # parts of a quantized matrix packed into this encoding (vindex3.codecs.packing)


@dataclass(frozen=True)
class Split:
    """One source tensor of exact ``shape`` that several container tensors are cut from (a fused
    q|k|v projection): ``pieces`` are (role, target name relative to the layer, transform steps)."""

    shape: tuple[int, ...]
    pieces: tuple[tuple[str, str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Drop:
    """A tensor known by name that holds no parameter (a causal-mask buffer an old checkpoint
    saved, a cached rotary table): not encoded, recorded in provenance with ``reason``."""

    reason: str


@dataclass(frozen=True)
class Refusal:
    """A tensor known by name and refused: ``message`` says why and what is accepted."""

    message: str
    category: str = "unsupported"


def place_tensors(src: CheckpointSource, graph: dict, r: ConfigReader, tied: bool, prefixes,
                  layer_table: Callable[[int], tuple[str, dict]]):
    """Assign every source tensor to an object (longest prefix) and, inside the decoder stack,
    a role by exact suffix from the table of the layer's operator (or a part of an assembled
    tensor, or a named refusal). Anything else is a blocking structure finding that names the
    tensor and the operator it fell under."""
    placements: list[TensorPlacement] = []
    dropped: list[tuple[str, str]] = []
    groups: dict[tuple[int, str], list[tuple[Part, str]]] = {}
    rejected: set[tuple[int, str]] = set()
    specs = src.tensor_specs()
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
                               f"(known: {_known(table)})", category="structure")
                continue
            if isinstance(role, Refusal):
                r.refuse(name, role.message, category=role.category)
                continue
            if isinstance(role, Drop):
                dropped.append((name, role.reason))
                r.findings.append(Finding(category="ignored", key=name, value=None, message=f"not encoded: {role.reason}",
                                          blocks=False))
                continue
            if isinstance(role, Split):
                shape = tuple(specs[name].shape)
                if shape != tuple(role.shape):
                    r.refuse(name, f"has shape {list(shape)}; layer {idx} expects {list(role.shape)}", category="structure")
                    continue
                ops = graph["layers"][int(idx)]["operands"]
                for piece_role, target, steps in role.pieces:
                    if piece_role in ops:
                        r.refuse(name, f"duplicate operand: role {piece_role} of layer {idx} is already {ops[piece_role]!r}",
                                 category="structure")
                        continue
                    ops[piece_role] = f"{idx}.{target}"
                    placements.append(TensorPlacement(name, obj, f"{idx}.{target}", piece_role, int(idx), transform=steps))
                continue
            if isinstance(role, Part):
                shape = tuple(specs[name].shape)
                if role.shape is not None and shape != tuple(role.shape):
                    r.refuse(name, f"has shape {list(shape)}; as part of {role.role} ({role.target}) of layer {idx} "
                                   f"it must be {list(role.shape)}", category="structure")
                    rejected.add((int(idx), role.target))  # the bank is refused already; no second finding
                    continue
                groups.setdefault((int(idx), role.target), []).append((role, name))
                continue
            ops = graph["layers"][int(idx)]["operands"]
            if role in ops:
                r.refuse(name, f"duplicate operand: role {role} of layer {idx} is already {ops[role]!r}", category="structure")
                continue
            ops[role] = rel
            placements.append(TensorPlacement(name, obj, rel, role, int(idx)))
        else:
            declared = graph["objects"].get(obj, {}).get("operands") or {"weight": "weight"}
            if rel not in declared.values():
                r.refuse(name, f"unexpected tensor {rel!r} in {obj} (known: {', '.join(sorted(declared.values()))})",
                         category="structure")
                continue
            if obj == "output_head" and tied:
                dropped.append((name, "the head is tied to the embedding; the separate copy is not encoded"))
                r.findings.append(Finding(category="metadata", key=name, value=None, message="tied head: duplicate lm_head not encoded", blocks=False))
                continue
            placements.append(TensorPlacement(name, obj, rel, next(k for k, v in declared.items() if v == rel), None))
    for (idx, target), parts in sorted(groups.items()):
        if (idx, target) in rejected:
            continue
        placed = _assemble(r, graph, idx, target, parts, layer_table, prefixes)
        if placed is not None:
            placements.append(placed)
    return placements, dropped


def _known(table: dict) -> str:
    """The suffixes a table accepts, with per-expert runs written once (``experts.{e}.w1.weight``)."""
    import re

    return ", ".join(sorted({re.sub(r"\.\d+\.", ".{e}.", k) for k, v in table.items() if not isinstance(v, (Refusal, Drop))}))


def _assemble(r: ConfigReader, graph: dict, idx: int, target: str, parts: list[tuple[Part, str]], layer_table,
              prefixes) -> TensorPlacement | None:
    """One container tensor from its parts: every index present exactly once, all parts agreeing
    on role, count and transform; else a blocking finding naming the missing or extra tensor."""
    first, name0 = parts[0]
    count, role, steps, codec = first.count, first.role, first.transform, first.codec
    for p, name in parts:
        if (p.count, p.role, p.transform, p.codec) != (count, role, steps, codec):
            r.refuse(name, f"disagrees with {name0} on how {target} of layer {idx} is assembled", category="structure")
            return None
    by_index: dict[int, str] = {}
    for p, name in parts:
        if p.index in by_index:
            r.refuse(name, f"is part {p.index} of {target} of layer {idx}, as is {by_index[p.index]}", category="structure")
            return None
        by_index[p.index] = name
    obj_prefix, obj = max(((p, o) for p, o in prefixes if name0.startswith(p)), key=lambda po: len(po[0]))
    if len(by_index) != count:
        _, table = layer_table(idx)
        prefix = f"{obj_prefix}{idx}."
        missing = [prefix + s for s, e in sorted(table.items(), key=lambda kv: kv[1].index if isinstance(kv[1], Part) else -1)
                   if isinstance(e, Part) and e.target == target and e.index not in by_index]
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        r.refuse(missing[0] if missing else name0,
                 f"{target} of layer {idx} ({role}) is assembled from {count} tensors; {count - len(by_index)} missing: "
                 f"{', '.join(missing[:3])}{more}", category="structure")
        return None
    ops = graph["layers"][idx]["operands"]
    rel = f"{idx}.{target}"
    if role in ops:
        r.refuse(name0, f"duplicate operand: role {role} of layer {idx} is already {ops[role]!r} (a checkpoint holds "
                        "one layout of a bank, not two)", category="structure")
        return None
    ops[role] = rel
    sources = tuple(by_index[i] for i in range(count))
    if count == 1 and not steps and not codec:
        return TensorPlacement(sources[0], obj, rel, role, idx)
    return TensorPlacement(sources[0], obj, rel, role, idx, sources=sources if count > 1 else (), transform=steps,
                           codec=codec)



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
