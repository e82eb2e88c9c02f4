"""OBSERVE ... RECORD INTO: the record's header, write and token events against transformers hooks
and greedy decoding, its receipt, and `vindex3 record verify` naming truncated and edited
records."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from fixtures import hf_greedy, load_reference
from internals_oracle import hf_readout, hf_run

import vindex3
from vindex3 import Draft, cli
from vindex3.errors import OutputRefused, RecordError
from vindex3.internals import FeatureAblation, Internals, verify_record

PROMPT = [5, 17, 99, 3, 250, 42]


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_a_record_accounts_for_every_write_and_token(tmp_path, containers, checkpoint_dirs):
    c = vindex3.open(containers("llama"))
    ix = Internals(c)
    out = tmp_path / "run.jsonl"
    r = ix.observe(PROMPT, out, generate=3, lens_tokens=[17, 99])
    hf = load_reference(checkpoint_dirs("llama"))
    assert r.generated_ids == hf_greedy(hf, PROMPT, 3) and r.status == "complete"
    recs = _lines(out)
    head, events, receipt = recs[0], recs[1:-1], recs[-1]
    assert head["type"] == "header" and head["run_id"] == r.run_id and head["container_digest"] == c.digest
    assert head["prompt_ids"] == PROMPT and head["executed_layers"] == [0, 1, 2, 3] and head["intervention"] is None
    assert head["component"] == c.graph.component.name and head["slice"] == "full model"
    assert {"vindex3", "numpy", "python"} <= set(head["library_versions"])
    writes = [e for e in events if e["type"] == "write"]
    tokens = [e for e in events if e["type"] == "token"]
    # prompt: 6 positions x 4 layers x 2 sites; then 2 decode steps (the last token is not run)
    assert len(writes) == 6 * 8 + 2 * 8 and r.write_events == len(writes)
    assert [t["id"] for t in tokens] == r.generated_ids and [t["position"] for t in tokens] == [6, 7, 8]
    assert receipt == {"type": "receipt", "events": len(events), "sha256": r.sha256, "status": "complete", "reason": None}
    # norms and lens readouts of the prompt pass against the reference's layer outputs
    _, rec = hf_run(hf, PROMPT)
    for e in writes[:48]:
        if e["site"] != "ffn":
            continue
        h = rec["layer"][e["layer"]][e["position"]]
        assert math.isclose(e["residual_norm"], float(np.linalg.norm(h)), rel_tol=1e-5)
        assert math.isclose(e["write_norm"], float(np.linalg.norm(rec["ffn"][e["layer"]][e["position"]])), rel_tol=1e-4)
        lg = hf_readout(hf, h[None])[0]
        for lens, t in zip(e["lens"], (17, 99)):
            assert lens["id"] == t and math.isclose(lens["logit"], float(lg[t]), rel_tol=1e-4, abs_tol=1e-4)
            if np.min(np.abs(np.delete(lg, t) - lg[t])) > 1e-3:
                assert lens["rank"] == int(np.count_nonzero(lg > lg[t]))
    assert verify_record(out).ok and verify_record(out).status == "complete"


def test_verify_names_truncated_and_edited_records(tmp_path, containers):
    ix = Internals(containers("llama"))
    out = tmp_path / "run.jsonl"
    ix.observe(PROMPT, out, generate=2)
    data = out.read_bytes()
    lines = data.splitlines(keepends=True)

    def check(name, blob, status, phrase):
        p = tmp_path / name
        p.write_bytes(blob)
        v = verify_record(p)
        assert not v.ok and v.status == status and phrase in " ".join(v.problems), v
        return v

    check("cut-mid.jsonl", data[: len(data) // 2], "truncated", "cut short")
    check("cut-line.jsonl", b"".join(lines[:-1]), "truncated", "no receipt")
    check("cut-receipt.jsonl", data[:-10], "truncated", "no receipt")
    edited = bytearray(data)
    i = data.index(b'"write_norm": ') + len(b'"write_norm": ')
    edited[i] = ord("9") if edited[i] != ord("9") else ord("8")
    check("edited.jsonl", bytes(edited), "edited", "the record was edited")
    check("dropped.jsonl", b"".join(lines[:3] + lines[4:]), "edited", "event line(s) before the receipt")
    check("appended.jsonl", data + lines[2], "edited", "goes on after it")
    check("header.jsonl", lines[0].replace(b'"generate": 2', b'"generate": 3') + b"".join(lines[1:]), "edited",
          "the record was edited")
    v = check("other.jsonl", b'{"hello": 1}\n', "malformed", "header")
    assert v.run_id is None
    check("empty.jsonl", b"", "truncated", "empty")
    from vindex3.errors import PathRefused

    with pytest.raises(PathRefused, match="does not exist"):
        verify_record(tmp_path / "nothing.jsonl")


def test_an_interrupted_run_leaves_an_honest_record(tmp_path, containers, monkeypatch):
    c = vindex3.open(containers("llama"))
    ix = Internals(c)
    ex, _ = ix.executor()
    calls = {"n": 0}
    real = ex._pass

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ex, "_pass", flaky)
    out = tmp_path / "run.jsonl"
    with pytest.raises(KeyboardInterrupt):
        ix.observe(PROMPT, out, generate=5)
    receipt = _lines(out)[-1]
    assert receipt["status"] == "interrupted" and receipt["reason"].startswith("KeyboardInterrupt")
    v = verify_record(out)
    assert v.ok and v.status == "interrupted"
    assert cli.main(["record", "verify", str(out)]) == 3


def test_drafts_record_only_their_layers_and_mixer_only_layers_only_mixers(tmp_path, containers):
    ix = Internals(containers("granitemoehybrid"))
    r = ix.observe(PROMPT, tmp_path / "d.jsonl", slice=Draft(2), generate=1)
    recs = _lines(tmp_path / "d.jsonl")
    assert recs[0]["executed_layers"] == [0, 1] and recs[0]["draft_depth"] == 2
    assert {e["layer"] for e in recs[1:-1] if e["type"] == "write"} == {0, 1} and r.executed_layers == [0, 1]
    m = Internals(containers("mamba2")).observe(PROMPT, tmp_path / "m.jsonl")
    sites = {(e["site"], e["operator"]) for e in _lines(tmp_path / "m.jsonl")[1:-1]}
    assert sites == {("mixer", "mamba2")} and m.write_events == len(PROMPT) * 3


def test_records_name_the_intervention_and_refuse_bad_paths(tmp_path, containers):
    ix = Internals(containers("llama"))
    ab = FeatureAblation.of([(1, 4), (2, 9)])
    out = tmp_path / "a.jsonl"
    ix.observe(PROMPT, out, intervention=ab)
    assert _lines(out)[0]["intervention"] == {"kind": "ablate_features", "features": [[1, 4], [2, 9]],
                                              "text": "ABLATE FEATURES (1:4, 2:9)"}
    with pytest.raises(OutputRefused, match="a.jsonl already exists"):
        ix.observe(PROMPT, out)
    with pytest.raises(OutputRefused, match="inside the container"):
        ix.observe(PROMPT, containers("llama") / "run.jsonl")
    with pytest.raises(RecordError, match="GENERATE must be a non-negative integer"):
        ix.observe(PROMPT, tmp_path / "g.jsonl", generate=-1)


def test_the_cli_verifies_a_record(tmp_path, containers, capsys):
    out = tmp_path / "run.jsonl"
    Internals(containers("llama")).observe(PROMPT, out, generate=1)
    assert cli.main(["record", "verify", str(out)]) == 0
    assert "complete" in capsys.readouterr().out
    assert cli.main(["record", "verify", "--json", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "complete"
    out.write_bytes(out.read_bytes()[:-5])
    assert cli.main(["record", "verify", str(out)]) == 1
    assert "RECORD TRUNCATED" in capsys.readouterr().err


def test_dumps_and_scores_name_the_intervention(tmp_path, containers):
    from vindex3.draft import dump_logits, read_dump, score_files

    c = vindex3.open(containers("llama"))
    ab = FeatureAblation.of([(1, 4), (3, 0)])
    clean = dump_logits(c, PROMPT, None, tmp_path / "clean.f32")
    abl = dump_logits(c, PROMPT, None, tmp_path / "abl.f32", intervention=ab)
    assert clean["intervention"] is None and abl["intervention"]["features"] == [[1, 4], [3, 0]]
    _, got = read_dump(tmp_path / "abl.f32")
    st = c.executor(intervention=ab).start()
    want = np.stack([st.prefill(PROMPT[:1])[0]] + [st.step(t) for t in PROMPT[1:]])
    assert np.array_equal(got, want)
    rep = score_files(tmp_path / "abl.f32", tmp_path / "clean.f32")
    assert rep.draft_intervention == abl["intervention"] and rep.target_intervention is None
