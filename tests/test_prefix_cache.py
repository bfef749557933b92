"""Prefix caching's bookkeeping and its snapshots: keys, sharing, eviction, the layout's budget, and a slot copied at a
block boundary continuing bit for bit without writing the shared blocks."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from deepinfer.engine import EngineArgs
from deepinfer.engine.block_manager import BlockManager, CacheLayout
from deepinfer.engine.memory import plan_caches
from deepinfer.engine.prefix_cache import chain_key
from deepinfer.engine.sequence import Sequence
from deepinfer.sampling_params import SamplingParams
from dsl.cache import CacheSpec, PagedCache
from dsl.context import SequenceState
from tests.test_block_manager import SPEC


def _seq(prompt: list[int]) -> Sequence:
    return Sequence("r", 0, prompt, SamplingParams(max_tokens=4), seed=0, max_model_len=1000)


def _manager(num_blocks: int = 8, num_snapshots: int = 2) -> BlockManager:
    layout = CacheLayout(num_slots=3, num_blocks=num_blocks, block_size=4, slot_bytes=1, block_bytes=1,
                         num_snapshots=num_snapshots, snapshot_interval=8)
    return BlockManager(layout, enable_prefix_caching=True)


def _run(manager: BlockManager, seq: Sequence, snapshot_at: int | None = None) -> None:
    """What the scheduler and the model runner do for `seq`'s whole prompt in one chunk: blocks, the snapshot (if
    `snapshot_at`: the chunk would end there) taken and registered, the blocks registered."""
    manager.allocate(seq, len(seq.prompt_token_ids))
    seq.num_computed_tokens = len(seq.prompt_token_ids)
    if snapshot_at is not None:
        planned = manager.prefix_cache.plan_snapshot(seq, snapshot_at - 1, snapshot_at, set())
        assert planned is not None and planned[0] == snapshot_at
        manager.prefix_cache.commit_snapshot(seq, planned, taken=True)
    manager.cache_blocks(seq)


def test_keys_chain_their_parents() -> None:
    a, b = chain_key(b"", [1, 2, 3, 4]), chain_key(b"", [1, 2, 3, 5])
    assert a != b and chain_key(a, [9] * 4) != chain_key(b, [9] * 4)
    assert chain_key(a, [9] * 4) == chain_key(chain_key(b"", [1, 2, 3, 4]), [9] * 4)


def test_a_hit_shares_blocks_up_to_its_snapshot() -> None:
    manager = _manager()
    first = _seq(list(range(17)))
    _run(manager, first, snapshot_at=8)
    assert manager.lookup(_seq([7] + list(range(1, 17)))) is None  # its first block differs
    second = _seq(list(range(14)) + [99, 98])
    hit = manager.lookup(second)
    assert hit is not None and (hit.num_tokens, hit.shared) == (8, 12) and hit.blocks == tuple(first.block_table[:2])
    assert manager.can_allocate(second, 8, hit)
    manager.allocate(second, 0, hit)
    assert second.num_computed_tokens == 8 and second.restore == hit.snapshot
    assert [manager.ref_counts[b] for b in first.block_table] == [2, 2, 1, 1, 1]


def test_freed_blocks_stay_findable_until_needed_and_go_last_first() -> None:
    manager = _manager(num_blocks=6)
    first = _seq(list(range(17)))
    _run(manager, first, snapshot_at=16)
    blocks = list(first.block_table)
    manager.deallocate(first)
    assert manager.num_free_blocks == 6 and list(manager.cached_free) == blocks[3::-1]  # keyed blocks, last first
    hit = manager.lookup(_seq(list(range(17))))
    assert hit is not None and hit.num_tokens == 16
    other = _seq([50 + i for i in range(9)])
    manager.allocate(other, 9)  # the unkeyed free blocks, then the keyed one freed first: `first`'s fourth
    assert other.block_table == [5, blocks[4], blocks[3]]
    assert blocks[3] not in manager.prefix_cache.key_of
    assert manager.lookup(_seq(list(range(17)))) is None  # its snapshot ended at the evicted block
    again = manager.lookup(_seq(list(range(13))))
    assert again is None  # no snapshot at 4, 8 or 12


def test_snapshots_are_evicted_least_recently_used_first() -> None:
    manager = _manager(num_blocks=12, num_snapshots=2)
    a, b = _seq(list(range(9))), _seq([100 + i for i in range(9)])
    _run(manager, a, snapshot_at=8)
    _run(manager, b, snapshot_at=8)
    assert manager.lookup(_seq(list(range(10)))) is not None  # touches a's snapshot: b's is now the oldest
    c = _seq([200 + i for i in range(9)])
    _run(manager, c, snapshot_at=8)
    assert manager.lookup(_seq([100 + i for i in range(10)])) is None
    assert manager.lookup(_seq(list(range(10)))) is not None and manager.lookup(_seq([200 + i for i in range(10)]))


def test_a_waiting_sequence_waits_for_a_snapshot_being_taken_on_its_prompt() -> None:
    manager = _manager()
    cache = manager.prefix_cache
    owner, waiting = _seq(list(range(20))), _seq(list(range(13)) + [77, 78])
    manager.allocate(owner, 4)
    owner.num_computed_tokens = 4
    assert cache.ask(owner, waiting, resume=0)  # they share 12 tokens: the owner is asked to stop there
    assert owner.snapshots_asked.keys() == {12} and cache.waits_for(waiting, 0) and not cache.waits_for(waiting, 12)
    assert cache.boundary(owner, 4, 20, set()) == 8  # the interval comes first
    manager.deallocate(owner)  # stopped before it: nothing is coming
    assert not cache.waits_for(waiting, 0)


def test_the_layout_gives_snapshots_their_share_of_the_budget() -> None:
    slot, block = SPEC.slot_bytes(), SPEC.block_bytes(16)
    budget = 4 * slot + 200 * block
    plain = CacheLayout.plan(SPEC, budget, max_num_seqs=4, max_model_len=64)
    cached = CacheLayout.plan(SPEC, budget, max_num_seqs=4, max_model_len=64, enable_prefix_caching=True)
    assert plain.num_snapshots == 0 and cached.num_snapshots > 4 and cached.nbytes <= budget
    assert cached.snapshot_interval % 16 == 0 and cached.num_blocks >= 4  # one sequence of max_model_len fits
    assert "snapshot slots" in cached.describe()


def test_a_budget_without_room_for_a_snapshot_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    slot, block = SPEC.slot_bytes(), SPEC.block_bytes(16)
    args = EngineArgs(max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=4 * slot + 4 * block)
    with caplog.at_level(logging.WARNING):
        layout, _ = plan_caches(SPEC, args, max_position_embeddings=64, device="cpu")
    assert layout.num_snapshots == 0 and "no room for a snapshot slot" in caplog.text
    caplog.clear()
    roomy = dataclasses.replace(args, kv_cache_memory_bytes=8 * slot + 8 * block)
    with caplog.at_level(logging.WARNING):
        assert plan_caches(SPEC, roomy, max_position_embeddings=64, device="cpu")[0].num_snapshots > 0
    assert "snapshot" not in caplog.text


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_enable_prefix_caching_must_be_a_bool(bad) -> None:
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False"):
        EngineArgs(enable_prefix_caching=bad)


def test_a_restored_slot_continues_bit_for_bit_without_writing_shared_blocks(compiled_fixture) -> None:
    """A slot copied at a block boundary continues as the original does (windows wrapped, Engram history, the
    compressor between groups), and writes nothing into the blocks it shares."""
    model = compiled_fixture("v41-tiny-engram")
    cache = PagedCache(CacheSpec.from_graph(model.graph), num_slots=3, num_blocks=6, block_size=16)
    ids = torch.randint(0, 512, (45,), generator=torch.Generator().manual_seed(0)).tolist()
    first = SequenceState(cache=cache, slot=0, block_table=[4, 1, 2])
    model.step([(first, ids[:20])], batch_invariant=True)
    model.step([(first, ids[20:32])], batch_invariant=True)
    cache.copy_slot(0, 2)
    shared = [p[[4, 1]].clone() for _, _, parts in cache.compressed.values() for p in parts]
    resumed = SequenceState(32, cache=cache, slot=2, block_table=[4, 1, 5])
    a = model.step([(first, ids[32:45])], all_logits=True, batch_invariant=True)
    b = model.step([(resumed, ids[32:45])], all_logits=True, batch_invariant=True)
    assert torch.equal(a, b)
    assert all(torch.equal(s, p[[4, 1]]) for s, p in zip(shared, [p for _, _, parts in cache.compressed.values()
                                                                     for p in parts], strict=True))
