"""Routed-expert FFN numerics: a router picks k of E experts per position, the picked experts'
gated MLPs run, their outputs are combined with the router's weights, and an optional shared
expert is added. One sequence, float32 end to end, semantics of transformers 5.24.0's MoE
blocks (torch 2.13.0 CPU, their default "eager" experts path when the block stands alone).

Routers live in ``moe_router`` (one pure function per routing rule), exact torch.topk tie
breaking in ``moe_topk``. This module holds the op's geometry (the graph facts it needs), its
weights (weight objects of any encoding, experts stacked or one tensor per expert), a
``prepare`` that validates them once, and ``moe_prefill`` / ``moe_step``.

Execution
---------
* Prefill groups positions by expert: the (position, slot) pairs are sorted by expert (stable),
  and each expert that any position picked runs once, as one matrix product over all of its
  positions. Decode (``moe_step``) is the same code with T = 1: exactly the k picked experts
  run, no other expert's matrices are touched.
* An expert is ``down(act(gate(x)) * up(x))`` with ``act`` one of silu / gelu / gelu_tanh, or
  gpt-oss's ``swiglu_clamped``: gate = min(gate, limit), up = clip(up, -limit, limit),
  out = (up + 1) * gate * sigmoid(alpha * gate) (limit 7, alpha 1.702 in gpt-oss). gate and up
  come from separate matrices, or from one fused matrix split in halves (gate first) or
  interleaved (gate = even columns, up = odd: gpt-oss). Optional biases on the fused gate_up
  and on down (gpt-oss).
* Combine: each picked expert's output is multiplied by its weight and added to a zeroed
  output in ascending expert order, which is the order of transformers' eager experts loop
  (``index_add_`` per expert): the float32 additions happen in exactly that order (the
  summands themselves differ from torch's by BLAS rounding). transformers' ``grouped_mm`` /
  ``batched_mm`` experts paths (grouped_mm is the default inside a full model) instead sum the
  k slots in router order: identical for k = 2, an ulp apart for k > 2. On CPU grouped_mm
  refuses widths whose rows are not 16-byte multiples (torch._grouped_mm), so an odd-width
  fixture needs ``experts_implementation="eager"`` (or batched_mm) on the reference side.
* Shared expert, added after the routed sum: ``plain`` (deepseek_v3 / kimi_linear
  ``shared_experts``, granitemoehybrid's ``shared_mlp`` -- which despite its name is a *gated*
  MLP, input_linear [2S, H] split in halves, gate first) or ``sigmoid_gated`` (qwen3_next /
  qwen2_moe: sigmoid(x @ shared_expert_gate.T) [T, 1] times the shared MLP).
* Record: per position the experts and weights the router chose, the experts that ran, and the
  bytes touched = router (+ bias, + correction bias) + shared expert (+ its gate) + only the
  experts that ran, summed from the weight objects' ``nbytes``.

Expert tensors on disk (transformers 5.24.0 ``save_pretrained`` of tiny random models; E
experts, H hidden, I expert intermediate, S shared intermediate; prefix ``model.layers.N.``)
------------------------------------------------------------------------------------------
Default save (``save_original_format=True``, the released layouts):

===================  ======================================================================
qwen3_moe, olmoe,    mlp.gate.weight [E, H]
qwen3_next,          mlp.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H],
qwen3_5_moe_text     .down_proj.weight [H, I]          (one tensor per expert)
                     qwen3_next / qwen3_5_moe add mlp.shared_expert.{gate,up}_proj.weight
                     [S, H], .down_proj.weight [H, S], mlp.shared_expert_gate.weight [1, H];
                     qwen3_moe ``mlp_only_layers`` give dense mlp.{gate,up,down}_proj
deepseek_v3          as qwen3_moe, plus mlp.gate.e_score_correction_bias [E] and
                     mlp.shared_experts.{gate,up}_proj.weight [S, H], .down_proj [H, S]
                     (S = moe_intermediate * n_shared_experts); the first
                     ``first_k_dense_replace`` layers are dense mlp.{gate,up,down}_proj
mixtral              block_sparse_moe.gate.weight [E, H];
                     block_sparse_moe.experts.{e}.w1.weight [I, H] (gate),
                     .w3.weight [I, H] (up), .w2.weight [H, I] (down)
kimi_linear          as mixtral (block_sparse_moe.experts.{e}.w1/w2/w3), plus
                     block_sparse_moe.gate.e_score_correction_bias [E] and
                     block_sparse_moe.shared_experts.{gate,up,down}_proj.weight
granitemoehybrid     block_sparse_moe.router.layer.weight [E, H];
                     block_sparse_moe.input_linear.weight [E, 2I, H] (fused, halves:
                     gate first), block_sparse_moe.output_linear.weight [E, H, I];
                     shared_mlp.input_linear.weight [2S, H] (halves), .output_linear [H, S]
gpt_oss              mlp.router.weight [E, H], mlp.router.bias [E];
                     mlp.experts.gate_up_proj [E, H, 2I] (in-out: x @ W; interleaved,
                     gate = even columns), mlp.experts.gate_up_proj_bias [E, 2I],
                     mlp.experts.down_proj [E, I, H] (in-out), mlp.experts.down_proj_bias [E, H]
                     (the released gpt-oss checkpoints store these as MXFP4
                     ``*_blocks`` / ``*_scales``: a low-bit encoding, not f32)
===================  ======================================================================

Runtime save (``save_original_format=False``), which transformers 5.24 also loads as is:
every family but gpt_oss stores ``{mlp|block_sparse_moe}.experts.gate_up_proj`` [E, 2I, H]
(halves, gate first) and ``.experts.down_proj`` [E, H, I] without ``.weight`` (mixtral and
kimi_linear under ``mlp.``; granitemoehybrid keeps ``block_sparse_moe.`` and its router
becomes ``block_sparse_moe.router.weight``); routers, correction biases and shared experts
keep their names. gpt_oss is the same in both saves.

Config keys -> geometry (transformers 5.24.0 config attributes; admission grades each)
-------------------------------------------------------------------------------------
=================  ==================================================================
qwen3_moe          softmax_topk; E num_experts, k num_experts_per_tok, I
                   moe_intermediate_size, renormalize norm_topk_prob (class default False),
                   act hidden_act; layer i is routed iff i not in mlp_only_layers and
                   num_experts > 0 and (i + 1) % decoder_sparse_step == 0, else dense
                   (intermediate_size)
qwen3_next         as qwen3_moe (norm_topk_prob default True) + shared sigmoid_gated,
                   S shared_expert_intermediate_size
olmoe              softmax_topk; E num_experts, I intermediate_size, renormalize
                   norm_topk_prob (default False); every layer routed
mixtral            softmax_topk, renormalize always True (no key); E num_local_experts,
                   I intermediate_size
granitemoehybrid   topk_softmax; E num_local_experts (0: no routed FFN, the dense
                   shared_mlp alone), I intermediate_size; shared plain,
                   S shared_intermediate_size
gpt_oss            topk_softmax + router_bias; E num_local_experts, I intermediate_size;
                   swiglu_clamped, limit swiglu_limit, alpha swiglu_alpha; fused_interleaved,
                   in_out, expert_bias
deepseek_v3,       sigmoid_group_topk; E n_routed_experts (kimi: num_experts), k
kimi_linear        num_experts_per_tok (kimi: num_experts_per_token), n_group (kimi:
                   num_expert_group), topk_group, renormalize norm_topk_prob (kimi:
                   moe_renormalize), routed_scaling_factor, correction_bias (always a
                   buffer in the reference), I moe_intermediate_size; shared plain with
                   S = moe_intermediate_size * n_shared_experts (kimi: num_shared_experts);
                   layer i routed iff i >= first_k_dense_replace (kimi: mlp_layer_types)
=================  ==================================================================

So the kernel accepts: gate_up ``separate`` | ``fused_halves`` | ``fused_interleaved``;
expert layout ``out_in`` ([.., out, in], x @ W.T) | ``in_out`` ([.., in, out], x @ W); each
expert matrix as one stacked 3-D weight or as a sequence of E 2-D weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ...codecs.base import Weight
from ...errors import ClosureError, UnsupportedOperator
from .checks import check_input
from .ffn import ACTIVATIONS
from .moe_router import router_logits, sigmoid, sigmoid_group_topk, softmax_topk, topk_softmax

__all__ = [
    "EXPERT_ACTS",
    "ROUTERS",
    "ExpertBank",
    "MoeGeometry",
    "MoeRecord",
    "MoeWeights",
    "PreparedMoe",
    "SharedExpert",
    "moe_prefill",
    "moe_step",
    "prepare_moe",
    "route",
]

F32 = np.float32
_ONE = F32(1.0)

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk")
EXPERT_ACTS = ("silu", "gelu", "gelu_tanh", "swiglu_clamped")
SHARED_ACTS = ("silu", "gelu", "gelu_tanh")
GATE_UP_FORMS = ("separate", "fused_halves", "fused_interleaved")
EXPERT_LAYOUTS = ("out_in", "in_out")
SHARED_KINDS = ("none", "plain", "sigmoid_gated")


def _choice(name: str, v, allowed: tuple[str, ...]) -> None:
    if v not in allowed:
        raise ValueError(f"MoeGeometry.{name} is {v!r}; supported: {', '.join(allowed)}")


def _pos_int(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"MoeGeometry.{name} must be a positive int, got {v!r}")


def _absent(name: str, v, why: str) -> None:
    if v is not None and v is not False:
        raise ValueError(f"MoeGeometry.{name} is {v!r}, but {why}")


@dataclass(frozen=True)
class MoeGeometry:
    """The graph facts a routed-expert FFN op carries. Nothing here has a default: a value that
    does not apply to the chosen router / activation / shared kind must be None (or False), and
    one that applies must be given."""

    hidden_size: int
    num_experts: int
    top_k: int
    expert_intermediate: int
    router: str  # ROUTERS
    renormalize: bool  # norm_topk_prob (softmax_topk, sigmoid_group_topk); False for topk_softmax
    router_bias: bool  # the router linear has a bias (gpt_oss)
    correction_bias: bool  # e_score_correction_bias (sigmoid_group_topk only)
    n_group: int | None  # sigmoid_group_topk only
    topk_group: int | None  # sigmoid_group_topk only
    routed_scaling_factor: float | None  # sigmoid_group_topk only
    expert_act: str  # EXPERT_ACTS
    swiglu_limit: float | None  # swiglu_clamped only
    swiglu_alpha: float | None  # swiglu_clamped only
    gate_up: str  # GATE_UP_FORMS
    expert_layout: str  # EXPERT_LAYOUTS
    expert_bias: bool  # biases on the fused gate_up and on down (gpt_oss)
    shared: str  # SHARED_KINDS
    shared_intermediate: int | None  # plain / sigmoid_gated only
    shared_act: str | None  # SHARED_ACTS; plain / sigmoid_gated only

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_experts", "top_k", "expert_intermediate"):
            _pos_int(name, getattr(self, name))
        if self.top_k > self.num_experts:
            raise ValueError(
                f"MoeGeometry.top_k ({self.top_k}) exceeds num_experts ({self.num_experts})"
            )
        for name in ("renormalize", "router_bias", "correction_bias", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"MoeGeometry.{name} must be a bool, got {getattr(self, name)!r}")
        _choice("router", self.router, ROUTERS)
        _choice("expert_act", self.expert_act, EXPERT_ACTS)
        _choice("gate_up", self.gate_up, GATE_UP_FORMS)
        _choice("expert_layout", self.expert_layout, EXPERT_LAYOUTS)
        _choice("shared", self.shared, SHARED_KINDS)

        if self.router == "sigmoid_group_topk":
            _pos_int("n_group", self.n_group)
            _pos_int("topk_group", self.topk_group)
            if self.num_experts % self.n_group:
                raise ValueError(
                    f"MoeGeometry: num_experts ({self.num_experts}) is not a multiple of "
                    f"n_group ({self.n_group})"
                )
            per = self.num_experts // self.n_group
            if per < 2:
                raise ValueError(
                    f"MoeGeometry: {per} expert per group; the reference scores a group by its "
                    f"two best experts, so each group needs at least 2"
                )
            if self.topk_group > self.n_group:
                raise ValueError(
                    f"MoeGeometry.topk_group ({self.topk_group}) exceeds n_group ({self.n_group})"
                )
            if self.top_k > self.topk_group * per:
                raise ValueError(
                    f"MoeGeometry.top_k ({self.top_k}) exceeds the {self.topk_group * per} experts "
                    f"of the topk_group ({self.topk_group}) groups kept"
                )
            rsf = self.routed_scaling_factor
            if isinstance(rsf, bool) or not isinstance(rsf, (int, float)) or not np.isfinite(rsf):
                raise ValueError(
                    f"MoeGeometry.routed_scaling_factor must be a finite number for the "
                    f"sigmoid_group_topk router, got {rsf!r}"
                )
            object.__setattr__(self, "routed_scaling_factor", float(rsf))
        else:
            why = f"only the sigmoid_group_topk router has it (router is {self.router!r})"
            for name in ("n_group", "topk_group", "routed_scaling_factor", "correction_bias"):
                _absent(name, getattr(self, name), why)
            if self.router == "topk_softmax" and self.renormalize:
                raise ValueError(
                    "MoeGeometry.renormalize is True, but the topk_softmax router's weights are "
                    "a softmax over the k picked logits and have no renormalisation step"
                )

        if self.expert_act == "swiglu_clamped":
            for name in ("swiglu_limit", "swiglu_alpha"):
                v = getattr(self, name)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not np.isfinite(v):
                    raise ValueError(
                        f"MoeGeometry.{name} must be a finite number for swiglu_clamped, got {v!r}"
                    )
                object.__setattr__(self, name, float(v))
        else:
            why = f"only swiglu_clamped has it (expert_act is {self.expert_act!r})"
            _absent("swiglu_limit", self.swiglu_limit, why)
            _absent("swiglu_alpha", self.swiglu_alpha, why)
        if self.expert_bias and self.gate_up == "separate":
            raise ValueError(
                "MoeGeometry.expert_bias with gate_up 'separate' is not supported: expert "
                "biases exist for a fused gate_up only (gpt_oss)"
            )

        if self.shared == "none":
            why = "the op has no shared expert (shared is 'none')"
            _absent("shared_intermediate", self.shared_intermediate, why)
            _absent("shared_act", self.shared_act, why)
        else:
            _pos_int("shared_intermediate", self.shared_intermediate)
            _choice("shared_act", self.shared_act, SHARED_ACTS)

    @property
    def experts_per_group(self) -> int | None:
        return self.num_experts // self.n_group if self.n_group else None

    def expert_param_count(self) -> int:
        """Elements of one routed expert (its matrices and biases): what a position pays per
        expert it uses. With an encoding's bits per element this is STATS' bytes per expert,
        computed without reading a tensor."""
        H, In = self.hidden_size, self.expert_intermediate
        n = 3 * H * In
        return n + (2 * In + H if self.expert_bias else 0)

    def always_param_count(self) -> int:
        """Elements read for every position whatever the routing: router (+ bias, + correction
        bias) and the shared expert (+ its gate)."""
        E, H = self.num_experts, self.hidden_size
        n = E * H + (E if self.router_bias else 0) + (E if self.correction_bias else 0)
        if self.shared != "none":
            n += 3 * H * self.shared_intermediate + (H if self.shared == "sigmoid_gated" else 0)
        return n


# --------------------------------------------------------------------------- weights

Bank = Weight | Sequence[Weight]  # stacked [E, a, b] (or [E, n] for a bias), or E per-expert


@dataclass
class ExpertBank:
    """The routed experts' matrices, each either one stacked weight object [E, ...] or a
    sequence of E weight objects (one per expert, as most checkpoints store them). Which of
    gate_up / gate + up is set follows ``MoeGeometry.gate_up``; the axis order of each matrix
    follows ``MoeGeometry.expert_layout``."""

    down: Bank
    gate_up: Bank | None = None
    gate: Bank | None = None
    up: Bank | None = None
    gate_up_bias: Bank | None = None  # [E, 2I]
    down_bias: Bank | None = None  # [E, H]


@dataclass
class SharedExpert:
    """A gated dense MLP: gate + up [S, H] each, or gate_up [2S, H] (halves, gate first), and
    down [H, S]. Always out-in (x @ W.T)."""

    down: Weight
    gate_up: Weight | None = None
    gate: Weight | None = None
    up: Weight | None = None


@dataclass
class MoeWeights:
    router: Weight  # [E, H]
    experts: ExpertBank
    router_bias: Weight | None = None  # [E]
    correction_bias: Weight | None = None  # [E]
    shared: SharedExpert | None = None
    shared_gate: Weight | None = None  # [1, H] (sigmoid_gated)


@dataclass(frozen=True)
class _Expert:
    """One expert's operands, resolved once: 2-D weight objects and dense bias vectors."""

    gate_up: Weight | None
    gate: Weight | None
    up: Weight | None
    down: Weight
    gate_up_bias: np.ndarray | None
    down_bias: np.ndarray | None


