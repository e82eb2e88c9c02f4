"""Multi-head latent attention (MLA) numerics, one sequence, float32 end to end: the
attention of DeepSeek-V3 (``DeepseekV3Attention``) and of Kimi-Linear's full layers
(``KimiLinearAttention``), as transformers 5.24.0 computes them (eager attention).

With ``H`` heads, latent rank ``r`` (``kv_lora_rank``), rope width ``dr``
(``qk_rope_head_dim``), no-rope width ``dn`` (``qk_nope_head_dim``) and value width ``dv``:

1. Query: ``q_proj`` [H·(dn+dr), hidden] when ``q_lora_rank`` is null, else
   ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` with ``q_a_proj`` [q_lora_rank, hidden] (bias iff
   ``attention_bias``), an RMS norm at ``q_a_norm_eps`` and ``q_b_proj`` [H·(dn+dr),
   q_lora_rank]. Each head is [q_nope (dn) | q_rope (dr)].
2. ``kv_a_proj_with_mqa`` [r + dr, hidden] (bias iff ``attention_bias``) splits into the
   latent (r) and one rope key shared by all heads (dr); the latent goes through
   ``kv_a_layernorm`` at ``kv_a_norm_eps``.
3. Rope (DeepSeek; Kimi's MLA has none, its rope part stays as projected): on q_rope and the
   shared key, at absolute positions, cos/sin multiplied by the rope's attention factor
   (1 for plain rope; yarn's ``attention_factor``). ``rope_interleave`` true rotates the
   pairs (x0, x1), (x2, x3), … and writes the result de-interleaved, ``[x_even·c − x_odd·s |
   x_odd·c + x_even·s]``, exactly as transformers 5.24 does; false is rotate-half on
   ``[first half | second half]``. q and k use the same layout, so their products are those
   of the model.
4. ``kv_b_proj`` [H·(dn+dv), r] maps the latent to per-head [k_nope (dn) | v (dv)]; a head's
   key is [k_nope | shared rope key].
5. Softmax attention (causal) with scale ``(dn + dr)^-½``, times ``mscale(factor,
   mscale_all_dim)²`` when the rope is yarn and ``mscale_all_dim`` is set (the reference's
   ``yarn_apply_mscale``; ``mscale(s, m) = 0.1·m·ln s + 1`` for s > 1, else 1); then
   ``o_proj`` [hidden, H·dv] (bias iff ``attention_bias``).

**The norm eps of kv_a_layernorm and q_a_layernorm.** Both are built as ``RMSNorm(width)``
with the class default ε = 1e-6, not with the config's ``rms_norm_eps`` (which Kimi sets to
1e-5): no config states it. The geometry carries it explicitly (``kv_a_norm_eps``, and
``q_a_norm_eps`` on the q_lora path) and refuses to exist without it; it never borrows the
layer's ε.

**What a layer keeps.** Per position ONE latent row of width ``r + dr``: the normalised latent
followed by the shared key after rope (what transformers caches, too). ``LatentRows`` holds
them (grows by appending, rolls back by truncation); nothing keeps per-head K or V.

**Two ways to attend from the rows**, both here and tested to agree:

* ``reconstruct``: K_nope and V for every row through ``kv_b_proj`` each call (cost ∝
  rows · r · H·(dn+dv)), then ordinary attention — the reference's arithmetic;
* ``absorbed``: kv_b folded into the query and the output: ``q_lat = q_nope · W_kᵀ`` [H, r],
  scores ``[q_lat | q_rope] · row`` over the whole row at once, context ``P · latent`` [H, r],
  then ``· W_v`` per head (cost ∝ rows · H · (2r + dr) plus a fixed per-token H·r·(dn+dv)).

Defaults (``PREFILL_MODE`` / ``DECODE_MODE``), measured with bench/kda_mla_kernels.py at
hidden 1024, 8 heads, r 512, dr 64, dn 128, dv 128, one thread: prefill of 512 positions
reconstructs (5.7k tok/s reconstructed vs 4.2k absorbed, DeepSeek-style; its K/V product is
one matrix product shared by all T queries, and the attention runs over dn+dr and dv rather
than r+dr and r); decode absorbs (388 tok/s absorbed vs 44 reconstructed at a context of
512–576: reconstruction re-expands every stored row for a single query, a cost of context ·
r · H·(dn+dv) per token that absorption does not pay). A short multi-token continuation over a
long context (a speculative verify) is cheaper absorbed too: pass ``mode="absorbed"``.

deepseek_v3 checkpoints (``save_pretrained`` of transformers 5.24.0, recorded from a tiny
random model: hidden 48, 2 layers, heads 3, q_lora_rank 18, kv_lora_rank 20, qk_rope 6,
qk_nope 10, v 14, 4 routed experts of 24, 1 shared, first_k_dense_replace 1, intermediate 40,
vocab 64; ``{i}`` a layer, ``{e}`` an expert):

=====================================================  ==========================  ==========
tensor                                                 shape                       layers
=====================================================  ==========================  ==========
model.embed_tokens.weight                              [vocab, hidden]
lm_head.weight                                         [vocab, hidden]             untied
model.norm.weight                                      [hidden]
model.layers.{i}.input_layernorm.weight                [hidden]                    all
model.layers.{i}.post_attention_layernorm.weight       [hidden]                    all
model.layers.{i}.self_attn.q_a_proj.weight             [q_lora_rank, hidden]       q_lora
model.layers.{i}.self_attn.q_a_layernorm.weight        [q_lora_rank]               q_lora
model.layers.{i}.self_attn.q_b_proj.weight             [H·(dn+dr), q_lora_rank]    q_lora
model.layers.{i}.self_attn.q_proj.weight               [H·(dn+dr), hidden]         no q_lora
model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight   [r+dr, hidden]              all
model.layers.{i}.self_attn.kv_a_layernorm.weight       [r]                         all
model.layers.{i}.self_attn.kv_b_proj.weight            [H·(dn+dv), r]              all
model.layers.{i}.self_attn.o_proj.weight               [hidden, H·dv]              all
model.layers.{i}.self_attn.{q_a,kv_a_proj_with_mqa,o}_proj.bias  (attention_bias only)
model.layers.{i}.mlp.gate_proj.weight                  [intermediate, hidden]      i < k_dense
model.layers.{i}.mlp.up_proj.weight                    [intermediate, hidden]      i < k_dense
model.layers.{i}.mlp.down_proj.weight                  [hidden, intermediate]      i < k_dense
model.layers.{i}.mlp.gate.weight                       [E, hidden]                 i >= k_dense
model.layers.{i}.mlp.gate.e_score_correction_bias      [E]                         i >= k_dense
model.layers.{i}.mlp.experts.{e}.gate_proj.weight      [moe_inter, hidden]         i >= k_dense
model.layers.{i}.mlp.experts.{e}.up_proj.weight        [moe_inter, hidden]         i >= k_dense
model.layers.{i}.mlp.experts.{e}.down_proj.weight      [hidden, moe_inter]         i >= k_dense
model.layers.{i}.mlp.shared_experts.gate_proj.weight   [moe_inter·S, hidden]       i >= k_dense
model.layers.{i}.mlp.shared_experts.up_proj.weight     [moe_inter·S, hidden]       i >= k_dense
model.layers.{i}.mlp.shared_experts.down_proj.weight   [hidden, moe_inter·S]       i >= k_dense
=====================================================  ==========================  ==========

(``S`` = n_shared_experts. Loading stacks the experts into ``mlp.experts.gate_up_proj``
[E, 2·moe_inter, hidden] (gate rows first) and ``mlp.experts.down_proj``; save writes them
back per expert as above.)

MTP layers: transformers 5.24's DeepseekV3 builds none and ``save_pretrained`` writes none,
but released checkpoints carry ``num_nextn_predict_layers`` (alias ``num_mtp_layers``) extra
layers numbered after the decoder, ``model.layers.{L + j}.*`` for L = num_hidden_layers and
j < num_nextn_predict_layers (``model.layers.61.*`` in DeepSeek-V3): ``embed_tokens.weight``
[vocab, hidden], ``enorm.weight`` [hidden], ``hnorm.weight`` [hidden], ``eh_proj.weight``
[hidden, 2·hidden], ``shared_head.norm.weight`` [hidden], ``shared_head.head.weight``
[vocab, hidden], and a full decoder block (``input_layernorm``, ``self_attn.*``,
``post_attention_layernorm``, ``mlp.*`` as a sparse layer). Transformers ignores
``model.layers.61.*`` on load (``_keys_to_ignore_on_load_unexpected``) and loads them only into
an ``MtpModel`` for ``generate(use_mtp=True)``. Admission must set every ``model.layers.{n}``
with n >= num_hidden_layers aside by name as MTP (or refuse), never classify it as a decoder
layer and never drop it silently. The released DeepSeek-V3 weights are also FP8 (e4m3) with a
``*.weight_scale_inv`` [ceil(out/128), ceil(in/128)] float32 tensor beside every quantized
linear and a ``quantization_config`` in config.json: an encoding to carry or refuse by name.

deepseek_v3 config keys (transformers 5.24.0 ``DeepseekV3Config``):

=============================  =============================  =======================================
saved key                      aliases                        meaning and grade
=============================  =============================  =======================================
hidden_size, vocab_size,       -                              read
num_hidden_layers
num_attention_heads            -                              H
num_key_value_heads            -                              must equal H (kv_b expands the latent to
                                                              every head; other values crash the
                                                              reference)
q_lora_rank                    -                              null: q_proj path; int: q_a/q_b path
kv_lora_rank                   -                              r
qk_rope_head_dim               -                              dr (also saved as head_dim: the rotary
                                                              width, not a head width)
qk_nope_head_dim, v_head_dim   -                              dn, dv
qk_head_dim                    derived, saved                 must equal dn + dr
rope_parameters                rope_scaling (older spelling)  rope_type default | yarn; rope_theta;
                               rope_theta at top level        yarn: factor, original_max_position_
                               (older spelling)               embeddings, beta_fast (default 32),
                                                              beta_slow (default 1), mscale,
                                                              mscale_all_dim, attention_factor,
                                                              truncate (default true)
rope_interleave                -                              pairwise rope layout (default true)
max_position_embeddings        -                              yarn factor only when factor is absent
rms_norm_eps                   -                              decoder norms; NOT q_a/kv_a (1e-6)
attention_bias                 -                              q_a / kv_a / o biases
n_routed_experts               num_local_experts              E
num_experts_per_tok            -                              top-k
n_shared_experts               -                              shared MLP width multiplier
n_group, topk_group            -                              group-limited routing
norm_topk_prob                 -                              renormalise top-k weights
routed_scaling_factor          -                              multiplies routed weights
first_k_dense_replace          -                              dense FFN below this layer
moe_intermediate_size,         -                              expert and dense widths
intermediate_size
num_nextn_predict_layers       num_mtp_layers                 MTP layers after the decoder (set aside)
hidden_act                     -                              FFN activation (silu)
tie_word_embeddings            -                              head tying
scoring_func, topk_method,     hub keys, not fields           sigmoid / noaux_tc in the released
moe_layer_freq, ep_size,       (kept as attributes, unread)   configs; the reference always runs
quantization_config                                           sigmoid + correction bias, grouped, every
                                                              layer >= first_k_dense_replace; FP8:
                                                              an encoding to carry or refuse
pad/bos/eos_token_id, dtype,   -                              description
initializer_range, use_cache,
pretraining_tp, attention_
dropout, output_router_logits
=============================  =============================  =======================================
"""

