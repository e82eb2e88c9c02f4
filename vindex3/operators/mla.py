"""Multi-head latent attention (graph operator ``mla``, slot mixer; parameters in
``surface.operators.mla``): the attention of DeepSeek-V3 and of Kimi-Linear's full layers. The
numerics live in vindex3.exec.ops.mla (formulas, rope layouts, tensor tables).

Facts (`MlaParams`), each recorded in the graph, none defaulted here: ``num_heads`` H,
``q_lora_rank`` (null: the plain ``q_proj`` path), ``kv_lora_rank`` r, ``qk_nope_head_dim`` dn,
``qk_rope_head_dim`` dr, ``v_head_dim`` dv, ``attention_bias``, ``rope`` (null: no rope at all,
Kimi; else theta, the pair layout ``interleave`` and yarn scaling or null) and ``softmax_scale``
((dn + dr)^-½, times yarn's mscale² where the rope asks for it; derived, written out for
readers and checked against the other facts when the graph loads).

**kv_a_norm_eps and q_a_norm_eps are judgments of the family, not config values.** The
reference builds ``kv_a_layernorm`` and ``q_a_layernorm`` as ``RMSNorm(width)`` at the class
default ε = 1e-6, never at the config's ``rms_norm_eps``, and no config states it. Admission
records the value together with the reason (``judgments``). The graph may carry either as null
— unjudged — and still opens (STATS and EXPLAIN need no ε), but preparation refuses such an op
by name before the executor reads a single operand (`Mla.preflight`): the layer's ε is never
lent to it.

**State: one latent row per position** (`LatentRows`): the normalised kv latent (r) and the
shared rope key (dr), width r + dr, one ``latent_rows`` part; no K/V rows exist anywhere, and
asking the state for K or V is refused by name. It rolls back by truncation.

**Which attention form runs.** Both forms of vindex3.exec.ops.mla compute the same function
(tested to agree at the model level): ``reconstruct`` expands K_nope and V for every stored row
through ``kv_b_proj`` each pass, ``absorbed`` folds ``kv_b_proj`` into the query and the output
and attends over the latent rows directly. `attention_form` picks the one with fewer
multiply-adds for the pass at hand — with T new positions after p0 stored ones, on average
S = p0 + (T + 1)/2 rows per query:

    reconstruct  (p0 + T)·r·H·(dn + dv)  +  T·S·H·(dn + dr + dv)
    absorbed     T·H·r·(dn + dv)         +  T·S·H·(2r + dr)

so a decode step (T = 1) and a short continuation over a long context (a speculative verify)
run absorbed, and a prompt reconstructs (at DeepSeek's widths, r 512, dn dv 128, dr 64, the
break-even is about 170 new positions). Measured with bench/kda_mla_kernels.py: decode at a
512 context 388 tok/s absorbed against 44 reconstructed, prefill-512 5.7k tok/s reconstructed
against 4.2k absorbed.
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..continuation import Geometry, latent_rows
from ..errors import GraphSchemaError, StateError, UnsupportedOperator
from .base import ARRAY, MIXER, Kernel, Operator, Params, Role, parse_params, register

EPS_FACTS = ("kv_a_norm_eps", "q_a_norm_eps")


class YarnParams(BaseModel):
    """Yarn scaling of the rope, every value explicit (the reference's defaults for absent keys
    are resolved at admission and recorded). ``mscale`` / ``mscale_all_dim`` /
    ``attention_factor`` are null when the config does not state them (the reference then
    derives the attention factor from factor and the mscales)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    factor: float = Field(gt=0, allow_inf_nan=False)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(allow_inf_nan=False)
    beta_slow: float = Field(allow_inf_nan=False)
    mscale: float | None = Field(allow_inf_nan=False)
    mscale_all_dim: float | None = Field(allow_inf_nan=False)
    attention_factor: float | None = Field(allow_inf_nan=False)
    truncate: bool


class RopeParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    theta: float = Field(gt=0, allow_inf_nan=False)
    interleave: bool  # pairs (x0, x1), (x2, x3), ... (DeepSeek's rope_interleave) or rotate-half
    yarn: YarnParams | None


