"""Integer dot products (vindex3.codecs.intrinsics) and the executor choice ``activations``.

The oracle for every path is a numpy rendering, written here, of the arithmetic the module
documents: per-block activation codes, exact integer lanes of 4 products, 16 float32
accumulators updated chunk by chunk, a fixed tree. It must equal every path byte for byte; a
float64 product of the same quantized operands bounds the float32 rounding, and the exact
float product bounds the quantization of the activation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import vindex3
from vindex3 import codecs
from vindex3.codecs import intrinsics as I
from vindex3.codecs.kernels import F16_TABLE
from vindex3.errors import VindexError
from vindex3.exec.slice import Draft

pytestmark = pytest.mark.numeric

F32 = np.float32
ROOT = Path(__file__).resolve().parents[1]
RUNNABLE = [p for p in I.PATHS if I.available(p)]
# shape classes: one block (K < 64), K % 64 == 0, K % 64 == 32 (a tail block), SmolLM2's widths
KS = [32, 64, 96, 160, 576, 1536]
rng = np.random.default_rng(26)


def _weights(kind: str, O: int, K: int, *, extreme: bool = False):
    W = rng.standard_normal((O, K)).astype(F32)
    W[0, :32] = 0.0  # a zero block: scale 0
    if kind == "i8":
        w = codecs.get("int8").weight(codecs.get("int8").encode(W), (O, K))
        if extreme:  # codes the encoder never writes but a foreign file may hold: -128
            q = w.q.copy()
            q[1, ::3] = -128
            w = type(w)(q, w.s, (O, K))
        return w
    return codecs.get("q4").weight(codecs.get("q4").encode(W), (O, K))


def _x(T: int, K: int) -> np.ndarray:
    x = (rng.standard_normal((T, K)) * rng.uniform(0.01, 30, (T, 1))).astype(F32)
    x[0, 32 : min(K, 64)] = 0.0  # a zero activation block
    return x


# -- the documented arithmetic, in numpy ---------------------------------------------------
def ref_quantize(x: np.ndarray):
    T, K = x.shape
    b = x.reshape(T, K // 32, 32)
    d = (np.abs(b).max(axis=2) / F32(127)).astype(F32)
    safe = np.where(d > 0, d, F32(1))
    q = np.clip(np.rint(b / safe[..., None]), -127, 127).astype(np.int8)
    q[d == 0] = 0
    xs = (d * q.astype(np.int32).sum(axis=2).astype(F32)).astype(F32)
    return q.reshape(T, K), d, xs


def _codes(kind, w):
    """Weight codes in element order (int32 [O, K]) and the per-block scale (float32 [O, K/32])."""
    if kind == "i8":
        return w.q.astype(np.int32), w.s
    O, H = w.qs.shape
    blk = w.qs.reshape(O, H // 16, 16)
    codes = np.concatenate([blk & 15, blk >> 4], axis=2).reshape(O, 2 * H).astype(np.int32)
    return codes, F16_TABLE[w.d]


def ref_rows(kind, w, x) -> np.ndarray:
    """Y [T, O] by the lane/accumulator/tree order of intrinsics.py, float32 step by step."""
    codes, sw = _codes(kind, w)
    XQ, XD, XS = ref_quantize(x)
    O, K = codes.shape
    T = x.shape[0]
    lanes = (codes[None] * XQ.astype(np.int32)[:, None]).reshape(T, O, K // 4, 4).sum(axis=3)  # exact
    scale = (sw[None] * XD[:, None]).astype(F32)  # [T, O, nb]
    acc = np.zeros((T, O, 16), F32)
    for c in range((K + 63) // 64):
        n = 16 if 64 * (c + 1) <= K else 8
        lf = lanes[:, :, 16 * c : 16 * c + n].astype(F32)
        s = np.repeat(scale[:, :, 2 * c : 2 * c + n // 8], 8, axis=2)
        acc[:, :, :n] = acc[:, :, :n] + lf * s
    v8 = acc[..., :8] + acc[..., 8:]
    v4 = v8[..., :4] + v8[..., 4:]
    y = (v4[..., 0] + v4[..., 2]) + (v4[..., 1] + v4[..., 3])
    if kind == "q4":  # the offsets' term, summed block by block from zero, added last
        m = F16_TABLE[w.m]
        mt = np.zeros_like(y)
        for b in range(K // 32):
            mt = mt + m[None, :, b] * XS[:, None, b]
        y = y + mt
    return y.astype(F32)


def ref_f64(kind, w, x) -> tuple[np.ndarray, np.ndarray]:
    """The product of the same quantized operands in float64, and sum |terms| (for the bound)."""
    XQ, XD, _ = ref_quantize(x)
    xdq = (XQ.reshape(len(x), -1, 32).astype(np.float64) * XD[..., None]).reshape(x.shape)
    wd = w.dense().astype(np.float64)
    return xdq @ wd.T, np.abs(xdq) @ np.abs(wd).T


def run(kind, w, x, path, parallel=False) -> np.ndarray:
    y = np.empty((x.shape[0], w.rows), F32)
    k = I.rows_kernel(kind, path, parallel)
    if kind == "i8":
        k(w.q, w.s, x, y, I.ROWS_PER_TASK)
    else:
        k(w.qs, w.d, w.m, F16_TABLE, x, y, I.ROWS_PER_TASK)
    return y


# -- paths -----------------------------------------------------------------------------------
def test_the_path_follows_the_target_features():
    if not I._is_x86():
        assert I.best({"avx512f", "avx512bw", "avx512vnni"}) == "plain"
        return
    assert I.best({"avx512f", "avx512bw", "avx512vnni", "avx2"}) == "vnni512"
    assert I.best({"avx2", "avxvnni"}) == "vnni256"
    assert I.best({"avx2", "avx512vnni", "avx512vl"}) == "vnni256"  # the EVEX 256-bit form
    assert I.best({"avx2", "fma"}) == "avx2"
    assert I.best({"sse4.2", "avx"}) == "plain"
    assert I.best(set()) == "plain"
    with pytest.raises(ValueError, match="unknown integer dot path 'sse9'"):
        I.available("sse9")


def test_quantize_x_is_the_documented_quantization():
    x = _x(3, 160)
    x[1, 64:96] = np.linspace(-1, 1, 32, dtype=F32) * F32(1e-30)  # tiny but nonzero
    XQ, XD, XC, XS = I.quantized(x)
    q, d, xs = ref_quantize(x)
    assert np.array_equal(XQ, q) and np.array_equal(XD, d) and np.array_equal(XS, xs)
    assert np.array_equal(XC, -128 * q.astype(np.int32).reshape(3, 40, 4).sum(axis=2))
    assert np.abs(XQ).max() == 127 and XD.dtype == F32


def test_a_nonfinite_activation_block_gives_nan_not_garbage():
    w = _weights("i8", 8, 96)
    x = _x(1, 96)
    x[0, 70] = np.inf
    y = run("i8", w, x, "plain")
    assert np.isnan(y[0, 1:]).all()  # every row with a nonzero weight block there


@pytest.mark.parametrize("kind", ["i8", "q4"])
@pytest.mark.parametrize("K", KS)
@pytest.mark.parametrize("path", RUNNABLE)
def test_each_path_is_the_documented_arithmetic(kind, K, path):
    O, T = 37, 3  # O not a multiple of the task size
    w = _weights(kind, O, K, extreme=True)
    x = _x(T, K)
    y = run(kind, w, x, path)
    assert y.dtype == F32
    assert np.array_equal(y, ref_rows(kind, w, x))  # byte for byte
    # against float64 of the same operands: float32 rounding of at most K/64 + 6 sequential
    # steps (chunks, tree, scale products, offsets; the a-priori bound); measured over these
    # fixtures: max |d| / sum|terms| = 2.5e-7 (2.1 eps), the bound is >= 6.5 eps
    exact, mag = ref_f64(kind, w, x)
    bound = (K / 64 + 6 + (K / 32 if kind == "q4" else 0)) * np.finfo(F32).eps * mag + 1e-30
    assert (np.abs(y - exact) <= bound).all()


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_q8_products_stay_within_the_activation_quantization_of_the_float_product(kind):
    K = 576
    w = _weights(kind, 64, K)
    x = _x(2, K)
    y = run(kind, w, x, I.best())
    wd = w.dense().astype(np.float64)
    exact = x.astype(np.float64) @ wd.T
    # |x - x'| <= d/2 per element (round to nearest), so |y - x W^T| <= sum_j |w_j| d_b / 2,
    # plus the float32 rounding bounded above; measured: |d| reaches 0.12 of the first term
    _, XD, _ = ref_quantize(x)
    half = np.repeat(XD.astype(np.float64) / 2, 32, axis=1)
    bound = half @ np.abs(wd).T * (1 + 1e-6) + (K / 16) * np.finfo(F32).eps * (np.abs(x) @ np.abs(wd).T)
    assert (np.abs(y - exact) <= bound).all()


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_every_path_gives_the_same_bytes(kind):
    outs = {}
    for K in (32, 96, 576):
        w = _weights(kind, 50, K, extreme=True)
        x = _x(4, K)
        for p in RUNNABLE:
            outs[(K, p)] = run(kind, w, x, p)
        for p in RUNNABLE:
            assert np.array_equal(outs[(K, p)], outs[(K, "plain")]), (K, p)


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_results_do_not_depend_on_the_thread_count(kind):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); thread independence needs 2")
    w = _weights(kind, 1536 // 8, 576)
    x = _x(2, 576)
    serial = run(kind, w, x, I.best())
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            assert np.array_equal(run(kind, w, x, I.best(), parallel=True), serial)
    finally:
        numba.set_num_threads(before)


_CHILD = """
import json, sys, numpy as np
from vindex3 import codecs
from vindex3.codecs import intrinsics as I
rng = np.random.default_rng(5)
W = rng.standard_normal((40, 96)).astype(np.float32)
x = rng.standard_normal((2, 96)).astype(np.float32)
out = {"path": I.chosen(), "features": sorted(I.target_features())[:3]}
for enc in ("int8", "q4"):
    c = codecs.get(enc)
    w = c.weight(c.encode(W), W.shape).with_activations("q8")
    out[enc] = w.mm(x).tobytes().hex()
