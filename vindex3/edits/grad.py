"""Reverse-mode gradients through the tail of a decoder, in numpy: d loss / d h for the residual
h leaving layer L (every position), where the loss is a function of the logits at chosen rows.

A change ``delta`` added to the output of layer L's FFN at a position is added to the residual
leaving layer L there (pre-norm placement: the FFN's write joins the residual unnormed), so the
gradient of a loss with respect to that delta is the row of d loss / d h at the position. This is
what ROME and MEMIT fit their value vectors with.

The tail is layers L+1 .. N-1, the final norm and the head, for exactly the operators this module
differentiates: a pre-norm RMS (any weight offset), softmax attention (GQA with repeat_interleave
head mapping, full causal span, RoPE over the whole head or none, any query / score scale, no
biases, QK-norm, clamp, sinks, output gate or softcap), a residual add with any multiplier, a
gated SiLU FFN with separate gate and up and no biases, an RMS final norm and a head (tied or
not) with any multiplier and no bias or softcap. Anything else is refused by name
(`UnsupportedGradient`), never approximated.

It computes in float32 (what the executor does; activations are checked against it by the
caller) or float64 (the finite-difference and autograd checks)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import QueryRefused

F32 = np.float32

#: Bytes of dense tail weights one gradient may hold (checked before any weight is read).
MAX_TAIL_BYTES = 2 << 30


class UnsupportedGradient(QueryRefused):
    """The tail holds something this module's backward pass does not cover."""


def _refuse(layer, what: str):
    where = f"layer {layer}" if isinstance(layer, int) else layer
    raise UnsupportedGradient(f"the gradient through {where} is not available: {what} (the backward covers pre-norm "
                              "RMS, softmax attention with full causal span and whole-head RoPE or none, gated SiLU "
                              "FFNs without biases, an RMS final norm and a head without bias or softcap)")


@dataclass
class _Layer:
    index: int
    n1: np.ndarray
    e1: float
    n2: np.ndarray
    e2: float
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    wg: np.ndarray
    wu: np.ndarray
    wd: np.ndarray
    m1: float
    m2: float
    nh: int
    nkv: int
    hd: int
    rope: tuple | None  # (theta, dims, scaling)
    qscale: float
    sscale: float


def _check_layer(lo) -> None:
    """Refuse by name any op of a layer the backward does not cover."""
    kinds = [op.kind for op in lo.ops]
    want = ["rms_norm", "softmax", "residual_add", "rms_norm", "gated_ffn", "residual_add"]
    if kinds != want:
        _refuse(lo.index, f"its ops are {', '.join(kinds)}, and the backward covers exactly {', '.join(want)}")
    for op in (lo.ops[0], lo.ops[3]):
        if op.params.post:
            _refuse(lo.index, f"its {op.role} is a post-norm")
    a = lo.ops[1].params
    for flag, what in ((a.output_gate, "an attention output gate"), (a.sinks is not None, "attention sinks"),
                       (a.qk_norm_scope is not None, "QK-norm"), (a.qkv_clip is not None, "a q/k/v clamp"),
                       (a.logit_softcap is not None, "an attention softcap"), (any(a.bias.values()), "attention biases"),
                       (a.span != "full", f"a {a.span} attention span"),
                       (a.head_mapping != "repeat_interleave", f"head mapping {a.head_mapping!r}"),
                       (a.position == "rope" and a.rotary_dims != a.head_dim, "partial rotary dims")):
        if flag:
            _refuse(lo.index, what)
    f = lo.ops[4].params
    if f.activation != "silu":
        _refuse(lo.index, f"its FFN activation is {f.activation!r} (the backward covers silu)")
    if f.bias:
        _refuse(lo.index, "FFN biases")
    if f.fused_gate_up:
        _refuse(lo.index, "a fused gate/up projection")


def check_tail(plan, layer: int) -> None:
    """Refuse by name, before reading any weight, a tail (layers after ``layer``, the final norm
    and the head) that the backward does not cover."""
    n = len(plan.layers)
    if not 0 <= layer < n:
        raise QueryRefused(f"a gradient at layer {layer} names a layer the model does not have (0..{n - 1})")
    for lo in plan.layers[layer + 1:]:
        _check_layer(lo)
    if plan.final_norm.kind != "rms_norm":
        _refuse("the final norm", f"it is a {plan.final_norm.kind}")
    hp = plan.head.params
    if hp.softcap:
        _refuse("the head", "a logit softcap")
    if "bias" in plan.head.operands:
        _refuse("the head", "a head bias")