from __future__ import annotations

import functools
import math
import weakref

import numpy as np

from vindex3.errors import ClosureError, StateError
from vindex3.exec.state import OpState
from vindex3.operators.mla import MlaParams, MlaWeights, RopeParams, YarnParams

from .checks import check_input, expect_absent, expect_array, expect_weight

__all__ = [
    "DECODE_MODE",
    "MODES",
    "PREFILL_MODE",
    "LatentRows",
    "MlaGeometry",
    "MlaRope",
    "MlaWeights",
    "MlaYarn",
    "mla_prefill",
    "mla_step",
]

F32 = np.float32
_ONE = F32(1.0)
MODES = ("reconstruct", "absorbed")
PREFILL_MODE = "reconstruct"
DECODE_MODE = "absorbed"
QUERY_BLOCK = 128  # causal query blocks in prefill: the masked upper triangle is never computed


# The kernels take the operator's own params (its judged form); MlaGeometry builds them from the
# facts a kernel caller states (the softmax scale computed). MlaRope and MlaYarn are the params'
# rope and yarn.
MlaGeometry = MlaParams.kernel_facts
MlaRope = RopeParams
MlaYarn = YarnParams


class _Mark:
    """A snapshot of latent rows: the position count, valid while rows below it are untouched."""

    __slots__ = ("__weakref__", "positions", "valid")

    def __init__(self, positions: int):
        self.positions = positions
        self.valid = True

    def __repr__(self) -> str:
        return f"<latent rows mark at {self.positions}{'' if self.valid else ', invalidated'}>"


