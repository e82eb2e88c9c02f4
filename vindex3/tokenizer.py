"""The container's own tokenizer, from its capability snapshot (tokenizer.json and friends)."""

from __future__ import annotations

from .errors import InputError, IntegrityError


class Tokenizer:
    def __init__(self, tok, config: dict):
        self._tok = tok
        self.config = config
        bos = config.get("bos_token")
        if isinstance(bos, dict):
            bos = bos.get("content")
        if not isinstance(bos, str):
            bos = None
        self.bos_token = bos
        self.bos_id = tok.token_to_id(bos) if bos else None
        eos = config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not isinstance(eos, str):
            eos = None
        self.eos_token = eos
        self.eos_id = tok.token_to_id(eos) if eos else None
        # BOS as the tokenizer config declares; where it is silent, the tokenizer.json post-processor decides.
        self.add_bos = config.get("add_bos_token")

    @classmethod
    def from_json(cls, text: str, config: dict, source: str = "tokenizer.json") -> Tokenizer:
        """From the text of a tokenizer.json and the parsed tokenizer_config.json (the container
        reads and hash-checks both: `vindex3.container.Container.tokenizer`)."""
        from tokenizers import Tokenizer as HfTokenizer

        if not isinstance(config, dict):
            raise IntegrityError(f"{source}: tokenizer_config.json is not a JSON object")
        try:
            tok = HfTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise IntegrityError(f"{source} cannot be loaded by the tokenizers library: {str(e)[:200]}") from None
        for key in ("bos_token", "eos_token"):
            v = config.get(key)
            if v is not None and not isinstance(v, (str, dict)):
                raise IntegrityError(f"{source}: tokenizer_config.json {key} must be a string or an object, found {v!r}")
        add_bos = config.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise IntegrityError(f"{source}: tokenizer_config.json add_bos_token must be true, false or absent, found {add_bos!r}")
        t = cls(tok, config)
        # A special token the config names must exist: silently dropping the BOS (or never
        # seeing the EOS) would change every run without a word.
        for key, token, tid in (("bos_token", t.bos_token, t.bos_id), ("eos_token", t.eos_token, t.eos_id)):
            if config.get(key) is not None and (not token or tid is None):
                raise IntegrityError(f"{source}: tokenizer_config.json {key} {config.get(key)!r} is not a token of "
                                     "the vocabulary")
        if add_bos and t.bos_id is None:
            raise IntegrityError(f"{source}: tokenizer_config.json asks for a BOS token (add_bos_token) but names none")
        return t

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Token ids of ``text``; ``special=False`` adds no BOS/EOS (a chat template writes its
        own). Text that is not valid Unicode (a lone surrogate, as a broken terminal or file can
        produce) is refused by name, never handed to the tokenizer."""
        if not isinstance(text, str):
            raise InputError(f"a prompt is text, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InputError(f"the prompt is not valid Unicode text: a lone surrogate {text[e.start]!r} at character "
                             f"{e.start}", hint="check the input's encoding (it should be UTF-8)") from None
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
