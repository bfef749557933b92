"""A byte-level BPE tokenizer for Python source, trained with the `tokenizers` package.

Special tokens come first, so their ids are fixed: `<|bos|>` 0, `<|eos|>` 1 (end of document), `<|pad|>` 2 (also
Engram's pad) and `<|noise|>` 3 (DSpark's noise id). `tokenizer_config.json` names bos, eos and pad, which is where
deepinfer/tokenizer.py reads them. The engine adds no BOS to prompts, so the tokenizer adds none either.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|noise|>")
BOS, EOS, PAD, NOISE = SPECIAL_TOKENS


def train_tokenizer(texts: list[str], vocab_size: int, out: Path | None = None) -> Tokenizer:
    """Train on `texts`; with `out`, write tokenizer.json and tokenizer_config.json there."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    for i, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i, (token, tokenizer.token_to_id(token))
    if out is not None:
        save_tokenizer(tokenizer, Path(out))
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
              "additional_special_tokens": [NOISE], "add_bos_token": False, "add_eos_token": False,
              "model_max_length": 1048576, "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