class LatentRows(OpState):
    """One operator-defined float32 row per position ([positions, width]), growable: MLA keeps
    its normalised latent and rope key here. Rolled back by truncation (rows are only ever
    appended), so a position's row never changes once written.

    It keeps no K or V: asking it for them (``k``, ``v``) is refused by name. A snapshot is a
    mark (the position count), not a copy: rows below it are never rewritten unless a truncation
    cuts below it, which invalidates the mark, so restoring it is refused rather than wrong."""

    __slots__ = ("_buf", "_marks", "_n", "width")

    def __init__(self, width: int, capacity: int = 0):
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise ValueError(f"LatentRows width must be a positive int, got {width!r}")
        self.width = width
        self._buf = np.zeros((max(0, int(capacity)), width), F32)
        self._n = 0
        self._marks: weakref.WeakSet[_Mark] = weakref.WeakSet()

    @classmethod
    def for_geometry(cls, g: MlaParams, capacity: int = 0) -> LatentRows:
        return cls(g.latent_width, capacity)

    def __len__(self) -> int:
        return self._n

    @property
    def positions(self) -> int:
        return self._n

    def append(self, rows: np.ndarray) -> None:
        """Append ``rows`` [T, width] float32 as the next T positions."""
        if not isinstance(rows, np.ndarray) or rows.dtype != F32 or rows.ndim != 2 or rows.shape[1] != self.width:
            desc = f"{rows.dtype} {list(rows.shape)}" if isinstance(rows, np.ndarray) else type(rows).__name__
            raise StateError(f"latent rows take float32 [T, {self.width}], got {desc}")
        need = self._n + rows.shape[0]
        if need > self._buf.shape[0]:
            grown = np.zeros((max(need, 2 * self._buf.shape[0], 64), self.width), F32)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : need] = rows
        self._n = need

    def view(self) -> np.ndarray:
        """The rows written so far, [positions, width] (a read-only view, valid until the next
        append)."""
        v = self._buf[: self._n]
        v.flags.writeable = False
        return v

    def _no_kv(self, what: str):
        raise StateError(
            f"an MLA layer keeps no {what} rows: its state is one latent row per position "
            f"(width {self.width}: the normalised kv latent and the shared rope key); per-head keys "
            "and values exist only transiently, reconstructed through kv_b_proj"
        )

    @property
    def k(self):
        self._no_kv("K")

    @property
    def v(self):
        self._no_kv("V")

    def truncate(self, positions: int) -> None:
        """Forget every row from ``positions`` on (speculative rollback)."""
        if isinstance(positions, bool) or not isinstance(positions, int) or not 0 <= positions <= self._n:
            raise StateError(f"cannot truncate latent rows to {positions!r}: they hold {self._n} positions")
        for m in list(self._marks):
            if m.positions > positions:
                m.valid = False
        self._n = positions

    @property
    def nbytes(self) -> int:
        """Bytes the held positions occupy (width · 4 per position)."""
        return self._n * self.width * 4

    @property
    def capacity_nbytes(self) -> int:
        return self._buf.nbytes

    def snapshot(self) -> _Mark:
        """A mark at the current position (cheap: no rows are copied)."""
        m = _Mark(self._n)
        self._marks.add(m)
        return m

    def restore(self, snap: _Mark) -> None:
        """Return to a mark taken by ``snapshot()`` of these rows."""
        if not isinstance(snap, _Mark) or snap not in self._marks:
            raise StateError(f"cannot restore latent rows of width {self.width} from {snap!r}: not a snapshot of them")
        if not snap.valid:
            raise StateError(f"cannot restore latent rows to {snap.positions}: rows below it were truncated and "
                             "rewritten since the snapshot")
        if snap.positions > self._n:
            raise StateError(f"cannot restore latent rows forward to {snap.positions} (they hold {self._n})")
        self.truncate(snap.positions)

    def copy(self) -> LatentRows:
        """An independent copy of the rows."""
        c = LatentRows(self.width, self._n)
        c.append(self._buf[: self._n])
        return c

    def __repr__(self) -> str:
        return f"LatentRows(positions={self._n}, width={self.width})"