def tail_bytes(plan, layer: int, dtype=F32) -> int:
    """Dense bytes of the tail's weights in ``dtype`` (what `Tail` holds), from the plan alone."""
    size = np.dtype(dtype).itemsize
    n = 0
    for lo in plan.layers[layer + 1:]:
        for op in lo.ops:
            n += sum(int(np.prod(r.shape)) for r in op.operands.values())
    n += sum(int(np.prod(r.shape)) for r in plan.final_norm.operands.values())
    n += sum(int(np.prod(r.shape)) for r in plan.head.operands.values())
    return n * size


def _rope_rows(rope, T: int, dtype):
    from ..exec.ops.rope import RopeTable

    theta, dims, scaling = rope
    cos, sin = RopeTable(theta, dims, scaling).rows(0, T)
    return cos.astype(dtype), sin.astype(dtype)


def _rot(x):
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rot_t(g):
    half = g.shape[-1] // 2
    return np.concatenate([g[..., half:], -g[..., :half]], axis=-1)


def _rms(x, w, eps):
    r = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + x.dtype.type(eps))
    return w * (x * r), r


def _rms_back(dy, x, w, r):
    g = dy * w
    H = x.shape[-1]
    return r * g - x * (r ** 3) * (np.sum(g * x, axis=-1, keepdims=True) / x.dtype.type(H))


