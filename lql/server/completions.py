"""OpenAI-compatible completions: the request bodies (validated, unknown or unsupported fields
refused by name), the prompt as token ids (a completion's text tokenised as ``INFER 'text'``
does; a chat's messages through the model's own chat template, as ``INFER ... CHAT`` does),
and the generation itself, as a generator the model's worker advances one token at a time.

Decoding: ``temperature`` 0 is greedy (argmax over the float32 logits, exactly what ``INFER
... GENERATE`` picks); above 0 it samples from softmax(logits / temperature) in float64, cut
to the smallest set of tokens whose probability reaches ``top_p``, with a ``seed`` for a
reproducible stream. Generation stops at the container's end-of-sequence ids (their text is
not part of the output), at a ``stop`` string (cut before it), or after ``max_tokens``.
``draft_depth`` runs a draft slice; ``speculate: {depth, lookahead}`` generates by
self-speculative decoding, whose output is the full model's greedy output by construction.

Log-probabilities (``logprobs`` on completions, ``logprobs`` + ``top_logprobs`` on chat) are the
model's own distribution at each position -- softmax of the float32 logits computed in float64,
exactly as ``INFER ... TOP k`` computes its probabilities, whatever the sampling temperature --
one entry per generated token (an end-of-sequence token that stopped generation has none).
``echo`` (completions) puts the prompt's text before the completion, and with ``logprobs`` the
prompt's tokens' entries before the generated ones (the first prompt token has none)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import LqlError
from .config import Limits
from .worker import JobContext


class RequestRefusal(LqlError):
    """The request body is not one this server accepts (a 400 naming the field)."""


# Request bodies are strict: a JSON true is not a number and "1" is not an integer (no coercion).
_STRICT = ConfigDict(extra="forbid", strict=True)

#: The most draft tokens a speculation round may propose (LQL's max_lookahead default): the
#: bound applies before anything is allocated for the round.
MAX_LOOKAHEAD = 64

#: The most alternatives a log-probability entry lists (OpenAI's chat limit).
MAX_TOP_LOGPROBS = 20

#: The most choices (``n``) one request may ask for: they decode together, in batched passes of
#: up to 8 rows (vindex3.exec.batch.ROWS), so 16 is two passes a step.
MAX_N = 16


class Speculation(BaseModel):
    model_config = _STRICT
    depth: int = Field(ge=1)
    lookahead: int = Field(default=4, ge=1, le=MAX_LOOKAHEAD)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0 only with echo: score the prompt
    # strict floats still take a JSON integer (0, 1): a whole number is a number
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(default=1, ge=1, le=MAX_N)  # choices; choice i samples with seed + i
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)  # numpy's generators take seeds >= 0
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # extensions
    draft_depth: int | None = Field(default=None, ge=1)
    speculate: Speculation | None = None


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


_UNSUPPORTED_DEFAULTS = {
    "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "best_of": None, "suffix": None,
}


def validate(cls: type[BaseModel], body: Any) -> Any:
    """``body`` as the strict model ``cls``; an unknown field or a wrong value refused by name."""
    if not isinstance(body, dict):
        raise RequestRefusal("the request body must be a JSON object")
    try:
        return cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "body"
        if err.get("type") == "extra_forbidden":
            raise RequestRefusal(f"field {where!r} is not supported by this server",
                                 hint="supported: " + ", ".join(sorted(cls.model_fields))) from None
        raise RequestRefusal(f"field {where!r}: {err.get('msg')}") from None


def parse_request(cls: type[_Common], body: Any) -> _Common:
    """The request, validated; a field this server does not implement is refused by name."""
    req = validate(cls, body)
    for name, neutral in _UNSUPPORTED_DEFAULTS.items():
        v = getattr(req, name, neutral)
        if v in (None, neutral) or (name == "logit_bias" and not v):
            continue
        raise RequestRefusal(f"field {name!r} = {v!r} is not supported by this server",
                             hint=f"leave {name} out (only {neutral!r} is implemented)")
    if isinstance(req, CompletionRequest) and isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], str):
        if len(req.prompt) != 1:
            raise RequestRefusal(f"prompt holds {len(req.prompt)} strings; this server completes one prompt per request")
        req.prompt = req.prompt[0]
    if req.speculate is not None:
        if req.temperature != 0:
            raise RequestRefusal("speculate generates the full model's greedy output and needs temperature 0",
                                 hint='send "temperature": 0 with "speculate"')
        if req.n > 1:
            raise RequestRefusal(f"n = {req.n} cannot be combined with speculate: speculation gives the one greedy output",
                                 hint="ask for n 1 with speculate")
        if req.draft_depth is not None:
            raise RequestRefusal("draft_depth and speculate cannot be combined: speculation verifies with the full model",
                                 hint="the draft that proposes tokens is speculate.depth")
    if req.max_tokens == 0 and not (isinstance(req, CompletionRequest) and req.echo):
        raise RequestRefusal("max_tokens 0 generates nothing; it is taken only with echo (to score the prompt)",
                             hint="ask for at least 1 token, or send \"echo\": true")
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        raise RequestRefusal("top_logprobs needs logprobs: true", hint='send "logprobs": true with "top_logprobs"')
    if req.speculate is not None and top_logprobs_of(req) is not None:
        raise RequestRefusal("logprobs cannot be combined with speculate: speculation keeps no distribution per token",
                             hint="leave out speculate to get log-probabilities")
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestRefusal("stop takes up to 4 non-empty strings")
    return req


def choice_seed(seed: int | None, i: int) -> int | None:
    """The seed choice ``i`` samples with: ``seed + i`` (choice 0 is the request with n 1), kept
    within the seeds numpy takes by wrapping past 2**63 - 1; None (unseeded) stays None."""
    return None if seed is None else (seed + i) % 2**63


def top_logprobs_of(req: _Common) -> int | None:
    """How many alternatives each log-probability entry lists; None when none are asked for."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return getattr(req, "logprobs", None)


