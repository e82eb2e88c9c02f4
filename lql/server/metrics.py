"""What the server counts, in Prometheus' text exposition format (``GET /metrics``): requests by
endpoint and status, their latency (a histogram, measured from the request's arrival to the
last byte of its response, streams included), prompt and generated tokens by model, and the
gauges a scraper wants at that moment (requests running and waiting at the gate, generations
active on each model's worker).

Endpoints are labelled by their route (``/v1/models/{id}``), never by the raw path: a client
cannot grow the label set; a path no route matches is ``other``. Counters live in this process
and start at 0 with it; they are updated from the event loop only (no lock needed)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

#: Upper bounds (seconds) of the latency histogram's buckets; +Inf is implied.
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

ROUTES = ("/health", "/metrics", "/openapi.json", "/tokenize", "/detokenize", "/v1/health", "/v1/models", "/v1/query",
          "/v1/completions", "/v1/chat/completions", "/v1/embeddings")


def route_of(path: str) -> str:
    """The label of a request path: its route, or ``other``."""
    if path in ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{id}/stats" if path.endswith("/stats") else "/v1/models/{id}"
    return "other"


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, int], int] = defaultdict(int)  # (route, method, status)
        self.latency: dict[str, list[int]] = {}  # route -> per-bucket counts (+Inf last)
        self.latency_sum: dict[str, float] = defaultdict(float)
        self.latency_count: dict[str, int] = defaultdict(int)
        self.prompt_tokens: dict[str, int] = defaultdict(int)  # model -> tokens
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.embedding_tokens: dict[str, int] = defaultdict(int)

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        self.requests[(route, method, status)] += 1
        counts = self.latency.setdefault(route, [0] * (len(BUCKETS) + 1))
        i = next((k for k, b in enumerate(BUCKETS) if seconds <= b), len(BUCKETS))
        counts[i] += 1
        self.latency_sum[route] += seconds
        self.latency_count[route] += 1

    def usage(self, model: str, usage: dict[str, Any] | None) -> None:
        if usage:
            self.prompt_tokens[model] += int(usage.get("prompt_tokens", 0))
            self.completion_tokens[model] += int(usage.get("completion_tokens", 0))

    def text(self, gauges: dict[str, list[tuple[dict[str, str], float]]],
             batches: dict[str, dict[int, int]] | None = None, busy: dict[str, dict[str, float]] | None = None) -> str:
        """The exposition: every counter, the histogram, then ``gauges`` (name -> [(labels, value)]);
        ``batches``: per model, the batched decode passes by rows computed (the workers count them);
        ``busy``: per model, the seconds its worker spent by kind of work."""
        out: list[str] = []

        def head(name: str, kind: str, what: str) -> None:
            out.append(f"# HELP {name} {what}")
            out.append(f"# TYPE {name} {kind}")

        head("lql_requests_total", "counter", "HTTP requests answered, by route, method and status.")
        for (route, method, status), n in sorted(self.requests.items()):
            out.append(f'lql_requests_total{{route="{route}",method="{method}",status="{status}"}} {n}')
        head("lql_request_duration_seconds", "histogram",
             "Time from a request's arrival to the last byte of its response (streams included).")
        for route in sorted(self.latency):
            acc = 0
            for b, n in zip((*BUCKETS, None), self.latency[route]):
                acc += n
                le = "+Inf" if b is None else repr(float(b))
                out.append(f'lql_request_duration_seconds_bucket{{route="{route}",le="{le}"}} {acc}')
            out.append(f'lql_request_duration_seconds_sum{{route="{route}"}} {self.latency_sum[route]:.6f}')
            out.append(f'lql_request_duration_seconds_count{{route="{route}"}} {self.latency_count[route]}')
        for name, table, what in (
                ("lql_prompt_tokens_total", self.prompt_tokens, "Prompt tokens of completions, by model."),
                ("lql_completion_tokens_total", self.completion_tokens,
                 "Generated tokens of completions (an end-of-sequence token that stopped one counted), by model."),
                ("lql_embedding_tokens_total", self.embedding_tokens, "Input tokens of embeddings, by model.")):
            head(name, "counter", what)
            for model, n in sorted(table.items()):
                out.append(f'{name}{{model="{model}"}} {n}')
        if batches is not None:
            head("lql_batched_steps_total", "counter",
                 "Batched decode passes (several completions' next tokens in one pass), by model and rows per pass.")
            for model, table in sorted(batches.items()):
                for rows, n in sorted(table.items()):
                    out.append(f'lql_batched_steps_total{{model="{model}",rows="{rows}"}} {n}')
        if busy is not None:
            head("lql_worker_seconds_total", "counter",
                 "Seconds a model's worker spent, by work: batched decode passes, generation steps run "
                 "alone (prefills included), one-shot calls.")
            for model, table in sorted(busy.items()):
                for work, sec in sorted(table.items()):
                    out.append(f'lql_worker_seconds_total{{model="{model}",work="{work}"}} {sec:.6f}')
        for name, rows in gauges.items():
            head(name, "gauge", GAUGES[name])
            for labels, v in rows:
                lab = ",".join(f'{k}="{val}"' for k, val in labels.items())
                out.append(f"{name}{{{lab}}} {v:g}" if lab else f"{name} {v:g}")
        return "\n".join(out) + "\n"


GAUGES = {
    "lql_requests_running": "Requests holding a slot of --max-concurrent now.",
    "lql_requests_waiting": "Requests queued for a slot now (at most --max-queue).",
    "lql_generations_active": "Completions admitted to a model's worker and not finished, by model.",
}


class Measure:
    """ASGI middleware: every HTTP request's route, status and latency into ``metrics``."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.monotonic()
        status = [500]
        recorded = [False]

        def record() -> None:
            if not recorded[0]:
                recorded[0] = True
                self.metrics.observe(route_of(scope.get("path", "")), scope.get("method", ""), status[0],
                                     time.monotonic() - t0)

        async def send_measured(msg) -> None:
            if msg["type"] == "http.response.start":
                status[0] = int(msg["status"])
            await send(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, send_measured)
        finally:
            record()
