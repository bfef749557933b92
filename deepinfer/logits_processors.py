"""A request's own logits processors, with vLLM's meanings: `allowed_token_ids`, `bad_words` and `logit_bias`.

They run on a row's logits before the penalties and the temperature, in vLLM's order: every token outside
`allowed_token_ids` banned, then each bad word's last token banned where the outputs so far end with the rest of the
word, then each `logit_bias` added. A bad word is tokenized as written (its leading spaces stripped) and with one
leading space, as it would appear at the start of the text and after a word; a word of one token is banned outright.
Like the rest of the sampler they depend only on the row's logits and tokens, so a request's outputs still do not
depend on its batch. `resolve` checks the ids against the vocabulary and tokenizes the bad words once, when the
request is submitted.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.sampling_params import SamplingParams

_BAD_WORD_IDS = "_bad_words_token_ids"  # where `resolve` keeps the tokenized bad words, on the params object


def acts(params: SamplingParams) -> bool:
    """Whether any of the request's processors changes its logits (then rows leave the batched draws)."""
    return bool(params.allowed_token_ids or params.bad_words or params.logit_bias)


def resolve(params: SamplingParams, tokenizer, vocab_size: int) -> None:
    """Check the request's token ids against the vocabulary and tokenize its bad words; ValueError names a bad id."""
    for name, ids in (("allowed_token_ids", params.allowed_token_ids or ()), ("logit_bias", params.logit_bias or {})):
        outside = [t for t in ids if t >= vocab_size]
        if outside:
            raise ValueError(f"{name} holds token id {outside[0]}, outside the vocabulary [0, {vocab_size})")
    if params.bad_words and getattr(params, _BAD_WORD_IDS, None) is None:
        setattr(params, _BAD_WORD_IDS, bad_words_token_ids(params.bad_words, tokenizer))


def bad_words_token_ids(words: Sequence[str], tokenizer) -> list[list[int]]:
    """Each word's token ids as written and after a space, without repeats."""
    found: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = list(tokenizer.encode(text))
            if ids and ids not in found:
                found.append(ids)
    return found


def apply(logits: torch.Tensor, params: SamplingParams, output_token_ids: Sequence[int]) -> torch.Tensor:
    """The processors on one row of logits [V] (float64): a new tensor, or `logits` itself when none acts."""
    if not acts(params):
        return logits
    logits = logits.clone()
    if params.allowed_token_ids:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[torch.as_tensor(params.allowed_token_ids, dtype=torch.int64, device=logits.device)] = True
        logits.masked_fill_(~keep, float("-inf"))
    if params.bad_words:
        banned = banned_by_bad_words(getattr(params, _BAD_WORD_IDS), output_token_ids)
        if banned:
            logits[torch.as_tensor(banned, dtype=torch.int64, device=logits.device)] = float("-inf")
    if params.logit_bias:
        ids = torch.as_tensor(list(params.logit_bias), dtype=torch.int64, device=logits.device)
        logits[ids] += torch.as_tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    return logits


def banned_by_bad_words(words: list[list[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The last token of each bad word whose other tokens end `output_token_ids`."""
    outputs = list(output_token_ids)
    banned = []
    for ids in words:
        prefix = ids[:-1]
        if len(prefix) <= len(outputs) and outputs[len(outputs) - len(prefix):] == prefix:
            banned.append(ids[-1])
    return banned
