"""Kimi Delta Attention (KDA) mixer numerics: chunked prefill and single-token decode, one
sequence, float32 end to end.

Semantics follow transformers 5.24.0 ``KimiLinearDeltaAttention`` (kimi_linear), its torch
fallback path (``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``; the fla
kernels are not installed), for one sequence. With ``H`` heads of ``D`` channels
(``key_dim = H·D``; keys and values have the same head width in this family):

1. ``q_proj``, ``k_proj``, ``v_proj`` [key_dim, hidden], no biases.
2. Each of q, k, v has its own causal depthwise conv (kernel ``K``, no bias; the checkpoint
   stores ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, transformers stacks them into one
   ``conv1d`` in that order) followed by SiLU (the config's ``hidden_act``; only silu runs).
3. Forget gate, per *channel*, not per head: ``g = -exp(A_log[h]) · softplus(f_b(f_a(x)) +
   dt_bias)`` of shape [H, D]. ``f_a_proj`` is [rank, hidden] and ``f_b_proj`` [key_dim,
   rank]; the inner rank is read from ``f_a_proj``'s shape into the geometry
   (``forget_rank``), never assumed to be D (the reference builds it at D; a checkpoint need
   not). The softplus is the reference's: ``x`` above 20, else ``log(1 + exp(x))``.
4. ``beta = sigmoid(b_proj(x))`` per head.
5. q and k L2-normalised per head, ``x / sqrt(sum(x²) + 1e-6)`` (the eps is the reference
   kernel's constant, carried as ``l2norm_eps``), then q scaled by ``D^-½``.
6. The recurrence per head, state ``S`` [D_k, D_v]:
   ``S ← diag(e^g) S``; ``S ← S + k ⊗ β(v − Sᵀk)``; ``o = Sᵀq``.
7. Output: RMS norm of ``o`` over D per head (eps ``norm_eps``, the layer's ``rms_norm_eps``)
   × ``o_norm`` [D] × ``sigmoid(g_b(g_a(x)))`` (sigmoid, not SiLU; ``g_a_proj`` [gate_rank,
   hidden], ``g_b_proj`` [key_dim, gate_rank]), then ``o_proj`` [hidden, key_dim].

Prefill runs the chunked form of 6 (chunks of ``chunk_size`` positions counted from the start
of the call, as the reference does; the last chunk may be short). Within a chunk with
cumulative log-decay ``Γᵢ = Σ_{t≤i} g_t`` (per channel):

* ``Lᵢⱼ = Σ_d β_i k_id k_jd e^{Γ_id − Γ_jd}`` (j < i) and ``Aᵢⱼ = Σ_d q_id k_jd e^{Γ_id − Γ_jd}``
  (j ≤ i): the decays enter only as differences Γᵢ − Γⱼ ≤ 0, so nothing overflows however
  strongly a channel decays;
* ``U = (I + L)⁻¹ βV`` and ``W = (I + L)⁻¹ (βK ⊙ e^Γ)`` by forward substitution (the
  reference inverts ``I + L`` by the same row recursion, then multiplies);
* then, from the state ``S`` carried between chunks, with BLAS products batched over heads:
  ``Vnew = U − W S``, ``O = (Q ⊙ e^Γ) S + A Vnew``,
  ``S ← diag(e^{Γ_last}) S + (K ⊙ e^{Γ_last − Γ})ᵀ Vnew``.

Γ is kept in float64 and only differences Γᵢ − Γⱼ (and Γᵢ itself) are rounded to float32
before the exponential. The reference rounds Γ itself to float32; over a chunk |Γ| reaches
tens to thousands, so its rounding (|Γ|·6e-8) turns into a relative error of the decays that
the position-by-position recurrence never has: measured on a 141-position fixture, the core
output of the reference's chunk form is 5.9e-7 from a float64 recurrence, this one 9.3e-8 (the
float32 recurrence: 6e-8). Prefill therefore agrees with decode more closely than the
reference's two paths agree with each other, and everything stored and returned stays float32.

The intra-chunk part is one compiled kernel (numba, fastmath off) over every (head, chunk),
its inner loops running over contiguous positions or channels so that they vectorise without
reassociating a sum; there is no Python loop over positions. Decode (``kda_step``) runs the
recurrence itself, one compiled pass over the state per token, as the reference's recurrent
path does for one token with a cache.

The state is float32 because the reference makes it so; that judgment is written once, in
the operator module (vindex3/operators/kda.py).

State parts (fixed size, rolled back by snapshot, never truncated):

* ``recurrent`` float32 [H, D, D] (keys × values);
* ``conv_q``, ``conv_k``, ``conv_v`` float32 [K − 1, key_dim] each: the last K − 1 raw
  projection rows, oldest first (the reference keeps K; the oldest of its K never reaches an
  output, so it is not kept).

kimi_linear checkpoints (``save_pretrained`` of transformers 5.24.0, which writes the
original hub layout back; recorded from a tiny random model with hidden 48, 3 layers
[linear, full, linear], linear heads H=2 of D=8, conv kernel 3, MLA heads 3 with
kv_lora_rank 20, qk_rope 6, qk_nope 10, v 14, q_lora_rank null, 4 experts of 24,
1 shared expert, intermediate 40, vocab 64). ``{i}`` is a layer, ``{e}`` an expert:

=====================================================  ==========================  =========
tensor                                                 shape                       layers
=====================================================  ==========================  =========
model.embed_tokens.weight                              [vocab, hidden]
lm_head.weight                                         [vocab, hidden]             untied
model.norm.weight                                      [hidden]
model.layers.{i}.input_layernorm.weight                [hidden]                    all
model.layers.{i}.post_attention_layernorm.weight       [hidden]                    all
model.layers.{i}.self_attn.q_proj.weight               [H·D, hidden]               KDA
model.layers.{i}.self_attn.k_proj.weight               [H·D, hidden]               KDA
model.layers.{i}.self_attn.v_proj.weight               [H·D, hidden]               KDA
model.layers.{i}.self_attn.q_conv1d.weight             [H·D, 1, K]                 KDA
model.layers.{i}.self_attn.k_conv1d.weight             [H·D, 1, K]                 KDA
model.layers.{i}.self_attn.v_conv1d.weight             [H·D, 1, K]                 KDA
model.layers.{i}.self_attn.f_a_proj.weight             [rank_f, hidden] (rank_f=D) KDA
model.layers.{i}.self_attn.f_b_proj.weight             [H·D, rank_f]               KDA
model.layers.{i}.self_attn.A_log                       [1, 1, H, 1]                KDA
model.layers.{i}.self_attn.dt_bias                     [H·D]                       KDA
model.layers.{i}.self_attn.b_proj.weight               [H, hidden]                 KDA
model.layers.{i}.self_attn.g_a_proj.weight             [rank_g, hidden] (rank_g=D) KDA
model.layers.{i}.self_attn.g_b_proj.weight             [H·D, rank_g]               KDA
model.layers.{i}.self_attn.o_norm.weight               [D]                         KDA
model.layers.{i}.self_attn.o_proj.weight               [hidden, H·D]               KDA
model.layers.{i}.self_attn.q_proj.weight               [Hm·(nope+rope), hidden]    MLA
model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight   [kv_lora_rank+rope, hidden] MLA
model.layers.{i}.self_attn.kv_a_layernorm.weight       [kv_lora_rank]              MLA
model.layers.{i}.self_attn.kv_b_proj.weight            [Hm·(nope+v), kv_lora_rank] MLA
model.layers.{i}.self_attn.o_proj.weight               [hidden, Hm·v]              MLA
model.layers.{i}.block_sparse_moe.gate_proj.weight     [intermediate, hidden]      dense
model.layers.{i}.block_sparse_moe.up_proj.weight       [intermediate, hidden]      dense
model.layers.{i}.block_sparse_moe.down_proj.weight     [hidden, intermediate]      dense
model.layers.{i}.block_sparse_moe.gate.weight          [E, hidden]                 sparse
model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias  [E]                sparse
model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight         [moe_inter, hidden]  sparse
model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight         [hidden, moe_inter]  sparse
model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight         [moe_inter, hidden]  sparse
model.layers.{i}.block_sparse_moe.shared_experts.gate_proj.weight  [moe_inter·S, hidden]
model.layers.{i}.block_sparse_moe.shared_experts.up_proj.weight    [moe_inter·S, hidden]
model.layers.{i}.block_sparse_moe.shared_experts.down_proj.weight  [hidden, moe_inter·S]
=====================================================  ==========================  =========

Notes for admission: the *dense* FFN of the first ``first_k_dense_replace`` layers is saved
under ``block_sparse_moe.`` too (transformers renames every ``.mlp.`` back to
``.block_sparse_moe.`` on save); w1 is the gate, w3 the up and w2 the down projection (loading
concatenates w1|w3 into ``experts.gate_up_proj`` [E, 2·moe_inter, hidden] and stacks w2 into
``experts.down_proj``); the forget-gate tensors sit under ``self_attn.`` on disk
(``self_attn.forget_gate.`` in memory); ``A_log`` is per head, ``dt_bias`` per channel; the
MLA layers of this family have no q_a/q_b tensors when ``q_lora_rank`` is null (with a rank
they carry ``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj`` as deepseek_v3 does) and no rope.
Shared experts are one MLP of width ``moe_intermediate_size · num_shared_experts``. No MTP
tensors appear in this family (``num_nextn_predict_layers`` 0 in the released configs).

kimi_linear config keys (transformers 5.24.0 ``KimiLinearConfig``; the saved spelling is the
one in the first column; aliases are read as the same attribute):

=============================  =================================  =================================
saved key                      aliases / source                   meaning and grade
=============================  =================================  =================================
hidden_size, vocab_size        -                                  read
num_hidden_layers              -                                  read
num_attention_heads            -                                  MLA heads
num_key_value_heads            -                                  must equal num_attention_heads
                                                                  (the reference's MLA expands
                                                                  kv_b to every head; other values
                                                                  crash it)
kv_lora_rank, q_lora_rank      -                                  MLA ranks (q null: q_proj path)
qk_nope_head_dim,              -                                  MLA widths
qk_rope_head_dim, v_head_dim
qk_head_dim                    derived (nope + rope) and saved    check equals nope + rope
head_dim                       derived (= qk_rope_head_dim!)      NOT the KDA head width; the hub
                                                                  config writes hidden/heads here
rms_norm_eps                   -                                  decoder norms and KDA o_norm eps;
                                                                  NOT the MLA kv_a/q_a eps (1e-6)
linear_attn_config.head_dim    -> linear_head_dim                 KDA D
linear_attn_config.num_heads   -> linear_num_heads                KDA H
linear_attn_config             -> linear_conv_kernel_dim          KDA K
  .short_conv_kernel_size
linear_attn_config.kda_layers  1-indexed layer numbers            -> layer_types "linear_attention"
linear_attn_config             1-indexed layer numbers            -> layer_types "full_attention"
  .full_attn_layers
layer_types                    wins over linear_attn_config       per layer; absent and no
                                                                  linear_attn_config: transformers
                                                                  defaults to full every 4th layer
                                                                  (i % 4 == 0, i > 0): a default,
                                                                  refuse rather than adopt
linear_head_dim,               saved flat copies                  must agree with linear_attn_config
linear_num_heads,
linear_conv_kernel_dim
hidden_act                     -                                  FFN act and the KDA conv act
                                                                  (silu only)
num_experts                    num_local_experts                  E
num_experts_per_token          num_experts_per_tok                top-k
num_shared_experts             n_shared_experts                   shared MLP width multiplier
moe_renormalize                norm_topk_prob                     renormalise top-k weights
num_expert_group               n_group                            routing groups
topk_group                     -                                  groups kept
routed_scaling_factor          -                                  multiplies routed weights
moe_intermediate_size          -                                  expert width
intermediate_size              -                                  dense FFN width
first_k_dense_replace          kwarg only (not a field)           -> mlp_layer_types dense/sparse;
                                                                  absent: transformers uses 1
mlp_layer_types                wins over first_k_dense_replace    per layer dense | sparse
model_max_length               max_position_embeddings            description only (no rope)
attention_bias                 -                                  q_a / kv_a / o biases of MLA
tie_word_embeddings            -                                  head tying
moe_router_activation_func     hub key, ignored by transformers   must be "sigmoid" (reference
                                                                  always uses sigmoid)
use_grouped_topk, moe_layer_   hub keys, ignored by transformers  must be true / 1 (reference
  freq, topk_method                                               routes grouped every layer;
                                                                  noaux_tc)
mla_use_nope                   hub key, ignored by transformers   must be true (reference MLA has
                                                                  no rope; false is refused)
mla_use_output_gate            hub key (Kimi K3), ignored         must be false/absent (no output
                                                                  gate in the reference)
rope_theta, rope_scaling       hub keys, ignored                  unused (no rope); carried
num_nextn_predict_layers       hub key, ignored                   must be 0 (no MTP tensors)
pad/bos/eos_token_id, dtype,   -                                  description
initializer_range, use_cache,
pretraining_tp, attention_
dropout, output_router_logits
=============================  =================================  =================================
"""

