"""Fused decode layers: a decode-sized pass (at most `ROWS` positions, one stream, no observer,
no stream intervention) through a plain pre-norm transformer block in ONE compiled call a layer,
instead of about eight kernel launches and a few dozen numpy and Python calls around them.

The block it takes, read from the plan's ops and operator params (never from a model family):

    rms_norm → softmax attention → residual add → rms_norm → gated FFN (SiLU) → residual add

with the attention full-span, rope (any table) or none, and without biases, QK-norm, clamp,
softcap, sinks or an output gate; the FFN with separate gate and up, no biases, SiLU; the norms
pre-norms; every weight in an encoding with a rows kernel (f32, bf16, int8 and q4, under
activations 'exact' or 'q8'), the weights of one product group (q/k/v, gate/up) in one
encoding. Anything else, and any layer of an executor bound with an intervention, runs the ops
as before; `FusedStack.why` says why, per layer (EXPLAIN-able: `Executor.fused.describe()`).

Same bytes as the unfused path, by construction: the call runs the very compiled kernels the
unfused path launches one by one — `vindex3.exec.ops.decode`'s RMSNorm, attention and SiLU
kernels, and the rows / group kernels of vindex3.codecs (`intrinsics` for f32, bf16 and the q8
products, `kernels` for int8 and q4 under 'exact') — in the same order, on the same arrays; the
residual adds are float32 adds (times the multiplier when it is not 1) as numpy's. Each output
element is still computed by one thread, so the thread count changes no byte either. The
refusals are the unfused path's: a norm whose mean of squares is not finite, a residual holding
NaN or infinity, each raised after the same state changes (tests/test_fused_layer.py).

At more than one decode thread a layer whose products all have team kernels (f32, bf16, and
int8 and q4 under 'q8') runs as a team layer: one parallel region a call, its threads taking the
products' row tasks (vindex3.exec.ops.fused_source `team_source`; ``VINDEX3_TEAMS=0`` keeps a
region per product).

On by default; ``VINDEX3_FUSED_LAYERS=0`` turns the fast path off for a process, `set_enabled`
in one (tests and bench/decode_step.py run both), and ``VINDEX3_DECODE_KERNELS=0`` turns it off
with the decode kernels it is made of. Each fused layer function is a generated module held in
numba's on-disk cache (vindex3.exec.ops.fused_source; its name digests its text and the source
of every module whose kernels it calls, so a changed kernel never meets a stale entry): the
first process compiles it (8-13 s for SmolLM2's at load 4-5), every later one, a fresh shard
actor included, loads it (0.07-0.11 s for its first fused step, bench/decode_step.py
--first-pass). A cache directory that cannot be written compiles in memory, as before. numba is
imported when a fused layer first runs, not before.
"""

from __future__ import annotations

import json

import numpy as np

from ...codecs import threads
from ...switches import EnvSwitch, set_switch
from .norm import DECODE, make_weight

F32 = np.float32
ROWS = 8  # positions per pass up to which layers fuse (vindex3.exec.ops.decode.ROWS)
GROUPS = ("qkv", "o", "gu", "down")  # the products of a layer, in order


class _Switch:
    on = EnvSwitch("VINDEX3_FUSED_LAYERS")


FUSED = _Switch()
TEAM_KINDS = ("f32", "bf16", "i8q8", "q4q8")  # product kinds with a team kernel


def enabled() -> bool:
    return FUSED.on


def set_enabled(flag: bool | None) -> None:
    """Turn fused layers on or off for this process (None: read ``VINDEX3_FUSED_LAYERS`` again;
    off only when it is ``0``)."""
    set_switch(FUSED, "on", flag)


def set_team(flag: bool | None) -> None:
    """Turn team layers (one parallel region a layer at more than one decode thread) on or off
    for this process, with the other team launches (vindex3.codecs.threads `set_team`)."""
    threads.set_team(flag)


# --------------------------------------------------------------------------------------------
# eligibility: read once per executor from the plan's ops, their params and the weight classes
_BLOCK = ("rms_norm", "softmax", "residual_add", "rms_norm", "gated_ffn", "residual_add")


def _kind(w) -> str | None:
    """The product kind of a weight object, as its class declares it in its own namespace
    (`Weight.fused_kind`: never inherited, since a subclass may multiply otherwise), or None
    when it has no rows kernel the fused call can run."""
    k = type(w).__dict__.get("fused_kind")
    if k is None or len(w.shape) != 2 or w.shape[0] == 0:
        return None
    return k


def _arrays(kind: str, w) -> tuple:
    return {"f32": lambda: (w.a,), "bf16": lambda: (w.h,), "i8": lambda: (w.q, w.s), "i8q8": lambda: (w.q, w.s),
            "q4": lambda: (w.qs, w.d, w.m), "q4q8": lambda: (w.qs, w.d, w.m)}[kind]()


