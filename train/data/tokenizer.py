"""Tokenizers for the data pipeline: a byte-level default and a wrapper for trained HF `tokenizers` files.

Both expose the same small interface, so the loader and the probes never care which one they hold:
`encode(text) -> list[int]`, `encode_array(text) -> np.ndarray[int64]` (what the loader uses: a
12 MB corpus tokenizes in milliseconds instead of seconds), `decode(ids) -> str`, `vocab_size`, and the
special ids `bos_id`, `eos_id`, `pad_id`; and per token `token(id)` (its raw vocabulary form) and
`token_text(id)` (its decoded text, special tokens included), what the Engram token map reads
(`model.engram.compressed_token_map`).

The byte tokenizer needs no file and no download, so every machine can train out of the box, and it can
represent any input exactly: ids 0..255 are the UTF-8 bytes, then BOS = 256, EOS = 257, PAD = 258,
`vocab_size` = 259.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizerModel


class Tokenizer:
    """Common interface; subclasses implement `encode_array`, `decode` and set the ids below."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    chat_template: str | None = None  # a Jinja chat template shipped with the tokenizer (train/data/sft.py)

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` as int64, without special tokens (the loader adds BOS/EOS itself)."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as a list, without special tokens."""
        return self.encode_array(text).tolist()

    def decode(self, ids) -> str:
        """Text of `ids`; special tokens are dropped."""
        raise NotImplementedError

    def token(self, token_id: int) -> str:
        """The raw vocabulary form of one token (special tokens included)."""
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        """The decoded text of one token, special tokens included (U+FFFD for a partial UTF-8 byte)."""
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens. Never fails: unpaired surrogates are written as their UTF-8-like bytes."""

    vocab_size = 259
    bos_id, eos_id, pad_id = 256, 257, 258
    SPECIAL_TOKENS = {256: "<|bos|>", 257: "<|eos|>", 258: "<|pad|>"}

    def encode_array(self, text: str) -> np.ndarray:
        data = text.encode("utf-8", errors="surrogatepass")
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")

    def token(self, token_id: int) -> str:
        """A byte as SentencePiece's byte fallback spells it (``<0xC3>``), a special token by its name."""
        return self.SPECIAL_TOKENS.get(token_id) or f"<0x{token_id:02X}>"

    def token_text(self, token_id: int) -> str:
        return self.token(token_id) if token_id in self.SPECIAL_TOKENS else self.decode([token_id])


# Names tried, in order, when neither `data.<role>_token` nor a `tokenizer_config.json` beside the tokenizer
# names a special token. BOS and PAD fall back to EOS (GPT-2 style): BOS only has to start a document, and
# padding is never attended to or predicted.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|eos|>", "[SEP]", "<|end_of_text|>")
_BOS_NAMES = ("<s>", "<bos>", "<|bos|>", "[CLS]", "<|begin_of_text|>")
_PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
TOKENIZER_CONFIG = "tokenizer_config.json"


class HFTokenizer(Tokenizer):
    """A trained `tokenizers` JSON file; its post-processor (template BOS/EOS) is bypassed."""

    def __init__(self, path: str, bos_token: str | None = None, eos_token: str | None = None,
                 pad_token: str | None = None):
        file = Path(path).expanduser()
        if not file.is_file():
            raise FileNotFoundError(f"tokenizer file {str(file)!r} does not exist")
        self.path = str(file)
        spec = json.loads(file.read_text(encoding="utf-8"))
        config = _sibling_config(file)
        self.chat_template = _chat_template(spec.pop("chat_template", None) or config.get("chat_template"))
        self._tok = HFTokenizerModel.from_str(json.dumps(spec))  # `tokenizers` refuses keys it does not know
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._special(eos_token, config, _EOS_NAMES, None, "eos")
        self.bos_id = self._special(bos_token, config, _BOS_NAMES, self.eos_id, "bos")
        self.pad_id = self._special(pad_token, config, _PAD_NAMES, self.eos_id, "pad")

    def _special(self, name: str | None, config: dict, candidates: tuple[str, ...], fallback: int | None,
                 role: str) -> int:
        """Id of the token ``data.<role>_token`` names, else the one ``tokenizer_config.json`` names, else the first
        known name present, else `fallback`."""
        where = f"data.{role}_token"
        if name is None and _token_text(config.get(f"{role}_token")) is not None:
            name, where = _token_text(config[f"{role}_token"]), f"{role}_token of {self.path}'s tokenizer_config.json"
        for token in (name,) if name is not None else candidates:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        if name is not None:
            raise ValueError(f"{role} token {name!r} ({where}) is not in tokenizer {self.path!r}")
        if fallback is None:
            raise ValueError(f"tokenizer {self.path!r} has none of the {role} tokens {candidates}; "
                             f"set data.{role}_token")
        return fallback

    def token(self, token_id: int) -> str:
        """The text of one token (special tokens included), e.g. for a chat template's ``eos_token``."""
        return self._tok.id_to_token(token_id)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def encode_array(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def _sibling_config(file: Path) -> dict:
    """The ``tokenizer_config.json`` beside the tokenizer file (Hugging Face's layout: its ``chat_template`` and
    special tokens), or {}."""
    config = file.with_name(TOKENIZER_CONFIG)
    return json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}


def _token_text(token) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or an ``AddedToken`` object with its ``content``."""
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(template) -> str | None:
    """A template string; Hugging Face also stores a list of named templates, of which "default" is the chat one."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default", template[0].get("template") if template else None)
    return template


def load_tokenizer(path: str | None = None, bos_token: str | None = None, eos_token: str | None = None,
                   pad_token: str | None = None) -> Tokenizer:
    """The byte tokenizer when `path` is None, else the `tokenizers` JSON at `path`."""
    if path is None:
        return ByteTokenizer()
    return HFTokenizer(path, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token)
