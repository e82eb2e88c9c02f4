"""Vocabulary-cut draft heads: a draft whose head computes logits over the k most frequent
tokens only. A shallow draft is cheap in layers and expensive in vocabulary (SmolLM2's tied head
is 49152 x 576, a fifth of the model); the cut head reads k rows instead of all of them.

The kept ids are the k most frequent tokens of a named corpus (ties to the lower id), counted
with the container's tokenizer (or given as token ids) and, optionally, extended by the model's
own greedy continuation of each text. The default corpus is the seed list in
``vindex3.draft.seeds`` — not the frozen prompt bank, which stays the held-out test set. A cut
records its provenance (container digest, corpus digest, texts, tokens counted) and is refused
for another container.

The cut head is the model's own readout with its head rows gathered: each kept token's logit is
computed by the same kernel from the same row and the same normed hidden state, so it equals the
full head's logit bit for bit (a decode step or short draft; see codecs/f32.py). Cut tokens have
no logit, so they are never proposed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel

from .. import jsonio
from ..errors import DerivedStale, UnsupportedOperator, VindexError
from .slices import make_executor, open_container, resolve_slice

METHOD = "top-k token ids by count over the corpus (tokenized texts, plus n greedy tokens of the full model per text); ties to the lower id"


class VocabCut(BaseModel):
    """The k kept token ids (ascending) and where they came from."""

    k: int
    vocab: int
    kept: list[int]
    corpus: str  # the corpus's name ("seeds" for the built-in seed list, else the file's name)
    corpus_sha256: str  # of the corpus's texts as counted (JSON of the list)
    texts: int
    generated_per_text: int  # greedy tokens of the full model appended to each text before counting
    tokens_counted: int
    kept_share: float  # of the counted tokens, the share whose id is kept
    container_digest: str
    method: str = METHOD

    def ids(self) -> np.ndarray:
        return np.asarray(self.kept, dtype=np.int64)

    def check(self, container: Any) -> None:
        c = open_container(container)
        if self.container_digest != c.digest:
            raise DerivedStale(f"vocabulary cut was counted on container {self.container_digest[:16]}, "
                               f"not this one ({str(c.digest)[:16]})", hint="count the cut again on this container")

    def save(self, path: str | Path) -> None:
        jsonio.write_atomic(str(path), self.model_dump())

    @classmethod
    def load(cls, path: str | Path) -> VocabCut:
        return cls.model_validate(json.loads(Path(path).read_text()))


def corpus_digest(texts: Sequence[Any]) -> str:
    return hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode()).hexdigest()


def corpus_ids(c: Any, text: str | Sequence[int], what: str = "corpus") -> list[int]:
    """One corpus text as token ids: a string tokenized by the container's tokenizer (refused by
    name when it has none), ids taken as given; refused by name when an id is outside the
    vocabulary."""
    if isinstance(text, str):
        if c.tokenizer is None:
            raise VindexError("a text corpus needs the container's tokenizer; this container has none",
                              hint="give the corpus as token ids")
        ids = [int(x) for x in c.tokenizer.encode(text)]
    else:
        ids = [int(x) for x in text]
    V = int(c.graph.vocab_size)
    bad = next((x for x in ids if not 0 <= x < V), None)
    if bad is not None:
        raise VindexError(f"{what} token id {bad} is outside the vocabulary [0, {V})")
    return ids


def count_tokens(container: Any, texts: Sequence[str | Sequence[int]], generate: int = 0) -> np.ndarray:
    """Counts [vocab] of each token id over the corpus: each text tokenized (or given as ids),
    followed by ``generate`` greedy tokens of the full model."""
    c = open_container(container)
    V = int(c.graph.vocab_size)
    ex = None
    if generate:
        from .speculative import greedy_generate

        ex, _ = make_executor(c, resolve_slice(c, None)[0])
    seqs = []
    for t in texts:
        ids = corpus_ids(c, t)
        if generate and ids:
            ids = ids + greedy_generate(c, ids, generate, ex=ex).tokens
        seqs.append(ids)
    flat = np.asarray([i for s in seqs for i in s], dtype=np.int64)
    return np.bincount(flat, minlength=V)


def fit_vocab_cut(container: Any, k: int, texts: Sequence[str | Sequence[int]] | None = None, *,
                  corpus: str | None = None, generate: int = 0) -> VocabCut:
    """The k most frequent token ids of the corpus (default: the built-in seed list)."""
    c = open_container(container)
    if texts is None:
        from .seeds import SEED_TEXTS

        texts, corpus = list(SEED_TEXTS), corpus or "seeds"
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise VindexError(f"VOCAB TOP must be an integer ≥ 1; got {k!r}")
    counts = count_tokens(c, texts, generate)
    V = counts.shape[0]
    if k > V:
        raise VindexError(f"VOCAB TOP {k} is more than the vocabulary ({V} tokens)")
    order = np.lexsort((np.arange(V), -counts))  # count descending, then id ascending
    kept = np.sort(order[:k])
    total = int(counts.sum())
    return VocabCut(k=k, vocab=V, kept=[int(i) for i in kept], corpus=corpus or "corpus",
                    corpus_sha256=corpus_digest(texts), texts=len(texts), generated_per_text=generate,
                    tokens_counted=total, kept_share=float(counts[kept].sum() / total) if total else 0.0,
                    container_digest=str(c.digest))


def cut_readout(readout: Any, kept: np.ndarray) -> Any:
    """The readout (final norm and head) restricted to the head rows ``kept``: logits [T, k]."""
    from ..codecs.f32 import DenseF32

    head = readout.head
    if not isinstance(head, DenseF32) or head.a.ndim != 2:
        raise UnsupportedOperator(f"VOCAB TOP needs a float32 head; this head is encoded as {head.encoding!r}",
                                  hint="encode the container with the head in f32")
    bias = readout.head_bias[kept] if readout.head_bias is not None else None
    return dataclasses.replace(readout, head=DenseF32(np.ascontiguousarray(head.a[kept])), head_bias=bias)


def cut_executor(container: Any, depth: int | None, cut: VocabCut, max_positions: int | None = None) -> tuple[Any, float]:
    """An executor of the draft of ``depth`` layers (None: the full model) whose logits are over
    ``cut.kept`` only: column i is token ``cut.kept[i]``."""
    c = open_container(container)
    cut.check(c)
    ex, secs = make_executor(c, resolve_slice(c, depth)[0], max_positions=max_positions)
    if ex.readout is None:
        raise UnsupportedOperator("a vocabulary cut needs a slice with a head")
    if ex.readout.head.shape[0] != cut.vocab:
        raise DerivedStale(f"vocabulary cut is over {cut.vocab} tokens; this head has {ex.readout.head.shape[0]}")
    ex.readout = cut_readout(ex.readout, cut.ids())
    return ex, secs
