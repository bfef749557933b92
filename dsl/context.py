"""Per-forward context and per-sequence state, read by the ops that look across tokens.

A forward runs over the flat concatenation of one chunk of tokens from each of several sequences. The ops
that attend, pool or hash across tokens need to know where each chunk lies, at which positions, and where the
sequence's caches from earlier forwards live: its slot and block table in a `PagedCache` (dsl/cache.py), or,
for a state made without one, tensors of its own (dsl/unpaged_cache.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dsl.cache import PagedCache
from dsl.unpaged_cache import UNPAGED, UnpagedCache


@dataclass
class SequenceState:
    """What one sequence carries between forwards: its length so far and where its caches live.

    With `cache` set, the sequence owns slot `slot` of the pools and `block_table[i]` is the block holding positions
    i * block_size .. (i + 1) * block_size - 1 of every compressed cache; the pools' owner fills the table before a
    forward reaches those positions. Without, the caches are tensors in `caches`.
    """

    num_tokens: int = 0
    cache: PagedCache | None = None
    slot: int = 0
    block_table: list[int] = field(default_factory=list)
    caches: dict[str, Any] = field(default_factory=dict)

    @property
    def storage(self) -> PagedCache | UnpagedCache:
        """Where the cache ops read and write this sequence's caches."""
        return UNPAGED if self.cache is None else self.cache


@dataclass
class Chunk:
    state: SequenceState
    start: int  # first row of this chunk in the forward's flat token dim
    length: int

    @property
    def start_pos(self) -> int:
        return self.state.num_tokens

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


class ForwardContext:
    """One forward's layout: chunks, absolute positions [N], and which rows need logits."""

    def __init__(self, states: list[SequenceState], lengths: list[int], device: torch.device | str = "cpu",
                 logit_rows: torch.Tensor | None = None) -> None:
        self.chunks: list[Chunk] = []
        start = 0
        for state, length in zip(states, lengths, strict=True):
            self.chunks.append(Chunk(state, start, length))
            start += length
        self.num_tokens = start
        self.positions = torch.cat(
            [torch.arange(c.start_pos, c.start_pos + c.length, dtype=torch.long) for c in self.chunks]
        ).to(device) if self.chunks else torch.zeros(0, dtype=torch.long, device=device)
        self.logit_rows = logit_rows

    def commit(self) -> None:
        """Advance every sequence past the tokens of this forward; call once, after the forward."""
        for c in self.chunks:
            c.state.num_tokens += c.length