from __future__ import annotations

import math

import numba
import numpy as np

from vindex3.operators.base import check_operands
from vindex3.operators.kda import ROLES, KdaParams, KdaState, KdaWeights

from .checks import check_buffers, check_input
from .mamba2 import _exp_f32, _silu_f32

__all__ = [
    "KdaGeometry",
    "KdaState",
    "KdaWeights",
    "kda_prefill",
    "kda_step",
]

F32 = np.float32
_ONE = F32(1.0)
_SOFTPLUS_THRESHOLD = F32(20.0)  # the reference: x above 20 passes through unchanged


# The kernels take the operator's own params; KdaGeometry is their name at this level.
KdaGeometry = KdaParams


# --------------------------------------------------------------------------- checks


def _check(w: KdaWeights, g: KdaParams, state: KdaState) -> tuple[np.ndarray, np.ndarray]:
    """Validate operands and state; return (conv weight as [K, 3·key_dim], A_log as [H])."""
    ops = check_operands("kda", ROLES, w, g)
    check_buffers("kda", state, ((name, shape) for name, shape, _ in g.buffers()))
    cw_t = np.ascontiguousarray(np.concatenate([ops["q_conv"], ops["k_conv"], ops["v_conv"]], axis=0).T)  # [K, 3·key_dim]
    return cw_t, ops["A_log"]


