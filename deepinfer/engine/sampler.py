"""The engine's sampler: a step's tokens from its logits, one draw per sampling row, read back once for the step.

Each row's token is `deepinfer.sampler.sample`'s, so it depends on its logits, seed and position only. Rows that
`sample` would draw from their logits alone (`plain_greedy`, `plain_sampled`: nothing adjusting or cutting them, no
log-probabilities) are drawn together by `sample_plain`, every row of the step in one call and one read back; the
others, and every row of a step under a token constraint's mask, go through `sample` one row at a time. A logits
processor (a penalty, a ban, a bias) joins `adjust_logits` in deepinfer/sampler.py, and `adjusts_logits` says for
which rows it acts: those rows then take the per-row path here, the others keep the batched draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.outputs import Logprob
from deepinfer.sampler import plain_greedy, plain_sampled, sample, sample_plain, top_logprobs
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsl.context import SequenceState

# A row's tokens of a step and, per token, its log-probabilities (None where not asked for).
Tokens = tuple[list[int], list[dict[int, Logprob] | None]]


@dataclass
class SampleRow:
    """What sampling one row needs. `output_token_ids` are the outputs seen on the CPU when the step was scheduled;
    the one the previous step sampled follows them when `num_pending` is 1."""

    seq_id: int
    request_id: str
    index: int
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_pending: int


@dataclass(slots=True)
class Draw:
    """One sequence's sampling in a step: its `row`, its `outputs` so far (the previous step's token included), the
    `drafts` it fed after its last token (speculative decoding; none otherwise), its `first` row in the step's
    logits (1 + len(drafts) rows: after its last token, then after each draft) and its `state` after the forward."""

    row: SampleRow
    outputs: list[int]
    drafts: list[int]
    first: int
    state: SequenceState

    @property
    def position(self) -> int:
        """The sequence position of the token drawn from its first logits row."""
        return len(self.row.prompt_token_ids) + len(self.outputs)


class Sampler:
    """`sampler(logits, allowed, draws)`: each draw's token from logits [rows, vocab] (one row per draw, at
    `draw.first`) under `allowed`, the token constraint's masks (bool [draws, vocab], or None for none)."""

    def __init__(self, eos_token_ids: tuple[int, ...]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, allowed: torch.Tensor | None, draws: list[Draw]) -> list[Tokens]:
        picks = self.picks(logits, draws) if allowed is None else None
        out = []
        for j, d in enumerate(draws):
            if picks is not None and picks[j] is not None:
                out.append((picks[j], [None]))
            else:
                token, logprobs = self.token(logits[d.first], None if allowed is None else allowed[j], d.row,
                                             d.outputs)
                out.append(([token], [logprobs]))
        return out

    def picks(self, logits: torch.Tensor, draws: list[Draw]) -> list[list[int] | None] | None:
        """Every logits row of each draw (1 + len(drafts) of them, position after position) as `sample` picks it
        there, for the draws whose tokens `sample_plain` can draw; None for the others, which `token` samples.
        One `sample_plain` call and one read back for the whole step; None when no draw is plain."""
        num_rows, vocab = logits.shape
        temperatures, seeds, positions = [0.0] * num_rows, [0] * num_rows, [0] * num_rows  # temperature 0: argmax
        plain = [False] * len(draws)
        for j, d in enumerate(draws):
            params, num_outputs = d.row.params, len(d.outputs)
            if plain_greedy(params, num_outputs):
                plain[j] = True
            elif plain_sampled(params, num_outputs, vocab):
                plain[j] = True
                for k in range(1 + len(d.drafts)):
                    i = d.first + k
                    temperatures[i], seeds[i], positions[i] = params.temperature, d.row.seed, d.position + k
        if not any(plain):
            return None
        tokens = sample_plain(logits, temperatures, seeds, positions).tolist()
        return [tokens[d.first: d.first + 1 + len(d.drafts)] if p else None for d, p in zip(draws, plain, strict=True)]

    def token(self, logits: torch.Tensor, allowed: torch.Tensor | None, row: SampleRow,
              seen: list[int]) -> tuple[int, dict[int, Logprob] | None]:
        """`sample`'s token from one position's logits [vocab] under `allowed` [vocab] (None: every token), after
        the outputs `seen`; with its log-probabilities, of the raw logits, when the row asks for them."""
        params = row.params
        masked = logits if allowed is None else logits.masked_fill(~allowed, float("-inf"))
        token = sample(masked, params, row.seed, len(row.prompt_token_ids) + len(seen), seen, row.prompt_token_ids,
                       self.eos_token_ids)
        logprobs = top_logprobs(logits, token, params.logprobs) if params.logprobs is not None else None
        return token, logprobs
