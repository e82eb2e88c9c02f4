"""GGML block encodings kept byte for byte (vindex3.codecs.ggml): decoding equals
``gguf.quants.dequantize`` (gguf 0.19) bit for bit on every block, and the verbs kernels use
(mm, mm_t, take, sub_rows, expert) agree with the decoded tensor.

Blocks come two ways: floats quantized by ``gguf.quants.quantize`` where it can (q8_0, q4_0,
q4_1, q5_0, q5_1, mxfp4), and random bytes whose f16 scale fields are overwritten with random
finite f16 values (every type, the K-quants included: gguf.quants cannot quantize them)."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize, quantize

from vindex3 import codecs
from vindex3.codecs import WeightShapeError
from vindex3.codecs.ggml import KINDS
from vindex3.errors import UnsupportedEncoding

F32 = np.float32
Q = gguf.GGMLQuantizationType
NAMES = list(KINDS)
QUANTIZABLE = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "mxfp4"]
# byte offsets of the f16 scale fields inside one block, by type
F16_FIELDS = {
    "q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2),
    "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "mxfp4": (),
}
rng = np.random.default_rng(27)


def readonly(raw: np.ndarray) -> np.ndarray:
    return np.frombuffer(raw.tobytes(), dtype=np.uint8)


def random_blocks(name: str, rows: int, cols: int, *, scale_exp: tuple[int, int] = (-14, 2),
                  bounded_e8m0: bool = False) -> np.ndarray:
    """Random bytes [rows, row bytes] with every f16 scale field a random finite f16 value
    (exponents in ``scale_exp``, either sign); mxfp4's e8m0 byte stays random (every byte is
    a finite scale) unless ``bounded_e8m0``: then its exponent is drawn from ``scale_exp`` too."""
    _, be, bb = KINDS[name]
    raw = rng.integers(0, 256, size=(rows, cols // be, bb), dtype=np.uint8)
    if name == "mxfp4" and bounded_e8m0:
        raw[:, :, 0] = 128 + rng.integers(*scale_exp, size=(rows, cols // be))
    for off in F16_FIELDS[name]:
        n = rows * (cols // be)
        mant = rng.uniform(1.0, 2.0, n) * rng.choice([-1.0, 1.0], n)
        vals = np.ldexp(mant, rng.integers(*scale_exp, n)).astype(np.float16)
        raw[:, :, off : off + 2] = vals.view(np.uint8).reshape(rows, cols // be, 2)
    return raw.reshape(rows, -1)


def reference(name: str, raw2d: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):  # random scales may overflow a product
        return dequantize(raw2d, Q[name.upper()])


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == F32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


# -- exactness against gguf.quants ------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_decode_of_random_blocks_with_finite_scales_is_gguf_dequantize_bit_for_bit(name):
    c = codecs.get(name)
    rows, cols = 9, 4 * c.block
    raw = random_blocks(name, rows, cols)
    ref = reference(name, raw)
    assert np.isfinite(ref).mean() > 0.5  # the scales were made finite
    w = c.weight(readonly(raw.reshape(-1)), (rows, cols))
    assert same_bits(w.dense(), ref)
    assert same_bits(w.take(np.array([8, 0, 3])), ref[[8, 0, 3]])
    assert w.nonfinite() == int((~np.isfinite(ref)).sum())


@pytest.mark.parametrize("name", NAMES)
def test_decode_of_extreme_scales_is_gguf_dequantize_bit_for_bit(name):
    """Subnormal and largest f16 scales (products that overflow to infinity included)."""
    c = codecs.get(name)
    rows, cols = 5, 2 * c.block
    for exps in ((-24, -13), (14, 16)):
        raw = random_blocks(name, rows, cols, scale_exp=exps)
        with np.errstate(over="ignore", invalid="ignore"):
            ref = reference(name, raw)
        assert same_bits(c.weight(readonly(raw.reshape(-1)), (rows, cols)).dense(), ref)


@pytest.mark.parametrize("name", NAMES)
def test_decode_of_wholly_random_bytes_is_gguf_dequantize_bit_for_bit(name):
    """NaN and infinite scales too: NaN payloads propagate as numpy's arithmetic does."""
    c = codecs.get(name)
    rows, cols = 6, 2 * c.block
    raw = rng.integers(0, 256, size=(rows, cols // c.block * c.block_bytes), dtype=np.uint8)
    with np.errstate(over="ignore", invalid="ignore"):
        ref = reference(name, raw)
    assert same_bits(c.weight(readonly(raw.reshape(-1)), (rows, cols)).dense(), ref)


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_encode_is_gguf_quantize_and_decodes_as_gguf_dequantize(name):
    c = codecs.get(name)
    shape = (3, 4, 2 * c.block)
    w = (rng.standard_normal(shape) * 0.05).astype(F32)
    raw = c.encode(w)
    want = quantize(w.reshape(-1, shape[-1]), Q[name.upper()])
    assert raw.nbytes == c.nbytes(shape) == want.nbytes
    assert np.array_equal(raw, want.reshape(-1).view(np.uint8))
    assert same_bits(c.weight(readonly(raw), shape).dense(), reference(name, want).reshape(shape))


@pytest.mark.parametrize("name", ["q4_k", "q5_k", "q6_k"])
def test_k_quants_are_carried_not_written(name):
    c = codecs.get(name)
    with pytest.raises(UnsupportedEncoding, match=name):
        c.encode(np.zeros((2, 256), F32))


def test_bits_per_weight_and_sizes():
    want = {"q8_0": 8.5, "q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q4_k": 4.5, "q5_k": 5.5,
            "q6_k": 6.5625, "mxfp4": 4.25}
    for name, bpw in want.items():
        c = codecs.get(name)
        assert c.bits_per_weight == bpw
        block, size = gguf.GGML_QUANT_SIZES[Q[name.upper()]]
        assert (c.block, c.block_bytes) == (block, size)
        assert c.nbytes((3, 2 * block)) == 3 * 2 * size
        assert "multiple of" in c.accepts((3, block + 1))
        with pytest.raises(UnsupportedEncoding, match=f"{name}.*multiple of {block}"):
            c.nbytes((3, block + 1))
    with pytest.raises(WeightShapeError, match="needs"):
        codecs.get("q8_0").weight(np.zeros(10, np.uint8), (1, 32))


@pytest.mark.parametrize("name", ["q2_k", "q3_k", "iq4_nl", "iq2_xxs", "tq1_0"])
def test_other_gguf_types_have_no_codec_and_are_refused_by_name(name):
    assert not codecs.is_known(name)
    with pytest.raises(UnsupportedEncoding, match=f"'{name}'"):
        codecs.get(name, what=f"representation decoder_stack@{name}")


# -- verbs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("T", [1, 5, 40])
def test_mm_and_mm_t_are_products_with_the_decoded_tensor(name, T):
    c = codecs.get(name)
    rows, cols = 70, 2 * max(c.block, 128)
    raw = random_blocks(name, rows, cols, scale_exp=(-10, -6), bounded_e8m0=True)
    wt = c.weight(readonly(raw.reshape(-1)), (rows, cols))
    dense = wt.dense().astype(np.float64)
    assert np.isfinite(dense).all()
    x = rng.standard_normal((T, cols)).astype(F32)
    y = wt.mm(x)
    assert y.dtype == F32 and y.shape == (T, rows)
    # float32 dot products of n terms: |error| <= n * eps32 * sum |w x| (the classical bound)
    ref = x.astype(np.float64) @ dense.T
    bound = cols * np.finfo(F32).eps * (np.abs(x).astype(np.float64) @ np.abs(dense.T))
    assert (np.abs(y - ref) <= bound + 1e-30).all()
    assert np.array_equal(wt.mm(x[0]), wt.mm(x[:1])[0])
    xt = rng.standard_normal((T, rows)).astype(F32)
    yt = wt.mm_t(xt)
    ref_t = xt.astype(np.float64) @ dense
    bound_t = rows * np.finfo(F32).eps * (np.abs(xt).astype(np.float64) @ np.abs(dense))
    assert yt.shape == (T, cols) and (np.abs(yt - ref_t) <= bound_t + 1e-30).all()


@pytest.mark.parametrize("name", NAMES)
def test_sub_rows_and_experts_view_the_same_bytes(name):
    c = codecs.get(name)
    E, O, cols = 3, 10, c.block * 2
    raw = random_blocks(name, E * O, cols, scale_exp=(-8, -4), bounded_e8m0=True)
    bank = c.weight(readonly(raw.reshape(-1)), (E, O, cols))
    full = bank.dense()
    assert full.shape == (E, O, cols) and same_bits(full, reference(name, raw).reshape(E, O, cols))
    x = rng.standard_normal((2, cols)).astype(F32)
    for e in range(E):
        ex = bank.expert(e)
        assert same_bits(ex.dense(), full[e])
        assert np.array_equal(ex.mm(x), c.weight(readonly(raw[e * O : (e + 1) * O].reshape(-1)), (O, cols)).mm(x))
        part = ex.sub_rows(2, 7)
        assert same_bits(part.dense(), full[e, 2:7])
    with pytest.raises(WeightShapeError):
        bank.expert(E)


@pytest.mark.parametrize("name", ["q4_1", "q6_k"])
def test_mm_does_not_depend_on_the_thread_count(name):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); thread independence needs 2")
    c = codecs.get(name)
    raw = random_blocks(name, 300, 512, scale_exp=(-8, -4), bounded_e8m0=True)
    wt = c.weight(raw.reshape(-1), (300, 512))
    x = rng.standard_normal((2, 512)).astype(F32)
    before = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = wt.mm(x)
        numba.set_num_threads(2)
        two = wt.mm(x)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(one, two)