# --------------------------------------------------------------------------- conv


@numba.njit(cache=True, error_model="numpy")
def _conv_silu(seq, cw_t, out):  # pragma: no cover - compiled
    """Causal depthwise conv + SiLU, no bias: ``seq`` [K − 1 + T, C] (the stored rows, then
    the T new ones), ``cw_t`` [K, C]; out[t, c] = silu(sum over k ascending of
    seq[t + k, c] · cw_t[k, c])."""
    T, C = out.shape
    K = cw_t.shape[0]
    for t in range(T):
        o = out[t]
        r = seq[t]
        w0 = cw_t[0]
        for c in range(C):
            o[c] = r[c] * w0[c]
        for k in range(1, K):
            r = seq[t + k]
            wk = cw_t[k]
            for c in range(C):
                o[c] += r[c] * wk[c]
        for c in range(C):
            o[c] = _silu_f32(o[c])


def _run_conv(state: KdaState, q: np.ndarray, k: np.ndarray, v: np.ndarray, cw_t: np.ndarray) -> np.ndarray:
    """q, k, v [T, key_dim] raw projections -> [T, 3·key_dim] after conv and SiLU; the three
    windows move forward."""
    T = q.shape[0]
    win = np.concatenate([state.conv_q, state.conv_k, state.conv_v], axis=1)  # [K-1, 3kd]
    seq = np.concatenate([win, np.concatenate([q, k, v], axis=1)], axis=0)  # [K-1+T, 3kd]
    out = np.empty((T, seq.shape[1]), F32)
    _conv_silu(seq, cw_t, out)
    kd = q.shape[1]
    keep = seq[T:] if state.conv_q.shape[0] else seq[:0]
    state.conv_q[...] = keep[:, :kd]
    state.conv_k[...] = keep[:, kd : 2 * kd]
    state.conv_v[...] = keep[:, 2 * kd :]
    return out


