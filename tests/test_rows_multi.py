"""Rows kernels that multiply several activation rows in one pass over a weight
(vindex3.codecs.intrinsics: `float_kernel` for f32 and bf16, the q8 kernels for int8 and q4).

Invariant (``a_position_does_not_depend_on_its_companions``): the bytes of one activation
row's product do not depend on how many rows ride along nor on which — a batched stream equals
a lone stream and a verified draft position equals a decode step. The float order is written
out in LLVM vector IR, so it is also the same on every compile target: the suite compares the
vector path with the numba-loop path of the same order in one process (and, run again under
NUMBA_CPU_NAME=generic, on that target), and a child process compiled for generic and for
haswell hands back bytes equal to this process's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vindex3 import codecs
from vindex3.codecs import intrinsics as I

pytestmark = pytest.mark.numeric

F32 = np.float32
ROOT = Path(__file__).resolve().parents[1]
rng = np.random.default_rng(31)


def ref_float(w: np.ndarray, x: np.ndarray, L: int) -> np.ndarray:
    """The documented order in numpy, float32 step by step: L accumulators per position, chunk
    by chunk (the tail to lanes 0 ..), then the tree of halves."""
    O, K = w.shape
    y = np.empty((x.shape[0], O), F32)
    for t in range(x.shape[0]):
        acc = np.zeros((O, L), F32)
        for c in range(0, K, L):
            n = min(L, K - c)
            acc[:, :n] = acc[:, :n] + w[:, c : c + n] * x[t, c : c + n]
        n = L // 2
        while n >= 1:
            acc[:, :n] = acc[:, :n] + acc[:, n : 2 * n]
            n //= 2
        y[t] = acc[:, 0]
    return y


def _float_weight(kind: str, O: int, K: int):
    W = rng.standard_normal((O, K)).astype(F32)
    if kind == "f32":
        return W, W
    h = codecs.get("bf16").weight(codecs.get("bf16").encode(W), W.shape).h
    return h, (h.astype(np.uint32) << 16).view(F32)


def _run(kind, path, w, x, parallel=False):
    y = np.empty((x.shape[0], w.shape[0]), F32)
    I.float_kernel(kind, path, parallel)(w, np.ascontiguousarray(x), y, I.ROWS_PER_TASK)
    return y


@pytest.mark.parametrize("kind", ["f32", "bf16"])
@pytest.mark.parametrize("K", [7, 64, 100, 576])
def test_float_rows_are_the_documented_order_on_both_paths(kind, K):
    w, wf = _float_weight(kind, 37, K)
    x = rng.standard_normal((11, K)).astype(F32)
    want = ref_float(wf, x, I.FLOAT_GEOMETRY[kind][0])
    for path in ("vector", "plain"):
        assert np.array_equal(_run(kind, path, w, x), want), path


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_a_position_does_not_depend_on_its_companions(kind):
    K = 576
    w, _ = _float_weight(kind, 70, K)
    x = rng.standard_normal((12, K)).astype(F32)
    lone = np.stack([_run(kind, "vector", w, x[t : t + 1])[0] for t in range(12)])
    for T in range(1, 13):
        assert np.array_equal(_run(kind, "vector", w, x[:T]), lone[:T]), T
    others = rng.standard_normal((7, K)).astype(F32) * 1e6  # different companions, far larger
    mixed = np.concatenate([others[:3], x[5:6], others[3:]])
    assert np.array_equal(_run(kind, "vector", w, mixed)[3], lone[5])


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_float_rows_do_not_depend_on_the_thread_count(kind):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); thread independence needs 2")
    w, _ = _float_weight(kind, 300, 192)
    x = rng.standard_normal((5, 192)).astype(F32)
    serial = _run(kind, "vector", w, x)
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            assert np.array_equal(_run(kind, "vector", w, x, parallel=True), serial)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("kind", ["f32", "bf16"])
def test_fused_float_products_are_the_bytes_of_one_product_per_weight(kind):
    from vindex3.codecs.base import products

    c = codecs.get(kind)
    ws = []
    for O in (37, 16, 16):
        raw = c.encode(rng.standard_normal((O, 96)).astype(F32))
        raw.flags.writeable = False  # as a mapped segment hands them out
        ws.append(c.weight(raw, (O, 96)))
    fused = products(ws)
    assert "fused" in fused.__qualname__  # the one-launch kernel ran
    for T in (1, 3, 8):
        x = rng.standard_normal((T, 96)).astype(F32)
        for g, w in zip(fused(x), ws):
            assert np.array_equal(g, w.mm(x))


_CHILD = """
import json, numpy as np
from vindex3 import codecs
rng = np.random.default_rng(5)
W = rng.standard_normal((40, 100)).astype(np.float32)
x = rng.standard_normal((3, 100)).astype(np.float32)
out = {}
for enc in ("f32", "bf16"):
    c = codecs.get(enc)
    out[enc] = c.weight(c.encode(W), W.shape).mm(x).tobytes().hex()
