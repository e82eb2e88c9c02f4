"""Representations (issue 20): REPRESENT writes the same model in another encoding with its
fidelity recorded, COMPACT copies what the index refers to and lists what it leaves, DIFF tells
logical from physical differences, SCORE REPRESENTATION stores behavioural evidence, and every
tool that rewrites an index keeps what it does not understand.

Expected values are computed here from the containers' own bytes (numpy over the decoded
tensors, file hashes), never copied from a run of the code under test."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures import reseal

import vindex3
from vindex3.compact import compact
from vindex3.container import Container
from vindex3.diff import diff
from vindex3.errors import UnsupportedEncoding, VindexError
from vindex3.evidence import score_representation
from vindex3.represent import represent

ENCODINGS = ["bf16", "f16", "int8", "int8h", "q4"]
IDS = [1, 40, 41, 77, 9, 200, 13, 5]
BITS = {"bf16": 16.0, "f16": 16.0, "int8": 9.0, "int8h": 8.5, "q4": 5.0}


@pytest.fixture(scope="module")
def reps(tiny_llama_container, tmp_path_factory):
    """The tiny llama (every matrix's last dimension a multiple of 32) in every encoding."""
    base = tmp_path_factory.mktemp("reps")
    return {e: represent(tiny_llama_container, base / f"{e}.vindex3", e).path for e in ENCODINGS}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _tensors(c: Container) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {f"{o}/{n}": (e.dtype, tuple(e.shape)) for o, s in c.segments.items() for n, e in s.entries.items()}


def _dense(c: Container, label: str) -> np.ndarray:
    obj, name = label.split("/", 1)
    return np.asarray(c.segments[obj].weight(name).dense(), dtype=np.float32)


# ---- REPRESENT --------------------------------------------------------------------------------


@pytest.mark.parametrize("enc", ENCODINGS)
def test_represent_keeps_the_logical_model_and_records_true_fidelity(tiny_llama_container, reps, enc):
    src, out = Container(tiny_llama_container), Container(reps[enc])
    # the same logical model: graph bytes, objects, tensor names and shapes
    assert _sha(out.path / "system_graph.json") == _sha(src.path / "system_graph.json")
    a, b = _tensors(src), _tensors(out)
    assert {k: v[1] for k, v in a.items()} == {k: v[1] for k, v in b.items()}
    rec = out.provenance["representation"]
    assert rec["encoding"] == enc and rec["source"]["digest"] == src.digest
    assert set(rec["tensors"]) == set(a)
    for label, (dtype, shape) in b.items():
        r = rec["tensors"][label]
        assert r["encoding"] == dtype, label
        if len(shape) < 2:
            assert dtype == "f32", f"{label}: 1-D tensors stay float32"
        x, y = _dense(src, label).astype(np.float64), _dense(out, label).astype(np.float64)
        err = float(np.abs(x - y).max())
        if dtype == "f32":
            assert err == 0.0, label
            continue
        # the recorded figures are the ones the bytes give (float32 rounding of the statistic)
        assert r["max_abs_error"] == pytest.approx(err, rel=1e-5, abs=1e-12), label
        assert r["exact"] == (err == 0.0), label
        assert r["bits_per_weight"] == pytest.approx(BITS[dtype], abs=0.3), label
        scale = float(np.abs(x).max())
        bound = {"bf16": 2.0 ** -8, "f16": 2.0 ** -11, "int8": 1 / 254, "int8h": 1 / 254, "q4": 1 / 15}[dtype]
        assert err <= bound * scale * 1.01, f"{label}: {err} against {bound} x max|w| {scale}"
    # the embedding (and the untied head) are int8 under q4, with the reason recorded
    if enc == "q4":
        emb = next(k for k in b if k.startswith("embedding/"))
        assert b[emb][0] == "int8" and "embedding" in rec["tensors"][emb]["reason"]
    else:
        assert {d for d, s in b.values() if len(s) >= 2} == {enc}


@pytest.mark.parametrize("enc", ENCODINGS)
def test_a_represented_model_runs_close_to_its_source(tiny_llama_container, reps, enc):
    ref = vindex3.open(tiny_llama_container).executor().forward(IDS)
    got = vindex3.open(reps[enc]).executor().forward(IDS)
    assert got.shape == ref.shape and np.isfinite(got).all()
    rel = float(np.abs(got - ref).max() / np.abs(ref).max())
    assert rel < {"bf16": 0.02, "f16": 0.005, "int8": 0.05, "int8h": 0.05, "q4": 0.3}[enc], rel
    # Full and Draft run the same kernels: bit-identical at full depth
    c = vindex3.open(reps[enc])
    assert np.array_equal(c.executor(slice=vindex3.Draft(c.graph.num_layers)).forward(IDS), got)


def test_int8h_refuses_a_block_beyond_half_precision_by_name_and_writes_nothing(tiny_llama_container, tmp_path):
    """A finite float32 weight whose block scale (max|w| / 127) f16 cannot hold: REPRESENT into
    int8h names the tensor and the magnitude and leaves no output; int8 still takes it."""
    import shutil

    from corruption import huge_into

    from vindex3.errors import UnsupportedEncoding

    src = tmp_path / "src" / "c.vindex3"
    shutil.copytree(tiny_llama_container, src)
    seg = Container(src).segments["decoder_stack"]
    name = next(n for n, e in sorted(seg.entries.items()) if e.dtype == "f32" and len(e.shape) == 2)
    huge_into("segments/decoder_stack.bin", name, 1e7)(src)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(UnsupportedEncoding, match=r"1e\+07 needs a scale beyond float16's range.*int8h") as e:
        represent(src, out / "h.vindex3", "int8h")
    assert name in str(e.value)
    assert not any(out.iterdir())
    assert represent(src, out / "i.vindex3", "int8").path.exists()


def test_represent_refuses_an_unknown_target_and_writes_nothing(tiny_llama_container, tmp_path):
    with pytest.raises(VindexError, match="cannot write encoding 'nvfp4'"):
        represent(tiny_llama_container, tmp_path / "x.vindex3", "nvfp4")
    assert not any(tmp_path.iterdir())


def test_every_registered_encoding_is_a_target_or_refused_by_name(tiny_llama_container, reps, tmp_path):
    """One list, read from the codecs: every encoding this build registers either is a REPRESENT
    target (`Codec.represent_target`) and a whole container is written in it and opens, or is
    refused by name with nothing written; the command line offers exactly the targets."""
    from vindex3 import codecs
    from vindex3.cli import build_parser

    targets = codecs.targets()
    assert {"f32", "int8", "q4"} <= set(targets) < set(codecs.known())
    for enc in codecs.known():
        out = tmp_path / f"{enc}.vindex3"
        if enc in targets:
            path = reps[enc] if enc in reps else represent(tiny_llama_container, out, enc).path
            assert enc in {dtype for dtype, _ in _tensors(Container(path)).values()}, enc
        else:
            with pytest.raises(VindexError, match=f"cannot write encoding '{enc}'"):
                represent(tiny_llama_container, out, enc)
            assert not out.exists()
    parser = build_parser()
    for enc in codecs.known():
        argv = ["represent", "a", "b", "--encoding", enc]
        if enc in targets:
            assert parser.parse_args(argv).encoding == enc
        else:
            with pytest.raises(SystemExit):
                parser.parse_args(argv)


# ---- DIFF -------------------------------------------------------------------------------------


def test_diff_tells_logical_from_physical(tiny_llama_container, reps, containers, tmp_path):
    d = diff(tiny_llama_container, reps["int8"])
    assert d.logically_identical and not d.physically_identical
    assert d.verdict == "logically identical, physically different"
    assert {x.area for x in d.physical} >= {"encodings"}
    assert d.relation is not None  # the int8 container records the f32 one as its source
    same = diff(tiny_llama_container, tiny_llama_container)
    assert same.logically_identical and same.physically_identical and not same.metadata
    other = diff(tiny_llama_container, containers("qwen3"))
    assert not other.logically_identical and other.verdict == "logically different"


# ---- SCORE REPRESENTATION ------------------------------------------------------------------


def test_score_representation_measures_and_stores_evidence(tiny_llama_container, reps, tmp_path):
    bank = tmp_path / "bank.jsonl"
    bank.write_text("\n".join(json.dumps({"id": f"p{i}", "category": "c", "text": t})
                              for i, t in enumerate(["Water boils at", "One two three"])) + "\n")
    cand = tmp_path / "bf16.vindex3"
    shutil.copytree(reps["bf16"], cand)
    gen = Container(cand).generation
    s = score_representation(cand, tiny_llama_container, bank, greedy=4)
    # recompute KL and top-1 of the first prompt's positions independently
    ref_c, cand_c = vindex3.open(tiny_llama_container), vindex3.open(cand)
    ids = ref_c.tokenizer.encode("Water boils at")
    p = ref_c.executor().forward(ids).astype(np.float64)
    q = cand_c.executor().forward(ids).astype(np.float64)
    lp = p - np.logaddexp.reduce(p, axis=-1, keepdims=True)
    lq = q - np.logaddexp.reduce(q, axis=-1, keepdims=True)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    first = s.per_prompt[0]
    assert first.kl_mean == pytest.approx(float(kl.mean()), rel=1e-3, abs=1e-9)
    assert first.top1 == pytest.approx(float((p.argmax(-1) == q.argmax(-1)).mean()))
    assert 0 <= s.kl_p50 <= s.kl_p95 <= s.kl_max and s.prompts == 2
    stored = Container(cand)
    assert stored.generation == gen + 1
    ev = stored.provenance["evidence"]
    entry = ev[0] if isinstance(ev, list) else next(iter(ev.values()))
    assert entry["reference"]["digest"] == Container(tiny_llama_container).digest
    assert entry["kl_p95"] == pytest.approx(s.kl_p95)


def test_score_representation_against_default_is_the_default_models_path(tiny_llama_container, reps, tmp_path,
                                                                          monkeypatch):
    """AGAINST DEFAULT scores against what OPEN DEFAULT opens (here the fixture stands in for the
    default model, so that nothing is encoded or downloaded)."""
    import lql
    from vindex3 import default_model

    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"id": "p", "category": "c", "text": "Water boils at"}) + "\n")
    cand = tmp_path / "bf16.vindex3"
    shutil.copytree(reps["bf16"], cand)
    asked = []
    monkeypatch.setattr(default_model, "ensure", lambda *a, **k: asked.append(1) or tiny_llama_container)
    s = lql.Session()
    by_default = s.execute_one(f"SCORE REPRESENTATION '{cand}' AGAINST DEFAULT ON '{bank}' GREEDY 2")
    by_path = s.execute_one(f"SCORE REPRESENTATION '{cand}' AGAINST '{tiny_llama_container}' ON '{bank}' GREEDY 2")
    assert asked == [1] and by_default.kl_p95 == by_path.kl_p95 and by_default.prompts == 1


