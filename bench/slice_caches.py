"""Where the slice benchmark's sequences keep their caches: pools shared by all, as the engine keeps them, or tensors
of each sequence's own; and copies of one prefilled context for a decode batch."""

from __future__ import annotations

import math

import torch

from dsl.cache import CacheSpec, PagedCache
from dsl.context import SequenceState


class Caches:
    """Where a run's sequences keep their caches: in one `PagedCache`, as the engine keeps them (slot 0 and its blocks
    hold the shared context, slot 1 a path's warm-up prefill, slots 2 on a case's sequences, each slot its own
    `per_slot` blocks), or with `paged` False in tensors of each sequence's own."""

    def __init__(self, graph, paged: bool, max_batch: int, max_tokens: int, device: str) -> None:
        self.cache = None
        if paged:
            spec = CacheSpec.from_graph(graph)
            self.block_size = math.ceil(16 / spec.block_multiple) * spec.block_multiple
            self.per_slot = -(-max_tokens // self.block_size)
            self.cache = PagedCache(spec, max_batch + 2, (max_batch + 2) * self.per_slot, self.block_size, device)

    def fresh(self, slot: int) -> SequenceState:
        if self.cache is None:
            return SequenceState()
        return SequenceState(cache=self.cache, slot=slot,
                             block_table=list(range(slot * self.per_slot, (slot + 1) * self.per_slot)))

    def copies(self, context: SequenceState, n: int) -> list[SequenceState]:
        """n sequences holding `context`'s caches, in slots 2 .. n + 1."""
        if self.cache is None:  # `UnpagedCache` keeps a tensor per cache
            return [SequenceState(num_tokens=context.num_tokens,
                                  caches={k: v.clone() for k, v in context.caches.items()})
                    for _ in range(n)]
        c, states = self.cache, [self.fresh(2 + i) for i in range(n)]
        rings = [p for _, parts in c.windows.values() for p in parts] + [c.history]
        for ring in rings + [p for pool in c.partials.values() for p in pool]:
            ring[2 : n + 2] = ring[context.slot]
        used = -(-context.num_tokens // self.block_size)
        src = torch.tensor(context.block_table[:used])
        dst = torch.tensor([s.block_table[:used] for s in states]).reshape(-1)
        for _, _, parts in c.compressed.values():
            for part in parts:
                part[dst] = part[src].repeat(n, *[1] * (part.dim() - 1))
        for s in states:
            s.num_tokens = context.num_tokens
        return states