class Tail:
    """Layers ``layer``+1 .. N-1, the final norm and the head of ``executor``'s model (weights
    read through its prepared operands, so an overlay's edited weights are the ones used), in
    ``dtype``. ``value_and_grad`` is the forward and the reverse pass."""

    def __init__(self, executor, layer: int, dtype=F32, max_bytes: int = MAX_TAIL_BYTES):
        plan = executor.plan
        check_tail(plan, layer)
        need = tail_bytes(plan, layer, dtype)
        if need > max_bytes:
            raise QueryRefused(f"the gradient through layers {layer + 1}..{len(plan.layers) - 1} would hold {need >> 20} MiB "
                               f"of dense weights, above the bound of {max_bytes >> 20} MiB")
        self.dtype = np.dtype(dtype)
        self.layer = layer
        W = executor.prepared
        dt = self.dtype

        def mat(op, role):
            return np.asarray(W.weight(op.operands[role]).dense(), dtype=dt)

        def vec(op):
            from ..exec.ops.norm import make_weight

            return np.asarray(make_weight(W.array(op.operands["weight"]), op.params.weight_offset), dtype=dt)

        self.layers: list[_Layer] = []
        for lo in plan.layers[layer + 1:]:
            n1, at, r1, n2, ff, r2 = lo.ops
            a = at.params
            self.layers.append(_Layer(
                lo.index, vec(n1), float(n1.params.eps), vec(n2), float(n2.params.eps),
                mat(at, "q_proj"), mat(at, "k_proj"), mat(at, "v_proj"), mat(at, "o_proj"),
                mat(ff, "ffn_gate"), mat(ff, "ffn_up"), mat(ff, "ffn_down"),
                float(r1.params.multiplier), float(r2.params.multiplier), a.heads, a.kv_heads, a.head_dim,
                (a.rope_theta, a.rotary_dims, a.rope_scaling) if a.position == "rope" else None,
                float(a.query_scale), float(a.score_scale)))
        fn, hd = plan.final_norm, plan.head
        self.final_w, self.final_eps = vec(fn), float(fn.params.eps)
        self.head = mat(hd, "weight")
        self.mult = float(hd.params.multiplier)

    # -- one layer -------------------------------------------------------------------------------
    def _layer_fwd(self, L: _Layer, h):
        dt = self.dtype.type
        T = h.shape[0]
        g = L.nh // L.nkv
        a, r1 = _rms(h, L.n1, L.e1)
        q = (a @ L.wq.T).reshape(T, L.nh, L.hd)
        k = (a @ L.wk.T).reshape(T, L.nkv, L.hd)
        v = (a @ L.wv.T).reshape(T, L.nkv, L.hd)
        if L.rope is not None:
            cos, sin = _rope_rows(L.rope, T, self.dtype)
            q = q * cos[:, None] + _rot(q) * sin[:, None]
            k = k * cos[:, None] + _rot(k) * sin[:, None]
        else:
            cos = sin = None
        q2 = q * dt(L.qscale)
        kx = np.repeat(k, g, axis=1)  # [T, nh, hd]: head j reads kv head j // g
        vx = np.repeat(v, g, axis=1)
        s = np.einsum("thd,shd->hts", q2, kx) * dt(L.sscale)
        s = np.where(np.triu(np.ones((T, T), bool), 1)[None], dt(-np.inf), s)
        s = s - s.max(axis=-1, keepdims=True)
        P = np.exp(s)
        P = P / P.sum(axis=-1, keepdims=True)
        o = np.einsum("hts,shd->thd", P, vx).reshape(T, L.nh * L.hd)
        y = o @ L.wo.T
        h2 = h + dt(L.m1) * y
        b, r2 = _rms(h2, L.n2, L.e2)
        gt = b @ L.wg.T
        u = b @ L.wu.T
        sg = 1.0 / (1.0 + np.exp(-gt))
        act = gt * sg
        out = h2 + dt(L.m2) * ((act * u) @ L.wd.T)
        return out, (h, a, r1, q2, kx, vx, P, o, h2, b, r2, gt, u, sg, act, cos, sin)

    def _layer_back(self, L: _Layer, c, dout):
        dt = self.dtype.type
        h, _a, r1, q2, kx, vx, P, _o, h2, _b, r2, gt, u, sg, act, cos, sin = c
        T = h.shape[0]
        g = L.nh // L.nkv
        dh2 = dout.copy()
        dm = (dt(L.m2) * dout) @ L.wd
        du = dm * act
        dgt = dm * u * (sg * (1.0 + gt * (1.0 - sg)))
        db = dgt @ L.wg + du @ L.wu
        dh2 += _rms_back(db, h2, L.n2, r2)
        do = ((dt(L.m1) * dh2) @ L.wo).reshape(T, L.nh, L.hd)
        dP = np.einsum("thd,shd->hts", do, vx)
        dvx = np.einsum("hts,thd->shd", P, do)
        ds = P * (dP - np.sum(dP * P, axis=-1, keepdims=True)) * dt(L.sscale)
        dq = np.einsum("hts,shd->thd", ds, kx) * dt(L.qscale)
        dkx = np.einsum("hts,thd->shd", ds, q2)
        dk = dkx.reshape(T, L.nkv, g, L.hd).sum(axis=2)
        dv = dvx.reshape(T, L.nkv, g, L.hd).sum(axis=2)
        if cos is not None:
            dq = dq * cos[:, None] + _rot_t(dq * sin[:, None])
            dk = dk * cos[:, None] + _rot_t(dk * sin[:, None])
        da = dq.reshape(T, -1) @ L.wq + dk.reshape(T, -1) @ L.wk + dv.reshape(T, -1) @ L.wv
        return dh2 + _rms_back(da, h, L.n1, r1)

    # -- the whole tail --------------------------------------------------------------------------
    def logits(self, h: np.ndarray, rows) -> np.ndarray:
        """The logits at ``rows`` for the residual ``h`` [T, hidden] leaving layer ``layer``."""
        x = np.asarray(h, dtype=self.dtype)
        for L in self.layers:
            x, _ = self._layer_fwd(L, x)
        f, _ = _rms(x[list(rows)], self.final_w, self.final_eps)
        return (f @ self.head.T) * self.dtype.type(self.mult)

    def value_and_grad(self, h: np.ndarray, rows, loss):
        """``loss(logits [len(rows), vocab]) -> (value, d value / d logits)``. Returns (value,
        d value / d h [T, hidden], logits)."""
        dt = self.dtype.type
        x = np.asarray(h, dtype=self.dtype)
        caches = []
        for L in self.layers:
            x, c = self._layer_fwd(L, x)
            caches.append(c)
        rows = list(rows)
        xr = x[rows]
        f, r = _rms(xr, self.final_w, self.final_eps)
        logits = (f @ self.head.T) * dt(self.mult)
        value, dlogits = loss(logits)
        df = (np.asarray(dlogits, dtype=self.dtype) * dt(self.mult)) @ self.head
        dx = np.zeros_like(x)
        np.add.at(dx, rows, _rms_back(df, xr, self.final_w, r))
        for L, c in zip(reversed(self.layers), reversed(caches)):
            dx = self._layer_back(L, c, dx)
        return value, dx, logits


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def nll(targets):
    """The loss -sum_i log p(targets[i]) over the rows, and its gradient."""
    t = np.asarray(targets)

    def f(logits):
        lp = log_softmax(logits)
        n = np.arange(len(t))
        g = np.exp(lp)
        g[n, t] -= 1
        return float(-lp[n, t].sum()), g

    return f


def kl_from(logp0: np.ndarray):
    """The loss KL(p0 || p) summed over the rows (p0 given as log-probabilities), and its gradient."""

    def f(logits):
        lp = log_softmax(logits)
        p0 = np.exp(logp0)
        return float((p0 * (logp0 - lp)).sum()), np.exp(lp) * p0.sum(axis=-1, keepdims=True) - p0

    return f
