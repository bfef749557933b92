"""The cache manager: how the budget splits into slots and blocks, and which sequence holds which.

Every cache is accounted here, together (dsl/cache.py lays them out): a running sequence holds one slot (its
sliding windows in every layer, the compressor's partial groups, the Engram history: a size fixed by the model)
and one block per `block_size` token positions it has reached (the compressed KV and indexer keys of every KV
source). Slots come first from the budget, one per `max_num_seqs`; blocks take the rest. With prefix caching
(deepinfer/engine/prefix_cache.py) blocks are reference-counted and shared, a freed block keeps its entries until it
is needed again (least recently freed first), and snapshot slots share the budget with the blocks. The manager is
CPU bookkeeping only: the pools themselves live with the model runner.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from deepinfer.engine.prefix_cache import Hit, PrefixCache
from deepinfer.engine.sequence import Sequence
from dsl.cache import CacheSpec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheLayout:
    """What the budget buys: `num_slots` slots of `slot_bytes` and `num_blocks` blocks of `block_bytes`, and with
    prefix caching `num_snapshots` snapshot slots (of `slot_bytes` too), one due every `snapshot_interval` tokens."""

    num_slots: int
    num_blocks: int
    block_size: int
    slot_bytes: int
    block_bytes: int
    num_snapshots: int = 0
    snapshot_interval: int = 0

    @classmethod
    def plan(cls, spec: CacheSpec, budget: int, max_num_seqs: int, max_model_len: int,
             block_size: int | None = None, enable_prefix_caching: bool = False) -> CacheLayout:
        """Split `budget` bytes: a slot per sequence, then blocks (and snapshot slots with prefix caching); at least
        one sequence of max_model_len must fit."""
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
        layout = cls(max_num_seqs, num_blocks, block_size, slot_bytes, block_bytes)
        return layout.with_snapshots(budget, per_sequence) if enable_prefix_caching and block_bytes else layout

    def with_snapshots(self, budget: int, per_sequence: int) -> CacheLayout:
        """This layout with snapshot slots: one snapshot every `snapshot_interval` tokens, the interval chosen so a
        snapshot costs about what the blocks it covers cost, plus one per running sequence; blocks give up the room
        they need, down to one sequence's worth."""
        interval_blocks = max(1, math.ceil(self.slot_bytes / self.block_bytes))
        left = budget - self.num_slots * self.slot_bytes
        unit = interval_blocks * self.block_bytes + self.slot_bytes  # the bytes of one interval, snapshot included
        num_blocks = max((left - self.num_slots * self.slot_bytes) * interval_blocks // unit, per_sequence)
        num_blocks = min(num_blocks, self.num_blocks)
        want = math.ceil(num_blocks / interval_blocks) + self.num_slots
        num_snapshots = max(0, min(want, (left - num_blocks * self.block_bytes) // self.slot_bytes))
        return dataclasses.replace(self, num_blocks=num_blocks, num_snapshots=num_snapshots,
                                   snapshot_interval=interval_blocks * self.block_size)

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
        return (self.num_slots + self.num_snapshots) * self.slot_bytes + self.num_blocks * self.block_bytes

    def describe(self) -> str:
        snapshots = (f", {self.num_snapshots} snapshot slots (one due every {self.snapshot_interval} tokens)"
                     if self.snapshot_interval else "")
        return (f"{self.num_slots} slots of {self.slot_bytes / 1024:.1f} KiB and {self.num_blocks} blocks of "
                f"{self.block_size} tokens ({self.block_bytes} bytes each){snapshots}: {self.nbytes / 2**20:.1f} MiB")


class BlockManager:
    """Hands out slots and blocks; `can_allocate` / `allocate` before a step, `deallocate` when a sequence stops.

    With `enable_prefix_caching`, `lookup` finds where a waiting sequence can resume, `allocate` shares the blocks of
    that hit, `cache_blocks` registers a sequence's full blocks, and freed blocks that hold a key wait, least
    recently freed first, until a block is needed. `swa_replay_tokens`: bounded replay's setting, which decides which
    snapshots serve which sequence (deepinfer/engine/prefix_cache.py)."""

    def __init__(self, layout: CacheLayout, enable_prefix_caching: bool = False,
                 swa_replay_tokens: int | None = None) -> None:
        self.layout = layout
        self.free_slots = deque(range(layout.num_slots))
        self.free_blocks = deque(range(layout.num_blocks))
        self.prefix_cache = None
        if enable_prefix_caching and layout.block_bytes:
            snapshots = range(layout.num_slots, layout.num_slots + layout.num_snapshots)
            self.prefix_cache = PrefixCache(layout.block_size, layout.snapshot_interval, snapshots, swa_replay_tokens)
        self.cached_free: OrderedDict[int, None] = OrderedDict()  # free blocks that hold a key, oldest first
        self.ref_counts = [0] * layout.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks) + len(self.cached_free)

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks covering positions below `num_tokens` (none when the model has no compressed cache)."""
        return math.ceil(num_tokens / self.layout.block_size) if self.layout.block_bytes else 0

    def lookup(self, seq: Sequence) -> Hit | None:
        """Where waiting `seq` can resume from the prefix cache (None: from its start)."""
        return self.prefix_cache.lookup(seq) if self.prefix_cache is not None else None

    def can_allocate(self, seq: Sequence, num_new_tokens: int, hit: Hit | None = None) -> bool:
        """Whether `seq` can compute `num_new_tokens` more tokens (after `hit`'s, when given): a slot if it has none,
        and the blocks they reach."""
        if seq.slot is None and not self.free_slots:
            return False
        if hit is None:
            extra = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
            return extra <= self.num_free_blocks
        reused = sum(1 for b in hit.blocks if self.ref_counts[b] == 0)  # free now, no longer once shared
        return self.blocks_needed(hit.num_tokens + num_new_tokens) - len(hit.blocks) <= self.num_free_blocks - reused

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: Hit | None = None) -> None:
        """Give `seq` a slot (if it has none) and blocks for `num_new_tokens` more tokens (can_allocate first); with
        `hit`, `seq` first takes its blocks and resumes after them (`restore` names the snapshot)."""
        if seq.slot is None:
            seq.slot = self.free_slots.popleft()
        if hit is not None:
            for block in hit.blocks:
                if self.ref_counts[block] == 0:
                    del self.cached_free[block]
                self.ref_counts[block] += 1
            seq.block_table, seq.num_computed_tokens, seq.restore = list(hit.blocks), hit.num_tokens, hit.snapshot
            seq.num_registered_blocks = len(hit.blocks)
        for _ in range(self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)):
            seq.block_table.append(self._take_free())

    def _take_free(self) -> int:
        if self.free_blocks:
            block = self.free_blocks.popleft()
        else:
            block, _ = self.cached_free.popitem(last=False)
            self.prefix_cache.forget_block(block)
        self.ref_counts[block] = 1
        return block

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the full blocks of `seq` whose positions are computed (or being computed) and known."""
        if self.prefix_cache is None:
            return
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        full = min(seq.num_computed_tokens, known) // self.layout.block_size
        if full <= seq.num_registered_blocks:
            return
        keys = self.prefix_cache.keys(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.prefix_cache.register(keys[i], seq.block_table[i])
        seq.num_registered_blocks = full

    def deallocate(self, seq: Sequence) -> None:
        """Return the slot and blocks of `seq`; its caches are gone (a preempted sequence recomputes them), but with
        prefix caching its full blocks stay findable until they are needed again (its last ones first)."""
        self.cache_blocks(seq)
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq)
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
        # Freed blocks are evicted in the order freed: a sequence's last blocks go first, its chain's head stays.
        for block in reversed(seq.block_table) if self.prefix_cache is not None else seq.block_table:
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                if self.prefix_cache is not None and block in self.prefix_cache.key_of:
                    self.cached_free[block] = None
                else:
                    self.free_blocks.append(block)
        seq.slot, seq.block_table, seq.num_registered_blocks, seq.restore = None, [], 0, None