def _group(ws: tuple, what: str) -> tuple[str, tuple, int] | str:
    """(kind, the arrays the product kernel takes, weight bytes) of weights that multiply one
    activation, or why they cannot be fused."""
    kinds = {_kind(w) for w in ws}
    if None in kinds:
        names = sorted({type(w).__name__ for w in ws if _kind(w) is None})
        return f"{what}: weight class {', '.join(names)} has no rows kernel the fused call runs"
    if len(kinds) != 1:
        return f"{what}: weights in different encodings ({', '.join(sorted(kinds))})"
    kind = kinds.pop()
    if any(w.shape[1] != ws[0].shape[1] for w in ws):
        return f"{what}: weights of different widths"
    parts = [_arrays(kind, w) for w in ws]
    cols = []
    for j in range(len(parts[0])):
        arrs = tuple(p[j] for p in parts)
        if not all(a.flags.c_contiguous for a in arrs) or not threads.one_array_type(arrs):
            return f"{what}: weight arrays are not of one C-contiguous array type"
        cols.append(arrs)
    if kind in ("q4", "q4q8"):
        cols.append(threads.kernels().F16_TABLE)
    return kind, tuple(cols), sum(a.nbytes for a in cols[0])


def _norm_ok(op) -> str | None:
    if op.params.post:
        return f"{op.role}: a post-norm"
    return None


def _attention_ok(p) -> str | None:
    bad = [name for name, on in (
        ("an output gate", p.output_gate), ("a sliding window", p.span != "full"),
        ("biases", any(p.bias.values())), ("QK-norm", p.qk_norm_eps is not None),
        ("a q/k/v clamp", p.qkv_clip is not None), ("attention sinks", p.sinks is not None),
        ("a logit softcap", p.logit_softcap is not None)) if on]
    return f"softmax with {', '.join(bad)}" if bad else None


def _ffn_ok(p) -> str | None:
    bad = [name for name, on in (("activation " + p.activation, p.activation != "silu"), ("biases", p.bias),
                                 ("a fused gate_up matrix", p.fused_gate_up)) if on]
    return f"gated_ffn with {', '.join(bad)}" if bad else None


class FusedLayer:
    """One layer's operands as the fused call takes them, and the call."""

    def __init__(self, index: int, ops, W, touched: int):
        n1, att, r1, n2, ffn, r2 = ops
        self.index = index
        self.touched = touched
        self.n1 = make_weight(W.held(n1.operands["weight"]).dense(), n1.params.weight_offset)
        self.n2 = make_weight(W.held(n2.operands["weight"]).dense(), n2.params.weight_offset)
        self.e1, self.e2 = F32(n1.params.eps), F32(n2.params.eps)
        self.m1, self.m2 = F32(r1.params.multiplier), F32(r2.params.multiplier)
        p = att.params
        self.nh, self.nkv, self.hd = p.heads, p.kv_heads, p.head_dim
        self.qscale, self.sscale = F32(p.query_scale), F32(p.score_scale)
        self.rope = (p.rope_theta, p.rotary_dims, json.dumps(p.rope_scaling, sort_keys=True)) if p.position == "rope" else None
        self.rope_args = (p.rope_theta, p.rotary_dims, p.rope_scaling)
        w = {role: W.held(ref) for role, ref in {**att.operands, **ffn.operands}.items()}
        groups = {"qkv": (w["q_proj"], w["k_proj"], w["v_proj"]), "o": (w["o_proj"],),
                  "gu": (w["ffn_gate"], w["ffn_up"]), "down": (w["ffn_down"],)}
        self.why = None
        self.args = {}
        self.kinds = {}
        for name, ws in groups.items():
            g = _group(ws, name)
            if isinstance(g, str):
                self.why = g
                return
            self.kinds[name], self.args[name], nbytes = g
            self.kinds[name + "_bytes"] = nbytes
        self._fns: dict = {}

    def team(self) -> bool:
        """Does this layer run as one parallel region (a team layer) at the current settings?"""
        return threads.team() and all(self.kinds[g] in TEAM_KINDS for g in GROUPS)

    def fn(self):
        """The compiled call for this layer's kinds and the current thread count: at one thread
        each product on numba's pool exactly when the unfused path would send it there; at more,
        the team layer when every product has a team kernel (and ``VINDEX3_TEAMS`` is not 0)."""
        team = self.team()
        key = (threads.count(), team)
        f = self._fns.get(key)
        if f is None:
            kinds = tuple(self.kinds[g] for g in GROUPS)
            par = ("team",) * 4 if team else tuple(threads.parallel(self.kinds[g + "_bytes"]) for g in GROUPS)
            f = self._fns[key] = _layer_fn(kinds, par, self.m1 == 1, self.m2 == 1)
        return f

    def run(self, h: np.ndarray, kv, p0: int, cos, sin) -> np.ndarray:
        if not h.flags.writeable:  # a shard's input from Ray: one compiled signature, one cache entry
            h = h.copy()
        T = h.shape[0]
        row0 = kv.reserve(T)
        out = np.empty(h.shape, F32)
        a = self.args
        f = self.fn()
        nt = threads.numba_count()
        with threads.launch():
            status = f(h, self.n1, self.e1, a["qkv"], a["o"], self.n2, self.e2, a["gu"], a["down"], kv.kt, kv.v,
                       row0, p0, cos, sin, self.qscale, self.sscale, self.m1, self.m2, self.nh, self.nkv, self.hd, out,
                       nt, np.zeros(threads.team_ctl_len(nt), np.int64))
        if status != 1:  # the K/V rows were written (the unfused path advances them before its FFN norm)
            kv.end += T
        if status:
            from .norm import _finite

            if status in (1, 2):
                _finite(np.array([np.nan], F32))  # the unfused norm's refusal, located by the caller
            from ..engine import _check_finite

            _check_finite(out, self.index)
        return out