print(json.dumps(out))
"""


def _child(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _CHILD], check=False, env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_float_products_are_the_same_bytes_on_every_compile_target():
    here = {}
    r = np.random.default_rng(5)
    W = r.standard_normal((40, 100)).astype(F32)
    x = r.standard_normal((3, 100)).astype(F32)
    for enc in ("f32", "bf16"):
        c = codecs.get(enc)
        here[enc] = c.weight(c.encode(W), W.shape).mm(x).tobytes().hex()
    generic = _child({"NUMBA_CPU_NAME": "generic"})
    haswell = _child({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt"})
    assert generic == here == haswell


# -- int8 and q4 under activations = 'q8' -------------------------------------------------------
RUNNABLE = [p for p in I.PATHS if I.available(p)]


def _int_run(kind, w, x, path):
    from vindex3.codecs.kernels import F16_TABLE

    y = np.empty((x.shape[0], w.rows), F32)
    k = I.rows_kernel(kind, path)
    x = np.ascontiguousarray(x)
    if kind == "i8":
        k(w.q, w.s, x, y, I.ROWS_PER_TASK)
    else:
        k(w.qs, w.d, w.m, F16_TABLE, x, y, I.ROWS_PER_TASK)
    return y


@pytest.mark.parametrize("kind", ["i8", "q4"])
@pytest.mark.parametrize("K", [32, 96, 576])
@pytest.mark.parametrize("path", RUNNABLE)
def test_a_q8_position_does_not_depend_on_its_companions(kind, K, path):
    c = codecs.get("int8" if kind == "i8" else "q4")
    w = c.weight(c.encode(rng.standard_normal((40, K)).astype(F32)), (40, K))
    x = rng.standard_normal((12, K)).astype(F32)
    lone = np.stack([_int_run(kind, w, x[t : t + 1], "plain")[0] for t in range(12)])
    for T in (1, 2, 5, 8, 9, 12):
        assert np.array_equal(_int_run(kind, w, x[:T], path), lone[:T]), T
    others = rng.standard_normal((4, K)).astype(F32) * 1e4
    mixed = np.concatenate([others[:2], x[7:8], others[2:]])
    assert np.array_equal(_int_run(kind, w, mixed, path)[2], lone[7])


def test_the_vector_kernels_prefetch_the_weight_stream_and_the_plain_ones_do_not():
    """Prefetch (intrinsics.PREFETCH) is wired into every vector dots kernel: the compiled
    kernel's LLVM IR calls llvm.prefetch; the numba-loop paths never do. Values are the
    other tests' business (a prefetch changes none)."""
    from vindex3.codecs.kernels import F16_TABLE

    K, O = 96, 20
    x = rng.standard_normal((2, K)).astype(F32)

    def ir_of(kernel, *args):
        kernel(*args)
        return "\n".join(kernel.inspect_llvm().values())

    for kind in ("f32", "bf16"):
        w, _ = _float_weight(kind, O, K)
        for path in ("vector", "plain"):
            k = I.float_kernel(kind, path)
            text = ir_of(k, w, x, np.empty((2, O), F32), I.ROWS_PER_TASK)
            assert ("llvm.prefetch" in text) == (path == "vector"), (kind, path)
    W = rng.standard_normal((O, K)).astype(F32)
    i8 = codecs.get("int8").weight(codecs.get("int8").encode(W), W.shape)
    q4 = codecs.get("q4").weight(codecs.get("q4").encode(W), W.shape)
    for path in [p for p in I.PATHS if I.available(p)]:
        a = ir_of(I.rows_kernel("i8", path), i8.q, i8.s, x, np.empty((2, O), F32), I.ROWS_PER_TASK)
        b = ir_of(I.rows_kernel("q4", path), q4.qs, q4.d, q4.m, F16_TABLE, x, np.empty((2, O), F32), I.ROWS_PER_TASK)
        assert ("llvm.prefetch" in a) == ("llvm.prefetch" in b) == (path != "plain"), path


