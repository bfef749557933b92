"""A request: a prompt, its sampling parameters and seed, its `n` sequences, and what it returns.

Prompts are checked at submission; one that cannot run (empty, a token outside the vocabulary, no room under
`max_model_len`) fails alone with a message, before it reaches the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.engine.sequence import Sequence
from deepinfer.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer.sampler import derive_seed
from deepinfer.sampling_params import SamplingParams


class RequestError(ValueError):
    """A request that cannot run (a malformed prompt, a token outside the vocabulary, too long, parameters that are
    not a SamplingParams): it fails alone."""


def check_prompt(ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """Raise RequestError unless `ids` can run: non-empty, in the vocabulary, with room for one more token."""
    if not ids:
        raise RequestError("the prompt is empty: it needs at least one token")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise RequestError(f"the prompt has {len(ids)} tokens, which leaves no room to generate within "
                           f"max_model_len={max_model_len}")


@dataclass
class Request:
    """One submitted prompt. `seqs` is empty for a request that failed at submission (`error` says why)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    error: str | None = None

    def make_sequences(self, max_model_len: int) -> list[Sequence]:
        """The request's `n` samples; sample i is seeded `derive_seed(seed, i)`."""
        self.seqs = [Sequence(self.request_id, i, self.prompt_token_ids, self.params, derive_seed(self.seed, i),
                              max_model_len) for i in range(self.params.n)]
        return self.seqs

    @property
    def is_finished(self) -> bool:
        return self.error is not None or all(s.is_finished for s in self.seqs)

    def output(self) -> RequestOutput:
        """The vLLM-shaped result; every completion's finish_reason is "error" when the request failed."""
        if self.error is not None:
            outputs = [CompletionOutput(index=i, text="", token_ids=[], finish_reason="error")
                       for i in range(self.params.n)]
        else:
            outputs = [CompletionOutput(index=s.index, text=s.text, token_ids=s.output_token_ids,
                                        cumulative_logprob=s.cumulative_logprob, logprobs=s.logprobs,
                                        finish_reason=s.finish_reason, stop_reason=s.stop_reason) for s in self.seqs]
        started = [s.num_cached_tokens for s in self.seqs if s.num_cached_tokens is not None]
        return RequestOutput(request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
                             outputs=outputs, finished=True, metrics=self.metrics, error=self.error, seed=self.seed,
                             num_cached_tokens=min(started) if started else None)
