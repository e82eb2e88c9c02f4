"""Operand closure: the graph's declared operands and the segment tables must agree exactly.
Every defect is collected (not just the first) and named."""

from __future__ import annotations

from .roles import FFN_FUSED_REQUIRED, FFN_REQUIRED, REQUIRED, expected_shapes

NORM_ROLES = {
    "pre_only": ("attn_norm", "ffn_norm"),
    "pre_post": ("attn_norm", "ffn_norm", "post_attn_norm", "post_ffn_norm"),
    "post_only": ("post_attn_norm", "post_ffn_norm"),
}


def required_roles(graph_raw: dict, layer: dict) -> set[str]:
    surface = graph_raw["surface"]
    op = layer["operator"]
    roles = set(REQUIRED.get(op, ()))
    placement = surface.get("norms", {}).get("placement")
    if op == "softmax":
        att = surface["attention"]
        roles |= {f"{k}_bias" for k, on in att.get("bias", {}).items() if on}
        if att.get("qk_norm"):
            roles |= {"q_norm", "k_norm"}
    if op == "mamba2" or placement == "pre_mixer":
        roles.add("mixer_norm")
        if layer.get("ffn"):
            roles.add("ffn_norm")
        m2 = surface.get("operators", {}).get("mamba2", {})
        if op == "mamba2":
            if m2.get("use_conv_bias"):
                roles.add("conv_bias")
            if m2.get("use_bias"):
                roles |= {"in_proj_bias", "out_proj_bias"}
    else:
        roles |= set(NORM_ROLES.get(placement, ()))
    if layer.get("ffn"):
        ffn = surface["ffn"]
        roles |= set(FFN_FUSED_REQUIRED if ffn.get("fused_gate_up") else FFN_REQUIRED)
        if ffn.get("bias"):
            roles |= {"ffn_down_bias"} | ({"ffn_gate_up_bias"} if ffn.get("fused_gate_up") else {"ffn_gate_bias", "ffn_up_bias"})
    return roles


def check(graph_raw: dict, tables: dict[str, dict[str, tuple[str, tuple[int, ...]]]]) -> list[str]:
    """tables: object -> tensor name -> (dtype, shape). Returns the list of defects (empty = closed)."""
    defects: list[str] = []
    surface = graph_raw["surface"]
    H = int(surface["hidden_size"])
    V = int(surface["head"]["vocab"])
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
        dtype, got = t[name]
        if tuple(got) != tuple(shape):
            defects.append(f"{what}: {obj}/{name} has shape {list(got)}, the surface implies {list(shape)}")
        if dtype != "f32":
            defects.append(f"{what}: {obj}/{name} is {dtype}; only f32 operands execute")

    objects = graph_raw["objects"]
    want("embedding", objects["embedding"]["operands"]["weight"], (V, H), "embedding")
    want("final_norm", objects["final_norm"]["operands"]["weight"], (H,), "final norm")
    head = surface["head"]
    if not head.get("tied"):
        if "output_head" not in objects:
            defects.append("output head: the head is untied but the graph has no output_head object")
        else:
            want("output_head", objects["output_head"]["operands"]["weight"], (V, H), "output head")
    elif "output_head" in objects:
        defects.append("output head: the head is tied but an output_head object is declared")

    for layer in graph_raw["layers"]:
        i = layer["index"]
        if layer["operator"] not in REQUIRED:
            # Described but not executable in this build: its operands must exist and be
            # claimed; their shapes are judged by the operator's executor when one exists.
            for role, name in sorted(layer.get("operands", {}).items()):
                t = tables.get("decoder_stack", {})
                if name not in t:
                    defects.append(f"layer {i} {role}: missing operand decoder_stack/{name}")
                else:
                    claimed["decoder_stack"].add(name)
            continue
        shapes = expected_shapes(surface, layer["operator"])
        operands = layer.get("operands", {})
        need = required_roles(graph_raw, layer)
        for role in sorted(need - set(operands)):
            defects.append(f"layer {i} ({layer['operator']}): missing operand role {role}")
        for role, name in sorted(operands.items()):
            if role not in shapes:
                defects.append(f"layer {i}: role {role} is not an operand of operator {layer['operator']}")
                continue
            if role not in need:
                defects.append(f"layer {i}: operand {role} ({name}) is not used under this surface")
            want("decoder_stack", name, shapes[role](), f"layer {i} {role}")

    for obj, t in tables.items():
        for name in sorted(set(t) - claimed.get(obj, set())):
            defects.append(f"{obj}/{name}: unclassified tensor (no role claims it)")
    return defects
