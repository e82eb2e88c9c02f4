"""Encode refuses damaged checkpoints by name: absurd or ill-typed safetensors headers, impossible
config values (NaN or negative eps, non-integer widths), lossy widening of integer weights, NaN
weights. A killed encode's temporary directory is removed by the next encode, and the default
model says when it rebuilds a damaged cache."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import vindex3
from vindex3.errors import AdmissionError, ConfigError, EncodeError, VindexError


@pytest.fixture
def ck(checkpoint_dirs, tmp_path):
    return Path(shutil.copytree(checkpoint_dirs("llama"), tmp_path / "ck"))


def _nothing_left(tmp_path: Path) -> None:
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".encoding-" in p.name]


def _set_header(st: Path, header_bytes: bytes, length: int | None = None) -> None:
    raw = st.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    st.write_bytes(struct.pack("<Q", len(header_bytes) if length is None else length) + header_bytes + raw[8 + n:])


def _header(st: Path) -> dict:
    raw = st.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("damage, needle", [
    (lambda st: _set_header(st, b"{}", 2**60), "header length 1,152,921,504,606,846,976 exceeds the file size"),
    (lambda st: _set_header(st, b"[1, 2, 3]"), "header is not a JSON object (found list)"),
    (lambda st: _set_header(st, b'"text"'), "header is not a JSON object (found str)"),
    (lambda st: _set_header(st, b"[" * 50_000 + b"]" * 50_000), "nested too deeply"),
    (lambda st: _set_header(st, b"\xff\xfe{}"), "is not JSON"),
])
def test_a_damaged_safetensors_header_is_refused_by_name(ck, tmp_path, damage, needle):
    damage(ck / "model.safetensors")
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        vindex3.admit(ck)
    with pytest.raises(ConfigError):
        vindex3.encode(ck, tmp_path / "out")
    _nothing_left(tmp_path)


@pytest.mark.parametrize("edit, needle", [
    (lambda h, n: h[n].update(dtype=5), "header entry must be"),
    (lambda h, n: h[n].update(shape="64"), "header entry must be"),
    (lambda h, n: h[n].update(data_offsets=[0]), "header entry must be"),
    (lambda h, n: h[n].update(data_offsets=[0, 10**12]), "are not inside the"),
    (lambda h, n: h[n].update(data_offsets=[4, 8]), "takes 256 bytes, data_offsets span 4"),
    (lambda h, n: h.update({"__metadata__": {"format": 1}}), "__metadata__ must map names to strings"),
])
def test_an_ill_typed_safetensors_entry_is_refused_by_name(ck, edit, needle):
    st = ck / "model.safetensors"
    h = _header(st)
    edit(h, "model.norm.weight")
    text = json.dumps(h).encode()
    raw = st.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    st.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    with pytest.raises(ConfigError, match=needle):
        vindex3.admit(ck)


@pytest.mark.parametrize("key, value", [
    ("rms_norm_eps", float("nan")), ("rms_norm_eps", -1e-5), ("rms_norm_eps", "1e-5"), ("rms_norm_eps", None),
    ("hidden_size", "64"), ("hidden_size", 0), ("num_attention_heads", True), ("num_key_value_heads", 2.0),
    ("intermediate_size", -96), ("vocab_size", [320]), ("hidden_act", ["silu"]), ("tie_word_embeddings", "no"),
    ("attention_bias", 1), ("head_dim", "16"), ("max_position_embeddings", 0),
])
def test_an_impossible_config_value_is_refused_by_its_key(ck, tmp_path, key, value):
    cfg = json.loads((ck / "config.json").read_text())
    cfg[key] = value
    (ck / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    plan = vindex3.admit(ck)
    assert not plan.admissible
    assert [f.key for f in plan.blocking()] == [key], plan.to_text()
    with pytest.raises(AdmissionError, match=key):
        vindex3.encode(ck, tmp_path / "out")
    _nothing_left(tmp_path)


@pytest.mark.parametrize("key, value", [("rope_parameters", {"rope_type": "linear", "rope_theta": 1e4}),
                                        ("rope_parameters", {"rope_type": "default", "rope_theta": True}),
                                        ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                                             "partial_rotary_factor": "half"}),
                                        ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8,
                                                             "low_freq_factor": float("nan"), "high_freq_factor": 4,
                                                             "original_max_position_embeddings": 16})])
def test_impossible_rope_parameters_are_refused(ck, key, value):
    cfg = json.loads((ck / "config.json").read_text())
    cfg[key] = value
    (ck / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    plan = vindex3.admit(ck)
    assert [f.key for f in plan.blocking()] == [key], plan.to_text()


@pytest.mark.parametrize("family, key, value", [("mamba2", "layer_norm_epsilon", -1.0), ("mamba2", "expand", float("nan")),
                                                ("mamba2", "use_bias", "false"), ("granitemoehybrid", "rms_norm_eps", float("inf")),
                                                ("granitemoehybrid", "mamba_expand", float("nan")),
                                                ("granitemoehybrid", "embedding_multiplier", 0.0)])
def test_the_state_space_families_refuse_impossible_values(checkpoint_dirs, tmp_path, family, key, value):
    ck = Path(shutil.copytree(checkpoint_dirs(family), tmp_path / "ck"))
    cfg = json.loads((ck / "config.json").read_text())
    cfg[key] = value
    (ck / "config.json").write_text(json.dumps(cfg, allow_nan=True))
    plan = vindex3.admit(ck)
    assert not plan.admissible and key in [f.key for f in plan.blocking()], plan.to_text()


def _resave(ck: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(ck / "model.safetensors")
    edit(tensors)
    save_file(tensors, ck / "model.safetensors")


def test_integer_weights_widen_only_when_exact(ck, tmp_path):
    exact = np.arange(-32, 32, dtype=np.int32)  # [64], what model.norm.weight needs
    _resave(ck, lambda t: t.update({"model.norm.weight": exact}))
    c = vindex3.open(vindex3.encode(ck, tmp_path / "exact"))
    assert np.array_equal(c.segments["final_norm"].tensor("weight"), exact.astype(np.float32))
    lossy = exact.astype(np.int64)
    lossy[5] = 2**24 + 1  # float32 cannot hold it
    _resave(ck, lambda t: t.update({"model.norm.weight": lossy}))
    with pytest.raises(ConfigError, match=r"model.norm.weight is I64 and 1 of its values have no exact float32 "
                                          r"\(first at flat index 5: 16777217\); refusing a lossy widening"):
        vindex3.encode(ck, tmp_path / "out")
    _nothing_left(tmp_path)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_refused_by_name(ck, tmp_path, value):
    def poison(t):
        w = t["model.layers.1.mlp.up_proj.weight"].copy()
        w[3, 7] = value
        t["model.layers.1.mlp.up_proj.weight"] = w

    _resave(ck, poison)
    with pytest.raises(EncodeError, match=r"model.layers.1.mlp.up_proj.weight holds 1 NaN or infinite value\(s\) "
                                          r"\(first at flat index 199"):
        vindex3.encode(ck, tmp_path / "out")
    _nothing_left(tmp_path)


def test_a_fifo_or_a_symlink_out_in_a_checkpoint_is_refused(ck, tmp_path):
    os.unlink(ck / "tokenizer.json")
    os.mkfifo(ck / "tokenizer.json")
    t0 = time.perf_counter()
    with pytest.raises(VindexError, match="FIFO"):
        vindex3.encode(ck, tmp_path / "out")
    assert time.perf_counter() - t0 < 10
    os.unlink(ck / "tokenizer.json")
    (ck / "config.json").rename(tmp_path / "config.json")
    os.mkfifo(ck / "config.json")
    with pytest.raises(ConfigError, match="FIFO"):
        vindex3.admit(ck)


# ---- temporary directories of killed encodes -------------------------------------------------------


def _marker(d: Path, pid: int, host: str | None = None) -> None:
    import socket

    from vindex3.encode import MARKER

    d.mkdir()
    (d / MARKER).write_text(json.dumps({"pid": pid, "host": host or socket.gethostname()}))
    (d / "segments").mkdir()
    (d / "segments" / "big.bin").write_bytes(b"\0" * 4096)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_next_encode_removes_what_a_killed_encode_left(tiny_llama_dir, tmp_path):
    dead = tmp_path / f".old.vindex3.encoding-{_dead_pid()}"
    alive = tmp_path / f".busy.vindex3.encoding-{os.getpid()}"  # a running encode: left alone
    foreign = tmp_path / ".other.encoding-1"  # no marker: not ours, left alone
    elsewhere = tmp_path / f".far.vindex3.encoding-{_dead_pid()}"
    _marker(dead, int(dead.name.rsplit("-", 1)[1]))
    _marker(alive, os.getpid())
    foreign.mkdir()
    _marker(elsewhere, int(elsewhere.name.rsplit("-", 1)[1]), host="another-host")
    from vindex3.encode import encode_detailed

    r = encode_detailed(tiny_llama_dir, tmp_path / "new.vindex3")
    assert r.cleaned == [dead.name]
    assert not dead.exists() and alive.exists() and foreign.exists() and elsewhere.exists()


def test_a_really_killed_encode_is_cleaned_by_the_next(tiny_llama_dir, tmp_path):
    """An encode killed with SIGKILL (no cleanup can run) leaves its temporary directory; the
    next encode into the same directory removes it and says so."""
    out = tmp_path / "out.vindex3"
    code = ("import sys, time, vindex3; "
            "vindex3.encode(sys.argv[1], sys.argv[2], progress=lambda *a: time.sleep(60))")
    p = subprocess.Popen([sys.executable, "-c", code, str(tiny_llama_dir), str(out)],
                         env={**os.environ, "PYTHONPATH": str(Path(vindex3.__file__).parents[1])})
    tmp = tmp_path / f".out.vindex3.encoding-{p.pid}"
    deadline = time.monotonic() + 60
    while not (tmp / "segments").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert tmp.exists() and not out.exists()
    from vindex3.cli import main

    assert main(["encode", str(tiny_llama_dir), str(out)]) == 0
    assert not tmp.exists() and vindex3.open(out).graph.num_layers == 4


# ---- the default model's cache ------------------------------------------------------------------------


def test_the_default_model_says_when_it_rebuilds_a_damaged_cache(tiny_llama_dir, tmp_path, monkeypatch):
    from vindex3 import default_model

    monkeypatch.setenv("VINDEX3_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "gguf_path", lambda: tiny_llama_dir)  # the tiny model stands in
    said: list[str] = []
    first = default_model.ensure_detailed(notice=said.append)
    assert first.encoded and first.rebuilt_because is None and said == []
    again = default_model.ensure_detailed(notice=said.append)
    assert not again.encoded and said == []
    (first.path / "system_graph.json").write_text("{}")  # damaged
    third = default_model.ensure_detailed(notice=said.append)
    assert third.encoded and "does not open" in third.rebuilt_because
    assert len(said) == 1 and "is being rebuilt" in said[0] and "system_graph.json" in said[0]
    assert vindex3.open(third.path).graph.num_layers == 4
    assert default_model.ensure(notice=said.append, rebuild=True) == third.path
    assert "a rebuild was asked for" in said[-1]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [default_model.CONTAINER_NAME]
