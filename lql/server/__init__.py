"""``lql serve``: LQL and OpenAI-compatible completions over HTTP (Starlette + uvicorn, the
``server`` extra). See docs/server.md.

- `lql.server.config`: models, key, profile, data directory, limits (every limit a flag).
- `lql.server.app`: the ASGI app (`create_app`), routes, keys, the error boundary.
- `lql.server.worker`: one worker thread per model; generations interleave token by token.
- `lql.server.policy`: profiles, path confinement, statement limits.
- `lql.server.completions`: OpenAI request bodies, prompts, sampling, stop strings.
- `lql.server.sessions`: X-Session-Id sessions with a TTL.
- `lql.server.client`: the HTTP client ``USE REMOTE`` speaks (standard library only).
- `lql.server.cli`: the ``lql serve`` command.

Importing this package imports neither Starlette nor uvicorn; `lql.server.app` does."""
