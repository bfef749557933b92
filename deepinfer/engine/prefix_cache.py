"""Prefix caching's bookkeeping: full blocks found again by a hash chain of their tokens, and the slot snapshots that
make resuming from them exact (docs/prefix_caching.md).

A full block's compressed entries depend on every token up to its end, so it is keyed by the hash of its parent's
key and its own tokens. What a sequence keeps outside the blocks (every layer's sliding window, the draft layers'
too, the Engram history) cannot be rebuilt from the blocks: a hit resumes only at a block boundary where a
snapshot of the slot was taken, a copy of the slot into one of the pool's snapshot slots. At a block boundary the
compressor's partial groups are empty (a block is a whole number of every compress ratio's groups), so windows and
history are all a snapshot needs.

Snapshots are taken where a sequence reaches: every `interval` tokens, the last block boundary before its prompt's
last token (the `n` samples of a request and repeated prompts resume there) and where its prompt branches from the
cached chain, from the prompts of the next waiting sequences, or where a waiting sequence asks it to stop (`ask`): a
shared system prompt resumes at its last full block. This file is CPU bookkeeping; the copies are the model
runner's, and the block manager (deepinfer/engine/block_manager.py) hands blocks out through it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from deepinfer.engine.sequence import Sequence


@dataclass(frozen=True)
class Hit:
    """Where a sequence resumes: `num_tokens` positions computed, in `blocks`, with its slot restored from
    `snapshot`; `shared` is how many tokens of its chain are cached (a snapshot at that boundary is worth taking)."""

    num_tokens: int
    blocks: tuple[int, ...]
    snapshot: int
    shared: int


def chain_key(parent: bytes, tokens: list[int]) -> bytes:
    """The key of a full block: a digest of its parent's key and its tokens."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return digest.digest()


