"""Matchers on the real V4 tokenizer: the vocabulary handed to xgrammar (sizes, added tokens), accept, rollback,
and the mask rows of drafts."""

from __future__ import annotations

import pytest
import torch

from deepinfer.structured_outputs import StructuredOutputsParams
from deepinfer.structured_outputs.bitmask import allocate_bitmask, unpack_bitmask
from deepinfer.structured_outputs.compiler import GrammarCompiler
from deepinfer.structured_outputs.matcher import RequestMatcher
from deepinfer.structured_outputs.tokenizer_info import build_tokenizer_info
from deepinfer.tokenizer import load_tokenizer

VOCAB = 129280  # the model head's and (here) the tokenizer's
EOS = 1
ANY_TEXT = StructuredOutputsParams(regex=r"[^\x00]{0,40}")  # almost anything: shows which ids can ever be allowed


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _allowed(matcher: RequestMatcher, vocab: int) -> torch.Tensor:
    bitmask = allocate_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask)
    return unpack_bitmask(bitmask, vocab)[0]  # bool [vocab]


def _matcher(tokenizer, params: StructuredOutputsParams, vocab: int = VOCAB) -> RequestMatcher:
    return RequestMatcher(GrammarCompiler(build_tokenizer_info(tokenizer, vocab, [EOS])).compile(params))


def test_added_tokens_are_never_allowed_but_eos_ends(tokenizer) -> None:
    allowed = _allowed(_matcher(tokenizer, ANY_TEXT), VOCAB)
    added = sorted(set(tokenizer.backend.get_added_tokens_decoder()) - {EOS})  # specials and chat markers
    assert len(added) > 1000 and not allowed[added].any()
    assert allowed[EOS]  # the empty string matches: eos may end it at once
    assert allowed.sum() > 100_000  # and nearly every ordinary token is allowed


@pytest.mark.parametrize("head", [VOCAB + 37, VOCAB - 280])  # a padded head; a head short of the tokenizer's end
def test_the_mask_follows_the_heads_vocabulary(tokenizer, head: int) -> None:
    allowed = _allowed(_matcher(tokenizer, ANY_TEXT, head), head)
    assert allowed.shape == (head,)
    assert not allowed[VOCAB:].any()  # padding rows of the head have no text: never allowed
    assert allowed[EOS] and allowed[:min(head, VOCAB)].sum() > 100_000
    assert allowed[127800:128000].sum() >= 195  # the last ordinary (not added) tokens keep their ids


def test_stop_tokens_outside_the_head_raise(tokenizer) -> None:
    with pytest.raises(ValueError, match="need a stop token inside the vocabulary"):
        build_tokenizer_info(tokenizer, 1000, [129000])


def test_accept_terminate_rollback(tokenizer) -> None:
    matcher = _matcher(tokenizer, StructuredOutputsParams(choice=["ab", "abc"]))
    a, b, c = (tokenizer.encode(ch)[0] for ch in "abc")
    assert not matcher.accept(c) and matcher.num_tokens == 0  # refused: state unchanged
    assert matcher.accept(a) and matcher.accept(b)
    allowed = _allowed(matcher, VOCAB)
    assert allowed[EOS] and allowed[c] and allowed.sum() == 2  # "ab" may end, or go on to "abc"
    assert matcher.accept(EOS) and matcher.is_terminated() and matcher.num_tokens == 3
    assert not matcher.accept(c)
    assert _allowed(matcher, VOCAB).all()  # a finished matcher leaves its row open
    matcher.rollback(1)
    assert not matcher.is_terminated() and matcher.accept(c) and matcher.accept(EOS) and matcher.is_terminated()
    with pytest.raises(ValueError, match="cannot roll back 5 tokens: 4 accepted"):
        matcher.rollback(5)


def test_draft_rows_match_sequential_fills_and_leave_the_state(tokenizer) -> None:
    matcher = _matcher(tokenizer, StructuredOutputsParams(regex=r"[a-c]{2,4}"))
    a, b, x = (tokenizer.encode(ch)[0] for ch in "abx")
    bitmask = allocate_bitmask(6, VOCAB)
    assert matcher.fill_draft_bitmask(bitmask, 1, [a, b, x, a]) == 2  # x breaks the grammar
    expected = [_allowed(matcher, VOCAB)]
    for token in (a, b):
        matcher.accept(token)
        expected.append(_allowed(matcher, VOCAB))
    matcher.rollback(2)
    rows = unpack_bitmask(bitmask, VOCAB)
    for i in range(3):
        assert torch.equal(rows[1 + i], expected[i])
    assert rows[4].all() and rows[5].all()  # past the refused draft: discarded by verification, left open
    assert matcher.num_tokens == 0 and torch.equal(_allowed(matcher, VOCAB), expected[0])
