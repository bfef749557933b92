"""What the CPU does with sampled tokens (deepinfer/engine/output_processor.py): a sequence's text is the decode of its
outputs when it finishes, decoded at every token only where stop strings are sought in it."""

from __future__ import annotations

from deepinfer.default_model import default_checkpoint
from deepinfer.engine.output_processor import OutputProcessor
from deepinfer.engine.sequence import Sequence
from deepinfer.sampling_params import SamplingParams
from deepinfer.tokenizer import load_tokenizer


class CountingTokenizer:
    """The embedded model's tokenizer, counting the tokens it decodes."""

    def __init__(self) -> None:
        self.inner, self.decoded = load_tokenizer(default_checkpoint()), 0

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        self.decoded += len(ids)
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def run(params: SamplingParams, text: str) -> tuple[Sequence, CountingTokenizer]:
    """`text`'s tokens appended one by one until the processor says done, then finished."""
    tokenizer = CountingTokenizer()
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
