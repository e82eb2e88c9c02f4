"""The server's OpenAPI 3.1 document (``GET /openapi.json``), generated from the pydantic models
that validate the request bodies: a field added to a request model appears here without an
edit. Responses are described by their shape in words and the one error shape every refusal
has; the endpoints are the app's routes (a test checks that no route is missing)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from . import completions as C
from . import service


class QueryRequest(BaseModel):
    """The body of /v1/query: LQL statements, separated by ';', run in order in one session."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lql: str
    model: str | None = None


class ErrorBody(BaseModel):
    """Every refusal and failure: LQL's one error shape."""

    class Error(BaseModel):
        type: str
        message: str
        hint: str | None = None
        line: int | None = None
        column: int | None = None
        expected: list[str] | None = None

    error: Error


REQUESTS: dict[str, type[BaseModel]] = {
    "/v1/query": QueryRequest,
    "/v1/completions": C.CompletionRequest,
    "/v1/chat/completions": C.ChatRequest,
    "/v1/embeddings": service.EmbeddingRequest,
    "/tokenize": service.TokenizeRequest,
    "/detokenize": service.DetokenizeRequest,
}

# (method, path) -> (summary, what a 200 answers)
ENDPOINTS: dict[tuple[str, str], tuple[str, str]] = {
    ("GET", "/health"): ("Liveness (no key needed)", '{"status": "ok"}'),
    ("GET", "/v1/health"): ("Liveness (no key needed)", '{"status": "ok"}'),
    ("GET", "/metrics"): ("Counters and gauges in Prometheus' text format", "text/plain exposition"),
    ("GET", "/openapi.json"): ("This document", "an OpenAPI 3.1 document"),
    ("GET", "/v1/models"): ("The served models", '{"object": "list", "data": [model, ...]}'),
    ("GET", "/v1/models/{model}"): ("One served model: OpenAI's fields and the model's facts", "a model object"),
    ("GET", "/v1/models/{model}/stats"): ("STATS of a served model", "STATS as `lql --json` prints it"),
    ("POST", "/v1/query"): ("Run LQL statements (X-Session-Id keeps a session)",
                            '{"model", "session", "results": [one object per statement, as `lql --json`]}'),
    ("POST", "/v1/completions"): ("OpenAI-compatible text completion (stream: server-sent events)",
                                  "a text_completion object, or its chunks as server-sent events"),
    ("POST", "/v1/chat/completions"): ("OpenAI-compatible chat completion (stream: server-sent events)",
                                       "a chat.completion object, or its chunks as server-sent events"),
    ("POST", "/v1/embeddings"): ("Hidden-state embeddings (mean or last, said in the response)",
                                 "an OpenAI embedding list"),
    ("POST", "/tokenize"): ("Token ids of a text", '{"model", "tokens", ...}'),
    ("POST", "/detokenize"): ("Text of token ids", '{"model", "text", ...}'),
}


def document(keyed: bool) -> dict[str, Any]:
    """The OpenAPI document; ``keyed``: the server needs a bearer key (all but the health paths)."""
    from .. import __version__

    models = [(m, "validation") for m in (*REQUESTS.values(), ErrorBody)]
    refs, defs = models_json_schema(models, ref_template="#/components/schemas/{model}")
    schemas = dict(defs.get("$defs", {}))
    error_ref = refs[(ErrorBody, "validation")]
    paths: dict[str, dict[str, Any]] = {}
    for (method, path), (summary, answer) in ENDPOINTS.items():
        op: dict[str, Any] = {
            "summary": summary,
            "responses": {
                "200": {"description": answer},
                "default": {"description": "a refusal or failure, in the one error shape",
                            "content": {"application/json": {"schema": error_ref}}},
            },
        }
        if path in REQUESTS:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": refs[(REQUESTS[path], "validation")]}}}
        if "{model}" in path:
            op["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
        if path == "/v1/query":
            op.setdefault("parameters", []).append(
                {"name": "X-Session-Id", "in": "header", "required": False,
                 "schema": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,128}$"},
                 "description": "run in the session kept under this id (see docs/server.md#sessions)"})
        if keyed and path not in ("/health", "/v1/health"):
            op["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "lql serve", "version": __version__,
                 "description": "LQL over HTTP (/v1/query) and OpenAI-compatible completions; see docs/server.md."},
        "paths": paths,
        "components": {"schemas": schemas},
    }
    if keyed:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
