"""Gated DeltaNet mixer numerics: prefill over a prompt and single-token decode, one sequence.

Semantics follow transformers 5.24.0 ``Qwen3NextGatedDeltaNet`` and ``Qwen3_5GatedDeltaNet``
(their torch fallback path: ``torch_chunk_gated_delta_rule`` for a call of several positions,
``torch_recurrent_gated_delta_rule`` for one position on a started cache), for one sequence,
float32 end to end. H_k key heads of width d_k, H_v value heads of width d_v, r = H_v / H_k.

1. Projections, in one of two on-disk layouts (``projection_layout``):

   * ``"qkvz_ba_grouped"`` (Qwen3-Next): ``in_proj_qkvz`` [2·key_dim + 2·value_dim, hidden]
     is grouped per key head: block j (of H_k) holds, in order, q_j [d_k], k_j [d_k], the
     values of its r value heads [r·d_v] and their z [r·d_v]. ``in_proj_ba`` [2·H_v, hidden]
     likewise: block j holds b of its r value heads [r], then a [r]. Value head h belongs to
     key head h // r (q and k are repeated to the value heads with ``repeat_interleave``).
   * ``"qkv_z_b_a"`` (Qwen3.5): ``in_proj_qkv`` [2·key_dim + value_dim, hidden] is already
     [q (all key heads) | k | v (all value heads)]; ``in_proj_z`` [value_dim, hidden],
     ``in_proj_b`` and ``in_proj_a`` [H_v, hidden].

   Both become the same conv input channels [q | k | v] (head-major inside each part), z
   [H_v, d_v], b and a [H_v]. A wrong grouping crashes nowhere: only parity catches it.
2. Causal depthwise conv over the conv_dim = 2·key_dim + value_dim channels (no bias in
   either family), kernel K, then SiLU. Its state is the last K raw inputs, oldest first,
   exactly what transformers' ``LinearAttentionLayer`` keeps.
3. β = sigmoid(b); g = −exp(A_log) · softplus(a + dt_bias) per value head (the log decay).
   q and k L2-normalised per head (x · rsqrt(Σx² + 1e-6)), q scaled by d_k^−½.
4. Delta rule per value head, state S [d_k, d_v]:
   S ← e^g S;  S ← S + k ⊗ β(v − Sᵀk);  o = Sᵀq.
   Prefill runs the chunked (WY / UT-transform) form with chunks of ``chunk_size`` (64 in
   the reference) counted from the first position of the call: per chunk, with γ the
   in-chunk cumulative sum of g and D[i, j] = exp(γ_i − γ_j) for j ≤ i (else 0),
       (I + strict_lower(diag(β) K Kᵀ ⊙ D)) [U | W] = [diag(β) V | diag(β e^γ) K]
       V' = U − W S;  O = (Q ⊙ e^γ) S + (Q Kᵀ ⊙ D) V';  S ← e^{γ_last} S + (K ⊙ e^{γ_last − γ})ᵀ V'.
   The unit lower-triangular solve is a compiled forward substitution; the products are
   batched BLAS over heads and chunks; the only Python loop is over chunks (the state
   dependence), never over positions. Decode runs the conv step (the prefill conv's
   arithmetic for one position, in place on the window) and the single-step recurrence above,
   each one compiled kernel. The two forms are one function up to float32 rounding; at the
   widths tested, the reference's own chunk and recurrent paths differ by up to ~7e-6 on
   outputs of size ~5, and this module's by as much (see the float64 test).
5. Gated RMSNorm per value head over d_v, norm first: o · rsqrt(mean(o²) + eps) · w · silu(z),
   where w is a *plain* weight (initialised to ones; not the (1 + w) of the decoder norms).
6. ``out_proj`` [hidden, value_dim].

State: ``recurrent`` [H_v, d_k, d_v] float32 and ``conv`` [conv_dim, K] float32, fixed size.
A snapshot is ``copy()``; a recurrence cannot be truncated.

Checkpoint facts for phase-B admission (transformers 5.24.0 ``save_pretrained`` of tiny random
models, float32; tests/test_gated_delta_kernels.py regenerates and checks every row below).
``P`` is ``model.`` for ``qwen3_next``, ``qwen3_5_text`` and ``qwen3_5_moe_text``, and
``model.language_model.`` for the released ``qwen3_5`` / ``qwen3_5_moe`` (vision-language)
checkpoints. Symbols: hidden, vocab, heads (num_attention_heads), kv_heads
(num_key_value_heads), head_dim, Hk (linear_num_key_heads), Hv (linear_num_value_heads), dk
(linear_key_head_dim), dv (linear_value_head_dim), K (linear_conv_kernel_dim), I
(intermediate_size), E (num_experts), Im (moe_intermediate_size), Is
(shared_expert_intermediate_size). ``(1+w)`` marks a zero-centred RMSNorm weight (applied as
1 + w, initialised to zeros).

    tensor (L = layer, e = expert)                    shape                        families
    P.embed_tokens.weight                             [vocab, hidden]              all
    P.norm.weight  (1+w)                              [hidden]                     all
    lm_head.weight  (absent iff tie_word_embeddings)  [vocab, hidden]              all
    P.layers.L.input_layernorm.weight  (1+w)          [hidden]                     all
    P.layers.L.post_attention_layernorm.weight  (1+w) [hidden]                     all
    -- linear_attention layers
    P.layers.L.linear_attn.in_proj_qkvz.weight        [2*Hk*dk + 2*Hv*dv, hidden]  next
    P.layers.L.linear_attn.in_proj_ba.weight          [2*Hv, hidden]               next
    P.layers.L.linear_attn.in_proj_qkv.weight         [2*Hk*dk + Hv*dv, hidden]    3.5
    P.layers.L.linear_attn.in_proj_z.weight           [Hv*dv, hidden]              3.5
    P.layers.L.linear_attn.in_proj_b.weight           [Hv, hidden]                 3.5
    P.layers.L.linear_attn.in_proj_a.weight           [Hv, hidden]                 3.5
    P.layers.L.linear_attn.conv1d.weight              [2*Hk*dk + Hv*dv, 1, K]      all
    P.layers.L.linear_attn.A_log                      [Hv]                         all
    P.layers.L.linear_attn.dt_bias                    [Hv]                         all
    P.layers.L.linear_attn.norm.weight  (plain w)     [dv]                         all
    P.layers.L.linear_attn.out_proj.weight            [hidden, Hv*dv]              all
    -- full_attention layers (gated attention)
    P.layers.L.self_attn.q_proj.weight                [2*heads*head_dim, hidden]   all
    P.layers.L.self_attn.k_proj.weight                [kv_heads*head_dim, hidden]  all
    P.layers.L.self_attn.v_proj.weight                [kv_heads*head_dim, hidden]  all
    P.layers.L.self_attn.o_proj.weight                [hidden, heads*head_dim]     all
    P.layers.L.self_attn.q_norm.weight  (1+w)         [head_dim]                   all
    P.layers.L.self_attn.k_norm.weight  (1+w)         [head_dim]                   all
    -- dense FFN (qwen3_5_text, qwen3_5; qwen3_next layers that are not sparse)
    P.layers.L.mlp.gate_proj.weight                   [I, hidden]                  dense
    P.layers.L.mlp.up_proj.weight                     [I, hidden]                  dense
    P.layers.L.mlp.down_proj.weight                   [hidden, I]                  dense
    -- routed experts (qwen3_next sparse layers, qwen3_5_moe_text, qwen3_5_moe)
    P.layers.L.mlp.gate.weight  (router)              [E, hidden]                  moe
    P.layers.L.mlp.experts.e.gate_proj.weight         [Im, hidden]                 moe
    P.layers.L.mlp.experts.e.up_proj.weight           [Im, hidden]                 moe
    P.layers.L.mlp.experts.e.down_proj.weight         [hidden, Im]                 moe
    P.layers.L.mlp.shared_expert.gate_proj.weight     [Is, hidden]                 moe
    P.layers.L.mlp.shared_expert.up_proj.weight       [Is, hidden]                 moe
    P.layers.L.mlp.shared_expert.down_proj.weight     [hidden, Is]                 moe
    P.layers.L.mlp.shared_expert_gate.weight          [1, hidden]                  moe

Notes on the table:

* q_proj rows are grouped per head: rows [2·h·head_dim, 2·h·head_dim + head_dim) are the
  query of head h, the next head_dim rows its gate (transformers views the output as
  [heads, 2·head_dim] and chunks the last axis).
* ``attention_bias: true`` adds q/k/v/o_proj ``.bias``; every saved config here says false.
* Experts are saved one tensor per expert and matrix (``experts.e.gate_proj``...), although
  the loaded module holds fused ``gate_up_proj`` [E, 2·Im, hidden] / ``down_proj`` [E,
  hidden, Im]: save_pretrained splits them back to the checkpoint spelling.
* qwen3_next picks the FFN per layer: sparse iff L not in ``mlp_only_layers`` and
  num_experts > 0 and (L + 1) % ``decoder_sparse_step`` == 0, else dense with ``I``.
  qwen3_5_moe_text layers are always sparse; qwen3_5_text always dense.
* The VL checkpoints (``qwen3_5``, ``qwen3_5_moe``) also carry the vision tower under
  ``model.visual.`` (``patch_embed.proj`` [vh, 3, temporal_patch, patch, patch] + bias,
  ``pos_embed.weight``, ``blocks.i.{norm1,norm2}`` LayerNorm weight+bias,
  ``blocks.i.attn.{qkv,proj}``, ``blocks.i.mlp.{linear_fc1,linear_fc2}`` with biases,
  ``merger.{norm,linear_fc1,linear_fc2}``): a perception component, carried and not executed.
* Released checkpoints also hold ``mtp.*`` tensors (a multi-token-prediction head);
  transformers ignores them on load (``_keys_to_ignore_on_load_unexpected``) and
  save_pretrained never writes them. Admission must classify them, not drop them silently.

Config keys (saved by transformers 5.24.0; the qwen3_5 / qwen3_5_moe VL configs nest the text
keys under ``text_config`` and add ``vision_config`` and the image/video token ids):

* Shared: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
  head_dim (explicit; class default 256, never hidden / heads), hidden_act (the conv and FFN
  activation, "silu"), rms_norm_eps (every RMSNorm, the gated one included),
  attention_bias, attention_dropout, max_position_embeddings, tie_word_embeddings,
  vocab_size, linear_conv_kernel_dim, linear_key_head_dim, linear_value_head_dim,
  linear_num_key_heads, linear_num_value_heads, layer_types, rope_parameters
  {rope_type, rope_theta, partial_rotary_factor}.
* ``layer_types`` ("linear_attention" | "full_attention") is always written on save. A
  config without it is expanded by transformers from ``full_attention_interval`` (default
  4: layer L is full iff (L + 1) % interval == 0). A config with neither gets that default in
  transformers; admission refuses it by name instead.
* ``partial_rotary_factor``: reference default 0.25 (``kwargs.setdefault``), moved into
  ``rope_parameters`` by transformers; legacy configs state it (and rope_theta) at top level.
  Rotary dims = int(head_dim · factor), rotate-half on the first rotary dims only.
  qwen3_5 / qwen3_5_moe text configs may carry ``mrope_section`` / ``mrope_interleaved`` in
  rope_parameters (multimodal RoPE): for text-only positions the three position streams are
  equal and the result is the plain RoPE above.
* qwen3_next adds: intermediate_size, decoder_sparse_step, mlp_only_layers, num_experts,
  num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
  norm_topk_prob, output_router_logits, router_aux_loss_coef.
  qwen3_5_moe_text adds the same MoE keys except decoder_sparse_step, mlp_only_layers and
  norm_topk_prob (no intermediate_size). qwen3_5_text adds intermediate_size only.
* Norm conventions: input/post-attention/final norms and q_norm/k_norm are zero-centred,
  x · rsqrt(mean(x²) + eps) · (1 + w), computed in float32; the gated norm inside the linear
  layer uses a plain w.
"""

