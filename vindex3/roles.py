"""Operand roles: which tensor plays which part in a layer, and the shape the surface implies.

Classification from source spellings happens at the import boundary (vindex3.families); what
is kept in the graph is the role → tensor mapping, so that past admission everything speaks
in roles. The expected shapes here are computed from the surface alone.
"""

from __future__ import annotations

import re
from typing import Callable

# Roles each operator requires (beyond optional ones), used by closure.
REQUIRED: dict[str, tuple[str, ...]] = {
    "softmax": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mamba2": ("in_proj", "conv_weight", "A_log", "D", "dt_bias", "gated_norm", "out_proj"),
}
FFN_REQUIRED = ("ffn_gate", "ffn_up", "ffn_down")
FFN_FUSED_REQUIRED = ("ffn_gate_up", "ffn_down")


def classify(suffix: str, table: dict[str, str]) -> str | None:
    """Exact-suffix classification: ``suffix`` must be a key of ``table`` verbatim."""
    return table.get(suffix)


_LAYER_RE = re.compile(r"^(\d+)\.(.+)$")


def split_layer(name: str) -> tuple[int, str] | None:
    m = _LAYER_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def expected_shapes(surface: dict, operator: str) -> dict[str, Callable[[], tuple[int, ...]]]:
    """role -> expected shape for a layer running ``operator`` under ``surface``."""
    H = int(surface["hidden_size"])
    out: dict[str, Callable[[], tuple[int, ...]]] = {
        "attn_norm": lambda: (H,),
        "ffn_norm": lambda: (H,),
        "post_attn_norm": lambda: (H,),
        "post_ffn_norm": lambda: (H,),
        "mixer_norm": lambda: (H,),
    }
    att = surface.get("attention")
    if att is not None:
        nh, nkv, hd = int(att["heads"]), int(att["kv_heads"]), int(att["head_dim"])
        out.update(
            q_proj=lambda: (nh * hd, H),
            k_proj=lambda: (nkv * hd, H),
            v_proj=lambda: (nkv * hd, H),
            o_proj=lambda: (H, nh * hd),
            q_bias=lambda: (nh * hd,),
            k_bias=lambda: (nkv * hd,),
            v_bias=lambda: (nkv * hd,),
            o_bias=lambda: (H,),
            q_norm=lambda: (hd,),
            k_norm=lambda: (hd,),
        )
    ffn = surface.get("ffn")
    if ffn is not None:
        inter = int(ffn["intermediate_size"])
        out.update(
            ffn_gate=lambda: (inter, H),
            ffn_up=lambda: (inter, H),
            ffn_gate_up=lambda: (2 * inter, H),
            ffn_down=lambda: (H, inter),
            ffn_gate_bias=lambda: (inter,),
            ffn_up_bias=lambda: (inter,),
            ffn_down_bias=lambda: (H,),
        )
    m2 = surface.get("operators", {}).get("mamba2")
    if m2 is not None:
        # Names of their own: the lambdas above close over nh, hd and inter by name, and a
        # hybrid surface has both groups.
        mh, mp, mn, mg, mk = (int(m2[x]) for x in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"))
        m_inter = mh * mp
        conv_dim = m_inter + 2 * mg * mn
        proj = int(m2.get("in_proj_dim", 2 * m_inter + 2 * mg * mn + mh))
        out.update(
            in_proj=lambda: (proj, H),
            in_proj_bias=lambda: (proj,),
            conv_weight=lambda: (conv_dim, 1, mk),
            conv_bias=lambda: (conv_dim,),
            A_log=lambda: (mh,),
            D=lambda: (mh,),
            dt_bias=lambda: (mh,),
            gated_norm=lambda: (m_inter,),
            out_proj=lambda: (H, m_inter),
            out_proj_bias=lambda: (H,),
        )
    return out