def stops_of(req: _Common) -> list[str]:
    return [] if req.stop is None else ([req.stop] if isinstance(req.stop, str) else list(req.stop))


def max_tokens_of(req: _Common, limits: Limits, default: int) -> int:
    n = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        n = req.max_completion_tokens
    if n is None:  # not asked for: the endpoint's default, within the server's limit
        return min(default, limits.max_tokens)
    if n > limits.max_tokens:
        raise RequestRefusal(f"max_tokens {n} is more than this server allows (--max-tokens is {limits.max_tokens})",
                             hint=f"ask for at most {limits.max_tokens} tokens")
    return n


def chat_text(messages: list[ChatMessage]) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            text = m.content
        else:
            parts = []
            for part in m.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise RequestRefusal(f"messages[{i}] has a content part of type {part.get('type')!r}; "
                                         "this server takes text parts only")
                parts.append(part["text"])
            text = "".join(parts)
        out.append({"role": m.role, "content": text})
    return out


def prompt_ids(catalog, req: _Common, limits: Limits) -> list[int]:
    """Token ids of the request's prompt (on the model's worker: the tokenizer lives there)."""
    from .. import chat

    if isinstance(req, ChatRequest):
        template = catalog.chat_template()
        if template is None:
            raise RequestRefusal(f"model {catalog.name} carries no chat template, so it cannot serve chat completions",
                                 hint="use /v1/completions with a text prompt")
        rendered = chat.render(template, chat_text(req.messages), add_generation_prompt=True, **catalog.special_tokens())
        ids = catalog.tokenize(rendered, special=False)
    elif isinstance(req.prompt, str):
        ids = catalog.tokenize(req.prompt)
    else:
        ids = [int(i) for i in req.prompt]
        bad = [i for i in ids if not 0 <= i < catalog.vocab]
        if bad:
            raise RequestRefusal(f"token id {bad[0]} is outside the vocabulary [0, {catalog.vocab})")
    if not ids:
        raise RequestRefusal("the prompt tokenises to no tokens")
    if len(ids) > limits.max_prompt_tokens:
        raise RequestRefusal(f"the prompt is {len(ids)} tokens, more than this server allows "
                             f"(--max-prompt-tokens is {limits.max_prompt_tokens})")
    return ids


