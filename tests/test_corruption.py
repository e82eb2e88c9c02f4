"""The corruption matrix: every file of a tiny container truncated, flipped, of the wrong JSON
type, missing a key, missing, a directory, a FIFO, a symlink out of the container; index paths
absolute or with '..'; swapped tensor names, shifted header lengths, wrong offsets, NaN/inf
weights; graph values out of range or renamed; finite but huge values written through f32,
bf16 and int8 and resealed; each as tampered and, where it is still a container a tool could
write, resealed with its hashes. Every case must end in a named refusal at OPEN, at first use
or at VERIFY: never an internal error, a hang, or a run that finishes with different logits;
and the container on disk is exactly as the edit left it. Containers changed while an LQL
session has them open are refused at the session's next statement (tests/corruption.py has
the edits and the probes)."""

from __future__ import annotations

import io
import json
import shutil
from contextlib import redirect_stderr, redirect_stdout

import numpy as np
import pytest
from corruption import (
    PROMPT,
    STEP_SECONDS,
    _bounded,
    baseline,
    huge_into,
    matrix,
    probe,
    probe_while_open,
    snapshot,
    while_open_cases,
)

import vindex3
from vindex3.cli import main


@pytest.fixture(scope="module")
def pristine(tiny_llama_container):
    return tiny_llama_container


@pytest.fixture(scope="module")
def expected(pristine):
    return baseline(pristine)