from __future__ import annotations

import numba
import numpy as np

from vindex3.errors import ClosureError
from vindex3.operators.gated_delta import (
    LAYOUT_GROUPED,
    LAYOUT_SPLIT,
    GatedDeltaParams,
    GatedDeltaState,
    GatedDeltaWeights,
)

from .checks import check_buffers, check_input, conv_2d, expect_array, expect_weight
from .mamba2 import _causal_conv_silu, _exp_f32, _silu_f32

__all__ = [
    "LAYOUT_GROUPED",
    "LAYOUT_SPLIT",
    "GatedDeltaGeometry",
    "GatedDeltaState",
    "GatedDeltaWeights",
    "gated_delta_prefill",
    "gated_delta_step",
]

F32 = np.float32
_NO_BIAS = np.zeros(1, F32)

_LAYOUT_FIELDS = {
    LAYOUT_GROUPED: ("in_proj_qkvz", "in_proj_ba"),
    LAYOUT_SPLIT: ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
}

# The kernels take the operator's own params; GatedDeltaGeometry builds them from the facts a
# kernel caller states (the written-out widths computed).
GatedDeltaGeometry = GatedDeltaParams.kernel_facts


# --------------------------------------------------------------------------- checks


def _conv_weight_2d(w: GatedDeltaWeights) -> np.ndarray:
    return conv_2d(w.conv_weight)