@dataclass(frozen=True)
class PreparedMoe:
    """Validated operands of one MoE op, ready for ``moe_prefill`` / ``moe_step``."""

    geometry: MoeGeometry
    router: Weight
    router_bias: np.ndarray | None
    correction_bias: np.ndarray | None
    experts: tuple[_Expert, ...]
    shared: SharedExpert | None
    shared_gate: Weight | None
    always_bytes: int  # router (+ biases) + shared expert (+ gate): read for every position
    expert_bytes: tuple[int, ...]  # per expert: its matrices and biases

    def bytes_for(self, experts) -> int:
        """Bytes touched by one call that ran ``experts``: the always-read part plus those."""
        return self.always_bytes + sum(self.expert_bytes[int(e)] for e in experts)


@dataclass(frozen=True)
class MoeRecord:
    """What one call did, for the trace: ``experts`` [T, k] and ``weights`` [T, k] are the
    router's choice per position (the reference's order), ``ran`` the experts whose matrices
    were multiplied (ascending), ``bytes_read`` what ``PreparedMoe.bytes_for(ran)`` counts."""

    experts: np.ndarray
    weights: np.ndarray
    ran: tuple[int, ...]
    bytes_read: int

    def to_data(self) -> dict:
        """Plain data: per position the experts and their weights, the experts that ran, the
        bytes read."""
        return {"experts": self.experts.tolist(), "weights": [[float(w) for w in row] for row in self.weights],
                "ran": list(self.ran), "bytes_read": int(self.bytes_read)}


