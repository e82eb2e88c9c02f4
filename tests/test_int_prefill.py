"""Prefill-sized products under ``activations = 'q8'`` (vindex3.codecs.inttiles): every position
of a prompt gets exactly the bytes it gets when decoded alone (the rows kernel with T = 1),
whatever T, the register tile, the integer dot path, the compile target and the thread count;
under ``'exact'`` prefill keeps decoded tiles and BLAS."""

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
from vindex3.codecs import inttiles as IT
from vindex3.codecs.kernels import F16_TABLE
from vindex3.codecs.rowwise import RowWeight

pytestmark = pytest.mark.numeric

F32 = np.float32
ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = [p for p in I.PATHS if I.available(p)]
ENC = {"i8": "int8", "q4": "q4"}
rng = np.random.default_rng(2026)


def _weight(kind: str, O: int, K: int):
    W = rng.standard_normal((O, K)).astype(F32)
    W[1, :32] = 0.0  # a zero block: scale 0
    c = codecs.get(ENC[kind])
    return c.weight(c.encode(W), (O, K))


def _x(T: int, K: int) -> np.ndarray:
    x = (rng.standard_normal((T, K)) * rng.uniform(0.01, 30, (T, 1))).astype(F32)
    x[T // 2, : min(K, 32)] = 0.0  # a zero activation block
    return x


def _one_by_one(w, x) -> np.ndarray:
    """Each position decoded alone: T = 1 products through the rows kernel."""
    return np.concatenate([w.mm(x[t : t + 1]) for t in range(x.shape[0])])


def _args(kind, w):
    return (w.q, w.s) if kind == "i8" else (w.qs, w.d, w.m, F16_TABLE)


def _tiles(kind, w, x, path=None, parallel=False, tile=None) -> np.ndarray:
    y = np.full((x.shape[0], w.rows), np.nan, F32)
    IT.tiles_kernel(kind, path, parallel, tile)(*_args(kind, w), x, y, I.ROWS_PER_TASK)
    return y


@pytest.mark.parametrize("K", [32, 96, 576])
def test_the_vector_quantizer_gives_the_bytes_of_quantize_x(K):
    x = _x(40, K)
    b = slice(0, 32)
    x[1, b] = 0.0
    x[2, b] = -0.0
    x[3, 7] = np.inf
    x[4, 9] = np.nan
    x[5, b] = -np.inf
    x[6, b] = np.float32(1e-42)  # subnormal magnitudes
    x[7, b] = np.arange(32, dtype=F32) - F32(15.5)  # with x[7, 0] = 127: d = 1, ties at every .5
    x[7, 0] = 127.0
    x[8, 3] = F32(3.4e38)
    T = x.shape[0]
    outs = []
    for f in (I.quantize_x, IT.quantize):
        o = (np.empty((T, K), np.int8), np.empty((T, K // 32), F32), np.empty((T, K // 4), np.int32),
             np.empty((T, K // 32), F32))
        f(x, *o)
        outs.append(o)
    for a, c in zip(*outs):
        assert a.tobytes() == c.tobytes()
    assert np.isnan(outs[1][1][3, 0]) and (outs[1][0][3, :32] == 0).all()
    assert (outs[1][0][7, 1:32] == np.rint(np.arange(1, 32) - 15.5)).all()  # ties to even


@pytest.mark.parametrize("kind", ["i8", "q4"])
@pytest.mark.parametrize("K", [32, 96, 160, 576])  # one block; tail blocks (96, 160); SmolLM2's width
@pytest.mark.parametrize("T", [9, 17, 37, 64])
def test_a_q8_prefill_gives_the_bytes_of_its_positions_decoded_one_by_one(kind, K, T):
    w = _weight(kind, 45, K).with_activations("q8")  # 45 rows: not a multiple of a tile nor a task
    x = _x(T, K)
    assert T > w.small_t  # the prefill branch of mm
    y = w.mm(x)
    assert y.dtype == F32 and y.shape == (T, 45)
    assert np.array_equal(y, _one_by_one(w, x))  # byte for byte (NaN-free: equal means equal)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("kind", ["i8", "q4"])
@pytest.mark.parametrize("path", RUNNABLE)
def test_every_path_and_tile_gives_the_bytes_of_the_rows_kernel(kind, path):
    K, T, O = 160, 21, 38
    w = _weight(kind, O, K)
    x = _x(T, K)
    rows = np.empty((T, O), F32)
    I.rows_kernel(kind, path)(*_args(kind, w), x, rows, I.ROWS_PER_TASK)
    for tile in (None, (1, 1), (1, 4), (4, 4), (2, 8), (3, 5), (8, 2)):
        assert np.array_equal(_tiles(kind, w, x, path, tile=tile), rows), tile


def test_a_paths_own_tile_entry_applies_to_that_path_only():
    """TILE_BY_PATH picks the register tile per path (AVX2's 16 registers take one row), every
    entry is a tile the kernel accepts, and a path without an entry keeps TILE."""
    assert IT.default_tile("i8", "avx2") == (1, 4) and IT.default_tile("q4", "avx2") == (1, 4)
    for kind in IT.TILE:
        assert IT.default_tile(kind, "vnni512") == IT.TILE[kind]
    for table in IT.TILE_BY_PATH.values():
        for kind, (R, P) in table.items():
            assert kind in IT.TILE and R >= 1 and 1 <= P <= I.MAX_T


@pytest.mark.parametrize("kind", ["i8", "q4"])
@pytest.mark.parametrize("path", [p for p in RUNNABLE if p != "plain"] or [pytest.param(
    None, marks=pytest.mark.skip(reason="the compile target runs no vector integer path"))])
def test_a_kernel_asked_for_no_tile_is_built_with_its_paths_tile(kind, path):
    """tiles_kernel without ``tile`` builds the kernel of `default_tile` for its path (the one it
    caches under that tile), not TILE's."""
    k = IT.tiles_kernel(kind, path)
    assert IT._TILES[(kind, path, False, *IT.default_tile(kind, path))] is k


def test_an_unknown_kind_or_path_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown prefill tile kind 'f32'"):
        IT.tiles_kernel("f32", "plain")
    with pytest.raises(ValueError, match="unknown integer dot path 'avx9'"):
        IT.tiles_kernel("i8", "avx9")


def test_a_tile_of_more_positions_than_a_pass_holds_is_refused_by_name():
    with pytest.raises(ValueError, match="positions must be 1..8"):
        IT.tiles_kernel("i8", "plain", tile=(2, 9))
    with pytest.raises(ValueError, match="rows >= 1"):
        IT.tiles_kernel("q4", "plain", tile=(0, 4))


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_a_nonfinite_activation_gives_nan_where_a_decode_step_does(kind):
    w = _weight(kind, 20, 96).with_activations("q8")
    x = _x(12, 96)
    x[5, 40] = np.inf
    y = w.mm(x)
    alone = _one_by_one(w, x)
    assert np.isnan(y[5, 2:]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()
    assert y.tobytes() == alone.tobytes()


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_exact_prefill_keeps_decoded_tiles_and_blas(kind):
    w = _weight(kind, 45, 160)
    assert w.with_activations("exact") is w and type(w)._tiles is RowWeight._tiles
    x = _x(17, 160)
    tiles = np.empty((17, 45), F32)
    RowWeight._tiles(w, x, tiles)
    y = w.mm(x)
    assert np.array_equal(y, tiles)
    # the float product of the decoded weight (BLAS may round differently, not by more)
    ref = x.astype(np.float64) @ w.dense().astype(np.float64).T
    assert np.allclose(y, ref, rtol=1e-4, atol=1e-3 * np.abs(ref).max())
    assert not np.array_equal(y, w.with_activations("q8").mm(x))  # q8 does change the products


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_q8_prefill_does_not_depend_on_the_thread_count(kind):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); thread independence needs 2")
    w = _weight(kind, 200, 576)
    x = _x(33, 576)
    serial = _tiles(kind, w, x)
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            assert np.array_equal(_tiles(kind, w, x, parallel=True), serial), n
    finally:
        numba.set_num_threads(before)


_CHILD = """
import json, numpy as np
from vindex3 import codecs
from vindex3.codecs import intrinsics as I
rng = np.random.default_rng(7)
W = rng.standard_normal((45, 160)).astype(np.float32)
x = rng.standard_normal((19, 160)).astype(np.float32)
out = {"path": I.chosen()}
for enc in ("int8", "q4"):
    c = codecs.get(enc)
    w = c.weight(c.encode(W), W.shape).with_activations("q8")
    y = w.mm(x)
    alone = np.concatenate([w.mm(x[t : t + 1]) for t in range(len(x))])
    out[enc] = y.tobytes().hex()
    out[enc + "_alone"] = bool(np.array_equal(y, alone))
print(json.dumps(out))
"""


def _child(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU") and k != "VINDEX3_INTDOT_PATH"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _CHILD], check=False, env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_q8_prefill_bytes_are_the_same_on_every_compile_target():
    host = _child({})
    generic = _child({"NUMBA_CPU_NAME": "generic"})
    haswell = _child({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt"})
    assert generic["path"] == "plain"  # no tile kernel: the rows kernel over every position
    if I._is_x86():
        assert haswell["path"] == "avx2"
    for enc in ("int8", "q4"):
        assert host[enc + "_alone"] and generic[enc + "_alone"] and haswell[enc + "_alone"], enc
        assert generic[enc] == host[enc] == haswell[enc], enc