def test_score_representation_refuses_a_different_model(tiny_llama_container, containers, tmp_path):
    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"id": "p", "category": "c", "text": "x"}) + "\n")
    with pytest.raises(VindexError, match="not the same model .logical differences: graph"):
        score_representation(containers("qwen3"), tiny_llama_container, bank, greedy=2, store=False)


# ---- COMPACT ------------------------------------------------------------------------------------


def test_compact_copies_what_is_referenced_and_lists_what_it_leaves(tiny_llama_container, tmp_path):
    src = tmp_path / "src.vindex3"
    shutil.copytree(tiny_llama_container, src)
    (src / "notes.txt").write_text("a person's notes")
    (src / "segments" / "old.bin").write_bytes(b"\0" * 100)
    (src / "scratch").mkdir()
    (src / "scratch" / "x").write_bytes(b"12345")
    before = {p.relative_to(src): _sha(p) for p in src.rglob("*") if p.is_file()}
    r = compact(src, tmp_path / "out.vindex3")
    left = {f.path: (f.kind, f.bytes) for f in r.left_behind}
    assert left["notes.txt"] == ("file", 16)
    assert left["segments/old.bin"] == ("file", 100)
    assert any(k.startswith("scratch") for k in left)
    out = r.path
    for rel, _n in r.copied:  # byte for byte
        assert _sha(out / rel) == _sha(src / rel), rel
    assert not (out / "notes.txt").exists() and not (out / "segments" / "old.bin").exists()
    assert {p.relative_to(src): _sha(p) for p in src.rglob("*") if p.is_file()} == before  # source untouched
    assert Container(out).digest == Container(src).digest
    assert Container(out).generation == Container(src).generation + 1
    assert Container(out).provenance["compacted"]["left_behind"]
    assert np.array_equal(vindex3.open(out).executor().forward(IDS), vindex3.open(src).executor().forward(IDS))


