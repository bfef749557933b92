"""The cache manager: how the budget splits into slots and blocks, and which sequence holds which.

Every cache is accounted here, together (dsl/cache.py lays them out): a running sequence holds one slot (its
sliding windows in every layer, the compressor's partial groups, the Engram history: a size fixed by the model)
and one block per `block_size` token positions it has reached (the compressed KV and indexer keys of every KV
source). Slots come first from the budget, one per `max_num_seqs`; blocks take the rest. The manager is CPU
bookkeeping only: the pools themselves live with the model runner.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass

from deepinfer.engine.sequence import Sequence
from dsl.cache import CacheSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheLayout:
    """What the budget buys: `num_slots` slots of `slot_bytes` and `num_blocks` blocks of `block_bytes`."""

    num_slots: int
    num_blocks: int
    block_size: int
    slot_bytes: int
    block_bytes: int

    @classmethod
    def plan(cls, spec: CacheSpec, budget: int, max_num_seqs: int, max_model_len: int,
             block_size: int | None = None) -> CacheLayout:
        """Split `budget` bytes: a slot per sequence, then blocks; at least one sequence of max_model_len must fit."""
        block_size = cls.check_block_size(spec, block_size)
        slot_bytes, block_bytes = spec.slot_bytes(), spec.block_bytes(block_size)
        if max_num_seqs * slot_bytes > budget:
            raise ValueError(f"a cache budget of {budget} bytes cannot hold the windows of max_num_seqs={max_num_seqs} "
                             f"sequences ({slot_bytes} bytes each): lower max_num_seqs to {budget // slot_bytes} or "
                             f"raise kv_cache_memory_bytes")
        per_sequence = math.ceil(max_model_len / block_size)
        num_blocks = 0
        if block_bytes:
            num_blocks = min((budget - max_num_seqs * slot_bytes) // block_bytes, per_sequence * max_num_seqs)
            if num_blocks < per_sequence:
                need = max_num_seqs * slot_bytes + per_sequence * block_bytes
                raise ValueError(f"a cache budget of {budget} bytes cannot hold one sequence of max_model_len="
                                 f"{max_model_len} tokens beside the slots: it needs {need} bytes; raise "
                                 f"kv_cache_memory_bytes or lower max_model_len or max_num_seqs")
        return cls(max_num_seqs, num_blocks, block_size, slot_bytes, block_bytes)

    @staticmethod
    def check_block_size(spec: CacheSpec, block_size: int | None) -> int:
        """`block_size`, or by default the smallest multiple of every compress ratio >= 16, checked."""
        multiple = spec.block_multiple
        block_size = block_size or math.ceil(16 / multiple) * multiple
        if block_size % multiple:
            raise ValueError(f"block_size {block_size} must be a multiple of every compress ratio, here {multiple}")
        return block_size

    @classmethod
    def longest_sequence(cls, spec: CacheSpec, budget: int, max_num_seqs: int, block_size: int | None = None
                         ) -> int | None:
        """Token positions of the longest sequence `budget` holds beside `max_num_seqs` slots; None when a sequence
        needs no blocks (a model without compressed caches) and any length fits."""
        block_size = cls.check_block_size(spec, block_size)
        block_bytes = spec.block_bytes(block_size)
        if not block_bytes:
            return None
        return max(0, budget - max_num_seqs * spec.slot_bytes()) // block_bytes * block_size

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes + self.num_blocks * self.block_bytes

    def describe(self) -> str:
        return (f"{self.num_slots} slots of {self.slot_bytes / 1024:.1f} KiB and {self.num_blocks} blocks of "
                f"{self.block_size} tokens ({self.block_bytes} bytes each): {self.nbytes / 2**20:.1f} MiB")


class BlockManager:
    """Hands out slots and blocks; `can_allocate` / `allocate` before a step, `deallocate` when a sequence stops."""

    def __init__(self, layout: CacheLayout) -> None:
        self.layout = layout
        self.free_slots = deque(range(layout.num_slots))
        self.free_blocks = deque(range(layout.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks covering positions below `num_tokens` (none when the model has no compressed cache)."""
        return math.ceil(num_tokens / self.layout.block_size) if self.layout.block_bytes else 0

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq` can compute `num_new_tokens` more tokens: a slot if it has none, and the blocks they reach."""
        if seq.slot is None and not self.free_slots:
            return False
        extra = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return extra <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give `seq` a slot (if it has none) and blocks for `num_new_tokens` more tokens (can_allocate first)."""
        if seq.slot is None:
            seq.slot = self.free_slots.popleft()
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self.free_blocks.popleft())

    def deallocate(self, seq: Sequence) -> None:
        """Return the slot and blocks of `seq`; its caches are gone (a preempted sequence recomputes them)."""
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
        self.free_blocks.extend(seq.block_table)
        seq.slot, seq.block_table = None, []
