"""Small-float encodings real checkpoints ship: fp8_e4m3_b128 (DeepSeek-V3), nvfp4 (NVIDIA
ModelOpt) and mxfp4 (gpt-oss experts; the GGML block layout, vindex3.codecs.ggml).

Oracles: torch's float8_e4m3fn -> float32 conversion for e4m3 values; numpy transcriptions of
the published formats written here (DeepSeek-V3's ``weight.float() * scale_inv`` per 128 x 128
block; ModelOpt's ``e2m1 * (weight_scale * weight_scale_2)``; transformers' gpt-oss
``convert_moe_packed_tensors`` for MXFP4 ``*_blocks`` / ``*_scales``, in float32); and
``gguf.quants.dequantize`` for the GGUF MXFP4 and NVFP4 block types."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from gguf.quants import dequantize

from vindex3 import codecs
from vindex3.codecs import WeightShapeError
from vindex3.codecs.ggml import mxfp4_from_blocks
from vindex3.errors import UnsupportedEncoding

F32 = np.float32
Q = gguf.GGMLQuantizationType
rng = np.random.default_rng(2027)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], F32)


def readonly(raw: np.ndarray) -> np.ndarray:
    return np.frombuffer(raw.tobytes(), dtype=np.uint8)


def same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype == F32 and a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def e4m3_torch(codes: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).to(torch.float32).numpy()


def finite_e4m3(shape) -> np.ndarray:
    c = rng.integers(0, 256, size=shape, dtype=np.uint8)
    c[(c & 0x7F) == 0x7F] = 0x3C  # NaN codes replaced by 1.5
    return c


# -- fp8 e4m3 with 128 x 128 block scales ------------------------------------------------------------
def fp8_reference(codes: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """DeepSeek-V3's dequantization, transcribed: every element times its block's scale."""
    w = e4m3_torch(codes)
    s = np.repeat(np.repeat(scale_inv, 128, axis=-2), 128, axis=-1)[..., : w.shape[-2], : w.shape[-1]]
    return (w * s).astype(F32)


def test_e4m3_table_is_torchs_float8_e4m3fn():
    from vindex3.codecs.fp_kernels import E4M3

    ref = e4m3_torch(np.arange(256, dtype=np.uint8))
    assert np.array_equal(np.isnan(E4M3), np.isnan(ref)) and np.isnan(E4M3).sum() == 2
    assert same_bits(E4M3[~np.isnan(ref)], ref[~np.isnan(ref)])


@pytest.mark.parametrize("shape", [(256, 384), (200, 130), (3, 130, 257), (1, 5)])
def test_fp8_decode_is_the_block_scaled_product(shape):
    c = codecs.get("fp8_e4m3_b128")
    codes = finite_e4m3(shape)
    sshape = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
    scales = (rng.uniform(0.5, 2.0, sshape) * 2.0 ** rng.integers(-20, 5, sshape)).astype(F32)
    raw = c.pack(codes, scales)
    assert raw.nbytes == c.nbytes(shape)
    w = c.weight(readonly(raw), shape)
    ref = fp8_reference(codes, scales)
    assert same_bits(w.dense(), ref)
    if len(shape) == 3:
        for e in range(shape[0]):
            ex = w.expert(e)
            assert same_bits(ex.dense(), ref[e])
            assert same_bits(ex.sub_rows(129, 130).dense(), ref[e, 129:130])
    else:
        assert same_bits(w.take(np.array([shape[0] - 1, 0])), ref[[shape[0] - 1, 0]])
        if shape[0] > 130:
            part = w.sub_rows(100, 200)  # crosses a 128-row scale block
            assert same_bits(part.dense(), ref[100:200])
    assert w.nonfinite() == 0
    nan = codes.copy()
    nan.reshape(-1)[0] = 0x7F
    assert c.weight(readonly(c.pack(nan, scales)), shape).nonfinite() == 1


def test_fp8_refuses_what_it_cannot_hold():
    c = codecs.get("fp8_e4m3_b128")
    with pytest.raises(WeightShapeError, match="128 x 128"):
        c.pack(np.zeros((200, 130), np.uint8), np.ones((1, 2), F32))
    with pytest.raises(UnsupportedEncoding, match="fp8_e4m3_b128"):
        c.encode(np.zeros((4, 4), F32))
    with pytest.raises(UnsupportedEncoding, match="matrix"):
        c.nbytes((7,))


# -- nvfp4 ---------------------------------------------------------------------------------------
def nvfp4_reference(codes: np.ndarray, scales: np.ndarray, g: np.ndarray) -> np.ndarray:
    """ModelOpt's NVFP4 dequantization, transcribed: element 2i is byte i's low nibble."""
    vals = np.stack([E2M1[codes & 15], E2M1[codes >> 4]], axis=-1).reshape(*codes.shape[:-1], -1)
    blk = (e4m3_torch(scales) * g.reshape(*g.shape, *([1] * (scales.ndim - g.ndim)))).astype(F32)
    return (vals * np.repeat(blk, 16, axis=-1)).astype(F32)


@pytest.mark.parametrize("shape", [(48, 64), (3, 20, 96)])
def test_nvfp4_decode_is_the_two_level_scaled_product(shape):
    c = codecs.get("nvfp4")
    codes = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 2), dtype=np.uint8)
    scales = finite_e4m3((*shape[:-1], shape[-1] // 16))
    M = int(np.prod(shape[:-2]))
    g = (rng.uniform(0.5, 2.0, M) * 2.0**-8).astype(F32)
    raw = c.pack(codes, scales, g)
    assert raw.nbytes == c.nbytes(shape)
    w = c.weight(readonly(raw), shape)
    ref = nvfp4_reference(codes, scales, g.reshape(shape[:-2]) if len(shape) > 2 else g[0])
    assert same_bits(w.dense(), ref)
    if len(shape) == 3:
        for e in range(shape[0]):
            assert same_bits(w.expert(e).dense(), ref[e])
            assert same_bits(w.expert(e).sub_rows(3, 9).dense(), ref[e, 3:9])
    assert c.bits_per_weight == 4.5


def test_nvfp4_with_unit_global_scale_is_ggufs_nvfp4_block():
    """gguf's NVFP4 block (4 unsigned e4m3 scales then 32 code bytes per 64 weights; sub-block k
    holds weights 16k..16k+7 in low nibbles and 16k+8.. in high nibbles) decodes, for scale
    bytes with the sign bit clear and below 0x7F, to what nvfp4 decodes with a global scale of 1."""
    c = codecs.get("nvfp4")
    rows, cols = 6, 128
    codes = rng.integers(0, 256, size=(rows, cols // 2), dtype=np.uint8)
    scales = rng.integers(0, 0x7F, size=(rows, cols // 16), dtype=np.uint8)
    ours = c.weight(readonly(c.pack(codes, scales, np.float32(1.0))), (rows, cols)).dense()
    # re-lay the same values out as gguf's blocks
    q = np.stack([codes & 15, codes >> 4], axis=-1).reshape(rows, cols // 16, 16)
    sub = (q[..., :8] | (q[..., 8:] << 4)).astype(np.uint8)  # [rows, subs, 8]
    blocks = np.concatenate([scales.reshape(rows, cols // 64, 4), sub.reshape(rows, cols // 64, 32)], axis=-1)
    ref = dequantize(blocks.reshape(rows, -1), Q.NVFP4)
    # gguf reads code 8 (e2m1 -0) as +0, the format's -0: equal as numbers, bit for bit elsewhere
    assert np.array_equal(ours, ref) and same_bits(ours[ref != 0], ref[ref != 0])


def test_nvfp4_refuses_mismatched_parts():
    c = codecs.get("nvfp4")
    with pytest.raises(WeightShapeError, match="scales"):
        c.pack(np.zeros((4, 16), np.uint8), np.zeros((4, 3), np.uint8), 1.0)
    with pytest.raises(WeightShapeError, match="global"):
        c.pack(np.zeros((2, 4, 16), np.uint8), np.zeros((2, 4, 2), np.uint8), np.ones(3, F32))
    with pytest.raises(UnsupportedEncoding, match="multiple of 16"):
        c.nbytes((4, 40))


# -- mxfp4 from gpt-oss's *_blocks / *_scales ----------------------------------------------------------
def gpt_oss_reference(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """transformers' convert_moe_packed_tensors in float32, before its final transpose:
    [..., G, 16] bytes (element 2i low nibble) and [..., G] e8m0 exponents -> [..., G * 32]."""
    lo, hi = E2M1[blocks & 15], E2M1[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    out = torch.ldexp(torch.from_numpy(vals), torch.from_numpy(scales.astype(np.int32) - 127)[..., None]).numpy()
    return out.reshape(*blocks.shape[:-2], -1)


@pytest.mark.parametrize("exps", [(100, 140), (0, 256)])
def test_mxfp4_from_gpt_oss_blocks_decodes_as_transformers_and_as_gguf(exps):
    E, O, G = 3, 10, 4
    blocks = rng.integers(0, 256, size=(E, O, G, 16), dtype=np.uint8)
    scales = rng.integers(*exps, size=(E, O, G)).astype(np.uint8)
    raw = mxfp4_from_blocks(blocks, scales)
    c = codecs.get("mxfp4")
    w = c.weight(readonly(raw), (E, O, G * 32))
    ours = w.dense()
    with np.errstate(over="ignore"):
        assert same_bits(ours, dequantize(raw.reshape(E * O, -1), Q.MXFP4).reshape(E, O, -1))
    ref = gpt_oss_reference(blocks, scales)
    # mxfp4 is gguf's: it reads code 8 (e2m1 -0) as +0 where transformers keeps -0
    nz = ref != 0
    if exps == (100, 140):
        assert np.array_equal(ours, ref) and same_bits(ours[nz], ref[nz])
    else:
        # e8m0 255: gguf (and so this codec) reads 2^127 where ldexp reads 2^128; e8m0 0 and 1
        # give float32 subnormals, rounded by ldexp; everywhere else the two agree bit for bit
        ok = np.repeat((scales > 1) & (scales < 255), 32, axis=-1)
        assert np.array_equal(ours[ok], ref[ok]) and same_bits(ours[ok & nz], ref[ok & nz])


# -- products ------------------------------------------------------------------------------------
def _fp_weight(name: str, shape):
    c = codecs.get(name)
    if name == "fp8_e4m3_b128":
        sshape = (*shape[:-2], -(-shape[-2] // 128), -(-shape[-1] // 128))
        return c.weight(readonly(c.pack(finite_e4m3(shape), rng.uniform(0.001, 0.01, sshape).astype(F32))), shape)
    if name == "nvfp4":
        codes = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 2), dtype=np.uint8)
        scales = rng.integers(0x20, 0x40, size=(*shape[:-1], shape[-1] // 16), dtype=np.uint8)
        return c.weight(readonly(c.pack(codes, scales, np.full(int(np.prod(shape[:-2])), 0.01, F32))), shape)
    blocks = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // 32, 16), dtype=np.uint8)
    return c.weight(readonly(mxfp4_from_blocks(blocks, np.full(blocks.shape[:-1], 120, np.uint8))), shape)


@pytest.mark.parametrize("name", ["fp8_e4m3_b128", "nvfp4", "mxfp4"])
@pytest.mark.parametrize("T", [1, 6, 30])
def test_products_are_products_with_the_decoded_tensor(name, T):
    bank = _fp_weight(name, (2, 160, 256))
    for e in range(2):
        wt = bank.expert(e).sub_rows(5, 150)  # a view whose first row is not a scale block's
        dense = wt.dense().astype(np.float64)
        x = rng.standard_normal((T, 256)).astype(F32)
        y = wt.mm(x)
        # float32 dot products of n terms: |error| <= n * eps32 * sum |w x| (the classical bound)
        ref = x.astype(np.float64) @ dense.T
        bound = 256 * np.finfo(F32).eps * (np.abs(x).astype(np.float64) @ np.abs(dense.T))
        assert y.dtype == F32 and (np.abs(y - ref) <= bound + 1e-30).all()
        xt = rng.standard_normal((T, 145)).astype(F32)
        ref_t = xt.astype(np.float64) @ dense
        bound_t = 145 * np.finfo(F32).eps * (np.abs(xt).astype(np.float64) @ np.abs(dense))
        assert (np.abs(wt.mm_t(xt) - ref_t) <= bound_t + 1e-30).all()
