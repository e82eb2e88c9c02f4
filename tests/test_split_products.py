"""Large products of a pass split into blocks fixed by their shape and shared among the pass's
threads (`threads.gemm`, BLAS held at one thread): the same bytes at every thread count, within a
dot product's rounding bound of one whole BLAS call, and the same prefill at any thread count."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import vindex3
from vindex3.codecs import threads
from vindex3.exec import engine

pytestmark = pytest.mark.numeric

F32 = np.float32
rng = np.random.default_rng(7)


class _Recorder:
    """The pool, counting the parts handed to it."""

    def __init__(self, pool):
        self.parts = 0
        self.pool = pool

    def submit(self, fn, *a, **k):
        self.parts += 1
        return self.pool.submit(fn, *a, **k)


@pytest.fixture
def restore():
    yield
    threads.set_count(None)


@pytest.fixture
def recorder(monkeypatch):
    r = _Recorder(threads._workers())
    monkeypatch.setattr(threads, "_workers", lambda: r)
    return r


# (T, rows, cols): prompt-sized passes over SmolLM2's and a 1.1B model's shapes, odd sizes, and a
# product just past the split threshold in each part
SHAPES = [(512, 576, 576), (512, 192, 576), (512, 1536, 576), (512, 576, 1536), (300, 1000, 333),
          (64, 576, 576), (17, 2048, 2048), (129, 5632, 64), (9, 49152, 576)]


def _dot_bound(x, W):
    """Bound on |a float32 dot product - the exact one| for any summation order: gamma_K of the
    sum of |x_k w_k| (gamma_K = K u / (1 - K u), u = 2^-24), twice over for two float32 results."""
    K = x.shape[1]
    u = 2.0**-24
    return 2 * (K * u / (1 - K * u)) * (np.abs(x).astype(np.float64) @ np.abs(W).T.astype(np.float64))


@pytest.mark.parametrize("T,rows,cols", SHAPES)
def test_a_split_product_has_the_same_bytes_at_every_thread_count(T, rows, cols, restore, recorder):
    """The blocks are a function of the shape: one thread computing them in turn, two or three
    sharing them, and the blocks as separate BLAS calls give the same bytes (into a fresh array
    or a strided slice of a larger one); against one whole BLAS call they are within a dot
    product's rounding bound (equal bytes there are not promised: OpenBLAS's Haswell/Zen kernels
    sum in an order that depends on the whole product's shape)."""
    W = rng.standard_normal((rows, cols)).astype(F32)
    x = rng.standard_normal((T, cols)).astype(F32)
    cuts = threads.gemm_cuts(T, cols, rows)
    assert len(cuts) - 1 == min(threads.GEMM_BLOCKS, rows // 64) > 1, "every shape here is large enough to split"
    assert cuts == sorted(cuts) and all(c % 16 == 0 for c in cuts[1:-1])
    with threadpool_limits(1, "blas"):
        whole = x @ W.T
        blocks = np.concatenate([x @ W.T[:, a:b] for a, b in itertools.pairwise(cuts)], axis=1)
        got = {}
        for n in (1, 2, 3):
            threads.set_count(n)
            before = recorder.parts
            with threads.SplitProducts():
                split = threads.gemm(x, W.T)
                out = np.full((T, rows + 5), np.nan, F32)
                threads.gemm(x, W.T, out=out[:, 2 : 2 + rows])
            assert recorder.parts - before == 2 * (min(n, len(cuts) - 1) - 1)  # two calls; the caller keeps one block
            assert np.isnan(out[:, :2]).all() and np.isnan(out[:, -3:]).all()
            got[n] = (split.tobytes(), out[:, 2 : 2 + rows].tobytes())
    assert got[1] == got[2] == got[3] == (blocks.tobytes(), blocks.tobytes())
    assert np.all(np.abs(blocks.astype(np.float64) - whole) <= _dot_bound(x, W))


def test_the_cuts_are_a_function_of_the_shape_alone(restore):
    for n in (1, 2, 5):
        threads.set_count(n)
        with threads.SplitProducts():
            assert threads.gemm_cuts(512, 576, 1536) == [0, 768, 1536]
            assert threads.gemm_cuts(64, 576, 192) == [0, 192]  # 7.1M multiply-adds: one call
            assert threads.gemm_cuts(512, 576, 100) == [0, 100]  # too few columns for two blocks of 64


def test_small_products_and_one_thread_do_not_split(restore, recorder):
    W = rng.standard_normal((192, 576)).astype(F32)
    x = rng.standard_normal((64, 576)).astype(F32)  # 7.1M multiply-adds: one part's worth
    threads.set_count(2)
    with threads.SplitProducts():
        threads.gemm(x, W.T)
    big = rng.standard_normal((512, 576)).astype(F32)
    threads.gemm(big, W.T)  # outside a pass: its blocks in turn in the calling thread
    threads.set_count(1)
    with threads.SplitProducts():
        threads.gemm(big, W.T)
    assert recorder.parts == 0


def test_a_part_that_fails_in_the_pool_raises_in_the_caller(restore):
    """The caller's own part (the first columns) succeeds, the pool's part does not fit its slice
    of ``out``: the pool's error reaches the caller, which waited for it."""
    threads.set_count(2)
    x = rng.standard_normal((512, 576)).astype(F32)
    bad = np.zeros((576, 1536), np.float32)
    with threads.SplitProducts(), pytest.raises(ValueError):
        threads.gemm(x, bad, out=np.empty((512, 1535), F32))  # out of the wrong shape: refused by numpy


def test_a_bad_thread_count_is_refused_before_blas_is_touched(restore, monkeypatch):
    from vindex3.errors import ConfigError

    before = [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"]
    monkeypatch.setenv("VINDEX3_DECODE_THREADS", "two")
    threads.set_count(None)
    with pytest.raises(ConfigError, match="VINDEX3_DECODE_THREADS"), engine.small_pass_threads():
        pass
    assert [i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"] == before
    monkeypatch.delenv("VINDEX3_DECODE_THREADS")


def test_a_small_pass_holds_blas_at_one_thread(restore):
    threads.set_count(2)
    with engine.small_pass_threads():
        counts = {i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"}
    assert counts <= {1}
    assert engine.decode_threads() == 2


@pytest.mark.parametrize("T", [200, engine.SMALL_PASS + 88])
def test_a_prompt_prefills_to_the_same_bytes_at_one_and_two_threads(smollm2_container, restore, recorder, T):
    """SmolLM2 in float32: a prompt's logits and its KV rows, with the products split over two
    threads and at one (a pass longer than SMALL_PASS shares its blocks among every core the
    process may use even at one decode thread); the split must have happened at two."""
    ex = vindex3.open(smollm2_container).executor()
    ids = [100 + (i * 37) % 40000 for i in range(T)]

    def run():
        st = ex.start()
        logits = st.prefill(ids)
        kv = [(ls.ops["mixer"].kt[:, :, : ls.ops["mixer"].end].tobytes(), ls.ops["mixer"].v[:, : ls.ops["mixer"].end].tobytes())
              for ls in st.state.layers.values()]
        return logits.tobytes(), kv

    threads.set_count(1)
    one = run()
    assert engine.pass_threads(T) == (1 if T <= engine.SMALL_PASS else threads.usable_cores())
    assert (recorder.parts > 0) == (engine.pass_threads(T) > 1)
    threads.set_count(2)
    at_one = recorder.parts
    two = run()
    assert recorder.parts > at_one
    assert two == one


def test_a_long_pass_holds_blas_at_one_thread_at_one_decode_thread(smollm2_container, restore, monkeypatch):
    """A pass longer than SMALL_PASS at the default decode count runs in the executor's limit
    too (BLAS at one thread, products in blocks): no pass is left to BLAS's own threads, whose
    split would make its bytes depend on BLAS's count."""
    seen = []
    real = threads.gemm

    def spy(x, bT, out=None):
        seen.append({i["num_threads"] for i in threadpool_info() if i.get("user_api") == "blas"})
        return real(x, bT, out=out)

    monkeypatch.setattr(threads, "gemm", spy)
    threads.set_count(1)
    ex = vindex3.open(smollm2_container).executor()
    ex.start().prefill([100 + (i * 37) % 40000 for i in range(engine.SMALL_PASS + 8)])
    assert seen and all(s <= {1} for s in seen)