# --------------------------------------------------------------------------- elementwise


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return _ONE / (_ONE + np.exp(-z))


def _forget_gate(x: np.ndarray, w: KdaWeights, g: KdaParams, A_log: np.ndarray) -> np.ndarray:
    """g = -exp(A_log) · softplus(f_b(f_a(x)) + dt_bias), as [T, H, D] float32."""
    T = x.shape[0]
    z = (w.f_b_proj.mm(w.f_a_proj.mm(x)) + w.dt_bias).reshape(T, g.num_heads, g.head_dim)
    # the reference's softplus: log(1 + exp(z)) below the threshold, z above it
    sp = np.where(z > _SOFTPLUS_THRESHOLD, z, np.log(_ONE + np.exp(np.minimum(z, _SOFTPLUS_THRESHOLD))))
    return (-np.exp(A_log))[None, :, None] * sp


def _l2norm(x: np.ndarray, eps: np.float32) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + eps)


def _gated_norm(o: np.ndarray, gate: np.ndarray, weight: np.ndarray, eps: np.float32) -> np.ndarray:
    """RMS over the last axis (D), × weight, × sigmoid(gate)."""
    var = np.mean(o * o, axis=-1, keepdims=True)
    return (weight * (o * (_ONE / np.sqrt(var + eps)))) * _sigmoid(gate)