def _cli(argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = _bounded(lambda: main(argv))
    return code, out.getvalue(), err.getvalue()


def test_corruption_matrix_ends_in_named_refusals(pristine, expected, tmp_path):
    cases = matrix(pristine, tmp_path / "outside")
    assert len(cases) >= 300
    ex = vindex3.open(pristine).executor()
    top = int(np.argmax(expected[-1]))
    counts: dict[str, int] = {}
    stages: dict[str, int] = {}
    bad = []
    for i, case in enumerate(cases):
        c = tmp_path / f"case{i}" / "c.vindex3"
        shutil.copytree(pristine, c)
        case.edit(c)
        edited = snapshot(c)
        o = probe(c, expected)
        counts[o.kind] = counts.get(o.kind, 0) + 1
        stages[o.stage] = stages.get(o.stage, 0) + 1
        if not o.ok():
            bad.append(f"{case.name}: {o.kind} at {o.stage}: {o.detail}")
        elif o.seconds > STEP_SECONDS:
            bad.append(f"{case.name}: took {o.seconds:.1f} s")
        # The same container through the command line: never exit 3, never a traceback, and
        # exit 0 only with the pristine answer.
        code, out, err = _cli(["exec", str(c), "--prompt", PROMPT, "--json"])
        if code == 3 or "Traceback" in err or code not in (0, 2):
            bad.append(f"{case.name}: vindex3 exec exited {code}: {err[-300:]}")
        elif code == 0 and json.loads(out)["next_token"] != top:
            bad.append(f"{case.name}: vindex3 exec exited 0 with another next token")
        # VERIFY checks integrity: a container whose hashes agree with content that OPEN or the
        # run refuses (a hand-written unknown encoding, a tokenizer that does not load) may pass.
        code, out, err = _cli(["verify", str(c)])
        if code == 3 or "Traceback" in err or (code == 0 and o.stage not in ("open", "use")):
            bad.append(f"{case.name}: vindex3 verify exited {code}: {err[-300:]}")
        if snapshot(c) != edited:  # a refusal changes nothing on disk (no repair, no rewrite)
            bad.append(f"{case.name}: the container on disk changed while it was probed")
        shutil.rmtree(c.parent)
    print(f"\ncorruption matrix: {len(cases)} cases, outcomes {counts}, refused at {stages}")
    assert not bad, f"{len(bad)} of {len(cases)} cases went wrong:\n" + "\n".join(bad)
    assert ex.forward([1, 2, 3]).shape == (3, 320)  # the pristine container is untouched


def test_the_matrix_covers_every_file_and_every_kind_of_damage(pristine, tmp_path):
    cases = matrix(pristine, tmp_path)
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    files = [str(p.relative_to(pristine)) for p in pristine.rglob("*") if p.is_file()]
    for f in files:
        for kind in ("truncated to half", "middle byte flipped", "missing", "directory", "fifo", "symlink out"):
            assert f"{f}: {kind}" in names
    for needle in ("of the wrong type", "missing generation", "renamed", "absolute segment path", "'..' segment path",
                   "names swapped", "header length shifted", "offset moved", "NaN in", "inf in", "window 0",
                   "theta 0", "score scale NaN", "norm eps -1e-5", "activation silu -> gelu", "empty representations",
                   "3e38 in", "-1e30 in", "2**64 in"):
        assert any(needle in n for n in names), needle


def test_a_fifo_segment_is_refused_without_being_opened(pristine, tmp_path):
    """OPEN, VERIFY and exec return at once with a named refusal (they used to block forever)."""
    import os

    c = tmp_path / "c"
    shutil.copytree(pristine, c)
    (c / "segments" / "embedding.bin").unlink()
    os.mkfifo(c / "segments" / "embedding.bin")
    with pytest.raises(vindex3.errors.IntegrityError, match="is a FIFO, not a regular file"):
        _bounded(lambda: vindex3.open(c), 5)
    rep = _bounded(lambda: vindex3.verify(c), 5)
    assert not rep.ok and any("FIFO" in p for p in rep.problems)
    code, _, err = _cli(["exec", str(c), "--tokens", "1,2"])
    assert code == 2 and "FIFO" in err


def test_a_segment_path_outside_the_container_is_never_read(pristine, tmp_path, monkeypatch):
    import builtins

    c = tmp_path / "c"
    shutil.copytree(pristine, c)
    idx = json.loads((c / "index.json").read_text())
    rep = idx["representations"]["embedding@f32"]
    rep["segment"] = "/etc/passwd"
    idx["segments"] = [{"path": r["segment"], "bytes": r["segment_bytes"], "sha256": r["segment_sha256"]}
                       for r in idx["representations"].values()]
    (c / "index.json").write_text(json.dumps(idx))
    opened = []
    real_open = builtins.open

    def spy(f, *a, **k):
        opened.append(str(f))
        return real_open(f, *a, **k)

    monkeypatch.setattr(builtins, "open", spy)
    with pytest.raises(vindex3.errors.IntegrityError, match="absolute path"):
        vindex3.open(c)
    assert "/etc/passwd" not in opened


def test_verify_names_a_renamed_hash_key_and_an_empty_index(pristine, tmp_path):
    c = tmp_path / "c"
    shutil.copytree(pristine, c)
    idx = json.loads((c / "index.json").read_text())
    rep = idx["representations"]["final_norm@f32"]
    rep["payload_sha"] = rep.pop("payload_sha256")
    (c / "index.json").write_text(json.dumps(idx))
    r = vindex3.verify(c)
    assert not r.ok and any("payload_sha256 is missing" in p for p in r.problems)
    assert any("payload_sha is not a known key" in p for p in r.problems)
    idx["representations"] = {}
    (c / "index.json").write_text(json.dumps(idx))
    r = vindex3.verify(c)
    assert not r.ok and any("representations" in p for p in r.problems)


def test_tensor_hashes_are_checked_on_first_use_only_for_what_a_slice_reads(pristine, tmp_path):
    """A damaged last layer does not stop a draft that never reads it, and stops the full model
    by name the moment it would be read; opening reads no tensor at all."""
    c = tmp_path / "c"
    shutil.copytree(pristine, c)
    seg = c / "segments" / "decoder_stack.bin"
    raw = bytearray(seg.read_bytes())
    hlen = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + hlen])
    t = next(t for t in header["tensors"] if t["name"] == "3.mlp.down_proj.weight")
    raw[8 + hlen + t["offset"] + 8] ^= 0x01  # one bit of one weight
    seg.write_bytes(bytes(raw))
    opened = vindex3.open(c)
    ids = [1, 5, 9]
    draft = opened.executor(slice=vindex3.Draft(3)).forward(ids)
    assert np.array_equal(draft, vindex3.open(pristine).executor(slice=vindex3.Draft(3)).forward(ids))
    with pytest.raises(vindex3.errors.IntegrityError, match=r"tensor 3.mlp.down_proj.weight: its bytes hash"):
        opened.executor()