class FusedStack:
    """The executed layers of one executor, each fused or not (``why[i]``: None when layer i
    fuses, else the reason it runs op by op); `begin` gives `Executor._layers` a pass's fused steps."""

    rows = ROWS

    def __init__(self, layers: dict[int, FusedLayer], why: dict[int, str | None], head_rows: bool = True):
        self.layers = layers
        self.why = why
        self.active = bool(layers)
        # every layer fused and a head with a rows kernel: a decode-sized pass makes no BLAS
        # call, so it need not hold BLAS's thread count (a threadpoolctl limit costs ~0.1-0.2 ms
        # a pass, enter and exit)
        self._blas_free = self.active and len(layers) == len(why) and head_rows
        self._tables: dict = {}
        for fl in layers.values():
            if fl.rope is not None and fl.rope not in self._tables:
                from .rope import RopeTable

                self._tables[fl.rope] = RopeTable(*fl.rope_args)
        self._no_rope = np.empty((ROWS, 0), F32)

    def describe(self) -> list[str]:
        """One line per executed layer: fused, or why not (the switches are read per pass)."""
        off = "" if FUSED.on and DECODE.on else " (but off: VINDEX3_FUSED_LAYERS=0, or VINDEX3_DECODE_KERNELS=0)"
        def fused(i):
            return "fused" + (" (one parallel region)" if self.layers[i].team() else "") + off

        return [f"layer {i}: " + (fused(i) if w is None else f"not fused ({w})") for i, w in self.why.items()]

    def takes(self, T: int) -> bool:
        return self.active and T <= ROWS and FUSED.on and DECODE.on

    def blas_free(self, T: int) -> bool:
        """Does a pass of T positions run without any BLAS call (every layer fused, the head a
        rows kernel)?"""
        return self._blas_free and T <= ROWS and FUSED.on and DECODE.on

    def begin(self, T: int, p0: int) -> dict:
        """A pass of T positions from p0: each fused layer's step, ``step(h, layer_state) -> (h,
        operand bytes touched)``; the engine's layer loop runs the other layers op by op."""
        rope = {key: t.rows(p0, T) for key, t in self._tables.items()}
        none = (self._no_rope, self._no_rope)

        def step_of(fl):
            cos, sin = rope[fl.rope] if fl.rope is not None else none
            return lambda h, ls: (fl.run(h, ls.ops["mixer"], p0, cos, sin), fl.touched)

        return {i: step_of(fl) for i, fl in self.layers.items()}


def plan_fused(plan, layers: list[int], kernels, W, intervention, head=None) -> FusedStack:
    """Which executed layers fuse, decided once per executor (see the module docstring).
    ``head``: the readout's head weight, if the slice has one."""
    from ...operators import distinct_bytes

    fused: dict[int, FusedLayer] = {}
    why: dict[int, str | None] = {}
    for i, fns in kernels:
        ops = plan.layers[i].ops
        kinds = tuple(op.kind for op in ops)
        reason = None
        if intervention is not None:
            reason = "the executor is bound with an intervention"
        elif kinds != _BLOCK:
            reason = f"ops {' → '.join(kinds)} are not the plain pre-norm block"
        elif any(getattr(fn, "reports", False) for fn in fns):
            reason = "an op reports what each call read"
        else:
            reason = _norm_ok(ops[0]) or _norm_ok(ops[3]) or _attention_ok(ops[1].params) or _ffn_ok(ops[4].params)
        if reason is None:
            touched = sum(distinct_bytes(op.operands) for op in ops if op.kind != "residual_add")
            fl = FusedLayer(i, ops, W, touched)
            reason = fl.why
            if reason is None:
                fused[i] = fl
        why[i] = reason
    return FusedStack(fused, why, head is None or _kind(head) is not None)


# --------------------------------------------------------------------------------------------
# the compiled calls: generated modules, cached on disk by numba (vindex3.exec.ops.fused_source)
_LAYERS: dict = {}


def _layer_fn(kinds: tuple, par: tuple, unit1: bool, unit2: bool):
    path = threads.intdot().chosen() if any(k in ("i8q8", "q4q8") for k in kinds) else "-"
    key = (kinds, par, unit1, unit2, path)
    f = _LAYERS.get(key)
    if f is None:
        from . import fused_source

        text = (fused_source.team_source(kinds, unit1, unit2, path) if par == ("team",) * 4
                else fused_source.source(kinds, par, unit1, unit2, path))
        f = _LAYERS[key] = fused_source.load(key, text)
    return f