# --------------------------------------------------------------------------- recurrence


@numba.njit(cache=True)
def _kda_intra(q, k, v, g, beta, C, U, W, Aqk, qg, kd, glast):  # pragma: no cover - compiled
    """The intra-chunk half of the chunked delta rule, for every head and chunk.

    In: q, k, v, g [H, T, D] (q normalised and scaled, k normalised, g the log-decays),
    beta [H, T], chunk length C. Out, per chunk of positions [t0, t0 + n):
    U, W [H, T, D] = (I + L)⁻¹ βV and (I + L)⁻¹ (βK ⊙ e^Γ); Aqk [H, nC, C, C] the decayed
    q·k products (lower triangle incl. diagonal, zero above); qg = q ⊙ e^Γ,
    kd = k ⊙ e^{Γ_last − Γ}; glast [H, nC, D] = e^{Γ_last}."""
    H, T, D = k.shape
    Dv = v.shape[2]
    nC = (T + C - 1) // C
    gc = np.empty((C, D), np.float64)  # Γ, position-major
    gcT = np.empty((D, C), np.float64)  # Γ, channel-major (for loops over positions)
    kT = np.empty((D, C), np.float32)
    kb = np.empty((C, D), np.float32)
    L = np.zeros((C, C), np.float32)
    acc = np.empty(D, np.float64)
    kt = np.empty(C, np.float32)
    for h in range(H):
        for c in range(nC):
            t0 = c * C
            n = min(C, T - t0)
            # Γ: cumulative sum within the chunk, kept in float64 (see the module docstring)
            for d in range(D):
                acc[d] = 0.0
            for i in range(n):
                gi = g[h, t0 + i]
                gr = gc[i]
                for d in range(D):
                    acc[d] += gi[d]
                    gr[d] = acc[d]
            for i in range(n):
                b = beta[h, t0 + i]
                ki = k[h, t0 + i]
                for d in range(D):
                    kb[i, d] = ki[d] * b
                    gcT[d, i] = gc[i, d]
                    kT[d, i] = ki[d]
            # L (strictly lower) and Aqk (lower incl. diagonal); for a fixed row i the loop over
            # columns j is innermost, so each (i, j) sums its channels in ascending order
            A = Aqk[h, c]
            for i in range(n):
                Li = L[i]
                Ai = A[i]
                qi = q[h, t0 + i]
                for j in range(C):
                    Li[j] = 0.0
                    Ai[j] = 0.0
                for d in range(D):
                    gid = gc[i, d]
                    kbid = kb[i, d]
                    qid = qi[d]
                    gj = gcT[d]
                    kj = kT[d]
                    for j in range(i + 1):
                        kt[j] = kj[j] * _exp_f32(np.float32(gid - gj[j]))
                    for j in range(i):
                        Li[j] += kbid * kt[j]
                    for j in range(i + 1):
                        Ai[j] += qid * kt[j]
            for i in range(n, C):
                for j in range(C):
                    A[i, j] = 0.0
            # forward substitution with the unit lower-triangular I + L
            for i in range(n):
                b = beta[h, t0 + i]
                ui = U[h, t0 + i]
                wi = W[h, t0 + i]
                vi = v[h, t0 + i]
                for e in range(Dv):
                    ui[e] = vi[e] * b
                for d in range(D):
                    wi[d] = kb[i, d] * _exp_f32(np.float32(gc[i, d]))
                for j in range(i):
                    lij = L[i, j]
                    uj = U[h, t0 + j]
                    wj = W[h, t0 + j]
                    for e in range(Dv):
                        ui[e] -= lij * uj[e]
                    for d in range(D):
                        wi[d] -= lij * wj[d]
            last = gc[n - 1]
            for i in range(n):
                qi = q[h, t0 + i]
                ki = k[h, t0 + i]
                qgi = qg[h, t0 + i]
                kdi = kd[h, t0 + i]
                gi = gc[i]
                for d in range(D):
                    qgi[d] = qi[d] * _exp_f32(np.float32(gi[d]))
                    kdi[d] = ki[d] * _exp_f32(np.float32(last[d] - gi[d]))
            for d in range(D):
                glast[h, c, d] = _exp_f32(np.float32(last[d]))


