"""What the CPU does with a sampled token: record it, detokenize, and decide whether its sequence is done.

A sequence stops ("stop") at eos (unless `ignore_eos`), at a stop token id, or once its text holds a stop string
(trimmed there, or after it with `include_stop_str_in_output`); it ends ("length") at `max_tokens` or at the
model length. Stop strings are sought only where the new token could have completed one, as vLLM does.

A sequence with stop strings has its text decoded as it grows (each token may complete one); any other is decoded once,
when it finishes (`finish`): decoding the whole output at every token costs O(length) a step, which long completions
of many sequences would pay on the host each step. Where the tokenizer's decoder is byte-level (the text of a token
list is the UTF-8 of its tokens' bytes in order, undecodable bytes replaced), a growing text is decoded from the
last output where the text so far ended on a whole character (`Sequence.decoded`): past such a point the bytes
decode alone to what they decode to after it. Other decoders (which may strip, join or merge across tokens) decode
the whole output each token.
"""

from __future__ import annotations

from deepinfer.engine.sequence import Sequence
from deepinfer.outputs import Logprob

REPLACEMENT = "\ufffd"  # what undecodable bytes (a character cut between tokens among them) decode to


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer, self.eos_token_ids = tokenizer, eos_token_ids
        self._texts: dict[int, str] = {}  # id -> its text (special tokens spelled out), for log-probabilities
        self.byte_level = tokenizer.byte_level  # texts grow by their new outputs' text (deepinfer/tokenizer.py)

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def append(self, seq: Sequence, token: int, logprobs: dict[int, Logprob] | None) -> bool:
        """Record `token` (sampled with `logprobs`) as the next output of `seq`; True when `seq` is now done."""
        params = seq.params
        seq.output_token_ids.append(token)
        if logprobs is not None:
            for tid, lp in logprobs.items():
                lp.decoded_token = self._token_text(tid)
            seq.logprobs.append(logprobs)
            seq.cumulative_logprob += logprobs[token].logprob
        if params.stop:  # the text as it grows: the new token may complete a stop string
            search_from = max(0, len(seq.text) - max(len(x) for x in params.stop) + 1)
            seq.text = self._grown_text(seq)
        if token in self.eos_token_ids and not params.ignore_eos:
            seq.finish_reason = "stop"
        elif token in params.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif params.stop and len(seq.output_token_ids) >= params.min_tokens and self._find_stop(seq, search_from):
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= seq.max_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None

    def finish(self, seq: Sequence) -> None:
        """`seq` is done: its text, decoded once here where no stop string had it decoded as it grew."""
        if not seq.params.stop:
            seq.text = self._decode(seq)

    def _decode(self, seq: Sequence, start: int = 0) -> str:
        return self.tokenizer.decode(seq.output_token_ids[start:] if start else seq.output_token_ids,
                                     skip_special_tokens=seq.params.skip_special_tokens)

    def _grown_text(self, seq: Sequence) -> str:
        """`seq`'s text with its newest output: under a byte-level decoder, the text up to `seq.decoded`'s output
        and the decode of the outputs after it (which becomes the new point when it ends on a whole character);
        under others, the whole output decoded."""
        if not self.byte_level:
            return self._decode(seq)
        upto, text = seq.decoded
        text += self._decode(seq, upto)
        if not text.endswith(REPLACEMENT):  # whole characters: the bytes after these decode on their own
            seq.decoded = (len(seq.output_token_ids), text)
        return text

    @staticmethod
    def _find_stop(seq: Sequence, start: int) -> bool:
        """End `seq` at the earliest stop string in its text from `start` (trimmed there, or after it if asked)."""
        params = seq.params
        hits = [(at, stop) for stop in params.stop if (at := seq.text.find(stop, start)) >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        seq.text = seq.text[: at + len(stop)] if params.include_stop_str_in_output else seq.text[:at]
        seq.stop_reason = stop
        return True
