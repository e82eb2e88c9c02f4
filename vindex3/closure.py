"""Operand closure: the graph's declared operands and the segment tables must agree exactly.
Every defect is collected (not just the first) and named.

Expected roles and shapes come from the layer skeleton (vindex3.layout: its norms) and from
each slot's operator (its `Role` list under its typed parameters). Whether an operand's encoding
can be executed is not judged here: an encoding without a codec is carried, and refused only
when something must decode it."""

from __future__ import annotations

from .graph import Graph
from .layout import norm_roles


def check(graph: Graph, tables: dict[str, dict[str, tuple[str, tuple[int, ...]]]]) -> list[str]:
    """tables: object -> tensor name -> (dtype, shape). Returns the list of defects (empty = closed)."""
    defects: list[str] = []
    H = graph.hidden_size
    V = graph.vocab_size
    claimed: dict[str, set[str]] = {o: set() for o in tables}

    def want(obj: str, name: str, shape: tuple[int, ...], what: str) -> None:
        t = tables.get(obj)
        if t is None:
            defects.append(f"{what}: object {obj} has no segment")
            return
        if name not in t:
            defects.append(f"{what}: missing operand {obj}/{name}")
            return
        if name in claimed[obj]:
            defects.append(f"{what}: {obj}/{name} is claimed twice")
        claimed[obj].add(name)
        _, got = t[name]
        if tuple(got) != tuple(shape):
            defects.append(f"{what}: {obj}/{name} has shape {list(got)}, the surface implies {list(shape)}")

    def operand(obj: str, role: str = "weight") -> str | None:
        o = graph.objects.get(obj)
        ops = o.get("operands") if isinstance(o, dict) else None
        w = ops.get(role) if isinstance(ops, dict) else None
        if not isinstance(w, str):
            defects.append(f"{obj}: the graph names no {role} operand for it")
            return None
        return w

    norm_bias = bool(graph.core.norms.bias)
    ends = [("embedding", "weight", (V, H)), ("final_norm", "weight", (H,))]
    if norm_bias:
        ends.append(("final_norm", "bias", (H,)))
    if "position_embedding" in graph.objects:
        ends.append(("position_embedding", "weight", None))
    for obj, role, shape in ends:
        if obj not in graph.objects:
            defects.append(f"{obj}: the graph declares no {obj} object")
        elif (name := operand(obj, role)) is not None:
            if shape is None:  # learned positions: [positions, hidden], any number of rows
                got = tables.get(obj, {}).get(name)
                shape = (got[1][0] if got is not None and len(got[1]) == 2 else -1, H)
            want(obj, name, shape, obj.replace("_", " ") + ("" if role == "weight" else f" {role}"))
    if not graph.core.head.tied:
        if "output_head" not in graph.objects:
            defects.append("output head: the head is untied but the graph has no output_head object")
        elif (name := operand("output_head")) is not None:
            want("output_head", name, (V, H), "output head")
            if graph.core.head.bias and (name := operand("output_head", "bias")) is not None:
                want("output_head", name, (V,), "output head bias")
    elif "output_head" in graph.objects:
        defects.append("output head: the head is tied but an output_head object is declared")

    placement = graph.core.norms.placement
    for lp in graph.layers:
        i = lp.index
        slots = ["mixer"] + (["ffn"] if lp.ffn else [])
        described = [s for s in slots if graph.operator(i, s) is None]
        if described:
            # Described but not executable in this build: its operands must exist and be claimed;
            # their shapes are judged by an executor for the operator when one exists.
            for role, name in sorted(lp.operands.items()):
                if name not in tables.get("decoder_stack", {}):
                    defects.append(f"layer {i} {role}: missing operand decoder_stack/{name}")
                else:
                    claimed["decoder_stack"].add(name)
            continue
        # role -> (shape, required, what owns it)
        expected: dict[str, tuple[tuple[int, ...], bool, str]] = {
            r: ((H,), True, f"{placement} norms") for r in norm_roles(placement, slots, norm_bias)}
        for s in slots:
            op = graph.operator(i, s)
            for role in op.roles(graph.layer_params[i][s]):
                if role.name in expected:
                    defects.append(f"layer {i}: role {role.name} is claimed by both {expected[role.name][2]} and {op.name}")
                expected[role.name] = (role.shape, role.required, op.name)
        label = lp.operator + (f" + {lp.ffn} ffn" if lp.ffn else "")
        for role in sorted(r for r, (_, req, _) in expected.items() if req and r not in lp.operands):
            defects.append(f"layer {i} ({expected[role][2]}): missing operand role {role}")
        for role, name in sorted(lp.operands.items()):
            if role not in expected:
                defects.append(f"layer {i}: role {role} is not an operand of this layer ({label})")
                continue
            shape, required, _ = expected[role]
            if not required:
                defects.append(f"layer {i}: operand {role} ({name}) is not used under this surface")
            want("decoder_stack", name, shape, f"layer {i} {role}")

    # objects of drafter components (an MTP module) are judged by their drafter's own closure
    drafters = [o for o, e in graph.objects.items() if isinstance(e, dict) and isinstance(e.get("drafter"), dict)]
    if drafters:
        from .draft.mtp import drafter_closure

        for obj in drafters:
            defects.extend(drafter_closure(graph, obj, tables))
            claimed[obj] = set(tables.get(obj, {}))
    for obj, t in tables.items():
        for name in sorted(set(t) - claimed.get(obj, set())):
            defects.append(f"{obj}/{name}: unclassified tensor (no role claims it)")
    return defects
