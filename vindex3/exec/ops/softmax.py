"""Softmax attention: GQA with repeat_interleave head mapping, RoPE or NoPE, optional QK-norm
(per head or over the whole projection) and biases, an optional q/k/v clamp, optional learned
sinks, an optional output gate, sliding window (w keys including the query), query scale and
score scale kept separate. One code path serves batch prefill, continued prefill and
single-token decode.

A sink is one learned logit per query head that joins the softmax of every query and is then
dropped (gpt-oss): p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink - m)) with m the
maximum over the scores and the sink, so a head may attend to nothing.

With ``output_gate`` (gated attention) q_proj's output holds per head [query | gate]; the
attention output is multiplied by sigmoid(gate) before o_proj. A rotary width below head_dim
rotates the first ``rotary_dims`` dims of each head and passes the rest (vindex3.exec.ops.rope)."""

from __future__ import annotations

import numpy as np

from ...codecs.base import products
from . import rope as rope_mod
from .gated_attention import gate_output
from .norm import DECODE, SMALL_ROWS, decode_kernels, make_weight, prefill_kernels, rms_norm

QUERY_BLOCK = 128


def make_attention(p, w: dict, tap=None):
    """``p``: the softmax operator's params; ``w``: role -> Weight (projections) or float32 array
    (biases, QK-norm weights). Returns ``run(x [T, hidden], kv: KvRows, p0) -> [T, hidden]``.
    ``tap`` (internals only; the executor binds without it) is told each block's attention
    weights, ``tap("weights", q0, k0, w)`` with w [kv heads, group, queries, keys] for absolute
    query positions from q0 and keys from k0, and the heads' output before the output
    projection, ``tap("heads", p0, out)`` with out [T, heads * head_dim]."""
    nh, nkv, hd = p.heads, p.kv_heads, p.head_dim
    gated = p.output_gate
    g = nh // nkv
    window = p.window
    Wq, Wk, Wv, Wo = w["q_proj"], w["k_proj"], w["v_proj"], w["o_proj"]
    qkv = products((Wq, Wk, Wv))  # one launch where the encoding has a fused kernel, same bytes
    qb, kb, vb, ob = (w.get(n) for n in ("q_bias", "k_bias", "v_bias", "o_bias"))
    qn = make_weight(w["q_norm"], p.qk_norm_offset) if "q_norm" in w else None
    kn = make_weight(w["k_norm"], p.qk_norm_offset) if "k_norm" in w else None
    qk_eps = np.float32(p.qk_norm_eps) if p.qk_norm_eps is not None else None
    whole = p.qk_norm_scope == "projection"
    clip = np.float32(p.qkv_clip) if p.qkv_clip is not None else None
    sinks = w["sinks"].astype(np.float32).reshape(nkv, g, 1, 1) if p.sinks is not None else None
    table = rope_mod.RopeTable(p.rope_theta, p.rotary_dims, p.rope_scaling) if p.position == "rope" else None
    qscale = np.float32(p.query_scale)
    sscale = np.float32(p.score_scale)
    cap = np.float32(p.logit_softcap) if p.logit_softcap is not None else None
    neg = np.float32(-np.inf)

    flat_sinks = w["sinks"].astype(np.float32).reshape(nh) if p.sinks is not None else None
    no_cap = np.float32(0.0)

    def attend_small(dk, q, k, v, kv, p0: int, T: int, gate) -> np.ndarray:
        # a decode-sized pass: rope, the K/V write, scores, softmax and the weighted sum of V
        # in one compiled call (vindex3.exec.ops.decode); returns the heads' output as attend does
        first = 0 if window is None else max(0, p0 - window + 1)
        cos = sin = None
        if table is not None:
            cos, sin = table.rows(p0, T)
        probs = np.empty((nkv, g, T, p0 + T - first), np.float32) if tap is not None else None
        out = dk.attend(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), cos, sin,
                            qscale, kv, first, p0, 0 if window is None else window, sscale,
                            no_cap if cap is None else cap, flat_sinks, probs)
        if tap is not None:
            tap("weights", p0, first, probs)
        if gated:
            out = gate_output(out, gate)
        if tap is not None:
            tap("heads", p0, out)
        return out

    def attend_large(pk, q, k, v, kv, p0: int, T: int, gate) -> np.ndarray:
        # a prefill-sized pass: rope, the K/V write and attention in compiled calls split over
        # the threads (vindex3.exec.ops.prefill_attend); the weights, when tapped, per block of
        # QUERY_BLOCK queries as below, from the same call that computes the output
        first = 0 if window is None else max(0, p0 - window + 1)
        cos = sin = None
        if table is not None:
            cos, sin = table.rows(p0, T)
        out = pk.attend(q, k, v, cos, sin, qscale, kv, first, p0, 0 if window is None else window, sscale,
                        no_cap if cap is None else cap, flat_sinks, tap, QUERY_BLOCK)
        if gated:
            out = gate_output(out, gate)
        if tap is not None:
            tap("heads", p0, out)
        return out

    def project(x: np.ndarray):
        """x [T, hidden] -> (q, k, v, gate): the projections with their biases, the gate split
        off, a whole-projection QK-norm and the clamp; each row from its own row of x alone."""
        q, k, v = qkv(x)
        gate = None
        if qb is not None:
            q = q + qb
        if gated:  # per head [query | gate]: the query half goes on, the gate waits for the output
            T = x.shape[0]
            qg = q.reshape(T, nh, 2 * hd)
            q, gate = qg[:, :, :hd].reshape(T, nh * hd), qg[:, :, hd:].reshape(T, nh * hd)
        if kb is not None:
            k = k + kb
        if vb is not None:
            v = v + vb
        if qn is not None and whole:  # over the whole projection, before the split into heads
            q = rms_norm(q, qn, qk_eps)
            k = rms_norm(k, kn, qk_eps)
        if clip is not None:
            q, k, v = np.clip(q, -clip, clip), np.clip(k, -clip, clip), np.clip(v, -clip, clip)
        return q, k, v, gate

    def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, gate, kv, p0: int) -> np.ndarray:
        """The projected rows of positions p0.. of one stream -> the heads' output [T, heads *
        head_dim] (gated, before the output projection): per-head QK-norm, rotary at the
        stream's own positions, the rows appended to its KV rows ``kv`` and attended over them."""
        T = q.shape[0]
        q = q.reshape(T, nh, hd)
        k = k.reshape(T, nkv, hd)
        v = v.reshape(T, nkv, hd)
        if qn is not None and not whole:
            q = rms_norm(q, qn, qk_eps)
            k = rms_norm(k, kn, qk_eps)
        if DECODE.on and T <= SMALL_ROWS and (dk := DECODE.mod or decode_kernels()) is not None:
            return attend_small(dk, q, k, v, kv, p0, T, gate if gated else None)
        if T > SMALL_ROWS and (pk := prefill_kernels()) is not None:
            return attend_large(pk, q, k, v, kv, p0, T, gate if gated else None)
        if table is not None:
            cos, sin = table.rows(p0, T)
            q = rope_mod.apply(q, cos, sin)
            k = rope_mod.apply(k, cos, sin)
        if qscale != 1:
            q = q * qscale
        kv.append(k, v)
        first = 0 if window is None else max(0, p0 - window + 1)
        K, V = kv.view(first)  # [nkv, S, hd], absolute positions first..p0+T-1
        # queries grouped per kv head: [nkv, g, T, hd] (head h uses kv head h // g)
        qh = q.transpose(1, 0, 2).reshape(nkv, g, T, hd)
        out = np.empty((nkv, g, T, hd), np.float32)
        # Causal blocks of queries: block [a, b) only needs keys up to p0 + b, so the masked
        # upper triangle of a long prefill is never computed.
        for a in range(0, T, QUERY_BLOCK):
            b = min(T, a + QUERY_BLOCK)
            n = b - a
            lo = first if window is None else max(first, p0 + a - window + 1)
            hi = p0 + b
            Kb, Vb = K[:, lo - first : hi - first], V[:, lo - first : hi - first]
            Sb = hi - lo
            s = np.matmul(qh[:, :, a:b].reshape(nkv, g * n, hd), Kb.transpose(0, 2, 1)).reshape(nkv, g, n, Sb)
            s *= sscale
            if cap is not None:  # softcapped scores: c · tanh(s / c)
                s /= cap
                np.tanh(s, out=s)
                s *= cap
            if n > 1 or (window is not None and p0 + a - lo >= window):
                qpos = (p0 + a) + np.arange(n)[:, None]
                kpos = lo + np.arange(Sb)[None, :]
                masked = kpos > qpos
                if window is not None:
                    masked |= (qpos - kpos) >= window
                if masked.any():
                    s[:, :, masked] = neg
            if sinks is None:
                s -= s.max(axis=-1, keepdims=True)
                np.exp(s, out=s)
                s *= np.float32(1.0) / s.sum(axis=-1, keepdims=True)
            else:
                m = np.maximum(s.max(axis=-1, keepdims=True), sinks)
                s -= m
                np.exp(s, out=s)
                s *= np.float32(1.0) / (s.sum(axis=-1, keepdims=True) + np.exp(sinks - m))
            if tap is not None:
                tap("weights", p0 + a, lo, s)
            out[:, :, a:b] = np.matmul(s.reshape(nkv, g * n, Sb), Vb).reshape(nkv, g, n, hd)
        out = out.reshape(nh, T, hd).transpose(1, 0, 2).reshape(T, nh * hd)
        if gated:
            out = gate_output(out, gate)
        if tap is not None:
            tap("heads", p0, out)
        return out

    def output(out: np.ndarray) -> np.ndarray:
        """The heads' output [T, heads * head_dim] -> the op's write [T, hidden], row by row."""
        y = Wo.mm(out)
        if ob is not None:
            y = y + ob
        return y

    def run(x: np.ndarray, kv, p0: int) -> np.ndarray:
        return output(attend(*project(x), kv, p0))

    def attend_rows(q: np.ndarray, k: np.ndarray, v: np.ndarray, gate, kvs, p0s) -> np.ndarray | None:
        """``attend`` for N streams at one position each (row n of q, k, v and gate is stream
        n's, ``kvs[n]`` its KV rows, ``p0s[n]`` its position) in one compiled call
        (vindex3.exec.ops.decode_many); row n of the result is the bytes ``attend`` gives
        stream n alone. None when the decode kernels are off (the caller attends per stream)."""
        N = q.shape[0]
        if not (DECODE.on and N <= SMALL_ROWS and decode_kernels() is not None):
            return None
        from .decode_many import attend_many

        q = q.reshape(N, nh, hd)
        k = k.reshape(N, nkv, hd)
        v = v.reshape(N, nkv, hd)
        if qn is not None and not whole:  # per row and head, as each stream's own pass does it
            q = rms_norm(q, qn, qk_eps)
            k = rms_norm(k, kn, qk_eps)
        cos = sin = None
        if table is not None:
            table.rows(max(p0s), 1)  # the table reaches every stream's position
            at = np.asarray(p0s, np.intp)
            cos, sin = table.cos[at], table.sin[at]
        out = attend_many(np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v), cos, sin,
                          qscale, kvs, p0s, window, sscale, no_cap if cap is None else cap, flat_sinks)
        if gated:  # each stream's row gated on its own, as its own pass gates it
            out = np.concatenate([gate_output(out[n:n + 1], gate[n:n + 1]) for n in range(N)], axis=0)
        return out

    # The stages, for a caller that runs the row-wise ones (projections, output projection) once
    # over rows of several streams and only ``attend`` per stream (vindex3.exec.batch), or
    # ``attend.rows`` once for all of them when it can.
    attend.rows = attend_rows if tap is None else None
    run.stages = (project, attend, output)

    return run
