"""The seam speculative decoding plugs into: one object the scheduler and the model runner are given (None: off).

A sequence's proposal (drafts for its next step) comes back to the CPU with its step's tokens and waits on the
sequence. Each step the scheduler asks the speculator which of them each decoding sequence verifies (`plan`); those
drafts follow the sequence's last token in its chunk, and the forward returns logits after each of them. The model
runner hands the step's logits to the speculator to sample in the sampler's place (`verify`: a sequence gains the
drafts it accepts and one token more, and its rejected positions are taken back), then asks it for every sampled
sequence's next proposal (`propose`). A preempted sequence drops its proposal; `forget` tells the speculator which
sequences' caches were released.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from deepinfer.engine.sampler import Draw, Tokens

if TYPE_CHECKING:
    from deepinfer.engine.sequence import Sequence
    from deepinfer.engine.token_constraint import TokenConstraint


@dataclass
class Proposal:
    """A sequence's drafts for its next step and the confidence of each: the proposer's estimate that the draft is
    accepted, given the ones before it are."""

    tokens: list[int]
    confidences: list[float]


class Speculator(Protocol):
    """`num_speculative_tokens`: the most drafts a sequence verifies in a step (its caches keep that many positions
    more, so that rejected ones can be taken back)."""

    num_speculative_tokens: int

    def plan(self, decoding: list[Sequence], budget: int) -> dict[int, list[int]]:
        """The drafts each of `decoding` (running sequences that feed one token this step) verifies, by seq_id
        (those with none left out), within the step's `budget` of tokens."""

    def verify(self, logits: torch.Tensor, allowed: torch.Tensor | None, draws: list[Draw]) -> list[Tokens]:
        """Each draw's tokens: its drafts up to the first the target's token differs from, then the target's token,
        each sampled as the sampler would; logits [rows, vocab] as the runner's sampler gets them, `allowed` the
        token constraint's mask rows, 1 + len(draw.drafts) per draw in order (None: no mask). Takes the rejected
        drafts' positions back from each state."""

    def propose(self, draws: list[Draw], tokens: list[list[int]],
                constraint: TokenConstraint | None) -> dict[int, Proposal]:
        """The next step's proposal of each draw's sequence, by seq_id, after it gained `tokens` this step;
        within what `constraint` allows (its `fill_next`), when there is one."""

    def forget(self, seq_ids: list[int]) -> None:
        """The sequences' caches were released (finished or preempted): drop what is kept for them."""
