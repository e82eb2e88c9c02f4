"""The container's own tokenizer, from its capability snapshot (tokenizer.json and friends)."""

from __future__ import annotations

from pathlib import Path

from . import jsonio
from .errors import TokenizerMissing


class Tokenizer:
    def __init__(self, tok, config: dict):
        self._tok = tok
        self.config = config
        bos = config.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        self.bos_token = bos
        self.bos_id = tok.token_to_id(bos) if bos else None
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        self.eos_token = eos
        self.eos_id = tok.token_to_id(eos) if eos else None
        # BOS as the tokenizer config declares; where it is silent, the tokenizer.json post-processor decides.
        self.add_bos = config.get("add_bos_token")

    @classmethod
    def from_container(cls, path: Path) -> Tokenizer:
        tj = Path(path) / "tokenizer.json"
        if not tj.exists():
            raise TokenizerMissing(
                f"container {Path(path).name} carries no tokenizer (no tokenizer.json in its snapshot)",
                hint="pass token ids instead, e.g. INFER TOKENS (1, 2, 3)",
            )
        from tokenizers import Tokenizer as HfTokenizer

        tok = HfTokenizer.from_file(str(tj))
        cfg_path = Path(path) / "tokenizer_config.json"
        cfg = jsonio.load(cfg_path) if cfg_path.exists() else {}
        return cls(tok, cfg)

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``. ``special=False`` adds no BOS/EOS (a chat template writes its own)."""
        if not special:
            return list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos is None:
            return list(self._tok.encode(text, add_special_tokens=True).ids)
        ids = list(self._tok.encode(text, add_special_tokens=False).ids)
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def pieces(self, text: str) -> list[int]:
        """The ids of ``text`` alone: no BOS, no special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()