def test_a_legacy_container_without_tensor_hashes_is_checked_whole_on_first_use(pristine, tmp_path):
    """Containers encoded before per-tensor and header hashes were recorded still open; their
    segments are hashed whole against segment_sha256 the first time a tensor is read. VERIFY
    names the missing hashes: it cannot check such a container tensor by tensor."""
    c = tmp_path / "c"
    shutil.copytree(pristine, c)
    idx = json.loads((c / "index.json").read_text())
    for rep in idx["representations"].values():
        del rep["tensor_sha256"], rep["header_sha256"]
    del idx["index_sha256"]
    (c / "index.json").write_text(json.dumps(idx))
    r = vindex3.verify(c)
    assert not r.ok and all("re-encode" in p for p in r.problems)
    assert len(r.problems) == 2 * len(idx["representations"]) + 1
    ids = [1, 5, 9]
    assert np.array_equal(vindex3.open(c).executor().forward(ids), vindex3.open(pristine).executor().forward(ids))
    seg = c / "segments" / "final_norm.bin"
    raw = bytearray(seg.read_bytes())
    raw[-3] ^= 0x10
    seg.write_bytes(bytes(raw))
    opened = vindex3.open(c)  # headers are intact: OPEN cannot see payload damage
    with pytest.raises(vindex3.errors.IntegrityError, match="final_norm.bin.*sha256 .* differs"):
        opened.executor()


@pytest.mark.parametrize("encoding", ["bf16", "int8", "int8h"])
def test_resealed_huge_values_are_refused_by_name_in_each_encoding(pristine, tmp_path, encoding):
    """Finite but huge values written through an encoding (a bf16 weight of 3e38, an int8 block
    scale of 1e30) and resealed, so that every hash agrees: refused by name at first use (the
    magnitude scan) and by VERIFY, never silent zero logits; nothing on disk is changed."""
    from vindex3.represent import represent

    src = represent(pristine, tmp_path / f"{encoding}.vindex3", encoding).path
    expected = baseline(src)
    opened = vindex3.open(src)
    cases = []
    for obj, seg in opened.segments.items():
        for name, e in sorted(seg.entries.items()):
            if e.dtype == encoding:
                for value in (3e38, -1e30, 2.0**64):
                    cases.append((f"{obj}: {value:g} in {name}", huge_into(f"segments/{obj}.bin", name, value)))
                break  # one tensor per object and encoding
    assert len(cases) >= 3
    bad = []
    for i, (name, edit) in enumerate(cases):
        c = tmp_path / f"case{i}" / "c.vindex3"
        shutil.copytree(src, c)
        edit(c)
        edited = snapshot(c)
        o = probe(c, expected)
        # a scale of 3e38 times a code of 127 is past float32 itself: refused as infinite instead
        if not o.ok() or o.stage != "use" or not ("magnitude" in o.detail or "NaN or infinite" in o.detail):
            bad.append(f"{name}: {o.kind} at {o.stage}: {o.detail}")
        if snapshot(c) != edited:
            bad.append(f"{name}: the container on disk changed while it was probed")
        shutil.rmtree(c.parent)
    assert not bad, "\n".join(bad)


def test_a_container_changed_while_open_is_refused_before_the_next_statement(pristine, tmp_path):
    """Edits made while an LQL session has the container open (in place, with the modification
    time put back, replaced by rename, truncated, extended, deleted, resealed with a huge value,
    the graph rewritten): the session's next statement is refused by name, a fresh OPEN gets a
    newly verified container, and nothing on disk changes after the edit."""
    cases = while_open_cases()
    assert len(cases) >= 20
    bad = []
    counts: dict[str, int] = {}
    for i, case in enumerate(cases):
        c = tmp_path / f"case{i}" / "c.vindex3"
        shutil.copytree(pristine, c)
        o = probe_while_open(c, case.edit)
        counts[o.kind] = counts.get(o.kind, 0) + 1
        if not o.ok():
            bad.append(f"{case.name}: {o.kind} at {o.stage}: {o.detail}")
        shutil.rmtree(c.parent)
    print(f"\nchanged while open: {len(cases)} cases, outcomes {counts}")
    assert not bad, f"{len(bad)} of {len(cases)} cases went wrong:\n" + "\n".join(bad)