class PrefixCache:
    """Which block and which snapshot slot hold which key, and the snapshots least recently used first.

    `snapshot_slots` are slot ids of the pool past the running sequences' slots.
    """

    def __init__(self, block_size: int, interval: int, snapshot_slots: range) -> None:
        self.block_size, self.interval = block_size, interval
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}  # block -> key
        self.snapshot_of: dict[bytes, int] = {}  # key of the block a snapshot ends at -> its slot
        self.snapshot_key: dict[int, bytes] = {}
        self.snapshot_lru: OrderedDict[int, None] = OrderedDict()  # registered snapshots, least recently used first
        self.free_snapshots = deque(snapshot_slots)
        self.pending: dict[bytes, int] = {}  # key -> boundary of snapshots scheduled and not yet taken
        self.num_queried_tokens = self.num_hit_tokens = 0

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of the first `num_blocks` blocks of `seq` (its known tokens must cover them), kept on it."""
        tokens = seq.prompt_token_ids + seq.output_token_ids
        bs = self.block_size
        while len(seq.block_keys) < num_blocks:
            i = len(seq.block_keys)
            seq.block_keys.append(chain_key(seq.block_keys[-1] if i else b"", tokens[i * bs:(i + 1) * bs]))
        return seq.block_keys[:num_blocks]

    def lookup(self, seq: Sequence) -> Hit | None:
        """The longest resumable prefix of waiting `seq`: its cached blocks up to the last one a snapshot ends at,
        leaving its last known token to compute (its logits are needed)."""
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        blocks, resume, snapshot = [], 0, None
        for key in self.keys(seq, (known - 1) // self.block_size):
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
            if key in self.snapshot_of:
                resume, snapshot = len(blocks), self.snapshot_of[key]
        if snapshot is None:
            return None
        self.snapshot_lru.move_to_end(snapshot)
        return Hit(resume * self.block_size, tuple(blocks[:resume]), snapshot, len(blocks) * self.block_size)

    def count(self, seq: Sequence, resume: int) -> None:
        """`seq` starts (or restarts) with its first `resume` tokens found cached."""
        self.num_queried_tokens += len(seq.prompt_token_ids) + len(seq.output_token_ids)
        self.num_hit_tokens += resume

    def waits_for(self, seq: Sequence, resume: int) -> bool:
        """Whether a snapshot being taken on `seq`'s prompt lies past `resume`: it is worth waiting a step or two."""
        if not self.pending:
            return False
        keys = self.keys(seq, (len(seq.prompt_token_ids) - 1) // self.block_size)
        return any(self.pending.get(key, 0) > resume for key in keys)

    def boundary(self, seq: Sequence, start: int, end: int, shared: set[int]) -> int | None:
        """The first position in (start, end] where `seq` should leave a snapshot: a multiple of `interval`, the
        last block boundary before its prompt's last token, one of `shared` (where its prompt leaves the cached
        chain or another's prompt) or one a waiting sequence asked for (`ask`); None where there is none or it is
        cached or being taken."""
        bs = self.block_size
        prompt_end = (len(seq.prompt_token_ids) - 1) // bs * bs
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        candidates = {*range((start // self.interval + 1) * self.interval, end + 1, self.interval), prompt_end,
                      *shared, *seq.snapshots_asked}
        for b in sorted(p for p in candidates if start < p <= end and p % bs == 0):
            if b > known or b in seq.snapshots_asked:
                return b
            key = self.keys(seq, b // bs)[-1]
            if key not in self.snapshot_of and key not in self.pending:
                return b
        return None

    def plan_snapshot(self, seq: Sequence, start: int, end: int, shared: set[int]) -> tuple[int, int] | None:
        """(position, snapshot slot) where a chunk of `seq` covering positions start .. end - 1 leaves a snapshot,
        the slot reserved; None: nowhere, or no slot free."""
        boundary = self.boundary(seq, start, end, shared)
        if boundary is None:
            return None
        key = self._key_at(seq, boundary)
        seq.snapshots_asked.pop(boundary, None)
        if not self.free_snapshots:
            if not self.snapshot_lru:
                if key is not None:
                    self.pending.pop(key, None)
                return None
            self._drop_snapshot(next(iter(self.snapshot_lru)))
        if key is not None:
            self.pending[key] = boundary
        return boundary, self.free_snapshots.popleft()

    def commit_snapshot(self, seq: Sequence, snapshot: tuple[int, int], taken: bool) -> None:
        """Register the snapshot `plan_snapshot` gave `seq` when it was taken (and is not a duplicate), else free
        its slot."""
        boundary, slot = snapshot
        key = self._key_at(seq, boundary)
        if key is not None:
            self.pending.pop(key, None)
        if taken and key is not None and key not in self.snapshot_of:
            self.snapshot_of[key], self.snapshot_key[slot] = slot, key
            self.snapshot_lru[slot] = None
        else:
            self.free_snapshots.append(slot)

    def shared_with(self, seq: Sequence, others: list[Sequence]) -> set[int]:
        """Where the prompt blocks `seq` shares with each of `others`' prompts end (past its start)."""
        bs = self.block_size
        mine = self.keys(seq, (len(seq.prompt_token_ids) - 1) // bs)
        ends = set()
        for other in others:
            if other is not seq and len(other.prompt_token_ids) > bs:
                theirs = self.keys(other, min(len(mine), (len(other.prompt_token_ids) - 1) // bs))
                ends.add(bs * next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(theirs)))
        return ends

    def ask(self, owner: Sequence, waiting: Sequence, resume: int) -> bool:
        """Whether running `owner`, still before the end of the prompt blocks `waiting` shares with it, is asked to
        leave a snapshot there (so that `waiting` resumes there rather than recompute them beside it)."""
        if owner.num_computed_tokens >= len(owner.prompt_token_ids):
            return False
        boundary = max(self.shared_with(waiting, [owner]), default=0)
        if boundary <= max(resume, owner.num_computed_tokens):
            return False
        key = self.keys(waiting, boundary // self.block_size)[-1]
        owner.snapshots_asked[boundary] = key
        self.pending[key] = boundary
        return True

    def release(self, seq: Sequence) -> None:
        """`seq` stops: the snapshots it was asked for are not coming."""
        for key in seq.snapshots_asked.values():
            self.pending.pop(key, None)
        seq.snapshots_asked.clear()

    def _key_at(self, seq: Sequence, boundary: int) -> bytes | None:
        """The key of the block of `seq` ending at `boundary`, None while its tokens are not all known."""
        if boundary > len(seq.prompt_token_ids) + len(seq.output_token_ids):
            return None
        return self.keys(seq, boundary // self.block_size)[-1]

    def register(self, key: bytes, block: int) -> None:
        """`block` holds the entries of `key` (the first block computed for a key keeps it)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key], self.key_of[block] = block, key

    def forget_block(self, block: int) -> None:
        """`block` is about to be written with other entries: drop its key, and the snapshot that ends at it."""
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
            if key in self.snapshot_of:
                self._drop_snapshot(self.snapshot_of[key])

    def _drop_snapshot(self, slot: int) -> None:
        del self.snapshot_of[self.snapshot_key.pop(slot)]
        del self.snapshot_lru[slot]
        self.free_snapshots.append(slot)

    def clear(self) -> None:
        """Forget every key and snapshot (after a failed step, whose entries may be wrong); pending ones stay."""
        for slot in list(self.snapshot_lru):
            self._drop_snapshot(slot)
        self.block_of.clear()
        self.key_of.clear()

    @property
    def hit_rate(self) -> float:
        """Tokens resumed from the cache over the tokens of the sequences that looked it up."""
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
