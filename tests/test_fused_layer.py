"""Fused decode layers (vindex3.exec.ops.fused_layer): a decode-sized pass through a plain
pre-norm block in one compiled call a layer.

Invariant (``a_fused_layer_is_the_unfused_layers_bytes``): with the fast path on, every logit
and every K/V row equals, byte for byte, what the op-by-op path computes, for every encoding the
fast path takes, both activation treatments, every pass size it takes, over many passes, at one
and two threads and on every compile target. Layers it does not take run op by op, and the
reason is recorded per layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vindex3.codecs import threads
from vindex3.errors import NonFiniteActivation
from vindex3.exec.ops import decode
from vindex3.exec.ops import fused_layer as FL
from vindex3.exec.slice import Draft, Full, LayerRange

pytestmark = pytest.mark.numeric

ROOT = Path(__file__).resolve().parents[1]
ENCODINGS = ["f32", "bf16", "int8", "q4"]


@pytest.fixture(scope="module")
def reps(tiny_llama_encodings):
    return tiny_llama_encodings


@pytest.fixture
def restore_switch():
    yield
    FL.set_enabled(None)
    decode.set_enabled(None)
    threads.set_count(None)


def _run(ex, T: int, passes: int, fused: bool, seed: int = 0):
    """A prompt of 5 positions, then ``passes`` passes of T positions (the first of each pass
    the previous pass's greedy token): every pass's logits and the final K/V rows."""
    FL.set_enabled(fused)
    st = ex.start()
    rng = np.random.default_rng(seed)
    outs = [st.prefill(rng.integers(3, 300, 5))]
    tok = int(np.argmax(outs[-1][-1]))
    for _ in range(passes):
        ids = [tok] + [int(t) for t in rng.integers(3, 300, T - 1)]
        outs.append(st.prefill(ids))
        tok = int(np.argmax(outs[-1][-1]))
    kv = {i: (ls.ops["mixer"].kt[:, :, : ls.ops["mixer"].end].copy(), ls.ops["mixer"].v[:, : ls.ops["mixer"].end].copy())
          for i, ls in st.state.layers.items()}
    return outs, kv, st.state.position


def _same(a, b) -> bool:
    (la, kva, pa), (lb, kvb, pb) = a, b
    return (pa == pb and len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))
            and kva.keys() == kvb.keys() and all(np.array_equal(kva[i][j], kvb[i][j]) for i in kva for j in (0, 1)))


@pytest.mark.parametrize("T", [1, 2, 5, 8])
@pytest.mark.parametrize("act", ["exact", "q8"])
@pytest.mark.parametrize("enc", ENCODINGS)
def test_a_fused_layer_is_the_unfused_layers_bytes(reps, enc, act, T, restore_switch):
    import vindex3

    ex = vindex3.open(reps[enc]).executor(activations=act)
    assert ex.fused.active and all(w is None for w in ex.fused.why.values()), ex.fused.describe()
    calls = []
    real = FL.FusedLayer.run

    def counted(self, *a):
        calls.append(self.index)
        return real(self, *a)

    FL.FusedLayer.run = counted
    try:
        fused = _run(ex, T, 12, True, seed=T)
    finally:
        FL.FusedLayer.run = real
    assert len(calls) == 13 * len(ex.layers)  # every pass of every layer took the fast path
    assert _same(fused, _run(ex, T, 12, False, seed=T))


def test_residual_multipliers_and_scales_fuse_byte_identically(containers, restore_switch):
    """granite: a residual multiplier of 0.5, an attention multiplier as the query scale."""
    import vindex3

    c = vindex3.open(containers("granite"))
    for act in ("exact", "q8"):
        ex = c.executor(activations=act)
        assert ex.fused.active, ex.fused.describe()
        assert ex.fused.layers[0].m1 == np.float32(0.5)
        for T in (1, 4):
            assert _same(_run(ex, T, 6, True), _run(ex, T, 6, False))


def test_draft_stays_the_full_models_bytes(tiny_llama_container, restore_switch):
    import vindex3

    c = vindex3.open(tiny_llama_container)
    full, draft = c.executor(Full(), activations="q8"), c.executor(Draft(4), activations="q8")
    assert draft.fused.active
    assert _same(_run(draft, 1, 8, True), _run(full, 1, 8, True))


@pytest.mark.parametrize("family", ["qwen2", "llama_tied", "mistral"])
def test_ineligible_layers_fall_back_and_say_why(containers, family, restore_switch):
    """qwen2 (q/k/v biases, sliding windows), llama_tied (tanh-GELU), mistral (GELU, a window):
    no layer fuses, each says why, the passes run op by op and give the same bytes."""
    import vindex3

    ex = vindex3.open(containers(family)).executor()
    assert not ex.fused.active
    assert all(w for w in ex.fused.why.values())
    lines = "\n".join(ex.fused.describe())
    assert {"qwen2": "biases", "llama_tied": "gelu_tanh", "mistral": "sliding window"}[family] in lines
    real = FL.FusedLayer.run
    FL.FusedLayer.run = lambda *a: pytest.fail("a fused layer ran")
    try:
        a = _run(ex, 1, 4, True)
    finally:
        FL.FusedLayer.run = real
    assert _same(a, _run(ex, 1, 4, False))


def test_switches_hooks_and_interventions_take_the_unfused_path(tiny_llama_container, restore_switch):
    import vindex3
    from vindex3.exec.engine import Observer
    from vindex3.exec.intervention import FeatureAblation

    c = vindex3.open(tiny_llama_container)
    FL.set_enabled(False)
    assert all("off: VINDEX3_FUSED_LAYERS=0" in line for line in c.executor().fused.describe())
    FL.set_enabled(True)
    ab = c.executor(intervention=FeatureAblation(features=((1, 0), (1, 3))))
    assert not ab.fused.active and "intervention" in ab.fused.why[1]
    ex = c.executor()
    real = FL.FusedLayer.run
    FL.FusedLayer.run = lambda *a: pytest.fail("a fused layer ran")
    try:
        seen = []

        class Obs(Observer):
            def enter(self, layer, p0, h):
                seen.append(layer)

        st = ex.start(observer=Obs())
        st.prefill([5, 6, 7])
        assert seen == ex.layers  # an observed stream runs op by op
        decode.set_enabled(False)  # VINDEX3_DECODE_KERNELS=0: the fused call is made of them
        ex.start().prefill([5, 6, 7])
        decode.set_enabled(True)
        FL.set_enabled(False)  # VINDEX3_FUSED_LAYERS=0
        ex.start().prefill([5, 6, 7])
    finally:
        FL.FusedLayer.run = real


def test_thread_count_changes_no_byte(reps, restore_switch):
    import vindex3

    for enc, act in (("int8", "q8"), ("q4", "q8"), ("f32", "exact")):
        ex = vindex3.open(reps[enc]).executor(activations=act)
        threads.set_count(1)
        one = _run(ex, 3, 5, True)
        threads.set_count(2)
        two = _run(ex, 3, 5, True)
        assert _same(one, two), enc


def test_a_non_finite_layer_is_refused_as_the_unfused_path_refuses(tiny_llama_container, restore_switch):
    import vindex3

    ex = vindex3.open(tiny_llama_container).executor(LayerRange(0, 2))
    assert ex.fused.active
    for h, where in ((np.full((2, 64), 3e38, np.float32), "mean of squares"), (np.full((2, 64), np.nan, np.float32), "mean of squares")):
        errs = []
        for fused in (True, False):
            FL.set_enabled(fused)
            st = ex.start()
            st.prefill_hidden(np.ones((2, 64), np.float32))
            with pytest.raises(NonFiniteActivation, match=where) as e:
                st.prefill_hidden(h)
            errs.append((str(e.value), e.value.layer, e.value.site,
                         [ls.ops["mixer"].end for ls in st.state.layers.values()], st.state.position))
        assert errs[0] == errs[1]


_CHILD = """
import json, numpy as np, sys
import vindex3
from vindex3.exec.ops import fused_layer as FL
out = {}
for path, act in json.loads(sys.argv[1]):
    ex = vindex3.open(path).executor(activations=act)
    assert ex.fused.active and FL.enabled()
    st = ex.start()
    ls = [st.prefill([5, 9, 11])]
    for t in (7, 8, 9):
        ls.append(st.prefill([t, t + 1]))
    out[path + act] = b"".join(l.tobytes() for l in ls).hex()
print(json.dumps(out))
"""


def test_fused_passes_are_the_same_bytes_on_every_compile_target(reps, restore_switch):
    """Compiled for generic (the plain integer path) and haswell (AVX2), the fused passes give
    this process's bytes."""
    import vindex3

    arms = [(str(reps["int8"]), "q8"), (str(reps["q4"]), "q8"), (str(reps["f32"]), "exact"), (str(reps["bf16"]), "exact")]
    FL.set_enabled(True)
    here = {}
    for path, act in arms:
        st = vindex3.open(path).executor(activations=act).start()
        ls = [st.prefill([5, 9, 11])]
        for t in (7, 8, 9):
            ls.append(st.prefill([t, t + 1]))
        here[path + act] = b"".join(x.tobytes() for x in ls).hex()

    def child(extra):
        env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_CPU")}
        env.update(extra, PYTHONPATH=str(ROOT), VINDEX3_FUSED_LAYERS="1")
        r = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(arms)], check=False, env=env, cwd=ROOT,
                           capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    assert child({"NUMBA_CPU_NAME": "generic"}) == here
    assert child({"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+64bit,+avx,+avx2,+fma,+f16c,+sse4.2,+popcnt"}) == here


def test_a_weight_class_is_fused_only_as_it_declares_itself():
    from vindex3 import codecs
    from vindex3.codecs.f32 import DenseF32

    W = np.zeros((4, 64), np.float32)
    kinds = {}
    for enc in ("f32", "bf16", "f16", "int8", "int8h", "q4"):
        w = codecs.get(enc).weight(codecs.get(enc).encode(W), W.shape)
        kinds[enc] = (FL._kind(w), FL._kind(w.with_activations("q8")) if hasattr(w, "with_activations") else None)
    assert kinds["int8h"] == kinds["int8"] == ("i8", "i8q8")  # int8h runs the int8 kernels
    assert kinds["q4"] == ("q4", "q4q8") and kinds["f32"][0] == "f32" and kinds["bf16"][0] == "bf16"
    assert kinds["f16"][0] is None  # no fused rows kernel for f16

    class Other(DenseF32):  # a subclass may multiply otherwise: not fused unless it says so
        pass

    assert FL._kind(Other(W)) is None
