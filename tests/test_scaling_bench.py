"""The scaling bench's seeded shape builder (bench/scale_shape.py), on its tiny shape: the F32 GGUF
it writes is read back by vindex3's GGUF import equal to the seeded arrays (q/k rows un-permuted
from llama.cpp's order), the encoded f32 container holds those very values, and the Q8_0 / Q4_1
peer files hold the gguf package's quantization of the same arrays, imported natively byte for
byte. So every arm of bench/scaling_1b.py starts from one set of float32 arrays."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.numeric
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
pytest.importorskip("gguf")
try:  # the bench's vocabulary is cut from the shipped SmolLM2 GGUF
    from vindex3.default_model import gguf_path

    gguf_path()
except Exception as e:  # noqa: BLE001  (ContainerNotFound names what is missing)
    pytest.skip(f"SKIPPED LOUDLY: {e}", allow_module_level=True)

import scale_shape as S

LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
         "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}


def hf_name(gguf_name: str) -> str:
    if gguf_name in GLOBAL:
        return GLOBAL[gguf_name]
    _, i, part, _ = gguf_name.split(".")
    return f"model.layers.{i}.{LAYER[part]}.weight"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    return S.build(tmp_path_factory.mktemp("scale"), "tiny", log=lambda m: None)


def test_rotary_permutation_round_trips():
    from vindex3.sources.gguf import _unpermute_rotary

    w = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    p = S.permute_rotary(w, 4)
    assert not np.array_equal(p, w)
    assert np.array_equal(_unpermute_rotary(p, 4), w)


def test_gguf_import_reads_back_the_seeded_arrays(built):
    from vindex3.sources import open_source

    src = open_source(built["F32"])
    shapes = S.tensor_shapes(S.SHAPES["tiny"])
    assert set(src.tensor_specs()) == {hf_name(n) for n in shapes}
    for name, shape in shapes.items():
        assert np.array_equal(src.load(hf_name(name)), S.hf_array(name, shape)), name


def test_f32_container_holds_the_same_values(built):
    import vindex3

    c = vindex3.open(built["f32"])
    prefix = {"decoder_stack": "model.layers.", "embedding": "model.embed_tokens.", "final_norm": "model.norm.",
              "output_head": "lm_head."}
    arrays = {hf_name(n): S.hf_array(n, shape) for n, shape in S.tensor_shapes(S.SHAPES["tiny"]).items()}
    held = {prefix[obj] + name: seg.tensor(name) for obj, seg in c.segments.items() for name in seg.entries}
    assert set(held) == set(arrays)
    for name, a in held.items():
        assert a.dtype == np.float32 and np.array_equal(a, arrays[name]), name


def test_peer_block_files_quantize_the_same_arrays(built):
    import gguf
    from gguf.quants import quantize

    s = S.SHAPES["tiny"]
    shapes = S.tensor_shapes(s)
    for qname in ("Q8_0", "Q4_1"):
        r = gguf.GGUFReader(built[qname], "r")
        for t in r.tensors:
            a = S.gguf_array(t.name, shapes[t.name], s)
            if a.ndim == 1:
                assert np.array_equal(np.asarray(t.data), a), t.name
            else:
                assert t.tensor_type == gguf.GGMLQuantizationType[qname], t.name
                assert np.array_equal(np.asarray(t.data), quantize(a, gguf.GGMLQuantizationType[qname])), t.name
