"""xgrammar's view of our tokenizer: each id's text, sized to the model's head rather than to the tokenizer.

The tokenizer and the model's head may differ in size. The bitmask has one bit per logit, so the vocabulary handed
to xgrammar is the head's: ids past the tokenizer's end (padding rows of the head) get an empty text, which xgrammar
never allows; tokenizer ids past the head's end are dropped, since the model cannot emit them.

Added tokens (the special and chat-control tokens, `<｜User｜>` and the like) get an empty text too, so a constraint
never places one inside its text: their text would not survive decoding with skip_special_tokens, and the model
should not emit control markers inside a JSON string. The stop tokens (eos) are passed apart and stay allowed where
the grammar can end.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import xgrammar as xgr
from transformers import PreTrainedTokenizerFast

from deepinfer.tokenizer import Tokenizer


@lru_cache(maxsize=4)
def vocab_encoding(tokenizer: Tokenizer) -> tuple[xgr.VocabType, bool]:
    """(vocab type, add_prefix_space) of the tokenizer, as xgrammar detects them from its Hugging Face form.

    Byte-level (GPT-2 style, the V4 tokenizer), byte-fallback (SentencePiece style) or raw: how a token's text
    spells its bytes. Cached per tokenizer object: the detection reads the whole vocabulary (about a second).
    """
    # only the detected encoding is kept, so any stop id does (passing one spares xgrammar guessing, and its warning)
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend),
                                              stop_token_ids=[0])
    return info.vocab_type, info.add_prefix_space


def encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Token texts by id for ids [0, vocab_size): "" for added tokens and for ids the tokenizer lacks."""
    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()  # {id: AddedToken}
    vocab = [""] * vocab_size
    for text, token_id in backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size and token_id not in added:
            vocab[token_id] = text
    return vocab


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """The xgrammar TokenizerInfo for a model whose head has `vocab_size` rows and which stops at `stop_token_ids`.

    Stop ids outside the head are dropped; at least one must remain, or no constrained completion could end.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    stops = sorted({int(t) for t in stop_token_ids if 0 <= int(t) < vocab_size})
    if not stops:
        raise ValueError(f"structured outputs need a stop token inside the vocabulary [0, {vocab_size}), "
                         f"got {list(stop_token_ids)}")
    vocab_type, add_prefix_space = vocab_encoding(tokenizer)
    return xgr.TokenizerInfo(encoded_vocab(tokenizer, vocab_size), vocab_type, vocab_size=vocab_size,
                             stop_token_ids=stops, add_prefix_space=add_prefix_space)