print(json.dumps(out))
"""


def _child(env_extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU") and k != "VINDEX3_INTDOT_PATH"}
    env.update(env_extra, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", _CHILD], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_target_without_the_features_runs_the_fallback_with_the_same_bytes():
    host = _child({})
    generic = _child({"NUMBA_CPU_NAME": "generic"})
    assert generic["path"] == "plain"  # the fallback ran: no x86 extension in the target
    haswell = _child({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt"})
    if I._is_x86():
        assert haswell["path"] == "avx2"
    for enc in ("int8", "q4"):
        assert generic[enc] == host[enc] == haswell[enc], enc


def test_a_forced_path_the_target_lacks_is_refused_by_name():
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
    env.update(NUMBA_CPU_NAME="generic", VINDEX3_INTDOT_PATH="vnni512", PYTHONPATH=str(ROOT))
    code = "from vindex3.codecs import intrinsics as I\ntry:\n    I.chosen()\nexcept Exception as e:\n    print(e)"
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "VINDEX3_INTDOT_PATH='vnni512': the compile target lacks avx512f" in r.stdout


# -- the executor choice ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def int_reps(tiny_llama_container, tmp_path_factory):
    from vindex3.represent import represent

    base = tmp_path_factory.mktemp("intdot")
    reps = {e: represent(tiny_llama_container, base / f"{e}.vindex3", e).path for e in ("int8", "int8h", "q4", "bf16")}
    return reps | {"f32": tiny_llama_container}


IDS = [1, 40, 41, 77, 9, 200, 13, 5]


def _decode(ex, ids):
    st = ex.start()
    rows = [st.prefill(ids[:1])[-1]]
    for t in ids[1:]:
        rows.append(st.step(t))
    return np.stack(rows), st.trace


@pytest.mark.parametrize("enc", ["int8", "int8h", "q4"])
def test_activations_q8_is_recorded_and_draft_at_full_depth_is_bit_identical(int_reps, enc):
    c = vindex3.open(int_reps[enc])
    L = c.graph.num_layers
    default, _ = _decode(c.executor(), IDS)
    exact, tr_exact = _decode(c.executor(activations="exact"), IDS)
    assert np.array_equal(default, exact) and tr_exact.activations == "exact"
    full, tr = _decode(c.executor(activations="q8"), IDS)
    draft, trd = _decode(c.executor(Draft(L), activations="q8"), IDS)
    assert tr.activations == trd.activations == "q8"
    assert np.array_equal(full, draft)  # draft_at_full_depth_is_bit_identical, under q8
    assert full.dtype == F32 and not np.array_equal(full, exact)  # q8 did change the products
    # the same greedy choices on the tiny model at every position
    assert (np.argmax(full, axis=1) == np.argmax(exact, axis=1)).mean() >= 0.75


def test_q8_changes_nothing_for_a_float_encoding(int_reps):
    c = vindex3.open(int_reps["bf16"])
    a, _ = _decode(c.executor(), IDS)
    b, tr = _decode(c.executor(activations="q8"), IDS)
    assert np.array_equal(a, b) and tr.activations == "q8"


def test_an_unknown_activation_treatment_is_refused_by_name(int_reps):
    c = vindex3.open(int_reps["int8"])
    with pytest.raises(VindexError, match=r"activations 'q4' is not a known activation treatment \(known: exact, q8\)"):
        c.executor(activations="q4")


def test_activations_are_in_the_dump_sidecar_and_the_observe_record(int_reps, tmp_path):
    from vindex3.draft import dump_logits
    from vindex3.internals import Internals

    c = vindex3.open(int_reps["q4"])
    meta = dump_logits(c, IDS[:4], None, tmp_path / "d.f32", activations="q8")
    assert meta["activations"] == "q8"
    assert json.loads((tmp_path / "d.meta.json").read_text())["activations"] == "q8"
    assert dump_logits(c, IDS[:4], None, tmp_path / "e.f32")["activations"] == "exact"
    res = Internals(c).observe(IDS[:4], tmp_path / "run.jsonl", activations="q8")
    head = json.loads(Path(res.path).read_text().splitlines()[0])
    assert head["activations"] == "q8"
    view = Internals(c)
    view.trace(IDS[:4], IDS[4], save=str(tmp_path / "t.npz"), activations="q8")
    with np.load(tmp_path / "t.npz") as z:
        assert json.loads(str(z["provenance"]))["activations"] == "q8"


# -- the real model ----------------------------------------------------------------------------
@pytest.mark.parametrize("enc", ["int8", "int8h", "q4"])
def test_smollm2_in_int8_and_q4_answers_paris_under_both_activation_treatments(smollm2_container, tmp_path, enc):
    from vindex3.represent import represent

    out = represent(smollm2_container, tmp_path / f"smollm2-{enc}.vindex3", enc).path
    c = vindex3.open(out)
    ids = c.tokenizer.encode("The capital of France is")
    for act in ("exact", "q8"):
        ex = c.executor(activations=act)
        st = ex.start()
        st.prefill(ids[:-1])
        logits = st.step(ids[-1])  # the last position through the decode path
        assert c.tokenizer.decode([int(np.argmax(logits))]) == " Paris", act
        assert st.trace.activations == act


# -- bf16 rows, widened in registers --------------------------------------------------------------
def ref_bf16(h: np.ndarray, x: np.ndarray) -> np.ndarray:
    """64 float32 accumulators chunk by chunk, then the tree of halves (intrinsics.py)."""
    O, K = h.shape
    w = (h.astype(np.uint32) << 16).view(F32)
    y = np.empty((x.shape[0], O), F32)
    for t in range(x.shape[0]):
        acc = np.zeros((O, 64), F32)
        for c in range(0, K, 64):
            n = min(64, K - c)
            acc[:, :n] = acc[:, :n] + w[:, c : c + n] * x[t, c : c + n]
        n = 32
        while n >= 1:
            acc[:, :n] = acc[:, :n] + acc[:, n : 2 * n]
            n //= 2
        y[t] = acc[:, 0]
    return y


@pytest.mark.parametrize("K", [7, 64, 100, 576])
def test_bf16_rows_vector_and_plain_are_the_documented_order(K):
    W = rng.standard_normal((21, K)).astype(F32)
    w = codecs.get("bf16").weight(codecs.get("bf16").encode(W), W.shape)
    x = _x(2, K) if K >= 64 else rng.standard_normal((2, K)).astype(F32)
    want = ref_bf16(w.h, x)
    for path in ("vector", "plain"):
        y = np.empty((2, 21), F32)
        I.rows_bf16(path)(w.h, x, y, I.ROWS_PER_TASK)
        assert np.array_equal(y, want), path
    with pytest.raises(ValueError, match="unknown bf16 dot path 'avx'"):
        I.rows_bf16("avx")


# -- several weights against one activation (q/k/v, gate/up) -------------------------------------
def _encoded(enc: str, rows: tuple[int, ...], K: int):
    c = codecs.get(enc)
    out = []
    for O in rows:
        W = rng.standard_normal((O, K)).astype(F32)
        raw = c.encode(W)
        raw.flags.writeable = False  # as a mapped segment hands them out
        out.append(c.weight(raw, (O, K)))
    return out


@pytest.mark.parametrize("enc", ["int8", "q4"])
@pytest.mark.parametrize("K", [32, 96, 576])
@pytest.mark.parametrize("path", RUNNABLE)
def test_fused_q8_products_are_the_bytes_of_one_product_per_weight(enc, K, path):
    from vindex3.codecs.base import products

    ws = [w.with_activations("q8") for w in _encoded(enc, (37, 16, 16), K)]
    x = _x(3, K)
    I.use(path)
    try:
        fused = products(ws)
        assert fused.__qualname__.startswith("RowWeight.fused")  # the one-launch kernel ran
        got = fused(x)
        want = tuple(w.mm(x) for w in ws)
    finally:
        I.use(None)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert g.dtype == F32 and np.array_equal(g, w)


@pytest.mark.parametrize("kind", ["i8", "q4"])
def test_fused_q8_products_do_not_depend_on_the_thread_count(kind):
    import numba

    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip(f"numba has {numba.config.NUMBA_NUM_THREADS} thread(s); thread independence needs 2")
    ws = _encoded("int8" if kind == "i8" else "q4", (64, 33), 576)
    x = _x(2, 576)
    args = (tuple(w.q for w in ws), tuple(w.s for w in ws)) if kind == "i8" else (
        tuple(w.qs for w in ws), tuple(w.d for w in ws), tuple(w.m for w in ws), F16_TABLE)

    def run_group(parallel):
        ys = tuple(np.empty((2, w.rows), F32) for w in ws)
        I.group_kernel(kind, I.best(), parallel)(*args, x, ys, I.ROWS_PER_TASK)
        return ys

    serial = run_group(False)
    before = numba.get_num_threads()
    try:
        for n in (1, 2):
            numba.set_num_threads(n)
            assert all(np.array_equal(a, b) for a, b in zip(run_group(True), serial))
    finally:
        numba.set_num_threads(before)


def test_products_fall_back_to_one_product_per_weight_when_nothing_fuses():
    from vindex3.codecs.base import products

    K = 96
    i8 = [w.with_activations("q8") for w in _encoded("int8", (8, 8), K)]
    q4 = _encoded("q4", (8,), K)[0].with_activations("q8")
    writable = codecs.get("int8").weight(codecs.get("int8").encode(rng.standard_normal((8, K)).astype(F32)), (8, K))
    x = _x(2, K)
    exact = _encoded("int8", (8, 8), K)  # activations 'exact': no fused kernel, the bytes stay
    for ws in ([i8[0], q4], exact, [i8[0], i8[1].with_activations("exact")], [i8[0], writable.with_activations("q8")],
               [i8[0]]):
        f = products(ws)
        assert not f.__qualname__.startswith("RowWeight.fused"), ws
        got = f(x)
        assert all(np.array_equal(g, w.mm(x)) for g, w in zip(got, ws))
    # a fused kernel still takes what it cannot launch on (one activation row as 1-D, T > 8)
    f = products(i8)
    for xx in (x[0], _x(12, K)):
        assert all(np.array_equal(g, w.mm(xx)) for g, w in zip(f(xx), i8))


@pytest.mark.parametrize("act", ["exact", "q8"])
@pytest.mark.parametrize("enc", ["f32", "int8", "q4", "bf16"])
def test_a_decode_with_fused_projections_is_the_decode_without_them(int_reps, enc, act, monkeypatch):
    import vindex3.exec.ops.softmax as attn
    import vindex3.operators.gated_ffn as ffn
    from vindex3.codecs import threads

    c = vindex3.open(int_reps[enc])
    launches = [0]
    real = threads._LAUNCH

    class Counting(type(real)):
        def __enter__(self):
            launches[0] += 1
            return real.__enter__()

    monkeypatch.setattr(threads, "_LAUNCH", Counting())
    # the products' own grouping is measured here: fused decode layers (one call a layer, their
    # own test in tests/test_fused_layer.py) would hide it
    from vindex3.exec.ops import fused_layer

    monkeypatch.setattr(fused_layer.FUSED, "on", False)

    def step_launches(ex):
        st = ex.start()
        st.prefill(IDS[:3])
        launches[0] = 0
        st.step(IDS[3])
        return launches[0]

    fused, _ = _decode(c.executor(activations=act), IDS)
    n_fused = step_launches(c.executor(activations=act))

    def one_by_one(weights):
        ws = tuple(weights)
        return lambda x: tuple(w.mm(x) for w in ws)

    monkeypatch.setattr(attn, "products", one_by_one)
    monkeypatch.setattr(ffn, "products", one_by_one)
    apart, _ = _decode(c.executor(activations=act), IDS)
    n_apart = step_launches(c.executor(activations=act))
    assert np.array_equal(fused, apart)
    L = c.graph.num_layers
    # q/k/v: 3 launches become 1, gate/up: 2 become 1, for the fixed-order kernels (f32, bf16,
    # and int8/q4 under q8); int8/q4 under 'exact' keep one launch per weight
    fuses = enc in ("f32", "bf16") or (act == "q8" and enc in ("int8", "q4"))
    assert n_apart - n_fused == (3 * L if fuses else 0)


@pytest.mark.parametrize("K", [64, 100, 576])
def test_fused_bf16_products_are_the_bytes_of_one_product_per_weight(K):
    from vindex3.codecs.base import products

    ws = _encoded("bf16", (21, 8, 8), K)
    x = _x(2, K) if K % 32 == 0 else rng.standard_normal((2, K)).astype(F32)
    f = products(ws)
    assert f.__qualname__.startswith("RowWeight.fused")
    for g, w in zip(f(x), ws):
        assert np.array_equal(g, w.mm(x))
        assert np.array_equal(g, ref_bf16(w.h, x))  # the wired kernel is the documented order