def _check(w: GatedDeltaWeights, g: GatedDeltaParams, state: GatedDeltaState) -> np.ndarray:
    """Validate operands and state against the geometry; return the 2-D conv weight."""
    defects: list[str] = []
    wanted = g.projections()
    for layout, fields in _LAYOUT_FIELDS.items():
        for f in fields:
            if layout == g.projection_layout:
                expect_weight(f, getattr(w, f), wanted[f], defects)
            elif getattr(w, f) is not None:
                defects.append(
                    f"{f}: present, but the geometry declares the {g.projection_layout!r} "
                    f"projection layout (which reads {', '.join(wanted)})"
                )
    expect_weight("out_proj", w.out_proj, (g.hidden_size, g.value_dim), defects)
    cw = _conv_weight_2d(w)
    expect_array("conv_weight", cw, (g.conv_dim, g.conv_kernel), defects)
    expect_array("A_log", w.A_log, (g.num_value_heads,), defects)
    expect_array("dt_bias", w.dt_bias, (g.num_value_heads,), defects)
    expect_array("norm_weight", w.norm_weight, (g.value_head_dim,), defects)
    if defects:
        raise ClosureError("gated_delta operands do not match the layer geometry", defects)

    check_buffers("gated_delta", state, ((name, shape) for name, shape, _ in g.buffers()), contiguous=True)
    return cw


