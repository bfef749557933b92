"""What `LLM.generate` returns, shaped like vLLM's `RequestOutput` and `CompletionOutput`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one candidate token at one step, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sample of a request.

    `finish_reason` is "stop" (eos, a stop string or a stop token), "length" (max_tokens or the model length),
    "error" (the request could not run), or None while unfinished. `stop_reason` is the stop string or stop token id
    that ended it (None for eos or length). `logprobs` holds, per generated token, the requested top tokens and the
    sampled one; `cumulative_logprob` sums the sampled tokens' log-probabilities (both None unless asked for).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time() seconds) of one request, and the rates derived from them."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    # Speculative decoding: per draft position i, how many drafts at i were verified and how many accepted.
    drafts_verified: list[int] = field(default_factory=list)
    drafts_accepted: list[int] = field(default_factory=list)

    def count_drafts(self, verified: int, accepted: int) -> None:
        """A step verified drafts 0 .. verified - 1 and accepted the first `accepted` of them."""
        grow = verified - len(self.drafts_verified)
        if grow > 0:
            self.drafts_verified += [0] * grow
            self.drafts_accepted += [0] * grow
        for i in range(verified):
            self.drafts_verified[i] += 1
            self.drafts_accepted[i] += i < accepted

    @property
    def acceptance_rates(self) -> list[float]:
        """Per draft position i, the share of the steps that verified a draft at i which accepted it (and so every
        draft before it)."""
        return [a / v if v else 0.0 for a, v in zip(self.drafts_accepted, self.drafts_verified, strict=True)]

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verifying step gave on average: its accepted drafts plus the target's token after them."""
        steps = self.drafts_verified[0] if self.drafts_verified else 0
        return (steps + sum(self.drafts_accepted)) / steps if steps else None

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token, queueing included."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def total_time(self) -> float | None:
        """Seconds from arrival to the end of the request."""
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens (all samples) per second of the request's own running time, queueing excluded."""
        if self.finished_time is None or self.first_scheduled_time is None:
            return None
        elapsed = self.finished_time - self.first_scheduled_time
        return self.num_generated_tokens / elapsed if elapsed > 0 else None


@dataclass
class RequestOutput:
    """The result of one request: its prompt, its `n` completions, and its metrics.

    `error` holds why the request could not run (then every completion's finish_reason is "error"); `seed` is the
    seed it was sampled with, drawn by the engine when the request gave none, so any run can be reproduced.
    `prompt_logprobs`, when asked for (`SamplingParams.prompt_logprobs`), holds one entry per prompt token: None for
    the first, then the token's own log-probability followed by the most likely ones at its position.
    `num_cached_tokens`: the prompt tokens every sample found in the prefix cache when it first started (0 without
    prefix caching; None for a request that never started): the samples of one request share the prompt's blocks
    besides, which the engine's counters show (`LLMEngine.prefix_cache`).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None
    seed: int | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int | None = None
