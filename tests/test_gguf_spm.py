"""A SentencePiece vocabulary in a GGUF file (tokenizer.ggml.model llama: tokens, scores, byte
pieces <0x00>..<0xFF>, no merges) rebuilt as transformers 5.24.0 builds it for
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``: the same tokenizer.json, the same ids, the
same decoded text, BOS added when the file does not say otherwise."""

from __future__ import annotations

import json

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from vindex3.errors import AdmissionError
from vindex3.sources.gguf import GgufCheckpoint, _merges_from_scores

TEXTS = ["the thin in", " in the <think> é", "café x", "  hi  there ", "naïve 東京 🙂", "<s>the</s>", ""]


def spm_vocab(tied_scores: bool):
    toks = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(toks)
    pieces = ["▁", "t", "h", "e", "i", "n", "a", "▁t", "he", "▁the", "in", "▁in", "▁a", "é", "c", "f", "▁c", "af",
              "▁caf", "▁café", "th", "▁th", "<think>"]
    for i, p in enumerate(pieces):
        toks.append(p)
        types.append(4 if p == "<think>" else 1)
        scores.append(-float(i // 3) if tied_scores else -float(i))  # ties: the length rule orders them
    return toks, types, scores


def write(path, *, tied_scores=False, add_bos: bool | None = None, arch="llama"):
    toks, types, scores = spm_vocab(tied_scores)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(64)
    w.add_feed_forward_length(64)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((len(toks), 64)).astype(np.float32))
    for n in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{n}.weight", np.ones(64, np.float32))
    for n in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        w.add_tensor(f"blk.0.{n}.weight", (rng.standard_normal((64, 64)) / 8).astype(np.float32))
    if arch == "qwen2":
        for n in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(f"blk.0.{n}.bias", np.zeros(64, np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("variant", [{}, {"tied_scores": True}, {"add_bos": False}, {"add_bos": True}],
                         ids=["plain", "tied-scores", "no-bos", "bos-stated"])
def test_sentencepiece_vocabulary_matches_transformers(tmp_path, variant):
    from transformers import AutoTokenizer

    path = write(tmp_path / "spm.gguf", **variant)
    tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    caps = GgufCheckpoint(path).capability_files()
    assert json.loads(caps["tokenizer.json"]) == json.loads(tok.backend_tokenizer.to_str())
    ours = tokenizers.Tokenizer.from_str(caps["tokenizer.json"].decode())
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ours.encode(text).ids == ids, text
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip), text
    assert (tok("the").input_ids[0] == 1) is variant.get("add_bos", True)
    assert json.loads(caps["tokenizer_config.json"])["add_bos_token"] is variant.get("add_bos", True)


def test_merges_from_scores_order():
    vocab = {t: i for i, t in enumerate(["a", "b", "ab", "ba", "abb", "bb"])}
    scores = {"a": 0.0, "b": 0.0, "ab": -1.0, "ba": -1.0, "abb": -1.0, "bb": -3.0}
    # score first (highest), then the longer left piece, then the longer right piece, then vocab order
    want = [("ab", "b"), ("a", "bb"), ("a", "b"), ("b", "a"), ("b", "b")]
    assert _merges_from_scores(vocab, scores) == want
    from transformers.tokenization_utils_base import generate_merges

    assert generate_merges(vocab, scores) == want  # the reference's own rule agrees


def test_sentencepiece_on_another_architecture_is_refused_by_name(tmp_path):
    path = write(tmp_path / "q.gguf", arch="qwen2")
    with pytest.raises(AdmissionError, match="SentencePiece vocabulary on a qwen2 file"):
        GgufCheckpoint(path)
