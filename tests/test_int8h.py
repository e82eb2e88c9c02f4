"""int8h: int8 codes with half-precision block scales (Q8_0's bytes). The encoding is checked
against its documented layout; every product (each integer-dot path, several positions, prefill
tiles, fused launches, a team of threads, the float-lane 'exact' kernels) against the int8
weight holding the same codes and the float32 values of the scales, which must give the same
bytes; the half-to-float conversion against numpy on all 65,536 patterns."""

from __future__ import annotations

import numba
import numpy as np
import pytest
from numba import njit

from vindex3 import codecs
from vindex3.codecs import intrinsics as I
from vindex3.codecs.base import products
from vindex3.codecs.f16bits import scale_f32
from vindex3.codecs.int8 import Int8Blocks
from vindex3.codecs.rowwise import pad16
from vindex3.errors import UnsupportedEncoding

pytestmark = pytest.mark.numeric

F32 = np.float32
RUNNABLE = [p for p in I.PATHS if I.available(p)]
rng = np.random.default_rng(8)


@njit
def _convert(h, out):
    for i in range(h.size):
        out[i] = scale_f32(h[i])


def test_half_bits_become_the_float32_numpy_gives_on_every_pattern():
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    got = np.empty(h.size, F32)
    _convert(h, got)
    want = h.view(np.float16).astype(F32)
    nan = np.isnan(want)
    assert nan.sum() == 2 * 1023  # the NaN patterns, both signs
    assert np.array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])  # zeros signed, subnormals, inf
    assert np.isnan(got[nan]).all()
    f = rng.standard_normal(64).astype(F32)
    same = np.empty_like(f)
    _convert(f, same)
    assert np.array_equal(same.view(np.uint32), f.view(np.uint32))  # float32 scales pass unchanged


def _encoded(W):
    c = codecs.get("int8h")
    raw = c.encode(W)
    raw.flags.writeable = False  # as a mapped segment hands them out
    return raw, c.weight(raw, W.shape)


def _twin(w):
    """The int8 weight of the same codes and the float32 values of int8h's scales."""
    return Int8Blocks(w.q, w.s.view(np.float16).astype(F32), w.shape)


def _weights(O, K):
    W = rng.standard_normal((O, K)).astype(F32)
    W[0, :32] = 0.0  # a zero block: scale 0
    W[1, 32:64] *= 1e-6  # a block whose scale is a half-precision subnormal
    W[2, :32] *= 300.0  # a large block
    return W