# --------------------------------------------------------------------------- prepare


def _shape_of(w) -> tuple[int, ...] | None:
    return w.shape if isinstance(w, Weight) else None


def _expect(name: str, w, shape: tuple[int, ...], defects: list[str]) -> bool:
    if w is None:
        defects.append(f"{name}: missing, expected a weight {list(shape)}")
        return False
    if not isinstance(w, Weight):
        defects.append(f"{name}: not a weight object ({type(w).__name__})")
        return False
    if w.shape != shape:
        defects.append(f"{name}: shape {list(w.shape)}, expected {list(shape)}")
        return False
    return True


def _unexpected(name: str, w, why: str, defects: list[str]) -> None:
    if w is not None:
        defects.append(f"{name}: present, but {why}")


def _bank(name: str, bank, E: int, shape: tuple[int, ...], defects: list[str]) -> list | None:
    """Resolve a bank to E per-expert weight objects of ``shape``, or record why not."""
    if bank is None:
        defects.append(f"{name}: missing, expected [{E}, {', '.join(map(str, shape))}]")
        return None
    if isinstance(bank, Weight):
        if not _expect(name, bank, (E, *shape), defects):
            return None
        return [bank.expert(e) for e in range(E)]
    if isinstance(bank, (list, tuple)):
        if len(bank) != E:
            defects.append(f"{name}: {len(bank)} per-expert tensors, expected {E}")
            return None
        ok = [_expect(f"{name}[{e}]", w, shape, defects) for e, w in enumerate(bank)]
        return list(bank) if all(ok) else None
    defects.append(
        f"{name}: {type(bank).__name__}; expected a stacked weight or a sequence of {E} weights"
    )
    return None


