"""The service endpoints beside completions: ``/tokenize`` and ``/detokenize`` (the model's own
tokenizer, as ``INFER 'text'`` tokenises: BOS added unless ``add_special`` is false) and
``/v1/embeddings`` (OpenAI's shape).

An embedding is the model's final hidden state: the last layer's output at each position (the
residual stream *before* the final norm, what the executor's ``last_hidden`` holds after a
prefill), pooled over the input's positions by ``pooling``: ``"mean"`` (the default: the float32
mean over every position, BOS included when the tokenizer adds one) or ``"last"`` (the last
position's row). The response says which (``pooling``, ``hidden``). float32 throughout;
``encoding_format: "base64"`` sends the float32 little-endian bytes, as OpenAI's client expects."""

from __future__ import annotations

import base64
from typing import Literal

import numpy as np
from pydantic import BaseModel

from .completions import _STRICT, RequestRefusal
from .config import Limits

#: The most inputs one embeddings request may carry.
MAX_EMBEDDING_INPUTS = 64

HIDDEN = "the last layer's output (the residual stream before the final norm)"


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str
    add_special: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


class EmbeddingRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # extension
    pooling: Literal["mean", "last"] = "mean"


def _check_ids(ids: list[int], vocab: int, where: str) -> list[int]:
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise RequestRefusal(f"{where}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return [int(i) for i in ids]


def tokenize(catalog, req: TokenizeRequest) -> dict:
    ids = catalog.tokenize(req.prompt, special=req.add_special)
    return {"tokens": ids, "count": len(ids)}


def detokenize(catalog, req: DetokenizeRequest) -> dict:
    ids = _check_ids(req.tokens, catalog.vocab, "tokens")
    return {"prompt": catalog.decode(ids) or ""}


def inputs_of(req: EmbeddingRequest) -> list[str | list[int]]:
    """The request's inputs, one per embedding (refused when empty, too many, or asking dimensions)."""
    if req.dimensions is not None:
        raise RequestRefusal(f"field 'dimensions' = {req.dimensions} is not supported by this server",
                             hint="leave dimensions out: an embedding has the model's hidden size")
    x = req.input
    items: list[str | list[int]]
    if isinstance(x, str):
        items = [x]
    elif x and isinstance(x[0], int):
        items = [list(x)]  # type: ignore[arg-type]
    else:
        items = list(x)  # type: ignore[arg-type]
    if not items:
        raise RequestRefusal("input is empty: give a string, a list of strings, or token ids")
    if len(items) > MAX_EMBEDDING_INPUTS:
        raise RequestRefusal(f"input holds {len(items)} items, more than this server embeds in one request "
                             f"({MAX_EMBEDDING_INPUTS})")
    return items


def embed(host, req: EmbeddingRequest, limits: Limits, check) -> dict:
    """The embeddings of every input, on the model's worker (``check`` between inputs: stop on
    a disconnect or the time limit)."""
    cat = host.catalog
    items = inputs_of(req)
    data, total = [], 0
    for n, item in enumerate(items):
        check()
        where = f"input[{n}]" if len(items) > 1 else "input"
        ids = cat.tokenize(item) if isinstance(item, str) else _check_ids(item, cat.vocab, where)
        if not ids:
            raise RequestRefusal(f"{where} tokenises to no tokens")
        if len(ids) > limits.max_prompt_tokens:
            raise RequestRefusal(f"{where} is {len(ids)} tokens, more than this server allows "
                                 f"(--max-prompt-tokens is {limits.max_prompt_tokens})")
        vec = hidden_state(host.executor(None), ids, req.pooling)
        total += len(ids)
        emb = (base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii") if req.encoding_format == "base64"
               else [float(v) for v in vec])
        data.append({"object": "embedding", "index": n, "embedding": emb})
    return {"object": "list", "data": data, "model": host.id, "pooling": req.pooling, "hidden": HIDDEN,
            "usage": {"prompt_tokens": total, "total_tokens": total}}


def hidden_state(executor, ids: list[int], pooling: str) -> np.ndarray:
    """The pooled final hidden state of ``ids`` (float32 [hidden])."""
    st = executor.start()
    st.prefill(list(ids), last_only=True)
    h = np.asarray(st.last_hidden)
    if pooling == "last":
        return h[-1].astype(np.float32, copy=True)
    return h.mean(axis=0, dtype=np.float32)
