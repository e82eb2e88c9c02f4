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
self-speculative decoding, whose output is the full model's greedy output by construction."""

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
    max_tokens: int | None = Field(default=None, ge=1)
    # strict floats still take a JSON integer (0, 1): a whole number is a number
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    n: int = 1
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
    logprobs: int | None = None
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
    top_logprobs: int | None = None


_UNSUPPORTED_DEFAULTS = {
    "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0.0, "logit_bias": None, "echo": False, "logprobs": None,
    "best_of": None, "suffix": None, "top_logprobs": None,
}


def parse_request(cls: type[_Common], body: Any) -> _Common:
    """The request, validated; a field this server does not implement is refused by name."""
    if not isinstance(body, dict):
        raise RequestRefusal("the request body must be a JSON object")
    try:
        req = cls.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err.get("loc", ())) or "body"
        if err.get("type") == "extra_forbidden":
            raise RequestRefusal(f"field {where!r} is not supported by this server",
                                 hint="supported: " + ", ".join(sorted(cls.model_fields))) from None
        raise RequestRefusal(f"field {where!r}: {err.get('msg')}") from None
    for name, neutral in _UNSUPPORTED_DEFAULTS.items():
        v = getattr(req, name, neutral)
        if v in (None, neutral) or (name == "logprobs" and v is False) or (name == "logit_bias" and not v):
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
        if req.draft_depth is not None:
            raise RequestRefusal("draft_depth and speculate cannot be combined: speculation verifies with the full model",
                                 hint="the draft that proposes tokens is speculate.depth")
    if req.stop is not None:
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
        if len(stops) > 4 or any(not s for s in stops):
            raise RequestRefusal("stop takes up to 4 non-empty strings")
    return req


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
    """The next token: argmax at temperature 0, else a nucleus sample."""
    if temperature == 0:
        return int(np.argmax(logits))
    x = np.asarray(logits, dtype=np.float64)
    # the maximum first, then the division: every value is <= 0, so a tiny temperature gives
    # -inf (probability 0) instead of inf - inf = NaN
    with np.errstate(over="ignore"):  # -inf is the intended value for a tiny temperature
        x = (x - x.max()) / temperature
    p = np.exp(x)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
        q = np.zeros_like(p)
        q[keep] = p[keep]
        p = q / q.sum()
    assert rng is not None
    return int(rng.choice(p.shape[0], p=p))


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


class _Finished(BaseException):
    pass


def run(host, g: Generation, ctx: JobContext) -> Iterator[dict[str, Any]]:
    """The generation, one event per token: ``{"delta": text}``; then a last event
    ``{"delta": rest, "finish_reason", "usage"}``. Runs on the model's worker."""
    cat = host.catalog
    decode = (lambda ids: cat.decode(ids) or "") if cat.has_tokenizer else (lambda ids: "")
    ts = TextStream(decode, g.stops)
    stop_ids = set(g.stop_ids)
    produced = 0
    finish = "length"
    if g.speculate is not None:
        yield {"delta": ""}  # a turn for the other streams before the whole speculation runs
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
        rng = np.random.default_rng(g.seed) if g.temperature > 0 else None
        st = host.executor(g.depth).start()
        logits = np.asarray(st.prefill(list(g.ids)))[-1]
        for k in range(g.max_tokens):
            tok = pick(logits, g.temperature, g.top_p, rng)
            produced += 1
            if tok in stop_ids:
                finish = "stop"
                break
            delta, hit = ts.push(tok)
            if hit:
                finish = "stop"
                if delta:
                    yield {"delta": delta}
                break
            yield {"delta": delta}
            if k + 1 < g.max_tokens:
                logits = st.step(tok)
    yield {"delta": ts.finish(), "finish_reason": finish,
           "usage": {"prompt_tokens": len(g.ids), "completion_tokens": produced, "total_tokens": len(g.ids) + produced}}

