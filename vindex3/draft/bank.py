"""The frozen prompt bank (``prompts-v1.jsonl``): locating it and reading it."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .. import jsonio
from ..errors import ConfigError, LimitExceeded, PathRefused
from ..paths import existing_file, read_regular

BANK_NAME = "prompts-v1.jsonl"


class Prompt(BaseModel):
    """One bank entry: text to tokenize, or (for containers without a tokenizer, and for exact
    replays) the token ids themselves — exactly one of the two."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    category: str
    text: str | None = None
    token_ids: list[int] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> Prompt:
        if (self.text is None) == (self.token_ids is None):
            raise ValueError("give exactly one of text and token_ids")
        if self.token_ids is not None and not self.token_ids:
            raise ValueError("token_ids is empty")
        return self


def bank_candidates(repo_root: str | os.PathLike | None = None) -> list[Path]:
    """Where the bank may live, preferred first: ``shared/data`` beside the repository, then the
    vendored copy under ``tests/data``."""
    root = Path(repo_root) if repo_root is not None else Path(__file__).resolve().parents[2]
    return [root.parent / "shared" / "data" / BANK_NAME, root / "tests" / "data" / BANK_NAME]


def default_bank(repo_root: str | os.PathLike | None = None) -> Path:
    """The first bank that exists (see :func:`bank_candidates`)."""
    cands = bank_candidates(repo_root)
    for c in cands:
        if c.is_file():
            return c
    raise ConfigError(f"prompt bank {BANK_NAME} not found; looked in " + ", ".join(str(c) for c in cands))


MAX_BANK_BYTES = 256 << 20


def _read_bank(path: str | os.PathLike) -> bytes:
    try:
        return read_regular(existing_file(path, "prompt bank"), "prompt bank", max_bytes=MAX_BANK_BYTES)
    except PathRefused as e:
        p = Path(os.fspath(path)) if isinstance(path, (str, os.PathLike)) else None
        if e.reason == "missing" and p is not None:
            raise ConfigError(f"{p.name}: no such prompt bank at {p}") from None
        raise ConfigError(e.message) from None


def load_prompts(path: str | os.PathLike, *, max_prompts: int | None = None) -> list[Prompt]:
    """Read a JSONL prompt bank: one ``{"id", "category", "text" | "token_ids"}`` object a line;
    blank lines are skipped; ids must be unique. With ``max_prompts``, a bank holding more
    prompts is refused by name before anything is tokenized."""
    data = _read_bank(path)
    p = Path(os.fspath(path))
    lines = jsonio.decode_text(data, p.name).splitlines()
    prompts: list[Prompt] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if max_prompts is not None and len(prompts) >= max_prompts:
            raise LimitExceeded(f"{p.name}: the prompt bank holds more than {max_prompts} prompts (the limit)",
                                hint="use a smaller bank, or raise the prompt-bank limit explicitly")
        obj = jsonio.loads(line, source=f"{p.name} line {n}")
        try:
            prompts.append(Prompt.model_validate(obj))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "line"
            raise ConfigError(f"{p.name} line {n}: {where}: {first['msg']}") from None
    if not prompts:
        raise ConfigError(f"{p.name}: the prompt bank is empty")
    seen: set[str] = set()
    for pr in prompts:
        if pr.id in seen:
            raise ConfigError(f"{p.name}: prompt id {pr.id!r} appears twice")
        seen.add(pr.id)
    return prompts


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(_read_bank(path)).hexdigest()