class MlaParams(Params):
    HIDDEN = frozenset({"hidden_size", "judgments"})

    hidden_size: int = Field(gt=0)
    num_heads: int = Field(gt=0)
    q_lora_rank: int | None = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(ge=0)
    v_head_dim: int = Field(gt=0)
    q_a_norm_eps: float | None = Field(ge=0, allow_inf_nan=False)  # null: unjudged (refused at preparation)
    kv_a_norm_eps: float | None = Field(ge=0, allow_inf_nan=False)  # null: unjudged (refused at preparation)
    attention_bias: bool
    rope: RopeParams | None
    softmax_scale: float = Field(gt=0, allow_inf_nan=False)
    judgments: dict[str, str]  # fact -> why the family fixed it (no config states it)

    @model_validator(mode="after")
    def _consistent(self) -> MlaParams:
        if self.q_lora_rank is None and self.q_a_norm_eps is not None:
            raise ValueError("q_a_norm_eps is set but q_lora_rank is null (there is no q_a_layernorm)")
        dr = self.qk_rope_head_dim
        if self.rope is not None and (dr < 2 or dr % 2):
            raise ValueError(f"a rope needs an even qk_rope_head_dim of at least 2, found {dr}")
        unknown = sorted(set(self.judgments) - set(EPS_FACTS))
        if unknown:
            raise ValueError(f"judgments name facts that are not family judgments of mla: {', '.join(unknown)} "
                             f"(judged facts: {', '.join(EPS_FACTS)})")
        for key in self.judgments:
            if getattr(self, key) is None:
                raise ValueError(f"judgments explain {key}, but it is null")
        y = self.rope.yarn if self.rope is not None else None
        want = expected_softmax_scale(self.qk_head_dim, y and y.factor, y and y.mscale_all_dim)
        if not math.isclose(self.softmax_scale, want, rel_tol=1e-9):
            raise ValueError(f"softmax_scale is {self.softmax_scale!r}, but the widths and the rope make it {want!r}")
        return self

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


def expected_softmax_scale(qk_head_dim: int, yarn_factor: float | None, mscale_all_dim: float | None) -> float:
    """(dn + dr)^-½, times mscale(factor, mscale_all_dim)² when the rope is yarn and
    mscale_all_dim is set and non-zero (transformers' ``yarn_apply_mscale``)."""
    s = qk_head_dim ** -0.5
    if yarn_factor is not None and mscale_all_dim:
        m = 1.0 if yarn_factor <= 1 else 0.1 * mscale_all_dim * math.log(yarn_factor) + 1.0
        s = s * m * m
    return s


def attention_form(p, T: int, p0: int) -> str:
    """"absorbed" or "reconstruct": the form with fewer multiply-adds for T positions after p0
    stored rows (see the module docstring). Ties go to absorbed."""
    H, r, dn, dr, dv = p.num_heads, p.kv_lora_rank, p.qk_nope_head_dim, p.qk_rope_head_dim, p.v_head_dim
    seen = p0 + (T + 1) / 2
    reconstruct = (p0 + T) * r * H * (dn + dv) + T * seen * H * (dn + dr + dv)
    absorbed = T * H * r * (dn + dv) + T * seen * H * (2 * r + dr)
    return "absorbed" if absorbed <= reconstruct else "reconstruct"


def kernel_geometry(p: MlaParams):
    """The kernel's MlaGeometry for these facts (refuses an unjudged eps by name)."""
    from ..exec.ops.mla import MlaGeometry, MlaRope, MlaYarn

    rope = None
    if p.rope is not None:
        y = p.rope.yarn
        rope = MlaRope(theta=p.rope.theta, interleave=p.rope.interleave,
                       yarn=None if y is None else MlaYarn(**y.model_dump()))
    return MlaGeometry(
        hidden_size=p.hidden_size, num_heads=p.num_heads, q_lora_rank=p.q_lora_rank, kv_lora_rank=p.kv_lora_rank,
        qk_nope_head_dim=p.qk_nope_head_dim, qk_rope_head_dim=p.qk_rope_head_dim, v_head_dim=p.v_head_dim,
        q_a_norm_eps=p.q_a_norm_eps, kv_a_norm_eps=p.kv_a_norm_eps, rope=rope, attention_bias=p.attention_bias)