def _chunked(q, k, v, g, beta, S, C: int) -> np.ndarray:
    """Chunked delta rule over T positions. q, k, v, g [T, H, D], beta [T, H]; S [H, D, D] is
    advanced in place. Returns o [T, H, D]."""
    T, H, D = k.shape
    qh = np.ascontiguousarray(q.transpose(1, 0, 2))
    kh = np.ascontiguousarray(k.transpose(1, 0, 2))
    vh = np.ascontiguousarray(v.transpose(1, 0, 2))
    gh = np.ascontiguousarray(g.transpose(1, 0, 2))
    bh = np.ascontiguousarray(beta.T)
    nC = (T + C - 1) // C
    U = np.empty_like(vh)
    W = np.empty_like(kh)
    Aqk = np.empty((H, nC, C, C), F32)
    qg = np.empty_like(qh)
    kd = np.empty_like(kh)
    glast = np.empty((H, nC, D), F32)
    _kda_intra(qh, kh, vh, gh, bh, C, U, W, Aqk, qg, kd, glast)

    o = np.empty_like(vh)
    s = S.copy()
    for c in range(nC):  # chunks, not positions: the state is carried between them
        a, b = c * C, min(T, (c + 1) * C)
        n = b - a
        v_new = U[:, a:b] - np.matmul(W[:, a:b], s)  # [H, n, Dv]
        o[:, a:b] = np.matmul(qg[:, a:b], s) + np.matmul(Aqk[:, c, :n, :n], v_new)
        s = s * glast[:, c, :, None] + np.matmul(kd[:, a:b].transpose(0, 2, 1), v_new)
    S[...] = s
    return o.transpose(1, 0, 2)