# ---- unknown index fields and unknown encodings survive every rewrite -------------------------


def _with_unknowns(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    idx = json.loads((dst / "index.json").read_text())
    idx["x_future_top"] = {"nested": {"deeper": [1, 2, {"k": "v"}]}}
    idx.setdefault("model", {})["x_future_model"] = "kept"
    idx.setdefault("provenance", {})["x_future_prov"] = {"a": {"b": 3}}
    (dst / "index.json").write_text(json.dumps(idx))
    reseal(dst)
    return dst


def _assert_unknowns(path: Path) -> None:
    idx = json.loads((path / "index.json").read_text())
    assert idx["x_future_top"] == {"nested": {"deeper": [1, 2, {"k": "v"}]}}, path
    assert idx["model"]["x_future_model"] == "kept", path
    assert idx["provenance"]["x_future_prov"] == {"a": {"b": 3}}, path


def test_unknown_index_fields_survive_every_rewrite(tiny_llama_container, tmp_path):
    from vindex3.cli import main as vx

    src = _with_unknowns(tiny_llama_container, tmp_path / "src.vindex3")
    g = Container(src).generation
    assert vx(["label", str(src), "--name", "renamed"]) == 0
    _assert_unknowns(src)
    assert Container(src).generation == g + 1 and Container(src).name == "renamed"
    for make in (lambda o: represent(src, o, "int8").path, lambda o: compact(src, o).path):
        out = make(tmp_path / f"out{len(list(tmp_path.iterdir()))}.vindex3")
        _assert_unknowns(out)
        assert Container(out).generation == g + 2
    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"id": "p", "category": "c", "text": "Hi"}) + "\n")
    cand = represent(src, tmp_path / "scored.vindex3", "bf16").path
    score_representation(cand, src, bank, greedy=2)
    _assert_unknowns(cand)
    assert Container(cand).generation == g + 3