def test_a_cpus_own_prefetch_entry_applies_to_its_kind_and_positions_only(monkeypatch):
    """PREFETCH_BY_CPU overrides PREFETCH for the named CPU, kind and position count, and for
    nothing else; the compile target's name is NUMBA_CPU_NAME's when that is set."""
    from numba.core import config

    assert I.prefetch_distance("f32", 1, cpu="znver4") == 0
    assert I.prefetch_distance("f32", 8, cpu="znver4") == I.PREFETCH["f32"]
    assert I.prefetch_distance("i8", 1, cpu="znver4") == I.PREFETCH["i8"]
    assert I.prefetch_distance("f32", 2, cpu="znver3") == 0  # Zen 3: f32 at one and two positions only
    assert I.prefetch_distance("f32", 4, cpu="znver3") == I.PREFETCH["f32"]
    assert I.prefetch_distance("bf16", 1, cpu="znver3") == I.PREFETCH["bf16"]
    for kind in I.PREFETCH:
        assert I.prefetch_distance(kind, 1, cpu="a-cpu-with-no-entry") == I.PREFETCH[kind]
    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    assert I.target_cpu() == "haswell"
    monkeypatch.setattr(config, "CPU_NAME", "znver3")  # the compile target's own entry is the one read
    assert I.prefetch_distance("f32", 1) == 0 and I.prefetch_distance("f32", 8) == I.PREFETCH["f32"]
    assert I._tile("f32", 8) == (1, 8) and I._tile("q4", 8) == (1, 8)


def test_a_cpus_own_tile_entry_applies_to_its_kinds_only():
    """TILE_MIN_T_BY_CPU moves the first tiled position count for the named CPU and kind only
    (MAX_T + 1: no pass tiles); the default rule still tiles every kind but bf16 by 8, and the
    tiles' bytes are tested below with explicit options whatever the host's rule."""
    assert I.tile_min_t("f32", cpu="znver4") == 7 and I.tile_min_t("i8", cpu="znver4") == 5
    assert I.tile_min_t("q4", cpu="znver4") == I.TILE_MIN_T["q4"]
    assert all(I.tile_min_t(k, cpu="znver3") == I.MAX_T + 1 for k in ("f32", "i8", "q4"))
    for kind in I.TILE_MIN_T:
        assert I.tile_min_t(kind, cpu="a-cpu-with-no-entry") == I.TILE_MIN_T[kind]
    assert all(t <= I.MAX_T for k, t in I.TILE_MIN_T.items() if k != "bf16"), I.TILE_MIN_T
    for table in I.TILE_MIN_T_BY_CPU.values():
        assert all(1 <= t <= I.MAX_T + 1 for t in table.values()), table


@pytest.mark.parametrize("T", [1, 3, 8])
def test_a_kernel_without_prefetch_gives_the_same_bytes(T):
    """Prefetch moves when bytes arrive, never a value: the f32 kernel built with no prefetch at
    all (what PREFETCH_BY_CPU gives Zen 4's f32 at one position) equals the default's bytes."""
    L, PT = I.FLOAT_GEOMETRY["f32"]
    w, _ = _float_weight("f32", 37, 576)
    x = rng.standard_normal((T, 576)).astype(F32)
    got = {}
    for pf in (None, 0):
        y = np.empty((T, 37), F32)
        I._make_rows_float(I._make_float_dots("f32", L, PT, pf=pf), PT, False)(w, x, y, I.ROWS_PER_TASK)
        got[pf] = y
    assert np.array_equal(got[None], got[0])


# -- register tiles: two weight rows side by side, positions in groups (intrinsics._tile) --------
# The module's rule and two forced tiles (rows 3 with groups of 3 leaves remainders of rows and
# of positions; rows 1 with one group of 8 is the walk the kernels had before tiles), against
# the numba-loop path: 37 rows make a last task of 5 (an odd row left after the pairs), and
# K = 7 / 100 (float) and 96 (q8: a tail block) leave tails.
TILES = [{}, {"rows": 3, "group": 3}, {"rows": 1, "group": 8}]


