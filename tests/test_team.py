"""Team kernels and team layers (vindex3.codecs.intrinsics `team_kernel`,
vindex3.exec.ops.fused_source `team_source`): at more than one decode thread a fused layer is one
parallel region whose threads claim row tasks from shared counters (vindex3.codecs.atomics).

Invariants: a team kernel writes the group kernel's bytes whoever claims which tasks, including
when one thread ends up doing every task (a worker that never arrives); a team layer is the
one-thread fused layer's bytes for every encoding it takes; its refusals are the unfused path's."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit, prange

import vindex3
from vindex3 import codecs
from vindex3.codecs import atomics as A
from vindex3.codecs import intrinsics as I
from vindex3.codecs import threads
from vindex3.codecs.kernels import F16_TABLE
from vindex3.errors import NonFiniteActivation
from vindex3.exec.ops import decode
from vindex3.exec.ops import fused_layer as FL
from vindex3.exec.slice import LayerRange

pytestmark = pytest.mark.numeric

F32 = np.float32
rng = np.random.default_rng(43)
# rows of the three weights of a group: a partial task, one task exactly, and many tasks with a tail
ROWS = (37, 16, 301)


def _group(kind: str, K: int):
    """(arrays the team / group kernels take, as a tuple of tuples) for three weights of ``kind``."""
    Ws = [rng.standard_normal((o, K)).astype(F32) for o in ROWS]
    if kind == "f32":
        return ((*Ws,),)
    if kind == "bf16":
        ws = [codecs.get("bf16").weight(codecs.get("bf16").encode(W), W.shape) for W in Ws]
        return (tuple(w.h for w in ws),)
    if kind == "i8":
        ws = [codecs.get("int8").weight(codecs.get("int8").encode(W), W.shape) for W in Ws]
        return tuple(w.q for w in ws), tuple(w.s for w in ws)
    ws = [codecs.get("q4").weight(codecs.get("q4").encode(W), W.shape) for W in Ws]
    return tuple(w.qs for w in ws), tuple(w.d for w in ws), tuple(w.m for w in ws)


def _group_bytes(kind, arrs, x, ys):
    if kind in ("f32", "bf16"):
        I.float_kernel(kind, "vector", False, True)(arrs[0], x, ys, I.ROWS_PER_TASK)
    elif kind == "i8":
        I.group_kernel("i8", I.best())(*arrs, x, ys, I.ROWS_PER_TASK)
    else:
        I.group_kernel("q4", I.best())(*arrs, F16_TABLE, x, ys, I.ROWS_PER_TASK)


def _drivers(kind):
    """(alone, region): one body calling the team kernel over a three-weight group from every
    iteration of ``prange(nt)``, compiled serial (one thread runs the iterations in turn: the
    first claims every task, as when its partner never arrives) and parallel (a region of numba's
    threads). A region takes arrays, not tuples, so the body takes each array by name."""
    team = I.team_kernel(kind, None if kind in ("f32", "bf16") else I.best())
    rpt = I.ROWS_PER_TASK
    if kind in ("f32", "bf16"):
        def body(w0, w1, w2, x, y0, y1, y2, ctl, nt):
            for _ in prange(nt):
                team(((w0, w1, w2),), (x,), (y0, y1, y2), rpt, ctl, 3, nt)
    elif kind == "i8":
        def body(q0, q1, q2, s0, s1, s2, XQ, XD, XC, XS, y0, y1, y2, ctl, nt):
            for _ in prange(nt):
                team(((q0, q1, q2), (s0, s1, s2)), (XQ, XD, XC), (y0, y1, y2), rpt, ctl, 3, nt)
    else:
        def body(q0, q1, q2, d0, d1, d2, m0, m1, m2, XQ, XD, XC, XS, y0, y1, y2, ctl, nt, table):
            for _ in prange(nt):
                team(((q0, q1, q2), (d0, d1, d2), (m0, m1, m2)), (table, XQ, XD, XS), (y0, y1, y2), rpt, ctl, 3, nt)
    return njit(body), njit(parallel=True)(body)


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("kind", ["f32", "bf16", "i8", "q4"])
def test_a_team_kernel_writes_the_group_kernels_bytes(kind, T):
    """Called by one thread that takes every task (its own share from the front, then its
    partner's from the back: the partner arrives only after), and by regions of two threads and of
    one: the group kernel's bytes each time, every task counted done once."""
    K = 96 if kind != "f32" else 80
    arrs = _group(kind, K)
    x = (rng.standard_normal((T, K)) * 3).astype(F32)
    want = tuple(np.empty((T, o), F32) for o in ROWS)
    _group_bytes(kind, arrs, x, want)
    ntask = sum(-(-o // I.ROWS_PER_TASK) for o in ROWS)
    alone, region = _drivers(kind)
    act = (x,) if kind in ("f32", "bf16") else I.quantized(x)
    tail = (F16_TABLE,) if kind == "q4" else ()
    for nt, f in ((2, alone), (2, region), (1, region)):
        ys = tuple(np.full((T, o), np.nan, F32) for o in ROWS)
        ctl = np.zeros(threads.team_ctl_len(nt), np.int64)
        numba.set_num_threads(min(nt, numba.config.NUMBA_NUM_THREADS))
        try:
            f(*(w for col in arrs for w in col), *act, *ys, ctl, nt, *tail)
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        assert all(np.array_equal(a, b) for a, b in zip(want, ys)), (kind, T, nt, f)
        assert ctl[7 * A.SLOT] == ntask  # phase 3's done counter: every task once
        assert ctl[6 * A.SLOT] == nt  # its arrivals: each of the region's iterations once
        for sh in range(nt):  # every task of each share taken, each taker overshooting at most once
            word = int(ctl[(16 + 3 * nt + sh) * A.SLOT])
            taken = (word & 0xFFFFFFFF) + (word >> 32)
            length = ntask * (sh + 1) // nt - ntask * sh // nt
            assert length <= taken <= length + nt, (sh, word)


@pytest.mark.parametrize("T", [1, 3, 8])
@pytest.mark.parametrize("kind", ["f32", "bf16", "i8", "q4"])
def test_a_team_of_one_weight_writes_the_rows_kernels_bytes(kind, T, restore):
    """`team_rows` (the codecs' launch of a large weight, a model's head, at two threads)."""
    K = 96
    arrs = tuple(a[-1] for a in _group(kind, K))  # the 301-row weight
    x = (rng.standard_normal((T, K)) * 3).astype(F32)
    want = np.empty((T, ROWS[-1]), F32)
    if kind in ("f32", "bf16"):
        I.float_kernel(kind, "vector")(*arrs, x, want, I.ROWS_PER_TASK)
        args = arrs
    else:
        args = arrs + ((F16_TABLE,) if kind == "q4" else ())
        I.rows_kernel(kind, I.best())(*args, x, want, I.ROWS_PER_TASK)
    threads.set_count(2)
    got = np.full_like(want, np.nan)
    with threads.launch():
        I.team_rows(kind, *args, x, got, path=None if kind in ("f32", "bf16") else I.best())
    assert np.array_equal(want, got)


@pytest.mark.parametrize("enc", ["f32", "bf16", "int8", "q4"])
def test_a_large_weights_product_is_the_same_bytes_as_a_team(enc, restore):
    """A weight past `PARALLEL_MIN_BYTES` (as a model's head) multiplied through its codec (int8
    and q4 under activations 'q8') at two threads, as a team, and at one."""
    W = rng.standard_normal((4096 if enc != "f32" else 640, 576)).astype(F32)
    w = codecs.get(enc).weight(codecs.get(enc).encode(W), W.shape)
    if enc in ("int8", "q4"):
        w = w.with_activations("q8")
        assert w.activations == "q8"
    x = rng.standard_normal((3, 576)).astype(F32)
    threads.set_count(1)
    one = w.mm(x)
    threads.set_count(2)
    calls = []
    real = I.team_rows

    def counted(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    I.team_rows = counted
    try:
        two = w.mm(x)
    finally:
        I.team_rows = real
    assert calls == [{"f32": "f32", "bf16": "bf16", "int8": "i8", "q4": "q4"}[enc]]
    assert np.array_equal(one, two)


def test_the_teams_switch_sends_large_weights_to_a_team(restore):
    threads.set_count(2)
    assert threads.team(threads.PARALLEL_MIN_BYTES) and not threads.team(threads.PARALLEL_MIN_BYTES - 1)
    FL.set_team(False)
    assert not threads.team(threads.PARALLEL_MIN_BYTES)
    threads.set_team(None)
    threads.set_count(1)
    assert not threads.team(threads.PARALLEL_MIN_BYTES)


def test_a_team_kernel_of_an_unknown_kind_is_refused_by_name():
    with pytest.raises(ValueError, match="no team kernel for 'f16'"):
        I.team_kernel("f16")


# -- team layers -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reps(tiny_llama_encodings):
    return tiny_llama_encodings


@pytest.fixture
def restore():
    yield
    FL.set_enabled(None)
    FL.set_team(None)
    decode.set_enabled(None)
    threads.set_count(None)


def _passes(ex, T: int):
    st = ex.start()
    outs = [st.prefill([5, 9, 11, 13, 17])]
    tok = int(np.argmax(outs[-1][-1]))
    for i in range(6):
        outs.append(st.prefill([tok] + [3 + i + j for j in range(T - 1)]))
        tok = int(np.argmax(outs[-1][-1]))
    kv = [(ls.ops["mixer"].kt[:, :, : ls.ops["mixer"].end].copy(), ls.ops["mixer"].v[:, : ls.ops["mixer"].end].copy())
          for ls in st.state.layers.values()]
    return [o.tobytes() for o in outs], [(a.tobytes(), b.tobytes()) for a, b in kv]


@pytest.mark.parametrize("T", [1, 5, 8])
@pytest.mark.parametrize("enc,act", [("f32", "exact"), ("bf16", "exact"), ("int8", "q8"), ("q4", "q8")])
def test_a_team_layer_is_the_one_thread_layers_bytes(reps, enc, act, T, restore):
    ex = vindex3.open(reps[enc]).executor(activations=act)
    threads.set_count(1)
    one = _passes(ex, T)
    threads.set_count(2)
    assert all(line.endswith("fused (one parallel region)") for line in ex.fused.describe()), ex.fused.describe()
    team = _passes(ex, T)
    FL.set_team(False)
    assert not any("parallel region" in line for line in ex.fused.describe())
    per_product = _passes(ex, T)
    assert team == one and per_product == one


def test_layers_without_a_team_kernel_keep_a_region_per_product(reps, restore):
    """int8 under activations 'exact' runs the reassociating kernels, which have no team kernel."""
    ex = vindex3.open(reps["int8"]).executor(activations="exact")
    threads.set_count(2)
    assert ex.fused.active and not any(fl.team() for fl in ex.fused.layers.values())


@pytest.mark.parametrize("where", ["first norm", "second norm"])
def test_a_team_layer_refuses_as_the_unfused_path_refuses(tiny_llama_container, where, restore):
    """The first norm fails before the region starts; the second fails inside it (huge cached
    values reach the residual), and the other thread skips the FFN."""
    ex = vindex3.open(tiny_llama_container).executor(LayerRange(0, 2))
    errs = []
    for count, fused in ((2, True), (1, True), (1, False)):
        threads.set_count(count)
        FL.set_enabled(fused)
        st = ex.start()
        st.prefill_hidden(np.ones((2, 64), F32))
        if where == "first norm":
            h = np.full((2, 64), np.nan, F32)
        else:
            h = np.ones((1, 64), F32)
            mixer = st.state.layers[0].ops["mixer"]
            mixer.v[:, : mixer.end] = 1e30  # finite, but its square overflows in the second norm
        with pytest.raises(NonFiniteActivation, match="mean of squares") as e:
            st.prefill_hidden(h)
        errs.append((str(e.value), e.value.layer, e.value.site,
                     [ls.ops["mixer"].end for ls in st.state.layers.values()], st.state.position))
    assert errs[0] == errs[1] == errs[2]


def test_the_counter_layout_fits_every_phase_and_share():
    """`threads.team_ctl_len` (computed without numba) is whole slots of vindex3.codecs.atomics,
    and holds the last share counter a team layer's last product phase touches."""
    for nt in (1, 2, 3, 8):
        n = threads.team_ctl_len(nt)
        assert n % A.SLOT == 0
        last_phase = threads.TEAM_PHASES - 1
        assert (16 + last_phase * nt + nt - 1) * A.SLOT < n
        assert (16 + nt - 1) * A.SLOT < threads.team_ctl_len(nt, 1)


@pytest.mark.parametrize("given, expected", [
    ({}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": str(threads.SPIN_COUNT)}),
    ({"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5"}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}),
])
def test_workers_spin_a_bounded_while_unless_the_environment_says_otherwise(given, expected):
    """Importing the thread module (before numba's threading layer loads) sets a bounded spin only
    when the environment names no wait policy; a caller's policy or spin count is kept."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(given)
    code = ("import json, os; import vindex3.codecs.threads; "
            "print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == expected
