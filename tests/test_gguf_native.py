"""A GGUF file encoded without widening: every matrix keeps the file's own blocks (q4_1, q6_k,
q8_0, f16, ...), byte for byte; the container decodes them exactly as the file's dequantized
values, runs them, and carries the block types it cannot execute, refusing them by name only
when a slice must decode one.

Witnesses: the tiny llama GGUF of tests/test_gguf_import.py (every GGUF type it writes), a tiny
GGUF holding only executable types (run end to end against its own widened container), and the
shipped SmolLM2-135M-Instruct Q4_1 file (skips, saying so, when the package is absent)."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from fixtures import blas_products
from gguf import GGMLQuantizationType as Q
from test_gguf_import import write_tiny_gguf

import vindex3
from vindex3 import cli
from vindex3.encode import encode, encode_detailed
from vindex3.errors import UnsupportedEncoding
from vindex3.exec.slice import Draft
from vindex3.sources.gguf import GgufCheckpoint

F32 = np.float32
EXECUTABLE_TYPES = {
    0: {"attn_q": Q.Q4_0, "attn_k": Q.Q5_1, "attn_v": Q.Q8_0, "attn_output": Q.Q4_1,
        "ffn_gate": Q.Q6_K, "ffn_up": Q.Q4_K, "ffn_down": Q.Q5_0},
    1: {"attn_q": Q.F16, "attn_k": Q.BF16, "attn_v": Q.MXFP4, "attn_output": Q.Q8_0,
        "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_1, "ffn_down": Q.F32},
}


def bits(a: np.ndarray) -> np.ndarray:
    assert a.dtype == F32
    return np.ascontiguousarray(a).view(np.uint32)


@pytest.fixture(scope="module")
def tiny_all(tmp_path_factory):
    """The tiny GGUF with every type test_gguf_import writes (Q2_K, Q3_K, IQ4_NL included; the
    random K-quant blocks of the executable types given finite scales)."""
    return _finite_scales(write_tiny_gguf(tmp_path_factory.mktemp("native") / "tiny-all.gguf"))


@pytest.fixture(scope="module")
def tiny_exec(tmp_path_factory):
    """A tiny GGUF whose every type has a codec: scales of K-quant blocks made finite and small."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("native") / "tiny-exec.gguf", types=EXECUTABLE_TYPES, seed=3)
    return _finite_scales(path)


def _finite_scales(path):
    """Rewrite the f16 super-block scales of the K-quant tensors (written as random bytes by the
    tiny writer) to small finite values, in place, so the model computes finite logits."""
    from test_codecs_ggml import F16_FIELDS

    reader = gguf.GGUFReader(path, "r+")
    rng = np.random.default_rng(5)
    for t in reader.tensors:
        name = t.tensor_type.name.lower()
        if name not in ("q4_k", "q5_k", "q6_k"):
            continue
        _, bb = gguf.GGML_QUANT_SIZES[t.tensor_type]
        blocks = t.data.reshape(-1, bb)
        for off in F16_FIELDS[name]:
            vals = (rng.uniform(0.5, 1.0, blocks.shape[0]) * 2.0**-9).astype(np.float16)
            blocks[:, off : off + 2] = vals.view(np.uint8).reshape(-1, 2)
    del reader
    return path


# -- what a native encode writes -------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_native_encode_keeps_every_matrix_as_the_file_stores_it(tiny_all, tmp_path):
    src = GgufCheckpoint(tiny_all)
    r = encode_detailed(tiny_all, tmp_path / "n.vindex3", native=True)
    c = vindex3.open(r.path)
    specs = src.tensor_specs()
    seen = set()
    for obj, seg in c.segments.items():
        for rel, e in seg.entries.items():
            hf = {"embedding": "model.embed_tokens.weight", "final_norm": "model.norm.weight",
                  "output_head": "lm_head.weight"}.get(obj, f"model.layers.{rel}")
            want = specs[hf].dtype.lower()
            if len(e.shape) == 1:
                assert e.dtype == "f32", rel  # norms are read whole as float32
                continue
            assert e.dtype == want, (obj, rel, e.dtype, want)
            seen.add(e.dtype)
            raw = np.asarray(seg.raw(rel))
            assert np.array_equal(raw, src.encoded(hf))
            if "q_proj" not in hf and "k_proj" not in hf:  # the file's bytes, unchanged
                t = src._tensors[hf]
                assert hashlib.sha256(raw).hexdigest() == hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest()
            if vindex3.codecs.is_known(e.dtype):  # decodes to exactly what the widened path loads
                assert np.array_equal(bits(seg.weight(rel).dense()), bits(src.load(hf))), hf
    assert {"q4_0", "q5_1", "q8_0", "q4_1", "q6_k", "q4_k", "q5_0", "f16", "bf16", "q2_k", "q3_k", "iq4_nl",
            "q5_k"} <= seen
    prov = c.provenance["native"]
    assert set(prov["not_executable"]) == {"q2_k", "q3_k", "iq4_nl"}
    # a slice that must decode a carried block type is refused by name; one that stops short runs
    with pytest.raises(UnsupportedEncoding, match=r"encoding 'q2_k', which this build cannot execute"):
        c.executor().forward([1, 2, 3])
    out = c.executor(slice=Draft(1)).forward([1, 2, 3])
    assert out.dtype == F32 and np.isfinite(out).all()


