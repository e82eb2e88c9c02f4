"""``lql serve [PATH | --dir DIR] [--host 127.0.0.1] [--port 8088] [--api-key KEY |
--api-key-file F] [--max-concurrent N] [--profile full|read-only] [--data-dir DIR] ...``

With no PATH and no --dir it serves the built-in default model (SmolLM2-135M-Instruct, encoded
into the cache on first use). A bind to an address other than loopback needs a key, unless
``--insecure-no-key`` says otherwise. Every limit is a flag with its default shown in --help."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TextIO

from .config import PROFILES, Limits, ModelSpec, ServerConfig, is_loopback, model_id_for

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


def arg_parser() -> argparse.ArgumentParser:
    d = Limits()
    p = argparse.ArgumentParser(
        prog="lql serve",
        description="Serve LQL (/v1/query) and OpenAI-compatible completions over HTTP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("path", nargs="?", help="a container to serve (default: the built-in default model)")
    p.add_argument("--dir", metavar="DIR", help="serve every container in DIR, each under its directory name")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=int, default=8088, help="port to bind (0: any free port)")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help="require Authorization: Bearer KEY (all but /v1/health)")
    key.add_argument("--api-key-file", metavar="F", help="read the key from file F (its first line)")
    p.add_argument("--insecure-no-key", action="store_true", help="allow a non-loopback bind without a key")
    p.add_argument("--profile", choices=PROFILES, default="full",
                   help="read-only: only statements that read, GENERATE up to --read-only-generate")
    p.add_argument("--data-dir", metavar="DIR", help="statements' file paths resolve inside DIR (none: no paths)")
    for field, metavar, text in _LIMIT_FLAGS:  # each a Limits field, typed as its default is
        default = getattr(d, field)
        p.add_argument("--" + field.replace("_", "-"), type=type(default), default=default, metavar=metavar, help=text)
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages from ORIGIN (scheme://host[:port], or '*') call this server; repeatable "
                        "(default: none, no CORS headers)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p


# (Limits field, metavar, help) of the flags that set a server limit
_LIMIT_FLAGS = (
    ("max_concurrent", "N", "requests running model work at once"),
    ("max_queue", "N", "requests waiting for a slot before 429"),
    ("retry_after", "S", "Retry-After of a 429"),
    ("max_body_bytes", "N", "request body size"),
    ("max_prompt_tokens", "N", "prompt tokens of a completion or statement"),
    ("max_tokens", "N", "max_tokens of a completion and GENERATE n of a statement"),
    ("read_only_generate", "N", "GENERATE n allowed by the read-only profile"),
    ("max_statements", "N", "LQL statements per /v1/query request"),
    ("time_limit", "S", "seconds a request may run (waiting for a slot not counted)"),
    ("session_ttl", "S", "seconds an idle X-Session-Id session is kept"),
    ("max_sessions", "N", "live sessions"),
    ("memory_ceiling", "BYTES", "weight bytes held open (served models and OPENed containers, shared ones once)"),
)


class UsageError(Exception):
    pass


def config_from_args(args: argparse.Namespace, progress=None) -> tuple[ServerConfig, str, int]:
    """The server's configuration from the command line; refuses by name what cannot start."""
    if args.path and args.dir:
        raise UsageError("give a container PATH or --dir DIR, not both")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, UnicodeDecodeError, IndexError) as e:
            raise UsageError(f"--api-key-file {args.api_key_file}: cannot read a key from it ({e})") from None
        if not key:
            raise UsageError(f"--api-key-file {args.api_key_file}: its first line is empty")
    else:
        key = args.api_key
    if key is not None and not key:
        raise UsageError("--api-key is empty")
    if not is_loopback(args.host) and key is None and not args.insecure_no_key:
        raise UsageError(f"refusing to serve on {args.host} without an API key: any machine that reaches it could run "
                         "the model; give --api-key or --api-key-file (or --insecure-no-key if you mean it)")
    for name in ("max_concurrent", "max_body_bytes", "max_prompt_tokens", "max_tokens", "read_only_generate",
                 "max_statements", "max_sessions", "memory_ceiling"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("max_queue", "retry_after"):
        if getattr(args, name) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative")
    if args.time_limit <= 0 or args.session_ttl <= 0:
        raise UsageError("--time-limit and --session-ttl must be positive")
    data_dir = None
    if args.data_dir:
        data_dir = Path(args.data_dir)
        if not data_dir.is_dir():
            raise UsageError(f"--data-dir {args.data_dir} is not a directory")
    if args.dir:
        root = Path(args.dir)
        if not root.is_dir():
            raise UsageError(f"--dir {args.dir} is not a directory")
        found = sorted(p for p in root.iterdir() if p.is_dir() and (p / "index.json").exists())
        if not found:
            raise UsageError(f"--dir {args.dir} holds no container (no subdirectory with an index.json)")
        specs = tuple(ModelSpec(model_id_for(p), p) for p in found)
    elif args.path:
        specs = (ModelSpec(model_id_for(Path(args.path)), Path(args.path)),)
    else:
        from vindex3 import default_model

        path = default_model.ensure(progress=progress)
        specs = (ModelSpec(model_id_for(path), path, default_model=True),)
    limits = Limits(
        max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens, max_tokens=args.max_tokens,
        max_statements=args.max_statements, time_limit=args.time_limit, read_only_generate=args.read_only_generate,
        max_concurrent=args.max_concurrent, max_queue=args.max_queue, retry_after=args.retry_after,
        session_ttl=args.session_ttl, max_sessions=args.max_sessions, memory_ceiling=args.memory_ceiling,
    )
    try:
        config = ServerConfig(models=specs, api_key=key, profile=args.profile, data_dir=data_dir, limits=limits,
                              cors_origins=tuple(args.cors_origin))
    except ValueError as e:
        raise UsageError(str(e)) from None
    return config, args.host, args.port


def main(argv: list[str] | None = None, *, stderr: TextIO | None = None) -> int:
    err = stderr or sys.stderr
    args = arg_parser().parse_args(argv)
    try:
        import uvicorn  # noqa: F401 - the server extra is installed, or say so by name

        from .app import create_app
    except ImportError as e:
        print(f"lql serve: the server is an optional part of lql ({e.name} is not installed); "
              "from a clone of the source: pip install -e '.[server]'", file=err)
        return EXIT_USAGE
    from ..binding import is_engine_error

    try:
        config, host, port = config_from_args(args)
        app = create_app(config)
    except UsageError as e:
        print(f"lql serve: {e}", file=err)
        return EXIT_USAGE
    except Exception as e:
        if is_engine_error(e):  # a container that does not open: vindex3's refusal, by name
            print(f"lql serve: {e}", file=err)
            return EXIT_FAILED
        raise
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ids = ", ".join(m.id for m in config.models)
    print(f"lql serve: {ids} on http://{host}:{port} (profile {config.profile}, "
          f"{'key required' if config.api_key else 'no key'})", file=err, flush=True)
    from .transport import server

    server(app, host, port, log_level=args.log_level).run()
    return EXIT_OK
