"""Foundation: admission, encode, the container on disk, refusals, corruption, verify."""

from __future__ import annotations

import json
import math
import shutil
import struct

import numpy as np
import pytest

import vindex3
from vindex3 import jsonio
from vindex3.errors import (
    AdmissionError,
    ClosureError,
    ComponentError,
    ConfigError,
    ContainerNotFound,
    EncodeError,
    FormatVersionError,
    GraphSchemaError,
)
from vindex3.segments import Segment

FAMILY_LIST = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "granite"]


def copy_container(src, dst):
    shutil.copytree(src, dst)
    return dst


# -- admission ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILY_LIST)
def test_every_family_is_admissible_and_every_key_graded(checkpoint_dirs, family):
    ck = checkpoint_dirs(family)
    plan = vindex3.admit(ck)
    assert plan.admissible, plan.model_dump_json(indent=2)
    cfg = json.loads((ck / "config.json").read_text())
    graded = {f.key for f in plan.findings}
    assert set(cfg) <= graded, f"ungraded keys: {set(cfg) - graded}"


def test_unknown_config_key_blocks_and_is_named(checkpoint_dirs, tmp_path):
    ck = copy_container(checkpoint_dirs("llama"), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["frobnication_level"] = 7
    (ck / "config.json").write_text(json.dumps(cfg))
    plan = vindex3.admit(ck)
    assert not plan.admissible
    (f,) = [f for f in plan.findings if f.blocks]
    assert f.key == "frobnication_level" and f.value == 7 and f.category == "unknown"
    with pytest.raises(AdmissionError, match="frobnication_level"):
        vindex3.encode(ck, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_unregistered_model_type_fails_closed(checkpoint_dirs, tmp_path):
    ck = copy_container(checkpoint_dirs("llama"), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["model_type"] = "llama_but_different"
    (ck / "config.json").write_text(json.dumps(cfg))
    plan = vindex3.admit(ck)
    assert not plan.admissible
    msg = " ".join(f.message for f in plan.blocking())
    assert "llama_but_different" in msg and "never served as a Llama" in msg


def test_unsupported_activation_and_rope_type_are_named(checkpoint_dirs, tmp_path):
    ck = copy_container(checkpoint_dirs("llama"), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["hidden_act"] = "relu6"
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (ck / "config.json").write_text(json.dumps(cfg))
    plan = vindex3.admit(ck)
    blocked = {f.key: f.message for f in plan.blocking()}
    assert "relu6" in blocked["hidden_act"]
    assert "'dynamic' is not supported" in blocked["rope_parameters"]


def test_absent_rope_base_is_refused_not_defaulted(checkpoint_dirs, tmp_path):
    ck = copy_container(checkpoint_dirs("llama"), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["rope_parameters"]
    (ck / "config.json").write_text(json.dumps(cfg))
    plan = vindex3.admit(ck)
    assert not plan.admissible
    assert any(f.key == "rope_parameters" and "refusing to assume" in f.message for f in plan.blocking())


def test_admission_reads_headers_only(checkpoint_dirs, tmp_path, monkeypatch):
    from vindex3.sources import HfCheckpoint

    def boom(self, name):
        raise AssertionError(f"admission read tensor bytes of {name}")

    monkeypatch.setattr(HfCheckpoint, "load", boom)
    assert vindex3.admit(checkpoint_dirs("qwen3")).admissible


def test_sharded_checkpoint_is_admitted_and_encoded(checkpoint_dirs, tmp_path):
    import torch  # noqa: F401
    from safetensors.numpy import load_file, save_file

    src = checkpoint_dirs("llama")
    ck = tmp_path / "sharded"
    ck.mkdir()
    shutil.copy(src / "config.json", ck / "config.json")
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: tensors[n] for n in part}, ck / fn)
        weight_map.update({n: fn for n in part})
    (ck / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    out = vindex3.encode(ck, tmp_path / "out")
    c = vindex3.open(out)
    a = vindex3.open(vindex3.encode(src, tmp_path / "out2"))
    ids = [3, 5, 7, 11]
    assert np.array_equal(c.executor().forward(ids), a.executor().forward(ids))


# -- non-finite numbers in config.json ---------------------------------------------------------

def test_both_infinity_spellings_read_to_one_representation():
    bare = jsonio.loads('{"time_step_limit": [0.0, Infinity], "x": -Infinity, "n": NaN}')
    tagged = jsonio.loads('{"time_step_limit": [0.0, {"__float__": "Infinity"}], "x": {"__float__": "-Infinity"}, "n": {"__float__": "NaN"}}')
    for d in (bare, tagged):
        assert d["time_step_limit"][1] == math.inf and d["x"] == -math.inf and math.isnan(d["n"])
    # written back strictly, in the tagged spelling
    assert "Infinity" in jsonio.dumps(bare) and json.loads(jsonio.dumps(bare))["x"] == {"__float__": "-Infinity"}


def test_malformed_json_names_line_and_column(tmp_path):
    p = tmp_path / "config.json"
    p.write_text('{\n  "hidden_size": 64,\n  "oops" 3\n}')
    with pytest.raises(ConfigError, match=r"line 3, column 10"):
        jsonio.load(p)


# -- round trip and layout ---------------------------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen3", "granite"])
def test_round_trip_is_bit_exact(checkpoint_dirs, containers, family):
    from safetensors.numpy import load_file

    src = load_file(checkpoint_dirs(family) / "model.safetensors")
    c = vindex3.open(containers(family))
    prefixes = {"embedding": "model.embed_tokens.", "decoder_stack": "model.layers.", "final_norm": "model.norm.", "output_head": "lm_head."}
    seen = 0
    for obj, seg in c.segments.items():
        for name in seg.names():
            assert np.array_equal(seg.tensor(name), src[prefixes[obj] + name]), name
            seen += 1
    tied_dup = 1 if ("lm_head.weight" in src and "output_head" not in c.segments) else 0
    assert seen + tied_dup == len(src)


def test_segment_layout_header_alignment_and_order(tiny_llama_container):
    c = vindex3.open(tiny_llama_container)
    for obj, seg in c.segments.items():
        raw = seg.path.read_bytes()
        (hlen,) = struct.unpack("<Q", raw[:8])
        assert (8 + hlen) % 16 == 0
        header = json.loads(raw[8 : 8 + hlen])
        names = [t["name"] for t in header["tensors"]]
        assert names == sorted(names)
        offs = [t["offset"] for t in header["tensors"]]
        assert offs == sorted(offs)
        assert header["representation"] == f"{obj}@f32"


def test_capability_snapshot_copied(tiny_llama_dir, tiny_llama_container):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_llama_container / name).read_bytes() == (tiny_llama_dir / name).read_bytes()
    idx = json.loads((tiny_llama_container / "index.json").read_text())
    assert set(idx["capabilities"]) >= {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def test_graph_groups_exist_only_when_run(tiny_llama_container):
    g = json.loads((tiny_llama_container / "system_graph.json").read_text())
    assert g["schema"] == 6
    assert "attention" in g["surface"] and "ffn" in g["surface"]
    assert all(l["operator"] == "softmax" for l in g["layers"])
    assert [c["role"] for c in g["components"]] == ["primary_text"]


def test_opening_reads_no_tensor_data(tiny_llama_container, monkeypatch):
    calls = []
    monkeypatch.setattr(Segment, "_map", lambda self: calls.append(self.path) or (_ for _ in ()).throw(AssertionError("mapped")))
    c = vindex3.open(tiny_llama_container)
    c.op_plan()
    c.continuation()
    c.plan_slice(vindex3.Draft(2))
    assert calls == []


# -- refusals on open ---------------------------------------------------------------------------

def test_not_a_directory_and_no_index(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ContainerNotFound, match="not a directory"):
        vindex3.open(f)
    with pytest.raises(ContainerNotFound, match="no index.json"):
        vindex3.open(tmp_path)


@pytest.mark.parametrize("fmt,ver,found", [("VINDEX2", 2, "VINDEX2"), ("VINDEX3", 4, "VINDEX3 version 4"), ("VINDEX3", 2, "VINDEX2")])
def test_unknown_or_older_version_refused_before_anything_else(tiny_llama_container, tmp_path, fmt, ver, found):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    idx = json.loads((c / "index.json").read_text())
    idx["format"], idx["version"] = fmt, ver
    (c / "index.json").write_text(json.dumps(idx))
    (c / "system_graph.json").write_text("not even json")  # must not be read
    with pytest.raises(FormatVersionError) as e:
        vindex3.open(c)
    assert found in str(e.value) and "supported VINDEX3 version 3" in str(e.value)


def test_other_graph_schema_refused_with_reencode_hint(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    g = json.loads((c / "system_graph.json").read_text())
    g["schema"] = 5
    (c / "system_graph.json").write_text(json.dumps(g))
    with pytest.raises(GraphSchemaError) as e:
        vindex3.open(c)
    assert "schema 5" in str(e.value) and "re-encode" in str(e.value)


@pytest.mark.parametrize("roles,match", [([], "no primary_text"), (["primary_text", "primary_text"], "2 primary_text")])
def test_primary_text_component_must_be_unique(tiny_llama_container, tmp_path, roles, match):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    g = json.loads((c / "system_graph.json").read_text())
    comp = g["components"][0]
    g["components"] = [dict(comp, name=f"c{i}", role=r) for i, r in enumerate(roles)] or [dict(comp, role="perception")]
    (c / "system_graph.json").write_text(json.dumps(g))
    with pytest.raises(ComponentError, match=match):
        vindex3.open(c)


def test_closure_defects_on_open_are_listed(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    g = json.loads((c / "system_graph.json").read_text())
    g["layers"][1]["operands"]["q_proj"] = "1.self_attn.nope.weight"
    del g["layers"][2]["operands"]["ffn_up"]
    (c / "system_graph.json").write_text(json.dumps(g))
    with pytest.raises(ClosureError) as e:
        vindex3.open(c)
    text = str(e.value)
    assert "missing operand decoder_stack/1.self_attn.nope.weight" in text
    assert "layer 2 (gated_ffn): missing operand role ffn_up" in text
    assert "1.self_attn.q_proj.weight: unclassified tensor" in text


def test_unclassified_tensor_blocks_encode_and_leaves_nothing(checkpoint_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    ck = copy_container(checkpoint_dirs("llama"), tmp_path / "ck")
    t = load_file(ck / "model.safetensors")
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
    t["model.layers.1.mlp.up_proj.weight"] = t["model.layers.1.mlp.up_proj.weight"][:, :10].copy()
    save_file(t, ck / "model.safetensors")
    plan = vindex3.admit(ck)
    assert any("rotary_emb.inv_freq" in f.key and "unclassified" in f.message for f in plan.blocking())
    del t["model.layers.0.self_attn.rotary_emb.inv_freq"]
    save_file(t, ck / "model.safetensors")
    with pytest.raises(ClosureError) as e:
        vindex3.encode(ck, tmp_path / "out")
    assert "layer 1 ffn_up: decoder_stack/1.mlp.up_proj.weight has shape [96, 10], the surface implies [96, 64]" in str(e.value)
    assert not (tmp_path / "out").exists()
    assert not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_failed_encode_leaves_no_output(checkpoint_dirs, tmp_path, monkeypatch):
    from vindex3.sources import HfCheckpoint

    calls = {"n": 0}
    real = HfCheckpoint.load

    def flaky(self, name):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError("disk went away")
        return real(self, name)

    monkeypatch.setattr(HfCheckpoint, "load", flaky)
    with pytest.raises(EncodeError, match="disk went away"):
        vindex3.encode(checkpoint_dirs("llama"), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_encode_refuses_to_overwrite(tiny_llama_dir, tiny_llama_container):
    with pytest.raises(EncodeError, match="already exists"):
        vindex3.encode(tiny_llama_dir, tiny_llama_container)


# -- index rewrites preserve what they do not understand ----------------------------------------

def test_unknown_index_keys_survive_a_rewrite(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    idx = json.loads((c / "index.json").read_text())
    idx["x_future_feature"] = {"nested": [1, 2.5, "three"], "inf": {"__float__": "Infinity"}}
    from vindex3.manifest import seal

    idx = seal(idx)  # a later writer records the index's hash with its own keys in it
    (c / "index.json").write_text(json.dumps(idx))
    cont = vindex3.open(c)
    cont.rewrite_index(model={**cont.index["model"], "name": "renamed"})
    after = json.loads((c / "index.json").read_text())
    assert after["x_future_feature"] == idx["x_future_feature"]
    assert after["model"]["name"] == "renamed" and after["generation"] == idx["generation"] + 1
    assert vindex3.verify(c).ok


# -- verify ------------------------------------------------------------------------------------

def test_verify_clean(tiny_llama_container):
    r = vindex3.verify(tiny_llama_container)
    assert r.ok and r.checked >= 4


def test_verify_flipped_byte(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    seg = c / "segments" / "decoder_stack.bin"
    data = bytearray(seg.read_bytes())
    data[-100] ^= 0x01
    seg.write_bytes(bytes(data))
    r = vindex3.verify(c)
    assert not r.ok and any("segments/decoder_stack.bin: sha256" in p for p in r.problems)


def test_verify_truncated_segment(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    seg = c / "segments" / "embedding.bin"
    seg.write_bytes(seg.read_bytes()[:-64])
    r = vindex3.verify(c)
    assert not r.ok and any("segments/embedding.bin: size" in p and "truncated" in p for p in r.problems)


def test_verify_missing_segment_and_absent_sidecar(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    (c / "segments" / "final_norm.bin").unlink()
    (c / "tokenizer_config.json").unlink()
    r = vindex3.verify(c)
    assert any("segments/final_norm.bin: missing" in p for p in r.problems)
    assert any("tokenizer_config.json: missing" in p and "sidecar" in p for p in r.problems)


def test_verify_cli_exit_codes(tiny_llama_container, tmp_path, capsys):
    from vindex3.cli import main

    assert main(["verify", str(tiny_llama_container)]) == 0
    c = copy_container(tiny_llama_container, tmp_path / "c")
    (c / "segments" / "final_norm.bin").unlink()
    assert main(["verify", str(c)]) == 1
    assert "final_norm.bin" in capsys.readouterr().err


def test_cli_errors_are_one_line_not_tracebacks(tmp_path, capsys):
    from vindex3.cli import main

    assert main(["inspect", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "Traceback" not in err


def test_cli_inspect_and_plan_json(tiny_llama_dir, tiny_llama_container, capsys):
    from vindex3.cli import main

    assert main(["inspect", str(tiny_llama_container), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["operator_mix"] == "4 softmax (full)" and d["tokenizer"] is True and len(d["layers"]) == 4
    assert main(["plan", str(tiny_llama_dir), "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["admissible"] is True and p["model_type"] == "llama"


def test_verify_refuses_an_index_without_a_graph_hash(tiny_llama_container, tmp_path):
    c = copy_container(tiny_llama_container, tmp_path / "c")
    idx = json.loads((c / "index.json").read_text())
    del idx["graph"]
    (c / "index.json").write_text(json.dumps(idx))
    r = vindex3.verify(c)
    assert not r.ok and any("records no graph hash" in p for p in r.problems)


def test_absent_mlp_bias_is_a_recorded_reference_default(checkpoint_dirs, tmp_path):
    ck = copy_container(checkpoint_dirs("llama"), tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["mlp_bias"]
    (ck / "config.json").write_text(json.dumps(cfg))
    (f,) = [f for f in vindex3.admit(ck).findings if f.key == "mlp_bias"]
    assert f.category == "reference_default" and f.value is False and not f.blocks