def prepare_moe(w: MoeWeights, g: MoeGeometry) -> PreparedMoe:
    """Validate the operands against the geometry once (every defect is listed in one
    ClosureError) and resolve each expert's matrices; nothing is read beyond shapes."""
    defects: list[str] = []
    E, H, In = g.num_experts, g.hidden_size, g.expert_intermediate
    _expect("router", w.router, (E, H), defects)
    if g.router_bias:
        _expect("router_bias", w.router_bias, (E,), defects)
    else:
        _unexpected("router_bias", w.router_bias, "the geometry declares no router bias", defects)
    if g.correction_bias:
        _expect("correction_bias", w.correction_bias, (E,), defects)
    else:
        _unexpected("correction_bias", w.correction_bias, "the geometry declares none", defects)

    def io(out: int, inp: int) -> tuple[int, int]:
        return (out, inp) if g.expert_layout == "out_in" else (inp, out)

    b = w.experts
    gate_up = gate = up = None
    if g.gate_up == "separate":
        gate = _bank("experts.gate", b.gate, E, io(In, H), defects)
        up = _bank("experts.up", b.up, E, io(In, H), defects)
        _unexpected("experts.gate_up", b.gate_up, "gate_up is declared 'separate'", defects)
    else:
        gate_up = _bank("experts.gate_up", b.gate_up, E, io(2 * In, H), defects)
        for name in ("gate", "up"):
            _unexpected(f"experts.{name}", getattr(b, name), f"gate_up is {g.gate_up!r}", defects)
    down = _bank("experts.down", b.down, E, io(H, In), defects)
    gub = db = None
    if g.expert_bias:
        gub = _bank("experts.gate_up_bias", b.gate_up_bias, E, (2 * In,), defects)
        db = _bank("experts.down_bias", b.down_bias, E, (H,), defects)
    else:
        for name in ("gate_up_bias", "down_bias"):
            _unexpected(f"experts.{name}", getattr(b, name), "the geometry has no expert bias", defects)

    s = w.shared
    if g.shared == "none":
        _unexpected("shared", s, "the geometry declares no shared expert", defects)
        _unexpected("shared_gate", w.shared_gate, "the geometry declares no shared expert", defects)
    else:
        S = g.shared_intermediate
        if s is None:
            defects.append(f"shared: missing, the geometry declares a {g.shared!r} shared expert")
        else:
            if s.gate_up is not None:
                _expect("shared.gate_up", s.gate_up, (2 * S, H), defects)
                for name in ("gate", "up"):
                    _unexpected(f"shared.{name}", getattr(s, name), "shared.gate_up is given", defects)
            else:
                _expect("shared.gate", s.gate, (S, H), defects)
                _expect("shared.up", s.up, (S, H), defects)
            _expect("shared.down", s.down, (H, S), defects)
        if g.shared == "sigmoid_gated":
            _expect("shared_gate", w.shared_gate, (1, H), defects)
        else:
            _unexpected("shared_gate", w.shared_gate, "the shared expert is 'plain'", defects)
    if defects:
        raise ClosureError("moe operands do not match the layer geometry", defects)

    experts = []
    expert_bytes = []
    for e in range(E):
        ex = _Expert(
            gate_up=gate_up[e] if gate_up else None,
            gate=gate[e] if gate else None,
            up=up[e] if up else None,
            down=down[e],
            gate_up_bias=gub[e].dense() if gub else None,
            down_bias=db[e].dense() if db else None,
        )
        experts.append(ex)
        mats = [m for m in (ex.gate_up, ex.gate, ex.up, ex.down) if m is not None]
        mats += [bb[e] for bb in (gub, db) if bb]
        expert_bytes.append(sum(m.nbytes for m in mats))
    always = [w.router, w.router_bias, w.correction_bias, w.shared_gate]
    if s is not None:
        always += [s.gate_up, s.gate, s.up, s.down]
    return PreparedMoe(
        geometry=g,
        router=w.router,
        router_bias=w.router_bias.dense() if w.router_bias is not None else None,
        correction_bias=w.correction_bias.dense() if w.correction_bias is not None else None,
        experts=tuple(experts),
        shared=s,
        shared_gate=w.shared_gate,
        always_bytes=sum(m.nbytes for m in always if m is not None),
        expert_bytes=tuple(expert_bytes),
    )