@pytest.mark.parametrize("tile", TILES, ids=["rule", "r3g3", "r1g8"])
@pytest.mark.parametrize("K", [7, 100, 576])
def test_float_tiles_are_the_bytes_of_the_plain_path(tile, K):
    L, PT = I.FLOAT_GEOMETRY["f32"]
    tiled = I._make_rows_float(I._make_float_dots("f32", L, PT, **tile), PT, False)
    w, _ = _float_weight("f32", 37, K)
    x = rng.standard_normal((11, K)).astype(F32)
    for T in range(1, 12):
        got = np.empty((T, 37), F32)
        tiled(w, x[:T], got, I.ROWS_PER_TASK)
        assert np.array_equal(got, _run("f32", "plain", w, x[:T])), T


# a target without a vector integer path (NUMBA_CPU_NAME=generic) has no tile to compare: say so
VECTOR_PATHS = [p for p in RUNNABLE if p != "plain"] or [pytest.param(
    None, marks=pytest.mark.skip(reason="the compile target runs no vector integer path (only 'plain', "
                                        "whose rows are compared with the documented order elsewhere)"))]


@pytest.mark.parametrize("tile", TILES, ids=["rule", "r3g3", "r1g8"])
@pytest.mark.parametrize("kind", ["i8", "q4"])
@pytest.mark.parametrize("K", [96, 576])
@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_q8_tiles_are_the_bytes_of_the_plain_path(tile, kind, K, path):
    from vindex3.codecs.kernels import F16_TABLE

    c = codecs.get("int8" if kind == "i8" else "q4")
    w = c.weight(c.encode(rng.standard_normal((37, K)).astype(F32)), (37, K))
    if kind == "i8":
        k = I._make_rows_i8(I._make_i8_dots(path, **tile), False)
        run = lambda x, y: k(w.q, w.s, x, y, I.ROWS_PER_TASK)
    else:
        k = I._make_rows_q4(I._make_q4_dots(path, **tile), False)
        run = lambda x, y: k(w.qs, w.d, w.m, F16_TABLE, x, y, I.ROWS_PER_TASK)
    x = rng.standard_normal((11, K)).astype(F32)
    for T in range(1, 12):
        got = np.empty((T, 37), F32)
        run(np.ascontiguousarray(x[:T]), got)
        assert np.array_equal(got, _int_run(kind, w, x[:T], "plain")), T


def test_a_tile_refuses_an_empty_shape():
    with pytest.raises(ValueError, match="at least one row"):
        I._tile("f32", 8, rows=0)
    assert I._tile("f32", 8) == ((2, I.TILE_GROUP) if I.tile_min_t("f32") <= 8 else (1, 8))
    assert I._tile("f32", 8, rows=2, group=4) == (2, 4)
    assert I._tile("f32", 2) == (1, 2)
    assert I._tile("bf16", 4) == (1, 4)


def test_a_cpus_own_prefetch_locality_applies_to_its_kinds_only():
    """PREFETCH_LOCALITY_BY_CPU moves int8's prefetch to the outer cache levels on Zen 4 only;
    every other CPU and kind keeps locality 3 (all levels)."""
    assert I.prefetch_locality("i8", cpu="znver4") == 2
    for kind in ("f32", "bf16", "q4"):
        assert I.prefetch_locality(kind, cpu="znver4") == 3
    for kind in I.PREFETCH:
        assert I.prefetch_locality(kind, cpu="a-cpu-with-no-entry") == 3
    assert all(loc in (0, 1, 2, 3) for table in I.PREFETCH_LOCALITY_BY_CPU.values() for loc in table.values())


@pytest.mark.parametrize("path", VECTOR_PATHS)
@pytest.mark.parametrize("T", [1, 3, 8])
def test_every_prefetch_locality_gives_the_same_bytes(T, path):
    """Where a prefetch puts a line changes no value: the int8 kernel built with each locality
    (and without prefetch) equals the plain path's bytes, and its IR asks for the locality built."""
    c = codecs.get("int8")
    w = c.weight(c.encode(rng.standard_normal((37, 576)).astype(F32)), (37, 576))
    x = np.ascontiguousarray(rng.standard_normal((T, 576)).astype(F32))
    want = _int_run("i8", w, x, "plain")
    for loc, pf in ((3, None), (2, None), (1, None), (0, None), (3, 0)):
        k = I._make_rows_i8(I._make_i8_dots(path, pf=pf, locality=loc), False)
        y = np.empty((T, 37), F32)
        k(w.q, w.s, x, y, I.ROWS_PER_TASK)
        assert np.array_equal(y, want), (loc, pf)
        if pf is None:
            ir = next(iter(k.inspect_llvm().values()))
            assert f"i32 0, i32 {loc}, i32 1)" in ir, loc

