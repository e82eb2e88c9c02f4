"""Drafts on the real model, SmolLM2-135M-Instruct (30 layers): the full-depth draft is the full
model bit for bit, and speculation reproduces greedy decoding."""

import numpy as np
import pytest

import vindex3
from vindex3.draft import dump_logits, greedy_generate, read_dump, score_files, speculative_generate


@pytest.fixture(scope="module")
def smol(smollm2_container):
    return vindex3.open(smollm2_container)


@pytest.mark.slow
def test_smollm2_draft_at_full_depth_is_bit_identical(smol, tmp_path):
    ids = smol.tokenizer.encode("The capital of France is")
    L = smol.graph.num_layers
    assert L == 30
    full = dump_logits(smol, ids, vindex3.Full(), tmp_path / "t.f32")
    dump_logits(smol, ids, vindex3.Draft(L), tmp_path / "d.f32")
    assert np.array_equal(read_dump(tmp_path / "d.f32")[1], read_dump(tmp_path / "t.f32")[1])
    rep = score_files(tmp_path / "d.f32", tmp_path / "t.f32")
    assert rep.summary.top1 == 1.0 and rep.summary.kl_max == 0.0
    assert full["vocab"] == 49152 and full["container_digest"] == smol.digest
    # The last row predicts the token after the prompt: " Paris".
    assert smol.tokenizer.decode([int(read_dump(tmp_path / "t.f32")[1][-1].argmax())]) == " Paris"


@pytest.mark.slow
def test_smollm2_speculative_output_equals_greedy(smol):
    ids = smol.tokenizer.encode("The capital of France is")
    r = speculative_generate(smol, ids, 10, 28, 3, compare_plain=True)
    assert r.matches_plain is True
    assert r.tokens == greedy_generate(smol, ids, 10).tokens
    assert 1 + r.rounds + r.accepted == 10


def _own_copy(src, dst):
    """The container copied whole under ``dst``: FIT ADAPTER writes new files and rewrites
    index.json, and the cached container must stay untouched. A plain copy, not hard links: a
    new link changes the shared files' change time, which every session holding the cached
    container open rightly reads as the container changed on disk."""
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.slow
def test_smollm2_lql_speculate_with_adapter_equals_greedy(smollm2_container, smol, tmp_path):
    # INFER ... SPECULATE DEPTH 16 WITH ADAPTER on the real model: the draft reads through the
    # adapter FIT ADAPTER stored (a small corpus keeps the fit short; any adapter must leave the
    # tokens equal to greedy, since the full model verifies every one)
    import json

    import lql

    c = _own_copy(smollm2_container, tmp_path / "smol.vindex3")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": t}) for t in (
        "def add(a, b):\n    return a + b\n", "The river runs past the old mill and into the sea.",
        "Water boils at one hundred degrees Celsius at sea level.")) + "\n")
    s = lql.connect(c)
    (fit,) = s.execute(f"FIT ADAPTER AT DEPTH 16 ON '{corpus}' RIDGE 1.0")  # 3 texts: too few to cross-validate
    assert fit.key == "drafter_adapter_d16"
    prompt = "def fibonacci(n):"
    (r,) = s.execute(f"INFER '{prompt}' GENERATE 16 SPECULATE DEPTH 16 WITH ADAPTER LOOKAHEAD 3")
    assert r.adapter["key"] == "drafter_adapter_d16" and r.adapter["corpus"] == "corpus.jsonl"
    assert r.matches_plain is True
    assert r.generated_ids == greedy_generate(smol, smol.tokenizer.encode(prompt), 16).tokens
    assert "drafter" not in json.dumps(vindex3.open(smollm2_container).index.get("derived") or {})  # cache untouched