# --------------------------------------------------------------------------- kernels





def _act(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise UnsupportedOperator(
            f"MoE expert activation {name!r} has no executor (supported: {', '.join(EXPERT_ACTS)})"
        ) from None


def route(x: np.ndarray, p: PreparedMoe) -> tuple[np.ndarray, np.ndarray]:
    """The router alone: x [T, hidden] -> (weights float32 [T, k], experts int64 [T, k])."""
    g = p.geometry
    logits = router_logits(x, p.router, None)
    if p.router_bias is not None:
        logits = logits + p.router_bias
    if g.router == "softmax_topk":
        return softmax_topk(logits, g.top_k, renormalize=g.renormalize)
    if g.router == "topk_softmax":
        return topk_softmax(logits, g.top_k)
    return sigmoid_group_topk(
        logits,
        g.top_k,
        correction_bias=p.correction_bias,
        n_group=g.n_group,
        topk_group=g.topk_group,
        renormalize=g.renormalize,
        scaling_factor=g.routed_scaling_factor,
    )


def _mm(w: Weight, x: np.ndarray, in_out: bool) -> np.ndarray:
    # An in-out matrix [in, out] multiplies as x @ W: the weight's transposed product, which
    # reads the encoded bytes tile by tile (the container always stores banks out-in, [E, out,
    # in]: the operator sets expert_layout "out_in"; in-out is the kernel's own test layout).
    return w.mm_t(x) if in_out else w.mm(x)


def _expert(x: np.ndarray, ex: _Expert, g: MoeGeometry) -> np.ndarray:
    """One expert over its positions: x [n, hidden] -> [n, hidden]."""
    in_out = g.expert_layout == "in_out"
    In = g.expert_intermediate
    if ex.gate_up is not None:
        gu = _mm(ex.gate_up, x, in_out)
        if ex.gate_up_bias is not None:
            gu += ex.gate_up_bias
        if g.gate_up == "fused_interleaved":
            gate, up = gu[:, 0::2], gu[:, 1::2]
        else:
            gate, up = gu[:, :In], gu[:, In:]
    else:
        gate = _mm(ex.gate, x, in_out)
        up = _mm(ex.up, x, in_out)
    if g.expert_act == "swiglu_clamped":
        lim = F32(g.swiglu_limit)
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
        h = (up + _ONE) * (gate * sigmoid(gate * F32(g.swiglu_alpha)))
    else:
        h = _act(g.expert_act)(gate) * up
    y = _mm(ex.down, h, in_out)
    if ex.down_bias is not None:
        y += ex.down_bias
    return y


def _shared(x: np.ndarray, p: PreparedMoe) -> np.ndarray:
    g, s = p.geometry, p.shared
    if s.gate_up is not None:
        gu = s.gate_up.mm(x)
        S = g.shared_intermediate
        gate, up = gu[:, :S], gu[:, S:]
    else:
        gate, up = s.gate.mm(x), s.up.mm(x)
    y = s.down.mm(_act(g.shared_act)(gate) * up)
    if g.shared == "sigmoid_gated":
        y = sigmoid(p.shared_gate.mm(x)) * y
    return y


def _run(x: np.ndarray, p: PreparedMoe) -> tuple[np.ndarray, MoeRecord]:
    g = p.geometry
    T = x.shape[0]
    weights, experts = route(x, p)
    k = experts.shape[1]
    flat = experts.reshape(-1)
    wflat = weights.reshape(-1)
    order = np.argsort(flat, kind="stable")  # (position, slot) pairs grouped by expert
    counts = np.bincount(flat, minlength=g.num_experts)
    out = np.zeros((T, g.hidden_size), F32)
    ran = np.flatnonzero(counts)
    start = 0
    for e in ran:  # ascending: the reference's order of adds
        n = counts[e]
        sel = order[start : start + n]
        start += n
        tok = sel // k
        y = _expert(x[tok], p.experts[e], g)
        y *= wflat[sel][:, None]
        out[tok] += y
    if g.shared != "none":
        out += _shared(x, p)
    ran_t = tuple(int(e) for e in ran)
    return out, MoeRecord(experts, weights, ran_t, p.bytes_for(ran_t))


def moe_prefill(x: np.ndarray, p: PreparedMoe) -> tuple[np.ndarray, MoeRecord]:
    """Run the MoE FFN over ``x`` [T, hidden] (the normed layer input): returns the output
    [T, hidden] float32 and the record. Stateless: positions do not see each other."""
    check_input(x, 2, p.geometry.hidden_size, "moe_prefill")
    if x.shape[0] == 0:
        k = p.geometry.top_k
        none = MoeRecord(np.zeros((0, k), np.int64), np.zeros((0, k), F32), (), 0)
        return np.zeros((0, p.geometry.hidden_size), F32), none
    return _run(x, p)


def moe_step(x: np.ndarray, p: PreparedMoe) -> tuple[np.ndarray, MoeRecord]:
    """One position: ``x`` [hidden] -> [hidden] float32 and the record; only the k experts
    the router picks are multiplied."""
    check_input(x, 1, p.geometry.hidden_size, "moe_step")
    out, rec = _run(x[None], p)
    return out[0], rec