# --------------------------------------------------------------------------- projections


def _project(x: np.ndarray, w: GatedDeltaWeights, g: GatedDeltaParams):
    """x [T, hidden] -> qkv [T, conv_dim] (channels [q | k | v]), z [T, Hv, dv], b and a
    [T, Hv], whatever the on-disk layout."""
    T = x.shape[0]
    nk, nv, dk, dv, r = (
        g.num_key_heads,
        g.num_value_heads,
        g.key_head_dim,
        g.value_head_dim,
        g.heads_per_key,
    )
    if g.projection_layout == LAYOUT_GROUPED:
        p = w.in_proj_qkvz.mm(x).reshape(T, nk, 2 * dk + 2 * r * dv)
        qkv = np.empty((T, g.conv_dim), F32)
        qkv[:, : g.key_dim].reshape(T, nk, dk)[...] = p[:, :, :dk]
        qkv[:, g.key_dim : 2 * g.key_dim].reshape(T, nk, dk)[...] = p[:, :, dk : 2 * dk]
        qkv[:, 2 * g.key_dim :].reshape(T, nk, r * dv)[...] = p[:, :, 2 * dk : 2 * dk + r * dv]
        z = p[:, :, 2 * dk + r * dv :].reshape(T, nv, dv)
        ba = w.in_proj_ba.mm(x).reshape(T, nk, 2 * r)
        b = ba[:, :, :r].reshape(T, nv)
        a = ba[:, :, r:].reshape(T, nv)
        return qkv, z, b, a
    qkv = w.in_proj_qkv.mm(x)
    z = w.in_proj_z.mm(x).reshape(T, nv, dv)
    return qkv, z, w.in_proj_b.mm(x), w.in_proj_a.mm(x)