def _with_iq2_xxs(src: Path, dst: Path, tensor: str = "3.mlp.down_proj.weight") -> Path:
    """A container whose `tensor` is declared in an encoding this build does not know."""
    shutil.copytree(src, dst)
    seg = dst / "segments" / "decoder_stack.bin"
    raw = seg.read_bytes()
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    next(t for t in header["tensors"] if t["name"] == tensor)["dtype"] = "iq2_xxs"
    text = json.dumps(header, separators=(",", ":")).encode()
    seg.write_bytes(raw[:8] + text + b" " * (hlen - len(text)) + raw[8 + hlen:])
    reseal(dst)
    return dst


def test_an_unknown_encoding_is_carried_by_every_tool_and_refused_only_to_run(tiny_llama_container, tmp_path):
    from vindex3.cli import main as vx

    src = _with_iq2_xxs(tiny_llama_container, tmp_path / "src.vindex3")
    label = "decoder_stack/3.mlp.down_proj.weight"
    seg = Container(src).segments["decoder_stack"]
    payload = bytes(seg.raw("3.mlp.down_proj.weight"))
    assert vx(["verify", str(src)]) == 0
    assert vx(["inspect", str(src)]) == 0
    assert vx(["label", str(src), "--name", "still-iq2_xxs"]) == 0
    import lql

    s = lql.Session()
    s.execute(f"OPEN '{src}'")
    shown = s.execute_one("SHOW REPRESENTATIONS").to_text()
    assert "encoding iq2_xxs has no codec in this build" in shown
    outs = {"compact": compact(src, tmp_path / "c.vindex3").path,
            "represent": represent(src, tmp_path / "r.vindex3", "int8").path}
    for how, out in outs.items():
        c = Container(out)
        e = c.segments["decoder_stack"].entries["3.mlp.down_proj.weight"]
        assert e.dtype == "iq2_xxs", how
        assert bytes(c.segments["decoder_stack"].raw("3.mlp.down_proj.weight")) == payload, how
        with pytest.raises(UnsupportedEncoding, match="has encoding 'iq2_xxs', which this build cannot execute"):
            vindex3.open(out).executor()
    rec = Container(outs["represent"]).provenance["representation"]["tensors"][label]
    assert rec["encoding"] == "iq2_xxs" and "carried byte-identically" in rec["reason"]
    assert diff(src, outs["compact"]).physically_identical


# ---- SmolLM2 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("enc", ["int8", "q4"])
def test_smollm2_in_int8_and_q4_still_answers_paris(smollm2_container, tmp_path, enc):
    out = represent(smollm2_container, tmp_path / f"smollm2-{enc}.vindex3", enc).path
    c = vindex3.open(out)
    ids = c.tokenizer.encode("The capital of France is")
    logits = c.executor().forward(ids)[-1]
    assert c.tokenizer.decode([int(np.argmax(logits))]) == " Paris"