def test_bytes_are_the_documented_layout_and_codes_round_against_the_stored_scale():
    O, K = 7, 96
    W = _weights(O, K)
    raw, w = _encoded(W)
    c = codecs.get("int8h")
    assert c.nbytes((O, K)) == raw.size == pad16(O * K) + pad16(2 * O * (K // 32))
    assert c.bits_per_weight == 8.5 and w.encoding == "int8h"
    q = raw[: O * K].view(np.int8).reshape(O, K // 32, 32)
    d16 = raw[pad16(O * K):pad16(O * K) + 2 * O * (K // 32)].view("<f2").reshape(O, K // 32)
    blocks = W.reshape(O, K // 32, 32)
    assert np.array_equal(d16, (np.abs(blocks).max(axis=2) / F32(127)).astype(F32).astype(np.float16))
    d = d16.astype(F32)
    dense = (q.astype(F32) * d[..., None]).reshape(O, K)
    assert np.array_equal(w.dense(), dense)  # dequantization: float32(q) x float32(d)
    safe = np.where(d > 0, d, F32(1))[..., None]
    want = np.clip(np.rint(blocks / safe), -127, 127)
    want[d == 0] = 0
    assert np.array_equal(q, want.astype(np.int8))
    assert np.abs(q).max() == 127 and (q[0, 0] == 0).all()


def test_q8_0_blocks_re_encode_without_loss():
    # blocks as a Q8_0 file holds them: half-precision d, codes reaching +-127 in every block
    O, K = 5, 128
    q = rng.integers(-127, 128, (O, K // 32, 32)).astype(np.int8)
    q[:, :, 3] = 127
    d16 = rng.uniform(1e-3, 0.05, (O, K // 32)).astype(np.float16)
    W = (q.astype(F32) * d16.astype(F32)[..., None]).reshape(O, K)
    _raw, w = _encoded(W)
    assert np.array_equal(w.q.reshape(q.shape), q)
    assert np.array_equal(w.s.view(np.float16), d16)
    assert np.array_equal(w.dense(), W)


def test_what_int8h_cannot_hold_is_refused_by_name():
    c = codecs.get("int8h")
    W = np.ones((2, 64), F32)
    W[1, 40] = 1e7  # needs a scale of ~78740: past float16's 65504
    with pytest.raises(UnsupportedEncoding, match=r"int8h.*1e\+07.*float16"):
        c.encode(W)
    W[1, 40] = np.nan
    with pytest.raises(UnsupportedEncoding, match="int8h: the tensor holds a non-finite value"):
        c.encode(W)
    assert c.accepts((3, 48)) is not None  # 48 is not a multiple of the block


@pytest.mark.parametrize("T", [1, 3, 8, 37])
@pytest.mark.parametrize("path", RUNNABLE)
def test_every_q8_product_is_the_int8_bytes_of_the_same_values(path, T):
    K = 576
    _, w = _encoded(_weights(40, K))
    twin = _twin(w)
    x = rng.standard_normal((T, K)).astype(F32)
    I.use(path)
    try:
        a = w.with_activations("q8")
        assert type(a).__name__ == "Int8HalfBlocksQ8" and a.encoding == "int8h"
        got = a.mm(x)  # T = 37 runs the prefill tiles
        assert np.array_equal(got, twin.with_activations("q8").mm(x))
        assert np.array_equal(a.sub_rows(3, 17).mm(x), got[:, 3:17])
        ws = [w.with_activations("q8"), _encoded(_weights(24, K))[1].with_activations("q8")]
        fused = products(ws)
        assert fused.__qualname__.startswith("RowWeight.fused")  # the one-launch kernel ran
        for g, ref in zip(fused(x[:3]), (ws[0].mm(x[:3]), _twin(ws[1]).with_activations("q8").mm(x[:3]))):
            assert np.array_equal(g, ref)
    finally:
        I.use(None)


@pytest.mark.parametrize("T", [1, 5, 40])
def test_exact_products_gathers_and_decoding_are_the_int8_bytes(T):
    K = 160  # a tail block after the 64-element chunks
    _, w = _encoded(_weights(33, K))
    twin = _twin(w)
    x = rng.standard_normal((T, K)).astype(F32)
    assert np.array_equal(w.mm(x), twin.mm(x))
    ids = np.array([0, 2, 32, 2])
    assert np.array_equal(w.take(ids), twin.take(ids))
    assert np.array_equal(w.dense(), twin.dense())


def test_a_team_of_threads_gives_the_rows_kernels_bytes():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); a team needs 2")
    K = 576
    _, w = _encoded(_weights(300, K))
    x = rng.standard_normal((2, K)).astype(F32)
    got = np.empty((2, w.rows), F32)
    I.team_rows("i8", w.q, w.s, x, got)
    assert np.array_equal(got, _twin(w).with_activations("q8").mm(x))


def test_nonfinite_half_scales_are_counted_as_their_values_are():
    O, K = 4, 64
    raw, _ = _encoded(_weights(O, K))
    raw = raw.copy()
    s = raw[pad16(O * K):].view("<u2")
    s[1] = 0x7C00  # +inf: a whole block
    s[4] = 0x7E00  # NaN
    q = raw[: O * K].view(np.int8)
    q[32:64] = 0  # inf x 0 is NaN too: every element of the block counts
    w = codecs.get("int8h").weight(raw, (O, K))
    assert w.nonfinite() == _twin(w).nonfinite() == 64
