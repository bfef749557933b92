"""The token constraint: per-sequence allowed tokens (structured outputs), the hook the engine calls each step.

The engine holds one or None (no constraint). It calls `submit` when a sequence arrives and `is_ready` before the
scheduler admits it (so a constraint still being prepared holds back its own sequence and no other), and, when every
unfinished sequence is held so, blocks in `wait_ready`. The model runner calls the rest on the device side, in step
order on one thread, so the constraint always sees the tokens of the step before, asynchronous scheduling or not.
"""

from __future__ import annotations

from typing import Protocol

import torch

from deepinfer.engine.sampler import SampleRow
from deepinfer.sampling_params import SamplingParams


class TokenConstraint(Protocol):
    """Masks are bool [positions, vocab] (True = allowed) or a packed int32 bitmask [positions, ceil(vocab / 32)] (bit
    v % 32 of word v // 32); each mask row a sequence can reach must allow a token."""

    def submit(self, seq_id: int, params: SamplingParams) -> None:
        """A sequence arrives: start preparing its constraint (compiling a grammar) off the critical path; a
        sequence its params leave unconstrained needs nothing."""

    def is_ready(self, seq_id: int) -> bool:
        """Whether the sequence may be scheduled; never blocks."""

    def wait_ready(self, timeout: float) -> bool:
        """Block until a sequence held back may become ready, or `timeout` seconds; False at once when none is
        being prepared (nothing to wait for)."""

    def constrains(self, row: SampleRow) -> bool:
        """Whether the constraint masks or reads this row's tokens. A step none of whose rows it constrains calls
        neither `fill` nor `accept`, so its tokens may stay on the device (deepinfer/engine/model_runner.py)."""

    def fill(self, rows: list[SampleRow], drafts: list[list[int]]) -> torch.Tensor | None:
        """Once per step, after the forward is launched: a mask for the positions about to be sampled,
        1 + len(drafts[i]) rows for row i (the position after its last token, then after each of its drafts in
        turn); None when no row is constrained."""

    def accept(self, rows: list[SampleRow], tokens: list[list[int]]) -> dict[int, str | None] | None:
        """After sampling, with each row's tokens of the step in order: the sequences the constraint ends, by seq_id
        (None for none): None when the constraint is complete (the sequence stops there, finish_reason "stop"), or a
        message when it failed (the request fails alone, finish_reason "error")."""

    def fill_next(self, rows: list[SampleRow], drafts: list[list[int]]) -> torch.Tensor | None:
        """While drafts are proposed: one mask row per row, the tokens allowed after its accepted tokens followed by
        `drafts[i]`; a row allowing nothing says those drafts end or break the constraint."""

    def finish(self, seq_ids: list[int]) -> None:
        """The sequences will not be sampled again: forget them."""
