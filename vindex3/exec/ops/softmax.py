"""Softmax attention: GQA with repeat_interleave head mapping, RoPE or NoPE, optional QK-norm
and biases, sliding window (w keys including the query), query scale and score scale kept
separate. One code path serves batch prefill, continued prefill and single-token decode."""

from __future__ import annotations

import numpy as np

from . import rope as rope_mod
from .norm import make_weight, rms_norm


def make_attention(p: dict, w: dict):
    nh, nkv, hd = p["heads"], p["kv_heads"], p["head_dim"]
    g = nh // nkv
    window = p["window"]
    qT, kT, vT, oT = w["q_proj"].T, w["k_proj"].T, w["v_proj"].T, w["o_proj"].T
    qb, kb, vb, ob = (w.get(n) for n in ("q_bias", "k_bias", "v_bias", "o_bias"))
    qn = make_weight(w["q_norm"], p["qk_norm_offset"]) if "q_norm" in w else None
    kn = make_weight(w["k_norm"], p["qk_norm_offset"]) if "k_norm" in w else None
    qk_eps = np.float32(p["qk_norm_eps"]) if p["qk_norm_eps"] is not None else None
    table = rope_mod.RopeTable(p["rope_theta"], p["rotary_dims"], p["rope_scaling"]) if p["position"] == "rope" else None
    qscale = np.float32(p["query_scale"])
    sscale = np.float32(p["score_scale"])
    neg = np.float32(-np.inf)

    def run(x: np.ndarray, kv, p0: int) -> np.ndarray:
        T = x.shape[0]
        q = x @ qT
        k = x @ kT
        v = x @ vT
        if qb is not None:
            q = q + qb
        if kb is not None:
            k = k + kb
        if vb is not None:
            v = v + vb
        q = q.reshape(T, nh, hd)
        k = k.reshape(T, nkv, hd)
        v = v.reshape(T, nkv, hd)
        if qn is not None:
            q = rms_norm(q, qn, qk_eps)
            k = rms_norm(k, kn, qk_eps)
        if table is not None:
            cos, sin = table.rows(p0, T)
            q = rope_mod.apply(q, cos, sin)
            k = rope_mod.apply(k, cos, sin)
        if qscale != 1:
            q = q * qscale
        kv.append(k, v)
        first = 0 if window is None else max(0, p0 - window + 1)
        K, V = kv.view(first)  # [nkv, S, hd]
        S = K.shape[1]
        # queries grouped per kv head: [nkv, g*T, hd] (head h uses kv head h // g)
        qg = q.transpose(1, 0, 2).reshape(nkv, g * T, hd)
        scores = np.matmul(qg, K.transpose(0, 2, 1))  # [nkv, g*T, S]
        scores *= sscale
        scores = scores.reshape(nkv, g, T, S)
        if T > 1 or window is not None:
            qpos = p0 + np.arange(T)[:, None]
            kpos = first + np.arange(S)[None, :]
            masked = kpos > qpos
            if window is not None:
                masked |= (qpos - kpos) >= window
            if masked.any():
                scores = np.where(masked, neg, scores)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out = np.matmul(scores.reshape(nkv, g * T, S), V)  # [nkv, g*T, hd]
        out = out.reshape(nh, T, hd).transpose(1, 0, 2).reshape(T, nh * hd)
        y = out @ oT
        if ob is not None:
            y = y + ob
        return y

    return run