def _run_conv(state_conv: np.ndarray, qkv: np.ndarray, cw: np.ndarray) -> np.ndarray:
    """Causal depthwise conv + SiLU over ``qkv`` [T, conv_dim] after the stored inputs; moves
    the stored window forward and returns [T, conv_dim]."""
    T = qkv.shape[0]
    seq = np.concatenate([state_conv.T, qkv], axis=0)  # [K + T, conv_dim]
    out = np.empty(qkv.shape, F32)
    _causal_conv_silu(seq, np.ascontiguousarray(cw.T), _NO_BIAS, False, out)
    state_conv[...] = seq[T:].T
    return out


@numba.njit(cache=True, error_model="numpy")
def _conv_step_silu(state, x, cw, out):  # pragma: no cover - compiled
    """One position, in place: each channel's window state[c] [K] (oldest first) moves on by
    x[c], then out[c] = silu(sum over k ascending of window[k] * cw[c, k]): the arithmetic of
    the prefill kernel for T = 1, so a step continues a prefill bit for bit."""
    C, K = state.shape
    for c in range(C):
        s = state[c]
        wc = cw[c]
        for k in range(K - 1):
            s[k] = s[k + 1]
        s[K - 1] = x[c]
        acc = s[0] * wc[0]
        for k in range(1, K):
            acc += s[k] * wc[k]
        out[c] = _silu_f32(acc)


def _beta_and_decay(b: np.ndarray, a: np.ndarray, w: GatedDeltaWeights):
    """β = sigmoid(b) and g = −exp(A_log)·softplus(a + dt_bias), both [T, Hv] float32."""
    beta = F32(1.0) / (F32(1.0) + np.exp(-b))
    u = a + w.dt_bias
    # torch's softplus: u above 20 is returned as is, else log1p(exp(u))
    sp = np.where(u > F32(20.0), u, np.log1p(np.exp(np.minimum(u, F32(20.0)))))
    g = -np.exp(w.A_log) * sp
    return beta.astype(F32, copy=False), g.astype(F32, copy=False)


# --------------------------------------------------------------------------- gated norm


@numba.njit(cache=True, error_model="numpy")
def _gated_norm_kernel(o, z, weight, eps, out):  # pragma: no cover - compiled
    """o [Hv, T, dv] (the delta-rule output, heads first), z [T, Hv, dv] -> out [T, Hv*dv]:
    per head o * rsqrt(mean(o^2) + eps) * weight * silu(z), the mean accumulated in float64."""
    H, T, D = o.shape
    for t in range(T):
        for h in range(H):
            oh = o[h, t]
            zh = z[t, h]
            acc = 0.0
            for i in range(D):
                acc += np.float64(oh[i]) * np.float64(oh[i])
            rs = np.float32(1.0 / np.sqrt(acc / D + eps))
            base = h * D
            for i in range(D):
                out[t, base + i] = ((oh[i] * rs) * weight[i]) * _silu_f32(zh[i])


def _gated_norm(o: np.ndarray, z: np.ndarray, w: GatedDeltaWeights, g: GatedDeltaParams):
    T = z.shape[0]
    out = np.empty((T, g.value_dim), F32)
    _gated_norm_kernel(o, z, w.norm_weight, g.norm_eps, out)
    return out


# --------------------------------------------------------------------------- q/k norm


def _l2norm(x: np.ndarray, eps: float) -> np.ndarray:
    """x [..., d] * rsqrt(sum(x^2) + eps), float32."""
    ss = np.einsum("...i,...i->...", x, x)[..., None]
    return x * (F32(1.0) / np.sqrt(ss + F32(eps)))


