"""COMPILE with overrides (issue 30): an edit overlay baked into a new container computes the very
bytes the overlay computes over the original, and nothing else of the container changes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures import token_by_token

import vindex3
from vindex3.compile import (
    OverriddenSource,
    OverrideRefused,
    check_overrides,
    compile,
    overridden_executor,
)
from vindex3.errors import EncodeError
from vindex3.exec.engine import Executor
from vindex3.exec.slice import Draft, Full
from vindex3.manifest import seal
from vindex3.represent import represent

pytestmark = pytest.mark.numeric

IDS = [5, 17, 99, 3, 250, 42, 7, 7, 123, 310, 64, 1]
DOWN = "decoder_stack/1.mlp.down_proj.weight"


def _tensor(c, label: str) -> np.ndarray:
    obj, name = label.split("/", 1)
    return np.array(c.segments[obj].weight(name).dense(), dtype=np.float32)


def _edits(c, labels, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {lb: (_tensor(c, lb) + np.float32(0.3) * rng.standard_normal(_tensor(c, lb).shape).astype(np.float32))
            for lb in labels}


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family,labels", [
    ("llama", [DOWN, "decoder_stack/0.self_attn.q_proj.weight", "final_norm/weight", "output_head/weight"]),
    ("llama_tied", ["embedding/weight", "decoder_stack/3.post_attention_layernorm.weight"]),  # the tied head too
    ("qwen3", ["decoder_stack/2.self_attn.q_proj.bias", "decoder_stack/2.self_attn.k_norm.weight", DOWN]),
])
def test_compiled_container_equals_the_overlay_bit_for_bit(containers, tmp_path, family, labels):
    c = vindex3.open(containers(family))
    before = _hashes(c.path)
    ov = _edits(c, labels)
    r = compile(c, tmp_path / "out.vindex3", overrides=ov, provenance={"patch": "p", "edits": 1})  # an open container
    out = vindex3.open(r.path)
    overlay = overridden_executor(c, ov)
    baked = out.executor()
    a, b = overlay.forward(IDS), baked.forward(IDS)
    assert a.dtype == np.float32 and np.array_equal(a, b)
    assert np.abs(a - c.executor().forward(IDS)).max() > 1e-4  # the edit is real
    assert np.array_equal(token_by_token(overlay, IDS), token_by_token(baked, IDS))
    # a draft slice reads the same edited operands in both
    assert np.array_equal(Executor(c.op_plan(), OverriddenSource(c, ov), Draft(2)).forward(IDS),
                          out.executor(Draft(2)).forward(IDS))
    assert sorted(r.edited) == sorted(labels) and _hashes(c.path) == before  # the source is untouched


def test_only_the_edited_objects_change(containers, tmp_path):
    src = tmp_path / "src.vindex3"
    shutil.copytree(containers("llama"), src)
    idx = json.loads((src / "index.json").read_text())
    idx["x_future_feature"] = {"nested": [1, 2.5, "three"]}
    idx["model"]["x_model_note"] = "kept"
    (src / "index.json").write_text(json.dumps(seal(idx)))
    c = vindex3.open(src)
    r = compile(src, tmp_path / "out.vindex3", overrides=_edits(c, [DOWN]), provenance={"patch": {"name": "p1"}})
    out = vindex3.open(r.path)
    a, b = _hashes(src), _hashes(r.path)
    changed = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))
    assert changed == ["index.json", "segments/decoder_stack.bin"]
    assert out.generation == c.generation + 1 and out.authority == "derived"
    assert out.index["x_future_feature"] == idx["x_future_feature"] and out.index["model"]["x_model_note"] == "kept"
    rec = out.provenance["compiled"]
    assert rec["source"]["digest"] == c.digest and rec["patches"] == [{"patch": {"name": "p1"}}]
    [e] = rec["edited"]
    assert e["tensor"] == DOWN and e["encoding"] == "f32" and e["source_sha256"] != e["sha256"]
    # untouched tensors of the edited object are the same bytes; the other objects' entries unchanged
    seg_a, seg_b = c.segments["decoder_stack"], out.segments["decoder_stack"]
    for name in seg_a.entries:
        same = np.array_equal(seg_a.raw(name), seg_b.raw(name))
        assert same == (name != "1.mlp.down_proj.weight"), name
    for key in ("embedding@f32", "final_norm@f32", "output_head@f32"):
        assert out.index["representations"][key] == c.index["representations"][key]
    assert out.digest != c.digest and vindex3.verify(r.path).ok


def test_an_edit_in_an_int8_object_is_written_f32_beside_the_carried_bytes(tiny_llama_container, tmp_path):
    q = represent(tiny_llama_container, tmp_path / "int8.vindex3", "int8").path
    c = vindex3.open(q)
    ov = {DOWN: _tensor(c, DOWN) * np.float32(1.5)}
    r = compile(q, tmp_path / "out.vindex3", overrides=ov)
    out = vindex3.open(r.path)
    entries = out.segments["decoder_stack"].entries
    assert entries["1.mlp.down_proj.weight"].dtype == "f32" and entries["0.mlp.down_proj.weight"].dtype == "int8"
    assert "decoder_stack@int8" in out.index["representations"]  # int8 still holds most of its elements
    assert np.array_equal(overridden_executor(c, ov).forward(IDS), out.executor().forward(IDS))


def test_compile_without_overrides_is_a_verified_copy(tiny_llama_container, tmp_path):
    r = compile(tiny_llama_container, tmp_path / "copy.vindex3")
    a, b = _hashes(Path(tiny_llama_container)), _hashes(r.path)
    assert {k for k in a if a[k] != b.get(k)} == {"index.json"} and r.edited == []
    assert vindex3.open(r.path).digest == vindex3.open(tiny_llama_container).digest


@pytest.mark.parametrize("label,value,named", [
    ("decoder_stack/9.mlp.down_proj.weight", None, "has no tensor '9.mlp.down_proj.weight'"),
    ("perception/weight", None, "object 'perception' is not in the container"),
    ("final_norm", None, "a label is '<object>/<tensor>'"),
    (DOWN, np.zeros((96, 64), np.float32), "has shape [96, 64]; the stored tensor is [64, 96]"),
    (DOWN, np.zeros((64, 96), np.float64), "is float64, not float32"),
    (DOWN, np.full((64, 96), np.nan, np.float32), "holds 6144 NaN or infinite value(s)"),
    (DOWN, [[0.0]], "is a list, not a numpy array"),
])
def test_a_bad_override_is_refused_by_name_and_nothing_is_written(tiny_llama_container, tmp_path, label, value, named):
    c = vindex3.open(tiny_llama_container)
    ov = {label: np.zeros((1,), np.float32) if value is None else value}
    with pytest.raises(OverrideRefused) as e:
        compile(c.path, tmp_path / "out.vindex3", overrides=ov)
    assert label in str(e.value) and named in str(e.value)
    with pytest.raises(OverrideRefused):
        OverriddenSource(c, ov)
    assert not (tmp_path / "out.vindex3").exists() and list(tmp_path.iterdir()) == []


def test_provenance_must_be_json(tiny_llama_container, tmp_path):
    c = vindex3.open(tiny_llama_container)
    with pytest.raises(EncodeError, match="provenance is not JSON"):
        compile(c.path, tmp_path / "out.vindex3", overrides=_edits(c, [DOWN]), provenance={"v": np.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_check_overrides_returns_what_the_source_serves(tiny_llama_container):
    c = vindex3.open(tiny_llama_container)
    ov = _edits(c, [DOWN])
    got = check_overrides(c, ov)
    assert list(got) == [DOWN] and np.array_equal(got[DOWN], ov[DOWN])
    ref = c.op_plan().layers[1]
    src = OverriddenSource(c, ov)
    downs = [r for op in ref.ops for r in op.operands.values() if r.label == DOWN]
    assert downs and np.array_equal(src.weight(downs[0]).dense(), ov[DOWN])
    assert Executor(c.op_plan(), src, Full()).forward(IDS).dtype == np.float32
