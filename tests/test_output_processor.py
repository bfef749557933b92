"""What the CPU does with sampled tokens (deepinfer/engine/output_processor.py): a sequence's text is the decode of its
outputs when it finishes, decoded at every token only where stop strings are sought in it, and then, under a
byte-level decoder, only from its last whole character on."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from deepinfer.default_model import default_checkpoint
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.sequence import Sequence
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import Tokenizer, load_tokenizer


class CountingTokenizer:
    """The embedded model's tokenizer, counting the tokens it decodes; byte-level as it is, or (`byte_level` False)
    standing for a tokenizer whose decoder is not."""

    def __init__(self, byte_level: bool = False) -> None:
        self.inner, self.decoded = load_tokenizer(default_checkpoint()), 0
        self.byte_level = byte_level and self.inner.byte_level

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def run(params: SamplingParams, text: str, byte_level: bool = False) -> tuple[Sequence, CountingTokenizer]:
    """`text`'s tokens appended one by one until the processor says done, then finished."""
    tokenizer = CountingTokenizer(byte_level)
    processor = OutputProcessor(tokenizer, eos_token_ids=())
    seq = Sequence("r", 0, [1, 2, 3], params, seed=0, max_model_len=4096)
    for token in tokenizer.inner.encode(text):
        if processor.append(seq, token, None):
            break
    processor.finish(seq)
    return seq, tokenizer


def test_a_sequence_without_stop_strings_is_decoded_once_when_it_finishes() -> None:
    text = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n" * 4
    seq, tokenizer = run(SamplingParams(max_tokens=30), text)
    assert len(seq.output_token_ids) == 30 and seq.finish_reason == "length"
    assert seq.text == tokenizer.inner.decode(seq.output_token_ids)
    assert tokenizer.decoded == 30  # once, the whole output: not at every token


def test_stop_strings_are_sought_in_the_text_as_it_grows() -> None:
    text = "def fib(n):\n    return n\n\ndef other():\n    pass\n"
    seq, tokenizer = run(SamplingParams(max_tokens=100, stop=["\n\n"]), text)
    assert seq.finish_reason == "stop" and seq.stop_reason == "\n\n"
    assert seq.text == "def fib(n):\n    return n"
    n = len(seq.output_token_ids)
    assert tokenizer.decoded == n * (n + 1) // 2  # decoded at every token, and not again when it finished


def test_a_byte_level_text_grows_from_its_last_whole_character() -> None:
    """The embedded tokenizer's decoder is byte-level: stop strings found as before, each token decoded about once
    (not the whole output at every token)."""
    text = "def fib(n):\n    return n\n\ndef other():\n    pass\n"
    seq, tokenizer = run(SamplingParams(max_tokens=100, stop=["\n\n"]), text, byte_level=True)
    assert seq.finish_reason == "stop" and seq.stop_reason == "\n\n"
    assert seq.text == "def fib(n):\n    return n"
    assert tokenizer.decoded == len(seq.output_token_ids)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_growing_text_is_the_whole_decode_at_every_token(skip_special_tokens) -> None:
    """Random outputs over the whole vocabulary (byte tokens that cut characters, special tokens, text with
    characters of two to four bytes): after every token the text is the whole output's decode, and the tokens
    decoded stay linear in the output's length."""
    tokenizer = CountingTokenizer(byte_level=True)
    inner = tokenizer.inner
    rng = random.Random(0)
    ids = [rng.randrange(inner.vocab_size) for _ in range(300)]
    ids += inner.encode("naïve café — 数学 🙂 " * 8)
    ids += [rng.randrange(inner.vocab_size) for _ in range(300)]
    processor = OutputProcessor(tokenizer, eos_token_ids=())
    assert processor.byte_level
    params = SamplingParams(max_tokens=4096, stop=["\x00never"], skip_special_tokens=skip_special_tokens)
    seq = Sequence("r", 0, [1], params, seed=0, max_model_len=8192)
    for n, token in enumerate(ids, 1):
        assert not processor.append(seq, token, None)
        assert seq.text == inner.decode(ids[:n], skip_special_tokens=skip_special_tokens), n
    assert tokenizer.decoded < 4 * len(ids)


def test_other_decoders_decode_the_whole_output() -> None:
    """A decoder that may join or strip across tokens (here Metaspace's) is not byte-level: the text is the whole
    output's decode at every token. The embedded tokenizer's is."""
    backend = BackendTokenizer(models.WordLevel({"\u2581a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.decoder = decoders.Metaspace()
    tokenizer = Tokenizer(backend)
    assert not tokenizer.byte_level and load_tokenizer(default_checkpoint()).byte_level
    processor = OutputProcessor(tokenizer, eos_token_ids=())
    assert not processor.byte_level
    seq = Sequence("r", 0, [1], SamplingParams(max_tokens=10, stop=["zz"]), seed=0, max_model_len=64)
    ids = [0, 1, 0, 0, 1]
    for n, token in enumerate(ids, 1):
        processor.append(seq, token, None)
        assert seq.text == backend.decode(ids[:n])