# --------------------------------------------------------------------------- chunked form


@numba.njit(cache=True, error_model="numpy")
def _chunk_matrices(KK, QK, gc, beta, r, TV, TK, attn):  # pragma: no cover - compiled
    """The per-chunk C x C matrices, for every value head h (key head h // r) and chunk n:
        D[i, j]   = exp(gc_i - gc_j) for j <= i (the decay from position j to i), else 0
        L[i, j]   = beta_i * KK[i, j] * D[i, j] for j < i
        X         = (I + L)^-1 by forward substitution (unit lower triangular)
        TV[i, j]  = X[i, j] * beta_j             so that TV @ V = X diag(beta) V
        TK[i, j]  = X[i, j] * beta_j * e^gc_j    so that TK @ K = X diag(beta e^gc) K
        attn[i,j] = QK[i, j] * D[i, j], lower triangle with its diagonal.
    KK, QK [Hk, N, C, C]; gc, beta [Hv, N, C]; TV, TK, attn [Hv, N, C, C] (written whole)."""
    Hv, N, C = gc.shape
    L = np.empty((C, C), np.float32)
    zero = np.float32(0.0)
    for h in range(Hv):
        hk = h // r
        for n in range(N):
            g = gc[h, n]
            b = beta[h, n]
            kk = KK[hk, n]
            qk = QK[hk, n]
            X = TV[h, n]
            A = attn[h, n]
            for i in range(C):
                gi = g[i]
                for j in range(i + 1):
                    d = _exp_f32(gi - g[j])
                    A[i, j] = qk[i, j] * d
                    L[i, j] = (b[i] * kk[i, j]) * d
                for j in range(i + 1, C):
                    A[i, j] = zero
            # X row i = e_i - sum_{j < i} L[i, j] X[j]; row j of X is zero beyond column j
            for i in range(C):
                xi = X[i]
                for c in range(C):
                    xi[c] = zero
                xi[i] = np.float32(1.0)
                for j in range(i):
                    lij = L[i, j]
                    xj = X[j]
                    for c in range(j + 1):
                        xi[c] -= lij * xj[c]
            Y = TK[h, n]
            for i in range(C):
                for j in range(i + 1):
                    x = X[i, j] * b[j]
                    X[i, j] = x
                    Y[i, j] = x * _exp_f32(g[j])
                for j in range(i + 1, C):
                    Y[i, j] = zero


@numba.njit(cache=True, error_model="numpy")
def _decayed_qk(qh, kh, gc, r, qd, kdT):  # pragma: no cover - compiled
    """qd[h, n] = q * e^gc (rows), kdT[h, n] = (k * e^(gc_last - gc))^T, per value head h from
    key head h // r. qh, kh [Hk, N, C, dk]; gc [Hv, N, C]; qd [Hv, N, C, dk]; kdT [Hv, N, dk, C]."""
    Hv, N, C = gc.shape
    dk = qh.shape[3]
    for h in range(Hv):
        hk = h // r
        for n in range(N):
            g = gc[h, n]
            last = g[C - 1]
            for i in range(C):
                eq = _exp_f32(g[i])
                ek = _exp_f32(last - g[i])
                qi = qh[hk, n, i]
                ki = kh[hk, n, i]
                qo = qd[h, n, i]
                for c in range(dk):
                    qo[c] = qi[c] * eq
                    kdT[h, n, c, i] = ki[c] * ek


def _heads_first(x: np.ndarray, n_chunks: int, C: int) -> np.ndarray:
    """[T, H, d] -> [H, N, C, d], zero-padded at the end (padding is inert: k = v = 0, beta = 0,
    g = 0 leave the state and every real position untouched)."""
    T, H, d = x.shape
    out = np.zeros((H, n_chunks * C, d), F32)
    out[:, :T] = x.transpose(1, 0, 2)
    return out.reshape(H, n_chunks, C, d)


