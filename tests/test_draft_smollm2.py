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
