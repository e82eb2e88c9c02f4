"""Routers of the routed-expert FFN: which k of E experts each position uses, and with what
weight. Pure functions of float32 router logits, one per routing rule the released families
use, written after transformers 5.24.0 (the reference on torch 2.13.0 CPU):

``softmax_topk``        p = softmax(logits) over all E; top-k of p; optionally w /= sum(w).
                        qwen3_moe (``norm_topk_prob``), olmoe (``norm_topk_prob``, off by
                        default), mixtral (always renormalised), qwen3_next / qwen2_moe.
``topk_softmax``        top-k of the raw logits; w = softmax over those k values.
                        granitemoehybrid; gpt_oss (whose logits carry a router bias).
``sigmoid_group_topk``  s = sigmoid(logits); c = s + e_score_correction_bias (selection only);
                        per group of E / n_group experts the sum of its two best c; keep the
                        topk_group best groups, mask the others' c to -inf; top-k of c
                        (unsorted); w = s at those experts (never c); if renormalising
                        w /= (sum(w) + 1e-20); w *= routed_scaling_factor.
                        deepseek_v3, and kimi_linear, whose router in transformers 5.24 is the
                        same code line for line (its hub config key ``moe_router_activation_func``
                        is not read by transformers; the sigmoid is fixed).

Every top-k goes through ``moe_topk`` and breaks ties as torch.topk does, including the
partition order of ``sorted=False`` (it decides the order of the renormalisation sum). Sums of
the k weights use torch's own float32 reduction order (``ref_sum_lastdim``), so renormalised
weights agree with the reference bit for bit whenever the probabilities do. Softmax is
exp(x - max) times the reciprocal of the sum, as torch's CPU kernel computes it; its exp and
that sum are NumPy's, which can differ from torch's vectorised ones in the last bit (measured:
probabilities within 6e-7 relative), so a tie between probabilities is reproduced exactly
when the logits tie exactly, not when two different logits round to one probability.

Each router returns ``(weights float32 [T, k], experts int64 [T, k])`` in the reference's
order; the logits come from ``router_logits``.
"""

from __future__ import annotations

import numpy as np

from .moe_topk import topk_rows

__all__ = [
    "ref_sum_lastdim",
    "router_logits",
    "sigmoid",
    "sigmoid_group_topk",
    "softmax_lastdim",
    "softmax_topk",
    "topk_softmax",
]

F32 = np.float32
_ONE = F32(1.0)
_RENORM_EPS = F32(1e-20)  # deepseek_v3 / kimi_linear add it to the renormalisation denominator
_VEC = 8  # float lanes of torch's CPU sum kernel (its Vectorized<float> in the reduction)
_ILP = 4  # partial sums torch's row_sum keeps side by side


def router_logits(x: np.ndarray, weight, bias=None) -> np.ndarray:
    """x [T, hidden] float32 -> x @ W.T (+ b) [T, E] float32; ``weight`` is a weight object
    [E, hidden], ``bias`` a weight object [E] or None."""
    logits = weight.mm(x)
    if bias is not None:
        logits = logits + bias.dense()
    return logits


def softmax_lastdim(x: np.ndarray) -> np.ndarray:
    """torch.softmax(x, dim=-1) in float32: exp(x - max), then times 1 / sum (torch's CPU
    kernel multiplies by the reciprocal). The sum is NumPy's (torch's vectorised reduce_all
    tree is not reproduced: its exp already differs from NumPy's in the last bit)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e * (_ONE / e.sum(axis=-1, dtype=F32, keepdims=True))


def sigmoid(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return _ONE / (_ONE + np.exp(-x))


def _row_sum(cols: list[np.ndarray], zero: np.ndarray) -> np.ndarray:
    """torch's ``row_sum``: four interleaved partial sums over the whole groups of four, the
    leftover elements into the first, then the first plus the other three in order. ``cols``
    are the summands (any broadcastable shape), in memory order."""
    n = len(cols)
    whole = n // _ILP
    parts = [zero.copy() for _ in range(_ILP)]
    for i in range(whole):
        for j in range(_ILP):
            parts[j] = parts[j] + cols[i * _ILP + j]
    for i in range(whole * _ILP, n):
        parts[0] = parts[0] + cols[i]
    acc = parts[0]
    for j in range(1, _ILP):
        acc = acc + parts[j]
    return acc


def ref_sum_lastdim(a: np.ndarray) -> np.ndarray:
    """``a.sum(dim=-1)`` for a contiguous float32 array, adding in the order torch's CPU sum
    kernel adds (SumKernel's cascade_sum), so the rounding is the reference's: fewer than 8
    elements go through ``row_sum``; otherwise whole 8-lane vectors go through ``row_sum``
    lane-wise, and the result is 0 + the leftover elements + lanes 0..7 in order. Exact for
    rows shorter than 512 (torch's multi-level cascade only starts beyond that; not emulated).
    Verified against torch.sum for every length 1..69 in the tests."""
    n = a.shape[-1]
    lead = a.shape[:-1]
    zero = np.zeros(lead, F32)
    if n < _VEC:
        return _row_sum([a[..., i] for i in range(n)], zero)
    nv = n // _VEC
    lanes = _row_sum(
        [a[..., v * _VEC : (v + 1) * _VEC] for v in range(nv)], np.zeros((*lead, _VEC), F32)
    )
    acc = zero
    for i in range(nv * _VEC, n):
        acc = acc + a[..., i]
    for lane in range(_VEC):
        acc = acc + lanes[..., lane]
    return acc


def softmax_topk(
    logits: np.ndarray, top_k: int, *, renormalize: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Softmax over all experts, then the top k probabilities (sorted), optionally divided by
    their sum (qwen3_moe / olmoe ``norm_topk_prob``; mixtral always)."""
    probs = softmax_lastdim(logits)
    w, idx = topk_rows(probs, top_k, sorted=True)
    if renormalize:
        w = w / ref_sum_lastdim(w)[:, None]
    return w, idx


def topk_softmax(logits: np.ndarray, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top k raw logits (sorted), then a softmax over those k values."""
    v, idx = topk_rows(logits, top_k, sorted=True)
    return softmax_lastdim(v), idx


def sigmoid_group_topk(
    logits: np.ndarray,
    top_k: int,
    *,
    correction_bias: np.ndarray | None,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[np.ndarray, np.ndarray]:
    """DeepSeek-V3 / Kimi-Linear routing (see the module docstring). ``correction_bias``
    [E] float32 shifts the selection only; the weights are the plain sigmoid scores."""
    T, E = logits.shape
    scores = sigmoid(logits)
    choice = scores + correction_bias if correction_bias is not None else scores
    per = E // n_group
    best2, _ = topk_rows(choice.reshape(T * n_group, per), 2, sorted=True)
    group_scores = (best2[:, 0] + best2[:, 1]).reshape(T, n_group)
    _, gidx = topk_rows(group_scores, topk_group, sorted=False)
    keep = np.zeros((T, n_group), bool)
    np.put_along_axis(keep, gidx, True, axis=1)
    masked = np.where(np.repeat(keep, per, axis=1), choice, F32(-np.inf)).astype(F32, copy=False)
    _, idx = topk_rows(masked, top_k, sorted=False)
    w = np.take_along_axis(scores, idx, axis=1)
    if renormalize:
        w = w / (ref_sum_lastdim(w) + _RENORM_EPS)[:, None]
    return w * F32(scaling_factor), idx
