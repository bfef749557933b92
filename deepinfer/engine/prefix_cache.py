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

With bounded replay (`swa_replay_tokens`) the blocks, the windows of the layers before the boundary, the partial groups
and the history are the exact ones still, but a decoder layer's window at a position also depends on where the
sequence's replay starts (`replay_from`, deepinfer/replay.py), below which no decoder window is computed or seen. So a
snapshot at boundary B is tagged with the replay position R its decoder windows were computed from (None where
B <= R: it holds none), and serves a sequence whose replay starts at R' if B <= R' (it computes and sees no decoder
window before R', and everything else in the snapshot is exact) or if R' == R (the same tokens with the same cut: the
same windows). A boundary may hold snapshots of several tags. Without replay every R is 0, one tag.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass

from deepinfer.engine.sequence import Sequence
from deepinfer.replay import replay_from

Tag = int | None  # a snapshot's replay position (None: no decoder window in it; 0 without replay)


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

    `snapshot_slots` are slot ids of the pool past the running sequences' slots; `swa_replay_tokens`: bounded
    replay's setting (None: off).
    """

    def __init__(self, block_size: int, interval: int, snapshot_slots: range,
                 swa_replay_tokens: int | None = None) -> None:
        self.block_size, self.interval = block_size, interval
        self.swa_replay_tokens = swa_replay_tokens
        self.block_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}  # block -> key
        self.snapshot_of: dict[bytes, dict[Tag, int]] = {}  # key of the block a snapshot ends at -> tag -> its slot
        self.snapshot_key: dict[int, tuple[bytes, Tag]] = {}
        self.snapshot_lru: OrderedDict[int, None] = OrderedDict()  # registered snapshots, least recently used first
        self.free_snapshots = deque(snapshot_slots)
        self.pending: dict[tuple[bytes, Tag], int] = {}  # (key, tag) -> boundary of snapshots not yet taken
        self.num_queried_tokens = self.num_hit_tokens = 0

    def replay_from(self, seq: Sequence) -> int:
        """Where every prefill of `seq` starts running the decoder layers (0: all of it)."""
        return replay_from(len(seq.prompt_token_ids), self.swa_replay_tokens)

    def tag(self, seq: Sequence, boundary: int) -> Tag:
        """The tag of a snapshot `seq` leaves at `boundary`: its replay position, None where that is not before it."""
        start = self.replay_from(seq)
        return start if boundary > start else None

    def _serves(self, boundary: int, tag: Tag, seq: Sequence) -> bool:
        """Whether a snapshot at `boundary` tagged `tag` holds the state `seq` has there (the module docstring)."""
        start = self.replay_from(seq)
        return boundary <= start or tag == start

    def _covered(self, key: bytes, tag: Tag) -> bool:
        """Whether a snapshot of `key` with `tag` (or, for None, any tag: it serves whom None serves) is cached or
        being taken."""
        tags = {*self.snapshot_of.get(key, ()), *(t for k, t in self.pending if k == key)}
        return tag in tags or (tag is None and bool(tags))

    def keys(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The keys of the first `num_blocks` blocks of `seq` (its known tokens must cover them), kept on it."""
        bs = self.block_size
        while len(seq.block_keys) < num_blocks:  # the tokens sliced where a key is missing, not copied whole a call
            i = len(seq.block_keys)
            seq.block_keys.append(chain_key(seq.block_keys[-1] if i else b"", seq.token_ids(i * bs, bs)))
        return seq.block_keys[:num_blocks]

    def lookup(self, seq: Sequence) -> Hit | None:
        """The longest resumable prefix of waiting `seq`: its cached blocks up to the last one a snapshot that serves
        it ends at, leaving its last known token to compute (its logits are needed)."""
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        blocks, resume, snapshot = [], 0, None
        for key in self.keys(seq, (known - 1) // self.block_size):
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
            boundary = len(blocks) * self.block_size
            slot = next((s for t, s in self.snapshot_of.get(key, {}).items() if self._serves(boundary, t, seq)), None)
            if slot is not None:
                resume, snapshot = len(blocks), slot
        if snapshot is None:
            return None
        self.snapshot_lru.move_to_end(snapshot)
        return Hit(resume * self.block_size, tuple(blocks[:resume]), snapshot, len(blocks) * self.block_size)

    def count(self, seq: Sequence, resume: int) -> None:
        """`seq` starts (or restarts) with its first `resume` tokens found cached."""
        self.num_queried_tokens += len(seq.prompt_token_ids) + len(seq.output_token_ids)
        self.num_hit_tokens += resume

    def waits_for(self, seq: Sequence, resume: int) -> bool:
        """Whether a snapshot being taken on `seq`'s prompt that would serve it lies past `resume`: it is worth
        waiting a step or two."""
        if not self.pending:
            return False
        keys = set(self.keys(seq, (len(seq.prompt_token_ids) - 1) // self.block_size))
        return any(b > resume and self._serves(b, tag, seq) for (key, tag), b in self.pending.items() if key in keys)

    def boundary(self, seq: Sequence, start: int, end: int, shared: set[int]) -> int | None:
        """The first position in (start, end] where `seq` should leave a snapshot: a multiple of `interval`, the
        last block boundary before its prompt's last token, one of `shared` (where its prompt leaves the cached
        chain or another's prompt) or one a waiting sequence asked for (`ask`); None where there is none or a snapshot
        with its tag is cached or being taken."""
        bs = self.block_size
        prompt_end = (len(seq.prompt_token_ids) - 1) // bs * bs
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        candidates = {*range((start // self.interval + 1) * self.interval, end + 1, self.interval), prompt_end,
                      *shared, *seq.snapshots_asked}
        for b in sorted(p for p in candidates if start < p <= end and p % bs == 0):
            if b > known or b in seq.snapshots_asked:
                return b
            if not self._covered(self.keys(seq, b // bs)[-1], self.tag(seq, b)):
                return b
        return None

    def plan_snapshot(self, seq: Sequence, start: int, end: int, shared: set[int]) -> tuple[int, int] | None:
        """(position, snapshot slot) where a chunk of `seq` covering positions start .. end - 1 leaves a snapshot,
        the slot reserved; None: nowhere, or no slot free."""
        boundary = self.boundary(seq, start, end, shared)
        if boundary is None:
            return None
        entry = self._entry(seq, boundary)
        seq.snapshots_asked.pop(boundary, None)
        if not self.free_snapshots:
            if not self.snapshot_lru:
                if entry is not None:
                    self.pending.pop(entry, None)
                return None
            self._drop_snapshot(next(iter(self.snapshot_lru)))
        if entry is not None:
            self.pending[entry] = boundary
        return boundary, self.free_snapshots.popleft()

    def commit_snapshot(self, seq: Sequence, snapshot: tuple[int, int], taken: bool) -> None:
        """Register the snapshot `plan_snapshot` gave `seq` when it was taken (and is not a duplicate), else free
        its slot."""
        boundary, slot = snapshot
        entry = self._entry(seq, boundary)
        if entry is not None:
            self.pending.pop(entry, None)
        if taken and entry is not None and entry[1] not in self.snapshot_of.get(entry[0], {}):
            self.snapshot_of.setdefault(entry[0], {})[entry[1]] = slot
            self.snapshot_key[slot] = entry
            self.snapshot_lru[slot] = None
        else:
            self.free_snapshots.append(slot)

    def shared_with(self, seq: Sequence, others: list[Sequence]) -> set[int]:
        """Where a snapshot of `seq` serves each of `others` best: where the prompt blocks they share end (past its
        start), or with bounded replay, where that lies past the other's replay position and their replay positions
        differ, the last block boundary at or before the other's."""
        return {self._useful(self._common(seq, other), seq, other) for other in others
                if other is not seq and len(other.prompt_token_ids) > self.block_size}

    def _common(self, seq: Sequence, other: Sequence) -> int:
        """The positions of the full prompt blocks `seq` and `other` share (the last prompt token's block left out)."""
        bs = self.block_size
        mine = self.keys(seq, (len(seq.prompt_token_ids) - 1) // bs)
        theirs = self.keys(other, min(len(mine), (len(other.prompt_token_ids) - 1) // bs))
        return bs * next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), len(theirs))

    def _useful(self, boundary: int, taker: Sequence, user: Sequence) -> int:
        """The last block boundary at or before `boundary` where a snapshot `taker` leaves serves `user`."""
        if self._serves(boundary, self.tag(taker, boundary), user):
            return boundary
        return self.replay_from(user) // self.block_size * self.block_size

    def ask(self, owner: Sequence, waiting: Sequence, resume: int) -> bool:
        """Whether running `owner`, still before the end of the prompt blocks `waiting` shares with it (or, with
        bounded replay, the last boundary of those whose snapshot serves `waiting`), is asked to leave a snapshot
        there (so that `waiting` resumes there rather than recompute them beside it)."""
        if owner.num_computed_tokens >= len(owner.prompt_token_ids):
            return False
        boundary = self._useful(self._common(waiting, owner), owner, waiting)
        if boundary <= max(resume, owner.num_computed_tokens):
            return False
        entry = (self.keys(waiting, boundary // self.block_size)[-1], self.tag(owner, boundary))
        owner.snapshots_asked[boundary] = entry
        self.pending[entry] = boundary
        return True

    def release(self, seq: Sequence) -> None:
        """`seq` stops: the snapshots it was asked for are not coming."""
        for entry in seq.snapshots_asked.values():
            self.pending.pop(entry, None)
        seq.snapshots_asked.clear()

    def _entry(self, seq: Sequence, boundary: int) -> tuple[bytes, Tag] | None:
        """The key of the block of `seq` ending at `boundary` and the tag of its snapshot there, None while the
        block's tokens are not all known."""
        if boundary > len(seq.prompt_token_ids) + len(seq.output_token_ids):
            return None
        return self.keys(seq, boundary // self.block_size)[-1], self.tag(seq, boundary)

    def register(self, key: bytes, block: int) -> None:
        """`block` holds the entries of `key` (the first block computed for a key keeps it)."""
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key], self.key_of[block] = block, key

    def forget_block(self, block: int) -> None:
        """`block` is about to be written with other entries: drop its key, and the snapshots that end at it."""
        key = self.key_of.pop(block, None)
        if key is not None:
            del self.block_of[key]
            for slot in list(self.snapshot_of.get(key, {}).values()):
                self._drop_snapshot(slot)

    def _drop_snapshot(self, slot: int) -> None:
        key, tag = self.snapshot_key.pop(slot)
        tags = self.snapshot_of[key]
        del tags[tag]
        if not tags:
            del self.snapshot_of[key]
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
