"""Weight encodings: bytes, fidelity, and the verbs kernels use (mm, take, dense, expert).

The oracles are numpy renderings written here from the byte layouts documented in
docs/container.md ("Weight encodings"), and plain float32 products of the decoded tensor."""

from __future__ import annotations

import numpy as np
import pytest

from vindex3 import codecs
from vindex3.codecs import WeightShapeError
from vindex3.errors import UnsupportedEncoding

F32 = np.float32
ALL = ["f32", "bf16", "f16", "int8", "int8h", "q4"]
ROWS = [*ALL, "int8_row"]  # int8_row: the per-row variant, not registered, kept for a measurement
rng = np.random.default_rng(20)


def pad16(n: int) -> int:
    return n + (-n) % 16


def readonly(raw: np.ndarray) -> np.ndarray:
    """The bytes as a read-only buffer, as a memory-mapped segment hands them out."""
    return np.frombuffer(raw.tobytes(), dtype=np.uint8)


# -- independent decoders, from the documented layouts --------------------------------------
def oracle_dense(name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if name == "f32":
        return raw.view("<f4").reshape(shape)
    if name == "bf16":
        return (raw.view("<u2").astype(np.uint32) << 16).view("<f4").reshape(shape)
    if name == "f16":
        return raw.view("<f2").astype(F32).reshape(shape)
    if name == "int8":
        nb = cols // 32
        q = raw[: rows * cols].view(np.int8).reshape(rows, nb, 32)
        off = pad16(rows * cols)
        s = raw[off : off + 4 * rows * nb].view("<f4").reshape(rows, nb, 1)
        return (q.astype(F32) * s).reshape(shape)
    if name == "int8h":
        nb = cols // 32
        q = raw[: rows * cols].view(np.int8).reshape(rows, nb, 32)
        off = pad16(rows * cols)
        s = raw[off : off + 2 * rows * nb].view("<f2").astype(F32).reshape(rows, nb, 1)
        return (q.astype(F32) * s).reshape(shape)
    if name == "int8_row":
        q = raw[: rows * cols].view(np.int8).reshape(rows, cols)
        off = pad16(rows * cols)
        s = raw[off : off + 4 * rows].view("<f4")
        return (q.astype(F32) * s[:, None]).reshape(shape)
    if name == "q4":
        nb = cols // 32
        codes = raw[: rows * cols // 2].reshape(rows, nb, 16)
        o1 = pad16(rows * cols // 2)
        o2 = o1 + pad16(2 * rows * nb)
        d = raw[o1 : o1 + 2 * rows * nb].view("<f2").astype(F32).reshape(rows, nb, 1)
        m = raw[o2 : o2 + 2 * rows * nb].view("<f2").astype(F32).reshape(rows, nb, 1)
        q = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(F32)
        return (d * q + m).reshape(shape)
    raise AssertionError(name)


def codec(name):
    from vindex3.codecs.int8 import Int8RowCodec

    return Int8RowCodec() if name == "int8_row" else codecs.get(name)


def weights(shape, scale=0.05):
    return (rng.standard_normal(shape) * scale).astype(F32)


# -- registry --------------------------------------------------------------------------------
def test_registered_encodings():
    assert set(ALL) <= set(codecs.known())
    for n in ALL:
        assert codecs.get(n).name == n and codecs.is_known(n)


def test_unknown_encoding_is_refused_by_name():
    with pytest.raises(UnsupportedEncoding) as e:
        codecs.get("iq2_xxs", what="representation decoder_stack@iq2_xxs of object decoder_stack")
    msg = str(e.value)
    assert "'iq2_xxs'" in msg and "decoder_stack@iq2_xxs" in msg
    for n in ALL:
        assert n in msg  # what this build can execute


# -- bytes -----------------------------------------------------------------------------------
SHAPES = [(7, 64), (3, 5, 96), (1, 32), (33, 160)]


@pytest.mark.parametrize("name", ROWS)
@pytest.mark.parametrize("shape", SHAPES)
def test_nbytes_is_the_encoded_length_and_bytes_follow_the_documented_layout(name, shape):
    c = codec(name)
    w = weights(shape)
    raw = c.encode(w)
    assert raw.dtype == np.uint8 and raw.ndim == 1
    assert raw.nbytes == c.nbytes(shape)
    wt = c.weight(readonly(raw), shape)
    assert wt.nbytes == raw.nbytes and wt.shape == shape
    d = wt.dense()
    assert d.dtype == F32 and d.shape == shape
    assert np.array_equal(d, oracle_dense(name, raw, shape))


@pytest.mark.parametrize("name", ["bf16", "f16", "int8_row"])
def test_any_last_dimension_is_accepted_by_elementwise_and_per_row_encodings(name):
    c = codec(name)
    shape = (5, 37)
    assert c.accepts(shape) is None
    w = weights(shape)
    raw = c.encode(w)
    assert raw.nbytes == c.nbytes(shape)
    wt = c.weight(readonly(raw), shape)
    assert np.array_equal(wt.dense(), oracle_dense(name, raw, shape))
    x = rng.standard_normal((3, 37)).astype(F32)
    # 10x numpy's own float32 product error against float64 here (1.3e-7, 0.1 of this bound)
    np.testing.assert_allclose(wt.mm(x), x @ wt.dense().T, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["int8", "int8h", "q4"])
def test_block_encodings_refuse_a_last_dimension_that_is_not_a_multiple_of_32_by_name(name):
    c = codecs.get(name)
    why = c.accepts((4, 40))
    assert why and "40" in why and "32" in why
    for call in (lambda: c.nbytes((4, 40)), lambda: c.encode(weights((4, 40))), lambda: c.weight(np.zeros(200, np.uint8), (4, 40))):
        with pytest.raises(UnsupportedEncoding) as e:
            call()
        assert f"'{name}'" in str(e.value) and "[4, 40]" in str(e.value)


@pytest.mark.parametrize("name", ["bf16", "f16", "int8", "int8h", "q4"])
def test_wrong_byte_count_is_refused(name):
    c = codecs.get(name)
    raw = c.encode(weights((4, 64)))
    with pytest.raises(WeightShapeError):
        c.weight(raw[:-16], (4, 64))


# -- fidelity --------------------------------------------------------------------------------
def test_bf16_widening_is_exact_for_representable_values():
    specials = np.array([0.0, -0.0, 1.0, -2.5, np.inf, -np.inf, 1e-40, 3.0e38, 2.0**-133], F32)
    vals = np.concatenate([specials, weights(503, scale=3.0)])
    rep = (vals.view(np.uint32) & np.uint32(0xFFFF0000)).view(F32)  # bf16-representable
    c = codecs.get("bf16")
    got = c.weight(c.encode(rep), rep.shape).dense()
    assert np.array_equal(got.view(np.uint32), rep.view(np.uint32))
    nan = np.array([np.nan], F32)
    assert np.isnan(c.weight(c.encode(nan), (1,)).dense()).all()


def test_f16_widening_is_exact_including_subnormals_infinities_and_nan():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)  # every f16 bit pattern
    c = codecs.get("f16")
    w = c.weight(readonly(every.view(np.uint8)), (256, 256))
    got = w.dense().reshape(-1)
    want = every.view(np.float16).astype(F32)
    finite = ~np.isnan(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.isnan(got[~finite]).all()
    # the rows kernel widens the same way: W . e_j picks column j exactly
    x = np.zeros((1, 256), F32)
    x[0, 5] = 1.0
    col = w.mm(x)[0]
    ref = want.reshape(256, 256)[:, 5]
    ok = np.isfinite(want.reshape(256, 256)).all(axis=1)  # 0 * inf in a row makes its dot NaN
    assert np.array_equal(col[ok], ref[ok])


@pytest.mark.parametrize("name,bound", [("bf16", 2.0**-8), ("f16", 2.0**-11)])
def test_16_bit_rounding_is_within_half_an_ulp(name, bound):
    w = weights((16, 64), scale=1.0)
    f = codecs.measure(name, w)
    assert f.max_rel_error <= bound
    assert f.bits_per_weight == 16.0 and f.encoding == name and not f.exact


def test_f16_refuses_a_value_it_cannot_hold_by_name():
    with pytest.raises(UnsupportedEncoding) as e:
        codecs.get("f16").encode(np.array([1.0, 7.0e4], F32))
    assert "'f16'" in str(e.value) and "70000" in str(e.value)


@pytest.mark.parametrize("name,group", [("int8", 32), ("int8_row", 96)])
def test_int8_error_is_within_half_a_step_of_its_scale(name, group):
    w = weights((12, 96))
    w[3, :32] *= 40  # one block with a much larger range
    c = codec(name)
    d = c.weight(c.encode(w), w.shape).dense()
    step = np.abs(w.reshape(12, -1, group)).max(axis=-1, keepdims=True) / 127
    assert (np.abs(d - w).reshape(12, -1, group) <= step / 2 * (1 + 1e-5)).all()
    zero = np.zeros((2, 96), F32)
    assert np.array_equal(c.weight(c.encode(zero), zero.shape).dense(), zero)
    f = codecs.fidelity.measure(c, w)
    assert f.bits_per_weight == (9.0 if name == "int8" else 8 + 32 / 96)


def test_int8_reencodes_a_q8_0_style_source_without_loss():
    # blocks as a Q8_0 checkpoint dequantizes them (f16 scale, codes reaching +-127): the
    # shipped SmolLM2's embedding, which is also its tied head
    d = rng.uniform(1e-4, 1e-2, 48).astype(np.float16).astype(F32)
    q = rng.integers(-127, 128, (48, 32)).astype(F32)
    q[:, 0] = 127
    src = (q * d[:, None]).astype(F32).reshape(6, 256)
    f = codecs.measure("int8", src)
    assert f.exact and f.max_abs_error == 0.0


def test_q4_error_is_within_half_a_step_of_its_block_scale():
    w = weights((6, 128))
    c = codecs.get("q4")
    d = c.weight(c.encode(w), w.shape).dense()
    blocks = w.reshape(-1, 32)
    step = (blocks.max(1) - blocks.min(1)) / 15
    err = np.abs(d - w).reshape(-1, 32).max(1)
    # f16 rounding of d and m moves the grid by at most a few f16 ulps of the block's range
    assert (err <= step * (0.5 + 2.0**-8) + 1e-6).all()
    f = codecs.measure("q4", w)
    assert f.bits_per_weight == 5.0 and 0 < f.rel_rms_error < 0.1


def test_q4_reencodes_a_q4_1_style_source_without_loss():
    # blocks made the way a Q4_1 checkpoint is dequantized: f16 d and m, codes 0..15 with both
    # ends used; that is what SmolLM2's shipped weights are
    n = 64
    d = (rng.uniform(0.001, 0.02, n)).astype(np.float16).astype(F32)
    m = (-rng.uniform(0.0, 0.2, n)).astype(np.float16).astype(F32)
    q = rng.integers(0, 16, (n, 32)).astype(F32)
    q[:, 0], q[:, 1] = 0, 15
    src = (d[:, None] * q + m[:, None]).astype(F32).reshape(8, 256)
    f = codecs.measure("q4", src)
    assert f.exact and f.max_abs_error == 0.0


@pytest.mark.parametrize("name", ["int8", "q4"])
def test_non_finite_weights_are_refused_by_quantizers(name):
    w = weights((2, 64))
    w[1, 3] = np.nan
    with pytest.raises(UnsupportedEncoding, match="non-finite"):
        codecs.get(name).encode(w)


def test_fidelity_numbers_against_a_hand_computed_case():
    src = np.array([1.0, -2.0, 0.0, 4.0], F32)
    dec = np.array([1.5, -2.0, 0.0, 3.0], F32)
    f = codecs.fidelity.compare(src, dec, "x", 3)
    assert f.max_abs_error == 1.0
    assert f.max_rel_error == 0.5
    assert f.rel_rms_error == pytest.approx(np.sqrt(0.25 + 1.0) / np.sqrt(1 + 4 + 16))
    assert f.bits_per_weight == 6.0 and f.elements == 4 and not f.exact
    z = codecs.fidelity.compare(np.zeros(2, F32), np.array([0.0, 1e-3], F32), "x", 1)
    assert z.max_rel_error == np.inf


# -- verbs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ROWS)
@pytest.mark.parametrize("T", [1, 3, 37])
def test_mm_is_the_product_with_the_decoded_tensor(name, T):
    c = codec(name)
    shape = (80, 160)
    wt = c.weight(readonly(c.encode(weights(shape))), shape)
    dense = np.array(wt.dense())
    x = rng.standard_normal((T, shape[1])).astype(F32)
    y = wt.mm(x)
    assert y.dtype == F32 and y.shape == (T, shape[0])
    ref = (x.astype(np.float64) @ dense.T.astype(np.float64))
    scale = np.abs(x).astype(np.float64) @ np.abs(dense.T).astype(np.float64)
    assert (np.abs(y - ref) <= 1e-5 * scale + 1e-7).all()  # numpy's float32 product reaches 0.023 of this bound
    y1 = wt.mm(x[0])  # a single activation row
    assert y1.shape == (shape[0],)


@pytest.mark.parametrize("name", ROWS)
def test_mm_rows_kernel_does_not_depend_on_the_thread_count(name):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); thread independence needs 2")
    c = codec(name)
    shape = (300, 192)
    wt = c.weight(c.encode(weights(shape)), shape)
    x = rng.standard_normal((1, 192)).astype(F32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = wt.mm(x)
        numba.set_num_threads(2)
        two = wt.mm(x)
        again = wt.mm(x)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one, two) and np.array_equal(two, again)


@pytest.mark.parametrize("name", ["bf16", "f16", "int8", "int8h", "q4"])
def test_mm_refuses_activations_it_cannot_take(name):
    c = codecs.get(name)
    wt = c.weight(c.encode(weights((4, 64))), (4, 64))
    with pytest.raises(WeightShapeError, match="float32"):
        wt.mm(np.zeros((1, 64), np.float64))
    with pytest.raises(WeightShapeError, match=r"\[T, 64\]"):
        wt.mm(np.zeros((1, 32), F32))


@pytest.mark.parametrize("name", ROWS)
def test_take_gathers_decoded_rows(name):
    c = codec(name)
    shape = (50, 64)
    wt = c.weight(readonly(c.encode(weights(shape))), shape)
    ids = np.array([49, 0, 7, 7])
    got = wt.take(ids)
    assert got.dtype == F32 and np.array_equal(got, wt.dense()[ids])
    if name != "f32":
        with pytest.raises(WeightShapeError, match="50"):
            wt.take(np.array([50]))


@pytest.mark.parametrize("name", ROWS)
def test_expert_views_one_matrix_of_a_stacked_bank(name):
    c = codec(name)
    shape = (4, 24, 96)
    wt = c.weight(readonly(c.encode(weights(shape))), shape)
    bank = np.array(wt.dense())
    x = rng.standard_normal((2, 96)).astype(F32)
    for e in range(4):
        ex = wt.expert(e)
        assert ex.shape == (24, 96)
        assert np.array_equal(ex.dense(), bank[e])
        # 36x numpy's own float32 product error against float64 here (6.1e-7, 0.028 of this bound)
        np.testing.assert_allclose(ex.mm(x), x @ bank[e].T, rtol=1e-5, atol=1e-5)
    if name != "f32":
        with pytest.raises(WeightShapeError, match="expert 4"):
            wt.expert(4)
        with pytest.raises(WeightShapeError, match="expert"):
            wt.mm(x)


def test_f32_small_t_kernel_agrees_with_blas_and_stays_float32():
    from vindex3.codecs import f32 as f32mod

    w = weights((70, 160))
    wt = codecs.get("f32").weight(w.reshape(-1).view(np.uint8), w.shape)
    for T in (1, f32mod.SMALL_T, f32mod.SMALL_T + 1):
        x = rng.standard_normal((T, 160)).astype(F32)
        y = wt.mm(x)
        assert y.dtype == F32
        # 9x numpy's own float32 product error against float64 here (8.2e-7, 0.105 of this bound);
        # with the former atol 1e-6 it was 3.2x, and ours reached 0.35 of that bound
        np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=3e-6)


# -- the shipped model -----------------------------------------------------------------------
def _shipped_tensor(name):
    from vindex3.default_model import gguf_path
    from vindex3.errors import ContainerNotFound

    try:
        path = gguf_path()
    except ContainerNotFound as e:
        pytest.skip(f"the shipped SmolLM2 GGUF is not installed: {e}")
    import gguf
    from gguf.quants import dequantize

    r = gguf.GGUFReader(path, "r")
    t = next(t for t in r.tensors if t.name == name)
    return t.tensor_type.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=F32)


def test_q4_holds_the_shipped_q4_1_matrices_without_loss():
    qtype, w = _shipped_tensor("blk.0.ffn_down.weight")
    assert qtype == "Q4_1"
    f = codecs.measure("q4", w)
    assert f.exact, f


def test_int8_holds_the_shipped_q8_0_embedding_without_loss():
    qtype, w = _shipped_tensor("token_embd.weight")
    assert qtype == "Q8_0"
    f = codecs.measure("int8", w)
    assert f.exact, f


# -- non-finite counts (the container's first-use scan) ---------------------------------------
def _poison(name: str, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Bytes of ``name`` with a few stored fields set to values that decode to NaN or infinity,
    written straight into the documented sections (an encoder never writes them)."""
    raw = raw.copy()
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    if name == "f32":
        v = raw.view("<f4")
        v[3], v[70], v[71] = np.nan, np.inf, -np.inf
    elif name in ("bf16", "f16"):
        v = raw.view("<u2")
        inf = 0x7F80 if name == "bf16" else 0x7C00
        v[3], v[70], v[71] = inf, inf | 0x8000, inf | 1  # +inf, -inf, NaN
    elif name == "int8":
        s = raw[pad16(rows * cols):].view("<f4")
        s[1] = np.nan  # a whole block of 32
        s[4] = np.float32(3e38)  # large: only the codes whose product overflows
        q = raw[: rows * cols].view(np.int8)
        q[4 * 32 : 5 * 32] = 0
        q[4 * 32 + 2], q[4 * 32 + 9] = 127, -1  # 127 * 3e38 overflows; -1 * 3e38 does not
    elif name == "int8h":  # a half scale cannot overflow a code's product: only inf and NaN scales
        s = raw[pad16(rows * cols):].view("<u2")
        s[1], s[4] = 0x7E00, 0xFC00  # NaN, -inf: whole blocks
        q = raw[: rows * cols].view(np.int8)
        q[4 * 32 + 3] = 0  # 0 x -inf is NaN: still counted
    elif name == "q4":
        nb = cols // 32
        o1 = pad16(rows * cols // 2)
        o2 = o1 + pad16(2 * rows * nb)
        d = raw[o1 : o1 + 2 * rows * nb].view("<u2")
        m = raw[o2 : o2 + 2 * rows * nb].view("<u2")
        m[0] = 0x7C00  # +inf offset: the whole block
        d[2] = 0x7C00  # +inf scale: inf for codes > 0, NaN for code 0: the whole block
    return raw


@pytest.mark.parametrize("name", ALL)
def test_nonfinite_counts_exactly_the_elements_that_decode_to_nan_or_infinity(name):
    shape = (6, 96)
    c = codec(name)
    raw = _poison(name, c.encode(weights(shape)), shape)
    with np.errstate(over="ignore", invalid="ignore"):
        want = int(np.count_nonzero(~np.isfinite(oracle_dense(name, raw, shape))))
    assert want > 0
    assert c.weight(readonly(raw), shape).nonfinite() == want
    clean = c.encode(weights(shape))
    assert c.weight(readonly(clean), shape).nonfinite() == 0


@pytest.mark.parametrize("name", ALL)
def test_mm_t_and_sub_rows_read_the_same_bytes(name):
    c = codec(name)
    shape = (48, 64)
    wt = c.weight(readonly(c.encode(weights(shape))), shape)
    dense = np.array(wt.dense())
    x = rng.standard_normal((3, 48)).astype(F32)
    # 53x numpy's own float32 product error against float64 here (3.2e-7, 0.019 of this bound)
    np.testing.assert_allclose(wt.mm_t(x), x @ dense, rtol=1e-5, atol=1e-5)
    part = wt.sub_rows(16, 40)
    assert part.shape == (24, 64)
    assert np.array_equal(part.dense(), dense[16:40])
    with pytest.raises(WeightShapeError):
        wt.sub_rows(40, 16)


def test_the_decode_thread_count_is_one_setting_and_results_ignore_it(monkeypatch):
    from vindex3.codecs import threads
    from vindex3.errors import ConfigError

    monkeypatch.setattr(threads, "PARALLEL_MIN_BYTES", 0)  # every launch of 2 threads goes to the pool

    shape = (64, 96)
    x = rng.standard_normal((2, 96)).astype(F32)
    for name in ALL:
        c = codec(name)
        wt = c.weight(readonly(c.encode(weights(shape))), shape)
        outs = []
        try:
            for n in (1, 2):
                threads.set_count(n)
                assert threads.count() == n and threads.parallel(wt.nbytes) == (n == 2)
                outs.append(wt.mm(x))
        finally:
            threads.set_count(None)
        assert np.array_equal(outs[0].view(np.uint32), outs[1].view(np.uint32)), name
    with pytest.raises(ConfigError, match="positive"):
        threads.set_count(0)


def test_two_python_threads_may_multiply_at_once():
    """numba's workqueue pool aborts the process when two threads enter it together (the omp
    layer oversubscribes the cores instead): every launch is serialised by
    vindex3.codecs.threads.launch, with the thread count set on the launching thread."""
    import threading

    c = codec("int8")
    shape = (256, 512)
    wt = c.weight(readonly(c.encode(weights(shape))), shape)
    x = rng.standard_normal((1, 512)).astype(F32)
    want = wt.mm(x)
    errors: list = []

    def work():
        try:
            for _ in range(200):
                if not np.array_equal(wt.mm(x), want):
                    errors.append("differs")
        except Exception as e:  # noqa: BLE001 - any failure in a worker thread is the finding
            errors.append(e)

    from vindex3.codecs import threads

    threads.set_count(2)
    try:
        ts = [threading.Thread(target=work) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        threads.set_count(None)
    assert errors == []
