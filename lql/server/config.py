"""What a server is configured with: its models, its key, its profile, its data directory and
its limits. Every limit is a flag of ``lql serve`` with the default stated here (and in
docs/server.md); a request past a limit is refused by name, never clipped."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from pathlib import Path

PROFILES = ("full", "read-only")


@dataclass(frozen=True)
class Limits:
    """Bounds on one request's work. Defaults are the flags' defaults."""

    max_body_bytes: int = 1 << 20  # --max-body-bytes: a request body larger than 1 MiB is refused (413)
    max_prompt_tokens: int = 2048  # --max-prompt-tokens: prompt ids per completion or LQL statement
    max_tokens: int = 512  # --max-tokens: max_tokens of a completion, GENERATE n of a statement
    max_statements: int = 32  # --max-statements: LQL statements in one /v1/query request
    time_limit: float = 60.0  # --time-limit: seconds one request may run (queueing not counted)
    read_only_generate: int = 64  # --read-only-generate: GENERATE n allowed by the read-only profile
    max_concurrent: int = 4  # --max-concurrent: model-running requests at once, over every model
    max_queue: int = 16  # --max-queue: requests that may wait for a slot; beyond it, 429
    retry_after: int = 1  # --retry-after: the Retry-After seconds a 429 carries
    session_ttl: float = 900.0  # --session-ttl: seconds an idle X-Session-Id session is kept
    max_sessions: int = 64  # --max-sessions: live sessions; a new one beyond it is refused (429)
    # --memory-ceiling: bytes of weights the process may hold open (served models and every
    # container a session OPENs, each counted once however many sessions share it); an OPEN of
    # a container not open yet that would pass it is refused by name before anything is opened
    memory_ceiling: int = 16 << 30


@dataclass(frozen=True)
class ModelSpec:
    """A model the server serves: its id (the ``model`` field of a request) and its container."""

    id: str
    path: Path
    default_model: bool = False


@dataclass(frozen=True)
class ServerConfig:
    models: tuple[ModelSpec, ...]
    api_key: str | None = None
    profile: str = "full"
    data_dir: Path | None = None  # statements' file paths resolve inside it; None: no paths at all
    limits: Limits = field(default_factory=Limits)
    # ---- browsers (CORS): off unless origins are named ------------------------------------
    # --cors-origin ORIGIN (repeatable): web pages served from these origins may call the API
    # (a preflight is answered without a key; the requests themselves still need one). Empty:
    # no CORS header is ever sent, so browsers refuse cross-origin calls.
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self):
        if self.profile not in PROFILES:
            raise ValueError(f"profile {self.profile!r} is not one of {', '.join(PROFILES)}")
        ids = [m.id for m in self.models]
        dup = sorted({i for i in ids if ids.count(i) > 1})
        if dup:
            raise ValueError(f"two containers would be served under the same model id {dup[0]!r}")
        for origin in self.cors_origins:
            check_origin(origin)


def check_origin(origin: str) -> str:
    """A CORS origin as browsers send it: ``scheme://host[:port]`` (no path), or ``*`` (any)."""
    import re

    if origin != "*" and not re.fullmatch(r"https?://[A-Za-z0-9.\-\[\]:]+", origin):
        raise ValueError(f"CORS origin {origin!r} is not an origin: give scheme://host[:port] "
                         "(e.g. http://localhost:3000, no path and no trailing '/'), or '*' for any")
    return origin


def is_loopback(host: str) -> bool:
    """True for a host name or address that only this machine can reach."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def model_id_for(path: Path) -> str:
    """A container's model id: its directory name without the ``.vindex3`` suffix."""
    name = path.name
    return name[: -len(".vindex3")] if name.endswith(".vindex3") and len(name) > len(".vindex3") else name