# --------------------------------------------------------------------------- checks


def _check(w: MlaWeights, g: MlaParams, rows: LatentRows) -> None:
    d: list[str] = []
    H, hid, r, dr = g.num_heads, g.hidden_size, g.kv_lora_rank, g.qk_rope_head_dim
    qdim = H * g.qk_head_dim
    if g.q_lora_rank is None:
        expect_weight("q_proj", w.q_proj, (qdim, hid), d)
        for n in ("q_a_proj", "q_a_bias", "q_a_norm", "q_b_proj"):
            expect_absent(n, getattr(w, n), "the geometry has no q_lora_rank", d)
    else:
        ql = g.q_lora_rank
        expect_absent("q_proj", w.q_proj, "the geometry has a q_lora_rank (q_a -> q_b path)", d)
        expect_weight("q_a_proj", w.q_a_proj, (ql, hid), d)
        expect_array("q_a_norm", w.q_a_norm, (ql,), d)
        expect_weight("q_b_proj", w.q_b_proj, (qdim, ql), d)
        if g.attention_bias:
            expect_array("q_a_bias", w.q_a_bias, (ql,), d)
        else:
            expect_absent("q_a_bias", w.q_a_bias, "the geometry declares no attention bias", d)
    expect_weight("kv_a_proj", w.kv_a_proj, (r + dr, hid), d)
    expect_array("kv_a_norm", w.kv_a_norm, (r,), d)
    expect_weight("kv_b_proj", w.kv_b_proj, (H * (g.qk_nope_head_dim + g.v_head_dim), r), d)
    expect_weight("o_proj", w.o_proj, (hid, H * g.v_head_dim), d)
    for name, n in (("kv_a_bias", r + dr), ("o_bias", hid)):
        if g.attention_bias:
            expect_array(name, getattr(w, name), (n,), d)
        else:
            expect_absent(name, getattr(w, name), "the geometry declares no attention bias", d)
    if d:
        raise ClosureError("mla operands do not match the layer geometry", d)
    if not isinstance(rows, LatentRows) or rows.width != g.latent_width:
        raise StateError(
            f"mla state is {rows!r}; expected LatentRows of width {g.latent_width} "
            f"(kv_lora_rank {r} + qk_rope_head_dim {dr})"
        )


