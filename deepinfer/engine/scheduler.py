"""The scheduler: continuous batching with chunked prefill, first come first served, preemption by recompute.

Each step, running sequences go first, oldest first: a decode takes one token of the step's budget
(`max_num_batched_tokens`), a prefill in progress the next chunk of its prompt that fits. When the cache has no
block left for one, the newest running sequence is preempted: its slot and blocks are freed and it waits at the
head of the queue to recompute its prompt and outputs, so no request is lost. Then waiting sequences are admitted
in arrival order while the budget, `max_num_seqs` and the cache allow; one that is not `ready` yet (its grammar
still compiling) keeps its place in the queue while those behind it go.

With a speculator (deepinfer/engine/speculator.py) a decoding sequence also feeds drafts after its last token: the
speculator's `plan` says which, within the step's budget, before the chunks are taken. A draft counts as computed
once accepted.

With prefix caching, a waiting sequence resumes where the block manager finds its prefix cached, its slot restored
from a snapshot; a prefill chunk ends where its sequence should leave a snapshot, and one whose prompt a snapshot
being taken covers further than its own hit waits until that snapshot is in. `cache_step` registers a step's blocks
and snapshots once its tokens are seen.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from deepinfer.engine.block_manager import BlockManager
from deepinfer.engine.prefix_cache import Hit
from deepinfer.engine.sequence import Sequence, SequenceStatus
from deepinfer.engine.speculator import Speculator


@dataclass
class ScheduledChunk:
    """Tokens start .. start + length - 1 of `seq` in this step; `samples` when the chunk reaches its last token.
    The last `len(drafts)` of them are drafts to verify. `restore`: the snapshot slot the sequence's slot is restored
    from first; `snapshot`: (position, snapshot slot) to copy the slot into once the step has reached the position."""

    seq: Sequence
    start: int
    length: int
    samples: bool
    drafts: list[int] = field(default_factory=list)
    restore: int | None = None
    snapshot: tuple[int, int] | None = None


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 speculator: Speculator | None = None, ready: Callable[[Sequence], bool] | None = None) -> None:
        self.block_manager = block_manager
        self.ready = ready  # whether a waiting sequence may start (None: all may)
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.freed: list[int] = []  # ids of sequences whose caches were released since the last step
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        """The chunks of the next step (possibly none, while every sequence waits for tokens in flight)."""
        budget, chunks = self.max_num_batched_tokens, []
        drafts = self._drafts()
        for seq in list(self.running):
            length = min(seq.num_to_compute, budget)
            if seq.status is not SequenceStatus.RUNNING or length == 0:
                continue  # preempted above to make room, or done once its last tokens are seen
            verified = drafts.get(seq.seq_id, [])[: budget - length]
            start = seq.num_computed_tokens
            snapshot = self._snapshot(seq, start, start + length + len(verified))
            if snapshot is not None and not verified:
                length = snapshot[0] - start
            if not self._make_room(seq, length + len(verified)):
                if snapshot is not None:
                    self.block_manager.prefix_cache.commit_snapshot(seq, snapshot, taken=False)
                continue
            chunks.append(self._take(seq, length, verified, snapshot))
            budget -= length + len(verified)
        held: list[Sequence] = []  # not ready: back at the head of the queue, in order, after this loop
        while self.waiting and budget and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.ready is not None and not self.ready(seq):
                held.append(self.waiting.popleft())
                continue
            # A sequence preempted while its last token was in flight resumes once that token is seen.
            hit = self.block_manager.lookup(seq) if not seq.num_inflight else None
            if not seq.num_inflight and self._waits(seq, hit):
                held.append(self.waiting.popleft())
                continue
            start = hit.num_tokens if hit else 0
            length = min(seq.num_tokens - start, budget)
            if seq.num_inflight or not self.block_manager.can_allocate(seq, length, hit):
                break
            snapshot = self._snapshot(seq, start, start + length, hit)
            length = snapshot[0] - start if snapshot is not None else length
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.block_manager.allocate(seq, 0, hit)
            if self.block_manager.prefix_cache is not None:
                self.block_manager.prefix_cache.count(seq, start)
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = start
            chunks.append(self._take(seq, length, snapshot=snapshot))
            budget -= length
        self.waiting.extendleft(reversed(held))
        return chunks

    def _snapshot(self, seq: Sequence, start: int, end: int, hit: Hit | None = None) -> tuple[int, int] | None:
        """Where a chunk of `seq` over positions start .. end - 1 leaves a snapshot (prefix_cache.py says where),
        among the branch points of its prompt with the cached chain and with the next sequences to start."""
        cache = self.block_manager.prefix_cache
        if cache is None:
            return None
        shared = {hit.shared} if hit is not None else set()
        if start < len(seq.prompt_token_ids):
            shared |= cache.shared_with(seq, list(islice(self.waiting, self.max_num_seqs)))
        return cache.plan_snapshot(seq, start, end, shared)

    def _waits(self, seq: Sequence, hit: Hit | None) -> bool:
        """Whether waiting `seq` waits for a snapshot further along its prompt than `hit`: one being taken, or one
        it asks a running sequence that shares its prompt's blocks to leave."""
        cache = self.block_manager.prefix_cache
        if cache is None:
            return False
        resume = hit.num_tokens if hit else 0
        return cache.waits_for(seq, resume) or any(cache.ask(other, seq, resume) for other in self.running)

    def cache_step(self, chunks: list[ScheduledChunk], taken: set[int], failed: bool) -> None:
        """After a step's tokens are seen: register the blocks its sequences filled and the snapshots the model
        runner took (`taken`: their seq_ids); after a failed step, forget every key."""
        if self.block_manager.prefix_cache is None:
            return
        for c in chunks:
            if c.seq.status is SequenceStatus.RUNNING:
                self.block_manager.cache_blocks(c.seq)
            if c.snapshot is not None:
                self.block_manager.prefix_cache.commit_snapshot(c.seq, c.snapshot, c.seq.seq_id in taken and not failed)
        if failed:
            self.block_manager.prefix_cache.clear()

    def _drafts(self) -> dict[int, list[int]]:
        """The drafts each decoding sequence verifies this step, by seq_id (none without a speculator)."""
        if self.speculator is None:
            return {}
        decoding = [s for s in self.running if s.status is SequenceStatus.RUNNING and s.num_to_compute == 1]
        return self.speculator.plan(decoding, self.max_num_batched_tokens) if decoding else {}

    def _make_room(self, seq: Sequence, length: int) -> bool:
        """Preempt the newest running sequences until `seq` can have its blocks; False if `seq` itself went."""
        while not self.block_manager.can_allocate(seq, length):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def _take(self, seq: Sequence, length: int, drafts: list[int] | None = None,
              snapshot: tuple[int, int] | None = None) -> ScheduledChunk:
        drafts = drafts or []
        self.block_manager.allocate(seq, length + len(drafts))
        start = seq.num_computed_tokens
        seq.num_computed_tokens += length
        samples = seq.num_computed_tokens == seq.num_tokens
        if samples:
            seq.num_inflight += 1
        restore, seq.restore = seq.restore, None
        return ScheduledChunk(seq, start, length + len(drafts), samples, drafts, restore, snapshot)

    def preempt(self, seq: Sequence) -> None:
        """Free the caches of running `seq` and queue it first, to recompute them later."""
        self.running.remove(seq)
        self._release(seq)
        seq.status, seq.num_computed_tokens, seq.proposal = SequenceStatus.WAITING, 0, None
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire `seq` (finished or failed) and free its caches."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        self.block_manager.deallocate(seq)
        self.freed.append(seq.seq_id)
