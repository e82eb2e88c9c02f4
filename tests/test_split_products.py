"""Large products of a decode-sized pass split over the decode threads (`threads.gemm`, BLAS held
at one thread): the same bytes as one BLAS call, and the same prefill at any thread count."""

from __future__ import annotations

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


@pytest.mark.parametrize("T,rows,cols", SHAPES)
@pytest.mark.parametrize("n", [2, 3])
def test_a_split_product_is_the_bytes_of_one_blas_call(T, rows, cols, n, restore, recorder):
    W = rng.standard_normal((rows, cols)).astype(F32)
    x = rng.standard_normal((T, cols)).astype(F32)
    threads.set_count(n)
    with threadpool_limits(1, "blas"):
        whole = x @ W.T
        with threads.SplitProducts():
            split = threads.gemm(x, W.T)
            out = np.full((T, rows + 5), np.nan, F32)
            threads.gemm(x, W.T, out=out[:, 2 : 2 + rows])
    parts = min(n, rows // 64, T * rows * cols // threads.GEMM_SPLIT_MIN)
    assert parts > 1, "every shape here is large enough to split"
    assert recorder.parts == 2 * (parts - 1)  # two calls, each handing all parts but one to the pool
    assert split.tobytes() == whole.tobytes()
    assert out[:, 2 : 2 + rows].tobytes() == whole.tobytes() and np.isnan(out[:, :2]).all() and np.isnan(out[:, -3:]).all()


def test_small_products_and_one_thread_do_not_split(restore, recorder):
    W = rng.standard_normal((192, 576)).astype(F32)
    x = rng.standard_normal((64, 576)).astype(F32)  # 7.1M multiply-adds: one part's worth
    threads.set_count(2)
    with threads.SplitProducts():
        threads.gemm(x, W.T)
    big = rng.standard_normal((512, 576)).astype(F32)
    threads.gemm(big, W.T)  # outside a small pass: BLAS's own threads, no split
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
    threads and at one (a pass longer than SMALL_PASS: BLAS's own threads at one decode thread,
    the split at two); the split must have happened."""
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
    assert recorder.parts == 0
    threads.set_count(2)
    two = run()
    assert recorder.parts > 0
    assert two == one