@numba.njit(cache=True)
def _kda_recurrent(S, q, k, v, g, beta, out):  # pragma: no cover - compiled
    """The recurrence itself, position by position, as the reference's recurrent path:
    S = S · e^g (per key row); m = Sᵀk; S += k ⊗ β(v − m); o = Sᵀq.
    S [H, D, Dv] in place; q, k, g [T, H, D]; v [T, H, Dv]; beta [T, H]; out [T, H, Dv]."""
    T, H, D = k.shape
    Dv = v.shape[2]
    m = np.empty(Dv, np.float32)
    for t in range(T):
        for h in range(H):
            Sh = S[h]
            kt = k[t, h]
            qt = q[t, h]
            gt = g[t, h]
            for e in range(Dv):
                m[e] = 0.0
            for a in range(D):
                ea = _exp_f32(gt[a])
                ka = kt[a]
                row = Sh[a]
                for e in range(Dv):
                    row[e] = row[e] * ea
                    m[e] += row[e] * ka
            b = beta[t, h]
            vt = v[t, h]
            for e in range(Dv):
                m[e] = (vt[e] - m[e]) * b
            ot = out[t, h]
            for e in range(Dv):
                ot[e] = 0.0
            for a in range(D):
                ka = kt[a]
                qa = qt[a]
                row = Sh[a]
                for e in range(Dv):
                    row[e] = row[e] + ka * m[e]
                    ot[e] += row[e] * qa


# --------------------------------------------------------------------------- mixer


def _mix(x: np.ndarray, w: KdaWeights, g: KdaParams, state: KdaState, chunked: bool) -> np.ndarray:
    cw_t, A_log = _check(w, g, state)
    T = x.shape[0]
    H, D, kdim = g.num_heads, g.head_dim, g.key_dim
    qkv = _run_conv(state, w.q_proj.mm(x), w.k_proj.mm(x), w.v_proj.mm(x), cw_t)
    eps = F32(g.l2norm_eps)
    q = _l2norm(qkv[:, :kdim].reshape(T, H, D), eps) * F32(1.0 / math.sqrt(D))
    k = _l2norm(qkv[:, kdim : 2 * kdim].reshape(T, H, D), eps)
    v = qkv[:, 2 * kdim :].reshape(T, H, D)
    decay = _forget_gate(x, w, g, A_log)
    beta = _sigmoid(w.b_proj.mm(x))
    if chunked:
        o = _chunked(q, k, v, decay, beta, state.recurrent, g.chunk_size)
    else:
        o = np.empty((T, H, D), F32)
        _kda_recurrent(
            state.recurrent,
            np.ascontiguousarray(q),
            np.ascontiguousarray(k),
            np.ascontiguousarray(v),
            np.ascontiguousarray(decay),
            np.ascontiguousarray(beta),
            o,
        )
    gate = w.g_b_proj.mm(w.g_a_proj.mm(x)).reshape(T, H, D)
    y = _gated_norm(o, gate, w.o_norm, F32(g.norm_eps))
    return w.o_proj.mm(y.reshape(T, kdim))


def kda_prefill(x: np.ndarray, w: KdaWeights, g: KdaParams, state: KdaState) -> np.ndarray:
    """Run the mixer over ``x`` [T, hidden] (the normed layer input) from ``state``, chunked;
    return [T, hidden] float32 and leave ``state`` where a following prefill or step continues
    (a prompt fed in several calls gives what one call gives, to rounding)."""
    check_input(x, 2, g.hidden_size, "kda_prefill")
    if x.shape[0] == 0:
        _check(w, g, state)
        return np.zeros((0, g.hidden_size), F32)
    return _mix(x, w, g, state, chunked=True)


def kda_step(x: np.ndarray, w: KdaWeights, g: KdaParams, state: KdaState) -> np.ndarray:
    """One token: ``x`` [hidden] -> [hidden] float32, advancing ``state`` in place by the
    recurrence itself (the reference's path for one token on a started cache)."""
    check_input(x, 1, g.hidden_size, "kda_step")
    return _mix(x[None], w, g, state, chunked=False)[0]