def _check_mode(mode: str, what: str) -> None:
    if mode not in MODES:
        raise ValueError(f"{what}: mode {mode!r} is not one of {', '.join(MODES)}")


# --------------------------------------------------------------------------- rope


@functools.lru_cache(maxsize=64)
def _inv_freq(rope: RopeParams, dim: int) -> np.ndarray:
    """Inverse frequencies [dim / 2] float32, as transformers computes them (plain or yarn)."""
    y = rope.yarn
    base = rope.theta
    # base ** (2i / dim): the exponent in float32, the power in float64, rounded once (torch's
    # pow of a Python scalar by a float32 tensor), then float32 from there on
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(F32) / F32(dim)
    pos_freqs = (np.float64(base) ** exps.astype(np.float64)).astype(F32)
    extra = (_ONE / pos_freqs).astype(F32)
    if y is None:
        return extra
    inter = (_ONE / (F32(y.factor) * pos_freqs)).astype(F32)

    def corr_dim(rot: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(y.beta_fast), corr_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=F32) - F32(low)) / F32(high - low), F32(0), _ONE).astype(F32)
    extra_factor = (_ONE - ramp).astype(F32)
    return (inter * (_ONE - extra_factor) + extra * extra_factor).astype(F32)


def _cos_sin(rope: RopeParams, dim: int, p0: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, dim / 2] for positions p0 .. p0 + T − 1, times the attention factor."""
    inv = _inv_freq(rope, dim)
    freqs = np.arange(p0, p0 + T, dtype=np.int64).astype(F32)[:, None] * inv[None, :]
    cos, sin = np.cos(freqs), np.sin(freqs)
    if rope.yarn is not None:
        f = F32(rope.yarn.cos_sin_factor())
        if f != _ONE:
            cos, sin = cos * f, sin * f
    return cos, sin


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleave: bool) -> np.ndarray:
    """x [T, ..., dr] with cos/sin [T, dr/2]: pairs (even, odd) when interleaved (result laid
    out [rotated evens | rotated odds], as transformers writes it), else (first half, second
    half)."""
    half = x.shape[-1] // 2
    if interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


# --------------------------------------------------------------------------- attention


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x * (_ONE / np.sqrt(var + F32(eps))))


def _softmax_rows(s: np.ndarray) -> np.ndarray:
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s *= _ONE / s.sum(axis=-1, keepdims=True)
    return s


def _attend(qk: np.ndarray, keys: np.ndarray, vals: np.ndarray, p0: int, scale: np.float32) -> np.ndarray:
    """Causal attention of queries at positions p0 .. p0+T−1 over rows 0 .. p0+T−1.
    qk [H, T, dq]; keys [H or 1, S, dq]; vals [H or 1, S, dv]  ->  [H, T, dv]."""
    H, T, _ = qk.shape
    out = np.empty((H, T, vals.shape[-1]), F32)
    neg = F32(-np.inf)
    shared = keys.shape[0] == 1 and vals.shape[0] == 1
    for a in range(0, T, QUERY_BLOCK):
        b = min(T, a + QUERY_BLOCK)
        n = b - a
        hi = p0 + b  # block [a, b) sees rows < p0 + b
        if shared:  # one key set for every head: one product over all heads' queries
            s = (qk[:, a:b].reshape(H * n, -1) @ keys[0, :hi].T).reshape(H, n, hi)
        else:
            s = np.matmul(qk[:, a:b], keys[:, :hi].transpose(0, 2, 1))  # [H, n, hi]
        s *= scale
        if n > 1:
            qpos = p0 + a + np.arange(n)[:, None]
            masked = np.arange(hi)[None, :] > qpos
            s[:, masked] = neg
        p = _softmax_rows(s)
        if shared:
            out[:, a:b] = (p.reshape(H * n, hi) @ vals[0, :hi]).reshape(H, n, -1)
        else:
            out[:, a:b] = np.matmul(p, vals[:, :hi])
    return out


def _mla(x: np.ndarray, w: MlaWeights, g: MlaParams, rows: LatentRows, mode: str) -> np.ndarray:
    _check(w, g, rows)
    T = x.shape[0]
    H, r, dn, dr, dv = g.num_heads, g.kv_lora_rank, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    p0 = len(rows)

    if g.q_lora_rank is None:
        q = w.q_proj.mm(x)
    else:
        qa = w.q_a_proj.mm(x)
        if w.q_a_bias is not None:
            qa = qa + w.q_a_bias
        q = w.q_b_proj.mm(_rms(qa, w.q_a_norm, g.q_a_norm_eps))
    q = q.reshape(T, H, dn + dr)

    ckv = w.kv_a_proj.mm(x)
    if w.kv_a_bias is not None:
        ckv = ckv + w.kv_a_bias
    new = np.empty((T, r + dr), F32)
    new[:, :r] = _rms(ckv[:, :r], w.kv_a_norm, g.kv_a_norm_eps)
    q_nope, q_rope = q[:, :, :dn], q[:, :, dn:]
    if g.rope is not None:
        cos, sin = _cos_sin(g.rope, dr, p0, T)
        q_rope = _apply_rope(q_rope, cos, sin, g.rope.interleave)
        new[:, r:] = _apply_rope(ckv[:, r:], cos, sin, g.rope.interleave)
    else:
        new[:, r:] = ckv[:, r:]
    rows.append(new)
    L = rows.view()  # [S, r + dr], S = p0 + T
    S = L.shape[0]
    scale = F32(g.attention_scale)

    if mode == "reconstruct":
        kv = w.kv_b_proj.mm(L[:, :r]).reshape(S, H, dn + dv)
        keys = np.empty((H, S, dn + dr), F32)
        keys[:, :, :dn] = kv[:, :, :dn].transpose(1, 0, 2)
        keys[:, :, dn:] = L[None, :, r:]
        vals = kv[:, :, dn:].transpose(1, 0, 2)
        qk = np.empty((H, T, dn + dr), F32)
        qk[:, :, :dn] = q_nope.transpose(1, 0, 2)
        qk[:, :, dn:] = q_rope.transpose(1, 0, 2)
        o = _attend(qk, keys, vals, p0, scale)  # [H, T, dv]
    else:
        Wk, Wv = w.absorbed_factors(g)
        qk = np.empty((H, T, r + dr), F32)
        if isinstance(Wk, np.ndarray):
            qk[:, :, :r] = np.matmul(q_nope.transpose(1, 0, 2), Wk)  # [H, T, r]
        else:
            for h in range(H):
                qk[h, :, :r] = Wk[h].mm_t(np.ascontiguousarray(q_nope[:, h]))
        qk[:, :, r:] = q_rope.transpose(1, 0, 2)
        ctx = _attend(qk, L[None], L[None, :, :r], p0, scale)  # [H, T, r]
        if isinstance(Wv, np.ndarray):
            o = np.matmul(ctx, Wv.transpose(0, 2, 1))  # [H, T, dv]
        else:
            o = np.stack([Wv[h].mm(np.ascontiguousarray(ctx[h])) for h in range(H)])

    y = w.o_proj.mm(np.ascontiguousarray(o.transpose(1, 0, 2)).reshape(T, H * dv))
    if w.o_bias is not None:
        y = y + w.o_bias
    return y


def mla_prefill(
    x: np.ndarray, w: MlaWeights, g: MlaParams, rows: LatentRows, *, mode: str = PREFILL_MODE
) -> np.ndarray:
    """Attend ``x`` [T, hidden] (the normed layer input) at positions len(rows) ..
    len(rows)+T−1; append their T latent rows; return [T, hidden] float32."""
    check_input(x, 2, g.hidden_size, "mla_prefill")
    _check_mode(mode, "mla_prefill")
    if x.shape[0] == 0:
        _check(w, g, rows)
        return np.zeros((0, g.hidden_size), F32)
    return _mla(x, w, g, rows, mode)


def mla_step(
    x: np.ndarray, w: MlaWeights, g: MlaParams, rows: LatentRows, *, mode: str = DECODE_MODE
) -> np.ndarray:
    """One token ``x`` [hidden] at position len(rows) -> [hidden] float32; appends its row."""
    check_input(x, 1, g.hidden_size, "mla_step")
    _check_mode(mode, "mla_step")
    return _mla(x[None], w, g, rows, mode)[0]
