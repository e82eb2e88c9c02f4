"""Binding the Mamba2 mixer (vindex3.exec.ops.mamba2) to the executor: an op's params (the
graph's ``surface.operators.mamba2``) and its operands by role become one callable
``run(x, state) -> y`` over the rows of one pass, and ``new_state(params)`` allocates the
layer's recurrent buffers.

Which arithmetic runs mirrors transformers 5.24.0's ``Mamba2Mixer`` exactly:

* a pass of more than one position, or the very first pass of a layer whatever its length,
  runs the chunk form (``mamba2_prefill``: Δ clamped to ``time_step_limit``);
* a one-position pass on a layer that has already run runs the recurrent form
  (``mamba2_step``: Δ not clamped), as transformers does once the layer's cache holds state.

With the default limits (0, ∞) the clamp is a no-op and the two forms are one function; with a
finite limit they differ in transformers and here alike. The state remembers whether its layer
has run (``started``), so the choice never depends on anything but the state itself, and a
snapshot/restore carries it along.
"""

from __future__ import annotations

import numpy as np

from ...errors import UnsupportedOperator
from .mamba2 import Mamba2Geometry, Mamba2State, Mamba2Weights, mamba2_prefill, mamba2_step

__all__ = ["BoundState", "bind", "geometry", "new_state"]

# Geometry keys the executor needs; anything else in the params is description only.
_REQUIRED = ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "chunk_size", "time_step_limit", "norm_eps")
ROLE_TO_FIELD = {
    "in_proj": "in_proj",
    "in_proj_bias": "in_proj_bias",
    "conv_weight": "conv_weight",
    "conv_bias": "conv_bias",
    "A_log": "A_log",
    "D": "D",
    "dt_bias": "dt_bias",
    "gated_norm": "norm_weight",
    "out_proj": "out_proj",
    "out_proj_bias": "out_proj_bias",
}


class BoundState(Mamba2State):
    """A layer's Mamba2 buffers plus whether the layer has run at all (transformers' "the
    cache holds a recurrent state for this layer")."""

    __slots__ = ("started",)

    def __init__(self, ssm: np.ndarray, conv: np.ndarray, started: bool = False):
        super().__init__(ssm, conv)
        self.started = started

    def copy(self) -> BoundState:
        return BoundState(self.ssm.copy(), self.conv.copy(), self.started)

    def __repr__(self) -> str:
        return f"BoundState(ssm={self.ssm.shape}, conv={self.conv.shape}, started={self.started})"


def geometry(params: dict, hidden_size: int) -> Mamba2Geometry:
    """The op geometry from the graph's mamba2 params, refusing what the mixer cannot run."""
    missing = [k for k in _REQUIRED if k not in params]
    if missing:
        raise UnsupportedOperator(f"mamba2 operator geometry lacks {', '.join(missing)}")
    act = params.get("activation", "silu")
    if act != "silu":
        raise UnsupportedOperator(f"mamba2 conv activation {act!r} has no executor (supported: silu)")
    if params.get("norm_before_gate", False):
        raise UnsupportedOperator("mamba2 gated norm with norm_before_gate=true has no executor (supported: gate, then norm)")
    lo, hi = (float(v) for v in params["time_step_limit"])
    try:
        return Mamba2Geometry(
            hidden_size=int(hidden_size),
            num_heads=int(params["num_heads"]),
            head_dim=int(params["head_dim"]),
            state_size=int(params["state_size"]),
            n_groups=int(params["n_groups"]),
            conv_kernel=int(params["conv_kernel"]),
            chunk_size=int(params["chunk_size"]),
            time_step_limit=(lo, hi),
            norm_eps=float(params["norm_eps"]),
            use_conv_bias=bool(params.get("use_conv_bias", False)),
            use_bias=bool(params.get("use_bias", False)),
        )
    except ValueError as e:
        raise UnsupportedOperator(f"mamba2 operator geometry is not executable: {e}") from None


def new_state(params: dict) -> BoundState:
    """Zeroed float32 buffers: ssm [heads, head_dim, state] and conv [conv_dim, kernel]."""
    nh, hd, ns, g, k = (int(params[x]) for x in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"))
    conv_dim = nh * hd + 2 * g * ns
    return BoundState(np.zeros((nh, hd, ns), np.float32), np.zeros((conv_dim, k), np.float32))


def bind(params: dict, weights_by_role: dict[str, np.ndarray]):
    """``run(x [T, hidden] float32, state: BoundState) -> [T, hidden] float32``."""
    unknown = sorted(set(weights_by_role) - set(ROLE_TO_FIELD))
    if unknown:
        raise UnsupportedOperator(f"mamba2 has no operand role {', '.join(unknown)} (roles: {', '.join(ROLE_TO_FIELD)})")
    if "in_proj" not in weights_by_role:
        raise UnsupportedOperator("mamba2 operand in_proj is missing")
    g = geometry(params, weights_by_role["in_proj"].shape[1])
    fields = {f: weights_by_role.get(role) for role, f in ROLE_TO_FIELD.items()}
    w = Mamba2Weights(**fields)

    def run(x: np.ndarray, state: BoundState) -> np.ndarray:
        if x.shape[0] == 1 and state.started:
            y = mamba2_step(x[0], w, g, state)[None]
        else:
            y = mamba2_prefill(x, w, g, state)
        state.started = True
        return y

    return run