class _Bound(Kernel):
    def __init__(self, p: MlaParams, operands: dict):
        from ..exec.ops import mla as k

        self.k, self.p = k, p
        self.g = kernel_geometry(p)
        self.w = k.MlaWeights(**{name: operands.get(name) for name in
                                 ("q_proj", "q_a_proj", "q_a_bias", "q_a_norm", "q_b_proj", "kv_a_proj", "kv_a_bias",
                                  "kv_a_norm", "kv_b_proj", "o_proj", "o_bias")})

    def _rows(self, rows, p0: int):
        if len(rows) != p0:
            raise StateError(f"mla latent rows hold {len(rows)} positions, but the pass starts at position {p0}")
        return rows

    def prefill(self, x: np.ndarray, rows, p0: int) -> np.ndarray:
        form = attention_form(self.p, x.shape[0], p0)
        return self.k.mla_prefill(x, self.w, self.g, self._rows(rows, p0), mode=form)

    def step(self, x: np.ndarray, rows, p0: int) -> np.ndarray:
        form = attention_form(self.p, 1, p0)
        return self.k.mla_step(x[0], self.w, self.g, self._rows(rows, p0), mode=form)[None]


class Mla(Operator):
    name = "mla"
    slot = MIXER
    selects = "mla"
    operator_group = "mla"
    Params = MlaParams

    def params(self, surface, layer) -> MlaParams:
        ops = surface.get("operators")
        g = ops.get("mla") if isinstance(ops, dict) else None
        if not isinstance(g, dict):
            raise GraphSchemaError(f"system_graph.json: layer {layer.index} runs mla but surface.operators has no mla group")
        return parse_params(MlaParams, {**g, "hidden_size": surface.get("hidden_size")}, f"layer {layer.index} (mla)")

    def roles(self, p: MlaParams) -> list[Role]:
        H, hid, r, dr, ql, b = p.num_heads, p.hidden_size, p.kv_lora_rank, p.qk_rope_head_dim, p.q_lora_rank, p.attention_bias
        q = H * p.qk_head_dim
        lora = ql is not None
        return [
            Role("q_proj", (q, hid), not lora),
            Role("q_a_proj", (ql or 0, hid), lora),
            Role("q_a_bias", (ql or 0,), lora and b, ARRAY),
            Role("q_a_norm", (ql or 0,), lora, ARRAY),
            Role("q_b_proj", (q, ql or 0), lora),
            Role("kv_a_proj", (r + dr, hid)),
            Role("kv_a_bias", (r + dr,), b, ARRAY),
            Role("kv_a_norm", (r,), True, ARRAY),
            Role("kv_b_proj", (H * (p.qk_nope_head_dim + p.v_head_dim), r)),
            Role("o_proj", (hid, H * p.v_head_dim)),
            Role("o_bias", (hid,), b, ARRAY),
        ]

    def geometry(self, p: MlaParams) -> Geometry:
        return Geometry((latent_rows(p.latent_width),))

    def new_state(self, p: MlaParams):
        from ..exec.ops.mla import LatentRows

        return LatentRows(p.latent_width)

    def summary(self, p: MlaParams) -> dict:
        return {"heads": p.num_heads, "q_lora_rank": p.q_lora_rank, "kv_lora_rank": p.kv_lora_rank,
                "qk_nope_head_dim": p.qk_nope_head_dim, "qk_rope_head_dim": p.qk_rope_head_dim,
                "v_head_dim": p.v_head_dim, "rope": "none" if p.rope is None else ("yarn" if p.rope.yarn else "rope")}

    def preflight(self, p: MlaParams, where: str) -> None:
        for key, needed in (("kv_a_norm_eps", True), ("q_a_norm_eps", p.q_lora_rank is not None)):
            if needed and getattr(p, key) is None:
                norm = key.replace("_norm_eps", "_layernorm")
                raise UnsupportedOperator(
                    f"{where}: {key} is unjudged (null): the eps of {norm} is an architecture judgment of the family "
                    "(the reference builds it at its norm class default, which no config states); this build will not "
                    "lend it the layer's rms_norm_eps",
                    hint=f"re-encode the container from its checkpoint so that the mla operator records {key}",
                )
        try:
            kernel_geometry(p)
        except (ValueError, TypeError, GraphSchemaError) as e:
            raise UnsupportedOperator(f"{where}: the mla geometry is not executable: {e}") from None

    def bind(self, p: MlaParams, operands: dict) -> Kernel:
        return _Bound(p, operands)


register(Mla)
