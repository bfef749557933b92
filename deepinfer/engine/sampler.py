"""The engine's sampler: a step's tokens from its logits, one draw per sampling row, read back once for the step.

Each row's token is `deepinfer.sampler.sample`'s, so it depends on its logits, seed and position only. Rows that
`sample` would draw from their logits alone (`plain_greedy`, `plain_sampled`: nothing adjusting or cutting them, no
log-probabilities) are drawn together by `sample_plain`, every row of the step in one call and one read back; the
others, and every row of a step under a token constraint's mask, go through `sample` one row at a time. A step whose
every row is plain can leave its tokens on the device (`draw`): `SampledIds` copies them to the host without
waiting, and the next step feeds them to its placeholders on the device, so the host prepares that step while this
one runs. A logits processor (a penalty, a ban, a bias) joins `adjust_logits` in deepinfer/sampler.py, and
`adjusts_logits` says for which rows it acts: those rows then take the per-row path here, the others keep the
batched draw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from deepinfer.engine.sequence import Outputs
from deepinfer.outputs import Logprob
from deepinfer.sampler import plain_greedy, plain_sampled, sample, sample_plain, top_logprobs
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsl.context import SequenceState

# A row's tokens of a step and, per token, its log-probabilities (None where not asked for).
Tokens = tuple[list[int], list[dict[int, Logprob] | None]]


@dataclass
class SampleRow:
    """What sampling one row needs. `output_token_ids` are the outputs seen on the CPU when the step was scheduled
    (read in place: deepinfer.engine.sequence.Outputs; a list given is taken whole); the one the previous step sampled
    follows them when `num_pending` is 1."""

    seq_id: int
    request_id: str
    index: int
    params: SamplingParams
    seed: int
    prompt_token_ids: list[int]
    output_token_ids: Outputs
    num_pending: int

    def __post_init__(self) -> None:
        if not isinstance(self.output_token_ids, Outputs):
            tokens = list(self.output_token_ids)
            self.output_token_ids = Outputs(tokens, len(tokens))


@dataclass(slots=True)
class Draw:
    """One sequence's sampling in a step: its `row`, its `outputs` so far (the previous step's token included), the
    `drafts` it fed after its last token (speculative decoding; none otherwise), its `first` row in the step's
    logits (1 + len(drafts) rows: after its last token, then after each draft) and its `state` after the forward."""

    row: SampleRow
    outputs: Outputs
    drafts: list[int]
    first: int
    state: SequenceState

    @property
    def position(self) -> int:
        """The sequence position of the token drawn from its first logits row."""
        return len(self.row.prompt_token_ids) + len(self.outputs)


class SampledIds:
    """A step's drawn tokens: int64 [R] on the device at once (`ids`, which the next step may feed to its inputs there),
    and on the host once a copy queued behind them is done (`tolist` waits for it; `ready` says whether it would)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids
        self._list: list[int] | None = None
        if ids.is_cuda:
            self._host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._copied: torch.cuda.Event | None = torch.cuda.Event()
            self._copied.record()
        else:
            self._host, self._copied = ids, None

    def ready(self) -> bool:
        return self._list is not None or self._copied is None or self._copied.query()

    def tolist(self) -> list[int]:
        if self._list is None:
            if self._copied is not None:
                self._copied.synchronize()
            self._list = self._host.tolist()
        return self._list


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

    @staticmethod
    def is_plain(params: SamplingParams, num_outputs: int, vocab_size: int) -> bool:
        """Whether `sample_plain` draws a row of these params after `num_outputs` outputs as `sample` would."""
        return plain_greedy(params, num_outputs) or plain_sampled(params, num_outputs, vocab_size)

    def picks(self, logits: torch.Tensor, draws: list[Draw]) -> list[list[int] | None] | None:
        """Every logits row of each draw (1 + len(drafts) of them, position after position) as `sample` picks it
        there, for the draws whose tokens `sample_plain` can draw; None for the others, which `token` samples.
        One `sample_plain` call and one read back for the whole step; None when no draw is plain."""
        plain = [self.is_plain(d.row.params, len(d.outputs), logits.shape[1]) for d in draws]
        if not any(plain):
            return None
        tokens = self._draw_plain(logits, draws, plain).tolist()
        return [tokens[d.first: d.first + 1 + len(d.drafts)] if p else None for d, p in zip(draws, plain, strict=True)]

    def draw(self, logits: torch.Tensor, draws: list[Draw]) -> SampledIds:
        """Every logits row's token (a row no draw owns: its argmax), for draws that are all plain (`is_plain`),
        left on the device: `SampledIds`."""
        return SampledIds(self._draw_plain(logits, draws, [True] * len(draws)))

    @staticmethod
    def plain_rows(num_rows: int, draws: list[Draw], plain: list[bool]) -> tuple[list[float], list[int], list[int]]:
        """`sample_plain`'s temperatures, seeds and positions for `num_rows` logits rows: the plain draws' rows at
        their params, every other row greedy (temperature 0)."""
        temperatures, seeds, positions = [0.0] * num_rows, [0] * num_rows, [0] * num_rows
        for d, p in zip(draws, plain, strict=True):
            params = d.row.params
            if p and not params.is_greedy:
                for k in range(1 + len(d.drafts)):
                    i = d.first + k
                    temperatures[i], seeds[i], positions[i] = params.temperature, d.row.seed, d.position + k
        return temperatures, seeds, positions

    def _draw_plain(self, logits: torch.Tensor, draws: list[Draw], plain: list[bool]) -> torch.Tensor:
        """`sample_plain` over every logits row: the plain draws' rows at their params, every other row greedy."""
        return sample_plain(logits, *self.plain_rows(logits.shape[0], draws, plain))

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