# ---- decoding ---------------------------------------------------------------------------


def pick(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator | None) -> int:
    """One draw of vindex3's `Sampler` with the given generator (the sampling every front end
    uses; kept for the distribution test, which draws many times from one generator)."""
    from vindex3.generate import Sampler

    if temperature == 0:
        return int(np.argmax(logits))
    return Sampler(temperature, top_p).draw(logits, rng)


def logprob_entry(logits: np.ndarray, tok: int, k: int, token_text: Callable[[int], str | None]) -> dict[str, Any]:
    """The chosen token's log-probability and the ``k`` most probable tokens', from the model's
    distribution at one position: softmax of the float32 logits in float64, as ``INFER ... TOP``
    computes it (ties ordered by id, as there)."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max()
    p = np.exp(x)
    p /= p.sum()
    top: list[tuple[int, str, float]] = []
    if k:
        k = min(k, p.shape[0])
        cand = np.argpartition(-p, k - 1)[:k] if k < p.shape[0] else np.arange(p.shape[0])
        cand = cand[np.lexsort((cand, -p[cand]))]
        top = [(int(i), token_text(int(i)) or "", float(np.log(p[i]))) for i in cand]
    return {"id": int(tok), "token": token_text(int(tok)) or "", "logprob": float(np.log(p[tok])), "top": top}


class TextStream:
    """Generated ids → text deltas that never need taking back: a trailing incomplete UTF-8
    character (decoded as U+FFFD) and a tail that could begin a stop string are held back
    until the next token settles them. ``push`` says when a stop string appeared (the text is
    cut before it)."""

    def __init__(self, decode: Callable[[list[int]], str], stops: list[str]):
        self.decode, self.stops = decode, stops
        self.ids: list[int] = []
        self.sent = ""  # the text handed out so far
        self.cut = False  # a stop string ended the text

    def push(self, tok: int) -> tuple[str, bool]:
        self.ids.append(int(tok))
        text = self.decode(self.ids)
        base = len(self.sent) if text.startswith(self.sent) else len(text)
        hit = -1
        for s in self.stops:
            i = text.find(s, max(0, base - len(s) + 1))
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        if hit >= 0:
            self.cut = True
            return self._emit(text, max(hit, base), base), True
        safe = len(text)
        while safe > base and text[safe - 1] == "\ufffd":
            safe -= 1
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, safe - base), 0, -1):
                if text[safe - k : safe] == s[:k]:
                    hold = max(hold, k)
                    break
        return self._emit(text, safe - hold, base), False

    def finish(self) -> str:
        """The text held back, once generation is over (nothing after a stop string)."""
        if self.cut:
            return ""
        text = self.decode(self.ids)
        base = len(self.sent) if text.startswith(self.sent) else len(text)
        return self._emit(text, len(text), base)

    def _emit(self, text: str, upto: int, base: int) -> str:
        if upto <= base:
            return ""
        delta = text[base:upto]
        self.sent = text[:upto]
        return delta


@dataclass
class Generation:
    """One completion's parameters, bound to token ids."""

    ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    stop_ids: tuple[int, ...]
    depth: int | None = None
    speculate: Speculation | None = None
    top_logprobs: int | None = None  # None: no log-probabilities
    echo: str | None = None  # the prompt's text, sent before the completion


class _Finished(BaseException):
    pass