def test_cli_encodes_gguf_natively_and_widens_on_request(tiny_exec, tmp_path, capsys):
    assert cli.main(["encode", str(tiny_exec), str(tmp_path / "n.vindex3"), "--json"]) == 0
    kept = json.loads(capsys.readouterr().out)["kept_as_stored"]
    assert kept["q8_0"] == 3 and kept["q6_k"] == 2 and kept["f16"] == 1 and kept["mxfp4"] == 1 and "f32" not in kept
    assert cli.main(["encode", str(tiny_exec), str(tmp_path / "w.vindex3"), "--widen", "f32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kept_as_stored"] == {}
    n, w = vindex3.open(tmp_path / "n.vindex3"), vindex3.open(tmp_path / "w.vindex3")
    assert {e.dtype for s in w.segments.values() for e in s.entries.values()} == {"f32"}
    assert "native" not in w.provenance
    objs = {o["object"]: o for o in n.objects()}
    assert objs["embedding"]["encoding"] == "q8_0" and objs["embedding"]["bits_per_weight"] == 8.5
    assert objs["output_head"]["encoding"] == "q6_k" and objs["output_head"]["bits_per_weight"] == 6.562
    assert n.weight_bytes < w.weight_bytes / 3  # f16, bf16 and one f32 matrix among the blocks
    assert cli.main(["inspect", str(tmp_path / "n.vindex3")]) == 0
    shown = capsys.readouterr().out
    assert "embedding@q8_0" in shown and "8.50 bits/weight" in shown and "q6_k" in shown


def test_native_container_runs_like_its_widened_twin(tiny_exec, tmp_path):
    n = vindex3.open(encode(tiny_exec, tmp_path / "n.vindex3", native=True))
    w = vindex3.open(encode(tiny_exec, tmp_path / "w.vindex3"))
    for seg_n, seg_w in ((n.segments[o], w.segments[o]) for o in n.segments):
        for rel in seg_n.entries:
            assert np.array_equal(bits(np.asarray(seg_n.weight(rel).dense())), bits(np.asarray(seg_w.tensor(rel))))
    ids = [5, 17, 200, 3, 9, 44, 101, 7, 8, 250, 31, 2]
    # the widened container's own spread between two summation orders over the same float32
    # weights: its rows kernel against BLAS, over the same positions
    with blas_products():
        tiles = w.executor().forward(ids)
    spread = float(np.abs(w.executor().forward(ids) - tiles).max())
    for T in (3, len(ids)):  # the fused rows kernels (T <= 8) and decoded tiles + BLAS
        ln, lw = n.executor().forward(ids[:T]), w.executor().forward(ids[:T])
        assert ln.dtype == F32 and np.isfinite(lw).all()
        diff = float(np.abs(ln - lw).max())
        print(f"T={T}: native vs widened max|d| = {diff:.3g}; widened rows vs tiles = {spread:.3g}")
        # the native kernels sum in another order again (block scales applied to partial sums):
        # each order is within `spread` of the exact sum, so two of them within twice it
        assert diff <= 2 * max(spread, 4 * np.finfo(F32).eps * float(np.abs(lw).max())), (diff, spread)
    full = n.executor().forward(ids)
    assert np.array_equal(n.executor(slice=Draft(n.graph.num_layers)).forward(ids), full)


# -- SmolLM2-135M-Instruct Q4_1 ----------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_q4_1_encodes_natively_and_answers_paris(smollm2_gguf, smollm2_container, tmp_path):
    r = encode_detailed(smollm2_gguf, tmp_path / "smol.vindex3", native=True)
    c = vindex3.open(r.path)
    objs = {o["object"]: o for o in c.objects()}
    assert objs["decoder_stack"]["encodings"] == {"q4_1": 210, "f32": 60}
    assert objs["embedding"]["encoding"] == "q8_0"
    assert abs(objs["decoder_stack"]["bits_per_weight"] - 5.0) < 0.02
    assert c.provenance["native"]["not_executable"] == []
    f32 = vindex3.open(smollm2_container)  # the default model: the same file widened to float32
    assert c.weight_bytes < 0.25 * f32.weight_bytes
    ids = c.tokenizer.encode("The capital of France is")
    assert ids == f32.tokenizer.encode("The capital of France is")
    ln, lw = c.executor().forward(ids), f32.executor().forward(ids)
    assert c.tokenizer.token_text(int(ln[-1].argmax())) == " Paris"
    # the f32 container's own spread between its rows kernel (this 5-token prompt) and BLAS:
    # measured 5.1e-5 at |logit| <= 28; the native fused kernels (block scales applied to partial
    # sums) measured 4.7e-5 from the f32 container: two summation orders, each within the spread
    # of the exact sum
    with blas_products():
        tiles = f32.executor().forward(ids)
    spread = float(np.abs(tiles - lw).max())
    diff = float(np.abs(ln - lw).max())
    print(f"SmolLM2 native q4_1 vs f32 container: max|d| = {diff:.3g}; f32 rows vs tiles = {spread:.3g}")
    assert diff <= 2 * spread
    json.dumps(c.provenance["native"])  # serialisable record of what was kept


def test_shards_of_a_native_container_copy_the_blocks(tiny_all, tmp_path):
    from vindex3.shards import ShardContainer, write_shards
    from vindex3.shards.store import read_manifest

    c = vindex3.open(encode(tiny_all, tmp_path / "n.vindex3", native=True))
    out = write_shards(c, tmp_path / "set", 2)
    for e in read_manifest(out)["shards"]:
        member = ShardContainer(out / e["path"])
        for obj, seg in member.segments.items():
            for name in seg.entries:
                assert seg.entries[name].dtype == c.segments[obj].entries[name].dtype
                assert np.array_equal(np.asarray(seg.raw(name)), np.asarray(c.segments[obj].raw(name)))
