"""Large products of a pass split into blocks fixed by their shape and shared among the pass's
threads (`threads.gemm`, BLAS held at one thread): the same bytes at every thread count, within a
dot product's rounding bound of one whole BLAS call, and the same prefill at any thread count."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

import vindex3
from vindex3.codecs import blasblocks, threads
from vindex3.exec import engine

pytestmark = pytest.mark.numeric

F32 = np.float32
rng = np.random.default_rng(7)


class _Recorder:
    """The Python pool, counting the parts handed to it, and the products run as one region of
    numba's pool (vindex3.codecs.blasblocks), counting those."""

    def __init__(self, pool, region):
        self.parts = 0
        self.regions = 0
        self.pool = pool
        self._region = region

    def submit(self, fn, *a, **k):
        self.parts += 1
        return self.pool.submit(fn, *a, **k)

    def region(self, *a):
        ok = self._region(*a)
        self.regions += bool(ok)
        return ok

    @property
    def shared(self) -> int:
        """Products or parts given to threads other than the caller's."""
        return self.parts + self.regions


@pytest.fixture
def restore():
    yield
    threads.set_count(None)


@pytest.fixture(params=["region", "python"])
def route(request, monkeypatch):
    """How blocks are shared: one region of numba's pool calling numpy's own BLAS where it can
    be called (every CI machine: numpy's wheels carry it), or the pool of Python threads."""
    if request.param == "python":
        monkeypatch.setattr(blasblocks, "run", lambda *a: False)
    elif blasblocks._sgemm() is None:
        pytest.skip("numpy's BLAS here is not the scipy-openblas ILP64 build whose cblas_sgemm the region calls")
    return request.param


@pytest.fixture
def recorder(monkeypatch, route):
    r = _Recorder(threads._workers(), blasblocks.run)
    monkeypatch.setattr(threads, "_workers", lambda: r)
    monkeypatch.setattr(blasblocks, "run", r.region)
    r.route = route
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
        before = 0
        for n in (1, 2, 3):
            threads.set_count(n)
            with threads.SplitProducts():
                split = threads.gemm(x, W.T)
                out = np.full((T, rows + 5), np.nan, F32)
                threads.gemm(x, W.T, out=out[:, 2 : 2 + rows])
            if recorder.route == "python":  # two calls; the caller keeps one block
                assert recorder.parts - before == 2 * (min(n, len(cuts) - 1) - 1)
            else:  # two calls, each one region (none at one thread)
                assert recorder.regions - before == (2 if n > 1 else 0) and recorder.parts == 0
            before = recorder.shared
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
    assert recorder.shared == 0


def test_a_part_that_fails_in_the_pool_raises_in_the_caller(restore, route):
    """The caller's own part (the first columns) succeeds, the pool's part does not fit its slice
    of ``out``: the pool's error reaches the caller, which waited for it (the region refuses
    such an ``out`` before any pointer is taken, and the Python route then meets it)."""
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
    assert (recorder.shared > 0) == (engine.pass_threads(T) > 1)
    threads.set_count(2)
    at_one = recorder.shared
    two = run()
    assert recorder.shared > at_one
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


def test_every_layout_gives_numpys_block_bytes(restore, recorder):
    """The region's call is numpy's for the block: a weight's transposed view and a C-ordered
    right operand, a left operand with rows further apart than its width, and an output slice
    give ``np.matmul``'s bytes block by block; a left operand in column order (numpy would pass
    it transposed) is left to the Python threads, with the same bytes."""
    T, K, N = 300, 576, 1000
    W = rng.standard_normal((N, K)).astype(F32)
    wide = rng.standard_normal((T, K + 40)).astype(F32)
    cuts = threads.gemm_cuts(T, K, N)
    assert len(cuts) > 2
    threads.set_count(2)
    for x, x_in_region in ((wide[:, :K].copy(), True), (wide[:, 7 : 7 + K], True), (np.asfortranarray(wide[:, :K]), False)):
        for bT in (W.T, np.ascontiguousarray(W.T)):
            with threadpool_limits(1, "blas"):
                want = np.concatenate([np.matmul(x, bT[:, a:b]) for a, b in itertools.pairwise(cuts)], axis=1)
                before = recorder.regions
                with threads.SplitProducts():
                    got = threads.gemm(x, bT)
                    out = np.full((T, N + 3), np.nan, F32)
                    threads.gemm(x, bT, out=out[:, 1 : 1 + N])
            assert got.tobytes() == want.tobytes() and out[:, 1 : 1 + N].tobytes() == want.tobytes()
            assert np.isnan(out[:, 0]).all() and np.isnan(out[:, -2:]).all()
            if recorder.route == "region":
                assert recorder.regions - before == (2 if x_in_region else 0)


def test_the_region_refuses_what_it_must_not_write_through():
    """`blasblocks.run` takes pointers, so it checks first: a read-only ``out`` (it could be a
    read-only mapping), an ``out`` that overlaps an operand (numpy copies such operands first),
    shapes that do not match and cuts that do not cover the columns are all refused (False,
    nothing written) and left to numpy, which copies or names the error; a well-formed product
    runs there."""
    if blasblocks._sgemm() is None:
        pytest.skip("numpy's BLAS here is not the scipy-openblas ILP64 build whose cblas_sgemm the region calls")
    T, K, N = 300, 576, 1000
    W = rng.standard_normal((N, K)).astype(F32)
    x = rng.standard_normal((T, K)).astype(F32)
    cuts = threads.gemm_cuts(T, K, N)
    ro = np.zeros((T, N), F32)
    ro.flags.writeable = False
    buf = np.zeros((T, K + N), F32)
    buf[:, :K] = x
    ok = np.zeros((T, N), F32)
    with threadpool_limits(1, "blas"), threads.launch():
        assert blasblocks.run(x, W.T, ro, cuts, 2) is False
        assert blasblocks.run(buf[:, :K], W.T, buf[:, K - 8 : K - 8 + N], cuts, 2) is False  # out over x
        assert blasblocks.run(x, W.T, np.zeros((T, N - 1), F32), cuts, 2) is False
        assert blasblocks.run(x, W.T, np.zeros((T, N), F32), cuts[:-1], 2) is False  # cuts stop short
        assert blasblocks.run(x, W[:, :-1].T, np.zeros((T, N), F32), cuts, 2) is False  # K differs
        assert blasblocks.run(x, W.T, ok, cuts, 2) is True
    assert not ro.any() and not buf[:, K:].any()
    with threadpool_limits(1, "blas"):  # numpy's call at BLAS's own thread count would sum otherwise
        want = np.concatenate([np.matmul(x, W.T[:, a:b]) for a, b in itertools.pairwise(cuts)], axis=1)
    assert ok.tobytes() == want.tobytes()