def open_stream(host, g: Generation):
    """The stream a generation decodes in, as a `vindex3.exec.batch.Prefetched` (so that the
    worker can compute its steps in batches with other generations'); None for speculation,
    which runs its own streams. On the model's worker."""
    if g.speculate is not None:
        return None
    from vindex3.exec.batch import Prefetched

    return Prefetched(host.executor(g.depth).start())


def run(host, g: Generation, ctx: JobContext, stream=None) -> Iterator[dict[str, Any]]:
    """The generation, one event per token: ``{"delta": text}``; then a last event
    ``{"delta": rest, "finish_reason", "usage"}``. Runs on the model's worker, in ``stream``
    (`open_stream`; a new one when None). Before yielding a token that generation goes on
    from, it tells the stream so (``wants``): the worker may compute that step in a batch."""
    cat = host.catalog
    decode = (lambda ids: cat.decode(ids) or "") if cat.has_tokenizer else (lambda ids: "")
    ts = TextStream(decode, g.stops)
    stop_ids = set(g.stop_ids)
    k = g.top_logprobs
    if g.speculate is not None:
        # the echo, and a turn for the other streams before the whole speculation runs
        yield {"delta": g.echo or ""}
        from vindex3.draft import speculative_generate

        state = {"n": 0, "finish": "length"}

        def on_token(tok: int) -> None:
            ctx.check()
            state["n"] += 1
            if tok in stop_ids:
                state["finish"] = "stop"
                raise _Finished
            delta, hit = ts.push(tok)
            if delta:
                ctx.emit({"delta": delta})
            if hit:
                state["finish"] = "stop"
                raise _Finished

        try:
            speculative_generate(host.container, g.ids, g.max_tokens, g.speculate.depth, g.speculate.lookahead,
                                 on_token=on_token)
        except _Finished:
            pass
        produced, finish = state["n"], state["finish"]
    else:
        st = stream if stream is not None else open_stream(host, g)
        out: dict[str, Any] = {}
        try:
            yield from _decode(cat, g, st, ts, stop_ids, k, out)
        finally:
            st.close()  # its KV rows go with the request, not with the executor's last-run memory
        produced, finish = out["produced"], out["finish"]
    yield {"delta": ts.finish(), "finish_reason": finish,
           "usage": {"prompt_tokens": len(g.ids), "completion_tokens": produced, "total_tokens": len(g.ids) + produced}}


def _decode(cat, g: Generation, st, ts: TextStream, stop_ids: set[int], k: int | None,
            out: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The events of a plain (not speculative) generation in stream ``st``; what it produced
    and why it finished are left in ``out``."""
    from vindex3.generate import Sampler, generate_step

    produced, finish = 0, "length"
    # the one decode step (vindex3.generate): the prefill's record, then one per token
    calls = generate_step(st, g.ids, sampler=Sampler(g.temperature, g.top_p, g.seed), max_tokens=g.max_tokens,
                          stop_ids=stop_ids, logits=k is not None, prompt_logits=g.echo is not None and k is not None)
    record = next(calls)
    if g.echo is not None:
        ev: dict[str, Any] = {"delta": g.echo}
        if k is not None:
            every = record.prompt_rows
            first = cat.token_text(g.ids[0]) or ""
            ev["logprobs"] = [{"id": g.ids[0], "token": first, "logprob": None, "top": None}] + [
                logprob_entry(every[i - 1], g.ids[i], k, cat.token_text) for i in range(1, len(g.ids))]
        yield ev
    while record is not None and record.token is not None:
        tok = record.token
        produced += 1
        if record.stop:
            finish = "stop"
            break
        delta, hit = ts.push(tok)
        ev = {"delta": delta}
        if k is not None:
            ev["logprobs"] = [logprob_entry(record.logits, tok, k, cat.token_text)]
        if hit:
            finish = "stop"
            yield ev
            break
        # generate_step feeds a pick back unless it stopped or was the max_tokens-th
        st.wants = tok if produced < g.max_tokens else None
        yield ev
        record = next(calls, None)
    out["produced"], out["finish"] = produced, finish