def _chunked_delta_rule(
    q: np.ndarray,  # [T, Hk, dk] normalised and scaled
    k: np.ndarray,  # [T, Hk, dk] normalised
    v: np.ndarray,  # [T, Hv, dv]
    beta: np.ndarray,  # [T, Hv]
    gl: np.ndarray,  # [T, Hv] log decay
    S: np.ndarray,  # [Hv, dk, dv], advanced in place
    C: int,
) -> np.ndarray:
    """The chunked gated delta rule from state S; returns o [Hv, T, dv]."""
    T, nk, dk = k.shape
    nv, dv = v.shape[1], v.shape[2]
    r = nv // nk
    N = -(-T // C)
    Tp = N * C

    qh = _heads_first(q, N, C)  # [Hk, N, C, dk]
    kh = _heads_first(k, N, C)
    vh = _heads_first(v, N, C)  # [Hv, N, C, dv]
    bh = np.zeros((nv, Tp), F32)
    bh[:, :T] = beta.T
    gh = np.zeros((nv, Tp), F32)
    gh[:, :T] = gl.T
    gc = np.cumsum(gh.reshape(nv, N, C), axis=-1, dtype=F32)  # in-chunk cumulative log decay

    # q.k and k.k inside each chunk, once per key head
    kt = kh.swapaxes(-1, -2)
    KK = np.matmul(kh, kt)  # [Hk, N, C, C]
    QK = np.matmul(qh, kt)
    TV = np.empty((nv, N, C, C), F32)
    TK = np.empty((nv, N, C, C), F32)
    attn = np.empty((nv, N, C, C), F32)
    _chunk_matrices(KK, QK, gc, bh.reshape(nv, N, C), r, TV, TK, attn)

    # U = (I + L)^-1 diag(beta) V and W = (I + L)^-1 diag(beta e^gc) K, per value head; the
    # key operand is shared by the r value heads of a key head (broadcast, not copied)
    U = np.matmul(TV, vh)  # [Hv, N, C, dv]
    Wk = np.matmul(TK.reshape(nk, r, N, C, C), kh[:, None]).reshape(nv, N, C, dk)
    qd = np.empty((nv, N, C, dk), F32)
    kdT = np.empty((nv, N, dk, C), F32)
    _decayed_qk(qh, kh, gc, r, qd, kdT)
    cd = np.exp(gc[..., -1])[..., None, None]  # [Hv, N, 1, 1] decay over a whole chunk

    # the state dependence: one step per chunk, never per position
    WQ = np.concatenate([Wk, qd], axis=2)  # [Hv, N, 2C, dk]: one product with S for both
    vn = np.empty((nv, N, C, dv), F32)
    out = np.empty((nv, N, C, dv), F32)
    s = S
    for n in range(N):
        x = np.matmul(WQ[:, n], s)  # [Hv, 2C, dv]
        np.subtract(U[:, n], x[:, :C], out=vn[:, n])
        out[:, n] = x[:, C:]
        s = s * cd[:, n] + np.matmul(kdT[:, n], vn[:, n])
    S[...] = s
    out += np.matmul(attn, vn)  # the in-chunk part, all chunks at once
    return out.reshape(nv, Tp, dv)[:, :T]


# --------------------------------------------------------------------------- recurrent form


@numba.njit(cache=True, error_model="numpy")
def _recurrent_kernel(qkv, beta, gl, S, nk, dk, eps, scale, out):  # pragma: no cover - compiled
    """The single-step recurrence over T positions (in order), from and into S [Hv, dk, dv]:
    qkv [T, conv_dim] (after conv + SiLU), beta and gl [T, Hv], out [Hv, T, dv]. Per key head
    q and k are L2-normalised (sums in float64), q scaled; per value head
        S *= e^g;  u = beta (v - S^T k);  S += k u^T;  o = S^T q."""
    T = qkv.shape[0]
    nv, _, dv = S.shape
    r = nv // nk
    kd = nk * dk
    qn = np.empty(dk, np.float32)
    kn = np.empty(dk, np.float32)
    u = np.empty(dv, np.float32)
    for t in range(T):
        row = qkv[t]
        for h in range(nv):
            hk = h // r
            if h % r == 0:
                aq = 0.0
                ak = 0.0
                for i in range(dk):
                    qv = row[hk * dk + i]
                    kv = row[kd + hk * dk + i]
                    aq += np.float64(qv) * np.float64(qv)
                    ak += np.float64(kv) * np.float64(kv)
                rq = np.float32(1.0 / np.sqrt(aq + eps))
                rk = np.float32(1.0 / np.sqrt(ak + eps))
                for i in range(dk):
                    qn[i] = (row[hk * dk + i] * rq) * scale
                    kn[i] = row[kd + hk * dk + i] * rk
            decay = _exp_f32(gl[t, h])
            b = beta[t, h]
            Sh = S[h]
            vbase = 2 * kd + h * dv
            for j in range(dv):
                u[j] = 0.0
            for i in range(dk):
                si = Sh[i]
                ki = kn[i]
                for j in range(dv):
                    s = si[j] * decay
                    si[j] = s
                    u[j] += s * ki
            for j in range(dv):
                u[j] = (row[vbase + j] - u[j]) * b
            o = out[h, t]
            for j in range(dv):
                o[j] = 0.0
            for i in range(dk):
                si = Sh[i]
                ki = kn[i]
                qi = qn[i]
                for j in range(dv):
                    s = si[j] + ki * u[j]
                    si[j] = s
                    o[j] += s * qi


# --------------------------------------------------------------------------- prefill


def gated_delta_prefill(
    x: np.ndarray, w: GatedDeltaWeights, g: GatedDeltaParams, state: GatedDeltaState
) -> np.ndarray:
    """Run the mixer over ``x`` [T, hidden] (the normed layer input) from ``state``, in the
    chunked form; return [T, hidden] float32 and leave ``state`` where a following prefill or
    step continues. Works from a zero state and from one left by an earlier call."""
    check_input(x, 2, g.hidden_size, "gated_delta_prefill")
    cw = _check(w, g, state)
    T = x.shape[0]
    if T == 0:
        return np.zeros((0, g.hidden_size), F32)
    nk, nv, dk, dv = g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim

    qkv, z, b, a = _project(x, w, g)
    mixed = _run_conv(state.conv, qkv, cw)
    q = _l2norm(mixed[:, : g.key_dim].reshape(T, nk, dk), g.qk_l2norm_eps)
    q *= F32(dk**-0.5)
    k = _l2norm(mixed[:, g.key_dim : 2 * g.key_dim].reshape(T, nk, dk), g.qk_l2norm_eps)
    v = mixed[:, 2 * g.key_dim :].reshape(T, nv, dv)
    beta, gl = _beta_and_decay(b, a, w)

    o = _chunked_delta_rule(q, k, v, beta, gl, state.recurrent, g.chunk_size)
    return w.out_proj.mm(_gated_norm(o, z, w, g))


# --------------------------------------------------------------------------- step


def gated_delta_step(
    x: np.ndarray, w: GatedDeltaWeights, g: GatedDeltaParams, state: GatedDeltaState
) -> np.ndarray:
    """One token: ``x`` [hidden] -> [hidden] float32, advancing ``state`` in place with the
    single-step recurrence (transformers' path for one token on a started cache)."""
    check_input(x, 1, g.hidden_size, "gated_delta_step")
    cw = _check(w, g, state)
    qkv, z, b, a = _project(x[None], w, g)
    mixed = np.empty(qkv.shape, F32)
    _conv_step_silu(state.conv, qkv[0], cw, mixed[0])
    beta, gl = _beta_and_decay(b, a, w)
    o = np.empty((g.num_value_heads, 1, g.value_head_dim), F32)
    _recurrent_kernel(
        mixed,
        beta,
        gl,
        state.recurrent,
        g.num_key_heads,
        g.key_head_dim,
        g.qk_l2norm_eps,
        F32(g.key_head_dim**-0.5),
        o,
    )
    return w.out_proj.mm(_gated_norm(o, z, w, g))[0]
