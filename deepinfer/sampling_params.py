"""Per-request sampling parameters, with vLLM's names and meanings so users' scripts carry over."""

from __future__ import annotations

import math
from dataclasses import dataclass

from deepinfer.structured_outputs.params import StructuredOutputsParams

# Below this temperature sampling is greedy, as in vLLM: dividing logits by a tiny temperature only overflows.
GREEDY_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    """How to sample the completions of one request.

    Fields as in vLLM: `n` independent samples; `temperature` (0 = greedy); `top_p`, `top_k` (0 or -1 = off) and
    `min_p` restrict the support; `seed` makes sampling reproducible (None: the engine draws one and reports it);
    `stop` strings and `stop_token_ids` end a completion, as does the model's eos unless `ignore_eos`;
    `max_tokens` (None = up to the model length) and `min_tokens` bound its length; `logprobs` asks for that many
    top log-probabilities per generated token, after the sampled token's own (-1: the whole vocabulary), and
    `prompt_logprobs` as many per prompt token (the first has none); `presence_penalty`, `frequency_penalty` (in
    [-2, 2], over the generated tokens) and `repetition_penalty` (> 0, over prompt and generated tokens; 1 = off)
    reshape the logits, as do `logit_bias` ({token id: bias added to its logit}), `allowed_token_ids` (only these
    may be sampled) and `bad_words` (words whose last token is banned wherever the output so far ends with the
    rest of the word, the word spelled with and without a leading space; deepinfer/logits_processors.py).
    `structured_outputs` constrains the completion to a JSON schema, regex, grammar or choice.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or an integer >= 1, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < -1):  # -1: the whole vocabulary
                raise ValueError(f"{name} must be an integer >= 0, -1 (the whole vocabulary) or None, got {value!r}")
        self._check_processors()
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a number > 0 (1 = off), got {self.repetition_penalty!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                # ValueError as for every other bad field (vLLM's choice too), so callers catch one type
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")  # noqa: TRY004
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams or None, "
                             f"got {type(self.structured_outputs).__name__}")
        if self.structured_outputs is not None and (self.stop or self.stop_token_ids):
            # A stop inside the constrained text would end it short of its grammar, reported as "stop".
            raise ValueError("stop and stop_token_ids do not combine with structured_outputs: the grammar decides "
                             "where a constrained completion ends, and a stop string or token inside it would cut the "
                             "output short of its schema, regex or grammar")

    def _check_processors(self) -> None:
        """logit_bias, allowed_token_ids and bad_words; ids are checked against the vocabulary at submission."""
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r:.80}")
            bias = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.isdigit() else key  # JSON keys are strings
                if not _is_int(token) or token < 0 or not _is_real(value):
                    raise ValueError(f"logit_bias must be a dict of token ids (integers >= 0) to finite numbers, got "
                                     f"{key!r}: {value!r}")
                bias[token] = float(value)
            self.logit_bias = bias
        ids = self.allowed_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r:.80}")
            self.allowed_token_ids = list(ids)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {words!r:.80}")
            self.bad_words = list(words)

    @staticmethod
    def _check_stop(stop: str | list[str] | None) -> list[str]:
        if stop is None:
            return []
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
        return list(stops)

    @staticmethod
    def _check_stop_token_ids(ids: list[int] | None) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be a list of integers >= 0, got {ids!r}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        """True when sampling picks the argmax (temperature 0, or below 1e-5 as in vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE
