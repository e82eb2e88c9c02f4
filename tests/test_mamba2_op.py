"""Mamba2 mixer numerics against transformers' Mamba2Mixer (torch fallback path), fp32.

The oracle is the mixer module alone, on tiny random configs with n_groups > 1, widths
that are not powers of two, a chunk size that does not divide the sequence, and A_log,
dt_bias, D, conv bias and norm weights re-randomised so layout or offset bugs cannot
hide behind ones and zeros.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, Mamba2Config
from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer

from vindex3.errors import ClosureError, StateError
from vindex3.exec.ops.mamba2 import (
    Mamba2Geometry,
    Mamba2State,
    Mamba2Weights,
    _exp_f32,
    _gated_rmsnorm,
    _run_conv,
    _ssd_scan,
    _ssd_scan_cols,
    _ssd_scan_rows,
    mamba2_prefill,
    mamba2_step,
)

# 7x the mixer's largest fp32-vs-fp64 spread on these fixtures, 1.4e-6 (odd_g2, T >= 8; the mixer run in
# float64 on the same input); the reference's own steps-vs-prefill and two-calls-vs-one differ by <= 1.4e-6.
TOL = 1e-5

CONFIGS = {
    # hidden 72, 6 heads of 24, 3 groups of 2 heads, state 16, chunk 8
    "h72_g3": {
        "hidden_size": 72, "expand": 2, "num_heads": 6, "head_dim": 24, "state_size": 16, "n_groups": 3,
        "conv_kernel": 4, "chunk_size": 8, "use_bias": False, "use_conv_bias": True,
    },
    # odd widths everywhere the config allows: hidden 45, head_dim 15, state 13, kernel 3,
    # biases on in_proj / out_proj
    "odd_g2": {
        "hidden_size": 45, "expand": 2, "num_heads": 6, "head_dim": 15, "state_size": 13, "n_groups": 2,
        "conv_kernel": 3, "chunk_size": 8, "use_bias": True, "use_conv_bias": True,
    },
}


def make_mixer(name: str, seed: int = 0, **overrides):
    kw = dict(CONFIGS[name])
    kw.update(overrides)
    cfg = Mamba2Config(
        vocab_size=32, num_hidden_layers=1, layer_norm_epsilon=1e-5, **kw
    )
    torch.manual_seed(seed)
    mixer = Mamba2Mixer(cfg, layer_idx=0).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        h = cfg.num_heads
        mixer.A_log.copy_(torch.empty(h).uniform_(math.log(0.5), math.log(8.0), generator=gen))
        mixer.dt_bias.copy_(torch.empty(h).uniform_(-3.0, 0.5, generator=gen))
        mixer.D.copy_(torch.randn(h, generator=gen))
        mixer.norm.weight.copy_(1.0 + 0.5 * torch.randn(mixer.norm.weight.shape, generator=gen))
        if mixer.conv1d.bias is not None:
            mixer.conv1d.bias.copy_(0.2 * torch.randn(mixer.conv1d.bias.shape, generator=gen))
        for lin in (mixer.in_proj, mixer.out_proj):
            if lin.bias is not None:
                lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=gen))
    return cfg, mixer


def geometry_of(cfg) -> Mamba2Geometry:
    return Mamba2Geometry(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_heads,
        head_dim=cfg.head_dim,
        state_size=cfg.state_size,
        n_groups=cfg.n_groups,
        conv_kernel=cfg.conv_kernel,
        chunk_size=cfg.chunk_size,
        time_step_limit=tuple(cfg.time_step_limit),
        norm_eps=cfg.layer_norm_epsilon,
        use_conv_bias=cfg.use_conv_bias,
        use_bias=cfg.use_bias,
    )


def _ro(t):
    if t is None:
        return None
    a = t.detach().cpu().numpy().copy()
    a.setflags(write=False)  # the op must never write into (memory-mapped) weights
    return a


def weights_of(mixer) -> Mamba2Weights:
    return Mamba2Weights(
        in_proj=_ro(mixer.in_proj.weight),
        in_proj_bias=_ro(mixer.in_proj.bias),
        conv_weight=_ro(mixer.conv1d.weight),  # transformers layout [conv_dim, 1, kernel]
        conv_bias=_ro(mixer.conv1d.bias),
        A_log=_ro(mixer.A_log),
        D=_ro(mixer.D),
        dt_bias=_ro(mixer.dt_bias),
        norm_weight=_ro(mixer.norm.weight),
        out_proj=_ro(mixer.out_proj.weight),
        out_proj_bias=_ro(mixer.out_proj.bias),
    )


def setup(name: str, seed: int = 0, **overrides):
    cfg, mixer = make_mixer(name, seed, **overrides)
    return cfg, mixer, weights_of(mixer), geometry_of(cfg)


def inputs(cfg, T: int, seed: int = 7) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)


def torch_prefill(mixer, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return mixer(torch.from_numpy(x)[None]).numpy()[0]


def torch_prefill_then_steps(cfg, mixer, x: np.ndarray, n_prefill: int):
    """transformers driving its own cache: one prefill call, then one call per token."""
    cache = DynamicCache(config=cfg)
    outs = []
    with torch.no_grad():
        xt = torch.from_numpy(x)[None]
        outs.append(mixer(xt[:, :n_prefill], cache=cache).numpy()[0])
        assert cache.get_recurrent_state(0) is not None  # the cache really is being carried
        for t in range(n_prefill, x.shape[0]):
            outs.append(mixer(xt[:, t : t + 1], cache=cache).numpy()[0])
    return np.concatenate(outs, axis=0), cache


def ours_prefill_then_steps(w, g, x: np.ndarray, n_prefill: int):
    st = Mamba2State.zeros(g)
    outs = [mamba2_prefill(x[:n_prefill], w, g, st)]
    for t in range(n_prefill, x.shape[0]):
        o = mamba2_step(x[t], w, g, st)
        assert o.dtype == np.float32 and o.shape == (g.hidden_size,)
        outs.append(o[None])
    return np.concatenate(outs, axis=0), st


def maxdiff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


# --------------------------------------------------------------------------- geometry


def test_geometry_sizes_and_buffers():
    _cfg, mixer, _w, g = setup("h72_g3")
    assert g.intermediate == mixer.intermediate_size == 144
    assert g.conv_dim == mixer.conv_dim
    assert g.in_proj_dim == mixer.in_proj.out_features
    assert g.buffers() == [
        ("ssm", (6, 24, 16), "f32"),
        ("conv", (g.conv_dim, 4), "f32"),
    ]
    st = Mamba2State.zeros(g)
    assert st.ssm.dtype == np.float32 and st.conv.dtype == np.float32
    assert [(n, s) for n, s, _ in g.buffers()] == [("ssm", st.ssm.shape), ("conv", st.conv.shape)]
    c = st.copy()
    c.ssm[0, 0, 0] = 1.0
    assert st.ssm[0, 0, 0] == 0.0


# --------------------------------------------------------------------------- (1) prefill


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("T", [1, 5, 8, 29])
def test_prefill_matches_torch_mixer(name, T):
    cfg, mixer, w, g = setup(name)
    x = inputs(cfg, T)
    st = Mamba2State.zeros(g)
    ours = mamba2_prefill(x, w, g, st)
    assert ours.dtype == np.float32 and ours.shape == (T, cfg.hidden_size)
    assert st.ssm.dtype == np.float32 and st.conv.dtype == np.float32
    ref = torch_prefill(mixer, x)
    assert np.abs(ref).max() > 0.1  # the comparison is not between near-zeros
    assert maxdiff(ours, ref) <= TOL


# --------------------------------------------------------------------------- (2) prefill + steps


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("n_prefill", [1, 2, 11])
def test_prefill_then_steps_matches_transformers_cache(name, n_prefill):
    cfg, mixer, w, g = setup(name)
    T = 24
    x = inputs(cfg, T)
    ref, cache = torch_prefill_then_steps(cfg, mixer, x, n_prefill)
    ours, st = ours_prefill_then_steps(w, g, x, n_prefill)
    assert maxdiff(ours, ref) <= TOL
    # the carried buffers are the same objects as transformers' cache holds
    assert maxdiff(st.ssm, cache.get_recurrent_state(0)[0].numpy()) <= TOL
    assert maxdiff(st.conv, cache.get_conv_state(0)[0].numpy()) <= TOL
    # and the same as our own prefill of the whole sequence
    whole = mamba2_prefill(x, w, g, Mamba2State.zeros(g))
    assert maxdiff(ours, whole) <= TOL


# --------------------------------------------------------------------------- (3) pure decode


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_token_by_token_from_zero_equals_prefill(name):
    cfg, _mixer, w, g = setup(name)
    T = 21
    x = inputs(cfg, T, seed=3)
    st = Mamba2State.zeros(g)
    steps = np.stack([mamba2_step(x[t], w, g, st) for t in range(T)])
    st_p = Mamba2State.zeros(g)
    pre = mamba2_prefill(x, w, g, st_p)
    assert steps.dtype == np.float32
    assert maxdiff(steps, pre) <= TOL
    assert maxdiff(st.ssm, st_p.ssm) <= TOL
    assert maxdiff(st.conv, st_p.conv) <= TOL  # in_proj rows: gemv vs gemm rounding only


# --------------------------------------------------------------------------- (4) chunked prefill


def test_scan_kernel_is_the_same_arithmetic_for_one_and_many_positions():
    """Decode (T = 1 calls) and prefill (one call) run bit-identical recurrences."""
    rng = np.random.default_rng(1)
    T, H, P, G, N = 13, 6, 15, 3, 13
    xdt = rng.standard_normal((T, H, P)).astype(np.float32)
    dA = rng.uniform(0.2, 1.0, (T, H)).astype(np.float32)
    B = rng.standard_normal((T, G, N)).astype(np.float32)
    C = rng.standard_normal((T, G, N)).astype(np.float32)
    s0 = rng.standard_normal((H, P, N)).astype(np.float32)
    s_all, y_all = s0.copy(), np.empty((T, H, P), np.float32)
    _ssd_scan(s_all, xdt, dA, B, C, y_all)
    s_one, y_one = s0.copy(), np.empty((T, H, P), np.float32)
    for t in range(T):
        sl = slice(t, t + 1)
        _ssd_scan(s_one, xdt[sl], dA[sl], B[sl], C[sl], y_one[sl])
    assert np.array_equal(s_all, s_one) and np.array_equal(y_all, y_one)
    # both loop orders are the same arithmetic, whatever T
    for kernel in (_ssd_scan_cols, _ssd_scan_rows):
        s_k, y_k = s0.copy(), np.empty((T, H, P), np.float32)
        kernel(s_k, xdt, dA, B, C, y_k)
        assert np.array_equal(s_k, s_all) and np.array_equal(y_k, y_all)
    # and it is the recurrence: s = s*dA + xdt (x) B, y = s . C
    s = s0.astype(np.float64)
    for t in range(T):
        for h in range(H):
            s[h] = s[h] * dA[t, h] + np.outer(xdt[t, h], B[t, h // (H // G)])
            # 35x the same recurrence's float32-vs-float64 spread in numpy, 2.9e-6 (ours: 2.6e-6)
            assert np.allclose(y_all[t, h], s[h] @ C[t, h // (H // G)], atol=1e-4)


def test_exp_f32_is_accurate_and_propagates_nan():
    import numba

    @numba.njit
    def vexp(a, o):
        for i in range(a.size):
            o[i] = _exp_f32(a[i])

    x = np.concatenate([np.linspace(-87.0, 88.0, 400_001), [0.0, -0.0, 1e-30, -1e-30]])
    x = x.astype(np.float32)
    out = np.empty_like(x)
    vexp(x, out)
    ref = np.exp(x.astype(np.float64))
    # 2.5x float32's own rounding of exp, 2^-24 = 6.0e-8 relative; ours measured 7.8e-8 under both the
    # host and the generic numba target (numpy's float32 exp: 1.9e-7)
    assert np.max(np.abs(out - ref) / ref) < 1.5e-7
    assert out[-4] == 1.0 and out[-3] == 1.0
    special = np.array([np.nan, -np.inf, -200.0, np.inf], np.float32)
    so = np.empty_like(special)
    vexp(special, so)
    assert np.isnan(so[0]) and 0.0 <= so[1] < 1.2e-38 and 0.0 <= so[2] < 1.2e-38
    assert np.isinf(so[3])


def test_gated_norm_is_grouped_and_gated_first_like_transformers():
    _cfg, mixer, w, g = setup("h72_g3")
    rng = np.random.default_rng(4)
    y = rng.standard_normal((5, g.intermediate)).astype(np.float32)
    y[:, : g.norm_group_size] *= 10.0  # groups of very different scale
    gate = rng.standard_normal((5, g.intermediate)).astype(np.float32)
    ours = _gated_rmsnorm(y, gate, w, g)
    assert ours.dtype == np.float32
    with torch.no_grad():
        ref = mixer.norm(torch.from_numpy(y), torch.from_numpy(gate)).numpy()
    assert maxdiff(ours, ref) <= TOL  # the norm's fp32-vs-fp64 spread 2.2e-7, ours 9.5e-7 (values up to ~30)
    # a norm over the whole width, or one applied before the gate, would be far off
    u = y * (gate / (1 + np.exp(-gate)))
    whole = u / np.sqrt(np.mean(u * u, -1, keepdims=True) + 1e-5) * w.norm_weight
    before = y / np.sqrt(np.mean(y * y, -1, keepdims=True) + 1e-5) * w.norm_weight
    assert maxdiff(whole, ref) > 0.1 and maxdiff(before, ref) > 0.1


def test_conv_is_the_same_arithmetic_for_one_and_many_positions():
    _cfg, mixer, w, g = setup("odd_g2")
    rng = np.random.default_rng(2)
    T = 11
    xbc_in = rng.standard_normal((T, g.conv_dim)).astype(np.float32)
    stored = rng.standard_normal((g.conv_dim, g.conv_kernel)).astype(np.float32)
    cw = w.conv_weight[:, 0, :]
    st_all, st_one = Mamba2State.zeros(g), Mamba2State.zeros(g)
    st_all.conv[...] = stored
    st_one.conv[...] = stored
    out_all = _run_conv(st_all.conv, xbc_in, cw, w)
    out_one = np.concatenate([_run_conv(st_one.conv, xbc_in[t : t + 1], cw, w) for t in range(T)])
    assert np.array_equal(out_all, out_one) and np.array_equal(st_all.conv, st_one.conv)
    assert np.array_equal(st_all.conv, np.concatenate([stored.T, xbc_in])[-g.conv_kernel :].T)
    # and it is transformers' conv: silu(depthwise conv1d over [stored, new]), new positions
    seq = torch.from_numpy(np.concatenate([stored.T, xbc_in]).T.copy())[None]
    with torch.no_grad():
        ref = torch.nn.functional.conv1d(
            seq, mixer.conv1d.weight, mixer.conv1d.bias, groups=g.conv_dim
        )
        ref = torch.nn.functional.silu(ref)[0].T.numpy()[-T:]
    assert maxdiff(out_all, ref) <= TOL


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("split", [1, 2, 8, 13])
def test_prefill_in_two_calls_equals_one(name, split):
    cfg, _mixer, w, g = setup(name)
    T = 30
    x = inputs(cfg, T, seed=5)
    one = mamba2_prefill(x, w, g, st1 := Mamba2State.zeros(g))
    st2 = Mamba2State.zeros(g)
    two = np.concatenate(
        [mamba2_prefill(x[:split], w, g, st2), mamba2_prefill(x[split:], w, g, st2)]
    )
    assert maxdiff(one, two) <= TOL
    assert maxdiff(st1.ssm, st2.ssm) <= TOL
    assert maxdiff(st1.conv, st2.conv) <= TOL


def test_second_prefill_matches_transformers_cache():
    """A multi-token call on a cache that already holds state (chunk path with initial state)."""
    cfg, mixer, w, g = setup("odd_g2")
    x = inputs(cfg, 26, seed=11)
    cache = DynamicCache(config=cfg)
    with torch.no_grad():
        xt = torch.from_numpy(x)[None]
        ref = np.concatenate(
            [mixer(xt[:, :9], cache=cache).numpy()[0], mixer(xt[:, 9:], cache=cache).numpy()[0]]
        )
    st = Mamba2State.zeros(g)
    ours = np.concatenate([mamba2_prefill(x[:9], w, g, st), mamba2_prefill(x[9:], w, g, st)])
    assert maxdiff(ours, ref) <= TOL


def test_empty_prefill_leaves_state():
    cfg, _mixer, w, g = setup("h72_g3")
    st = Mamba2State.zeros(g)
    mamba2_prefill(inputs(cfg, 5), w, g, st)
    before = st.copy()
    out = mamba2_prefill(np.zeros((0, cfg.hidden_size), np.float32), w, g, st)
    assert out.shape == (0, cfg.hidden_size) and out.dtype == np.float32
    assert np.array_equal(st.ssm, before.ssm) and np.array_equal(st.conv, before.conv)


# --------------------------------------------------------------------------- (5) time-step limits


def test_infinite_upper_limit_is_the_default_and_matches():
    cfg, mixer, w, g = setup("h72_g3")
    assert g.time_step_limit[0] == 0.0 and math.isinf(g.time_step_limit[1])
    x = inputs(cfg, 19)
    assert maxdiff(mamba2_prefill(x, w, g, Mamba2State.zeros(g)), torch_prefill(mixer, x)) <= TOL


@pytest.mark.parametrize("limit", [(0.1, 0.4), (0.2, math.inf)])
def test_finite_time_step_limit_matches_transformers(limit):
    cfg, mixer, w, g = setup("odd_g2", time_step_limit=limit)
    assert g.time_step_limit == (float(limit[0]), float(limit[1]))
    T, n_prefill = 20, 9
    x = inputs(cfg, T, seed=13)

    # the limits bind on this input: some softplus(dt + dt_bias) lie outside them
    with torch.no_grad():
        proj = mixer.in_proj(torch.from_numpy(x)).numpy()
    dt = np.logaddexp(0.0, proj[:, -cfg.num_heads :] + w.dt_bias)
    assert (dt < limit[0]).any()
    assert math.isinf(limit[1]) or (dt > limit[1]).any()

    # prefill clamps, as transformers' chunk path does
    assert maxdiff(mamba2_prefill(x, w, g, Mamba2State.zeros(g)), torch_prefill(mixer, x)) <= TOL
    # steps do not clamp, as transformers' recurrent path (and mamba_ssm's step) does not
    ref, _ = torch_prefill_then_steps(cfg, mixer, x, n_prefill)
    ours, _ = ours_prefill_then_steps(w, g, x, n_prefill)
    assert maxdiff(ours, ref) <= TOL
    # ... so with a binding limit, decode is not the same function as prefill, there as here
    whole = mamba2_prefill(x, w, g, Mamba2State.zeros(g))
    assert maxdiff(ours[n_prefill:], whole[n_prefill:]) > 1e-3


# --------------------------------------------------------------------------- refusals


def test_misshapen_operands_and_state_are_refused_by_name():
    cfg, _mixer, w, g = setup("h72_g3")
    x = inputs(cfg, 3)
    wide = dataclasses.replace(
        w, in_proj=np.zeros((g.in_proj_dim + 2 * 10, g.hidden_size), np.float32)
    )
    with pytest.raises(ClosureError, match="d_mlp"):
        mamba2_prefill(x, wide, g, Mamba2State.zeros(g))
    bad = dataclasses.replace(w, D=w.D.astype(np.float64))
    with pytest.raises(ClosureError) as ei:
        mamba2_step(x[0], bad, g, Mamba2State.zeros(g))
    assert "D: dtype float64" in str(ei.value)
    st = Mamba2State.zeros(g)
    st.ssm = st.ssm[:, :, :-1].copy()
    with pytest.raises(StateError, match="ssm"):
        mamba2_prefill(x, w, g, st)
    with pytest.raises(TypeError, match="float32"):
        mamba2_prefill(x.astype(np.float64), w, g, Mamba2State.zeros(g))
    with pytest.raises(ValueError, match="n_groups"):
        dataclasses.replace(g, n_groups=4)


def test_memory_mapped_read_only_weights(tmp_path):
    cfg, _mixer, w, g = setup("odd_g2")
    mapped = {}
    for f in dataclasses.fields(w):
        a = getattr(w, f.name)
        if a is None:
            mapped[f.name] = None
            continue
        path = tmp_path / f"{f.name}.bin"
        a.tofile(path)
        mapped[f.name] = np.memmap(path, dtype=np.float32, mode="r", shape=a.shape)
    wm = Mamba2Weights(**mapped)
    x = inputs(cfg, 12)
    st_a, st_b = Mamba2State.zeros(g), Mamba2State.zeros(g)
    a = mamba2_prefill(x, w, g, st_a)
    b = mamba2_prefill(x, wm, g, st_b)
    assert np.array_equal(a, b)
    assert np.array_equal(mamba2_step(x[0], w, g, st_a), mamba2_step(x[0], wm, g, st_b))


def test_accepts_squeezed_conv_weight():
    cfg, _mixer, w, g = setup("odd_g2")
    w2 = dataclasses.replace(w, conv_weight=w.conv_weight[:, 0, :])
    x = inputs(cfg, 10)
    a = mamba2_prefill(x, w, g, Mamba2State.zeros(g))
    b = mamba2_prefill(x, w2, g, Mamba2State.zeros(g))
    assert np.array_equal(a, b)


# --------------------------------------------------------------------------- timing (report only)


@pytest.mark.parametrize("n_groups", [1, 8])
def test_timing_report_hidden256(n_groups):
    """Not an assertion: prints prefill T=512 and decode per-token times of one mixer against
    the torch mixer, interleaved, best of a few (bench/ holds the real measurement)."""
    cfg, mixer = make_mixer(
        "h72_g3",
        hidden_size=256, num_heads=8, head_dim=64, state_size=128, n_groups=n_groups,
        conv_kernel=4, chunk_size=256,
    )
    w, g = weights_of(mixer), geometry_of(cfg)
    x = inputs(cfg, 512)
    xt = torch.from_numpy(x)[None]
    mamba2_prefill(x[:16], w, g, Mamba2State.zeros(g))
    mamba2_step(x[0], w, g, Mamba2State.zeros(g))  # compile / warm

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    cache = DynamicCache(config=cfg)
    st = Mamba2State.zeros(g)
    with torch.no_grad():
        mixer(xt[:, :8], cache=cache)
        t_ours, t_torch, s_ours, s_torch = [], [], [], []
        for _ in range(3):
            t_ours.append(timed(lambda: mamba2_prefill(x, w, g, Mamba2State.zeros(g))))
            t_torch.append(timed(lambda: mixer(xt)))
            for _ in range(10):
                s_ours.append(timed(lambda: mamba2_step(x[8], w, g, st)))
                s_torch.append(timed(lambda: mixer(xt[:, 8:9], cache=cache)))
    to, tt, so, st_ = min(t_ours), min(t_torch), min(s_ours), min(s_torch)
    print(
        f"\n[mamba2 timing, hidden 256, 8x64 heads, state 128, n_groups {n_groups}, one mixer] "
        f"prefill T=512: ours {to * 1e3:.1f} ms, torch {tt * 1e3:.1f} ms (x{tt / to:.2f}); "
        f"step: ours {so * 1e6:.0f} us, torch {st_ * 1e6:.0f} us (x{st_ / so:.2f})"
    )
