"""The cache manager and the cache layout: budget accounting, slots and blocks, storage formats, paged = unpaged."""

from __future__ import annotations

import pytest
import torch

from deepinfer.engine.block_manager import BlockManager, CacheLayout
from deepinfer.engine.sequence import Sequence
from deepinfer.sampling_params import SamplingParams
from dsl.cache import CacheSpec, PagedCache
from dsl.cache_format import EntryFormat
from dsl.context import SequenceState
from dsl.ops.rounding import fp4_round, fp8_round

FP8 = EntryFormat("fp8", 32)
KV_FP4 = EntryFormat("fp4", 16, e4m3_scale=True)
INDEX_FP4 = EntryFormat("fp4", 32, e4m3_scale=False)
# Two layers of windows 8 wide, one KV source of ratio 2 with indexer keys, one of ratio 1, an n-gram history of 2.
SPEC = CacheSpec(windows=((0, 64, 8, FP8), (1, 64, 8, FP8)),
                 compressed=(("index", 0, 32, 2, INDEX_FP4), ("kv", 0, 64, 2, KV_FP4), ("kv", 1, 64, 1, KV_FP4)),
                 partials=((0, 64, 2),), history=2)


def test_spec_sizes_follow_the_formats() -> None:
    assert FP8.entry_bytes(64) == 64 + 2 and KV_FP4.entry_bytes(64) == 32 + 4 and INDEX_FP4.entry_bytes(32) == 16 + 1
    assert SPEC.block_multiple == 2
    assert SPEC.slot_bytes() == 2 * 8 * 66 + 2 * 1 * 64 * 4 + 2 * 8
    assert SPEC.block_bytes(16) == 8 * 17 + 8 * 36 + 16 * 36
    cache = PagedCache(SPEC, num_slots=3, num_blocks=5, block_size=16)
    assert SPEC.scratch_bytes() == 2 * 1 * 64 * 4 + 2 * 8  # a slot's partial groups and history, held once more
    assert cache.nbytes() == 3 * SPEC.slot_bytes() + 5 * SPEC.block_bytes(16) + SPEC.scratch_bytes()


def test_layout_splits_the_budget_into_slots_then_blocks() -> None:
    slot, block = SPEC.slot_bytes(), SPEC.block_bytes(16)
    layout = CacheLayout.plan(SPEC, budget=4 * slot + 100 * block + 7, max_num_seqs=4, max_model_len=64)
    assert (layout.num_slots, layout.num_blocks, layout.block_size) == (4, 16, 16)  # capped: 4 sequences of 4 blocks
    layout = CacheLayout.plan(SPEC, budget=4 * slot + 10 * block + 7, max_num_seqs=4, max_model_len=64)
    assert layout.num_blocks == 10 and layout.nbytes <= 4 * slot + 10 * block + 7
    assert CacheLayout.plan(SPEC, 10**9, 1, 64, block_size=32).block_size == 32


def test_layout_refuses_budgets_that_cannot_finish_a_request() -> None:
    slot, block = SPEC.slot_bytes(), SPEC.block_bytes(16)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        CacheLayout.plan(SPEC, budget=3 * slot, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        CacheLayout.plan(SPEC, budget=4 * slot + 3 * block, max_num_seqs=4, max_model_len=64)
    with pytest.raises(ValueError, match="multiple of every compress ratio"):
        CacheLayout.plan(SPEC, budget=10**9, max_num_seqs=4, max_model_len=64, block_size=15)


def _seq(prompt_len: int) -> Sequence:
    return Sequence("r", 0, list(range(prompt_len)), SamplingParams(max_tokens=4), seed=0, max_model_len=1000)


def test_blocks_follow_the_positions_reached_and_come_back() -> None:
    manager = BlockManager(CacheLayout(num_slots=2, num_blocks=5, block_size=16, slot_bytes=1, block_bytes=1))
    a, b, c = _seq(40), _seq(20), _seq(1)
    assert manager.can_allocate(a, 40)
    manager.allocate(a, 33)
    assert a.slot == 0 and len(a.block_table) == 3 and manager.num_free_blocks == 2
    a.num_computed_tokens = 33
    manager.allocate(a, 7)  # positions 33..39 stay in block 2
    assert len(a.block_table) == 3
    assert not manager.can_allocate(b, 40) and manager.can_allocate(b, 32)
    manager.allocate(b, 32)
    assert not manager.can_allocate(c, 1)  # no slot left, though no block is needed... and none is left either
    manager.deallocate(a)
    assert a.slot is None and a.block_table == [] and manager.num_free_blocks == 3
    assert manager.can_allocate(c, 1)
    assert sorted(manager.free_blocks) + sorted(b.block_table) == [0, 1, 2, 3, 4]


def test_a_model_without_compressed_caches_needs_no_blocks() -> None:
    windows_only = CacheSpec(windows=((0, 64, 8, FP8),))
    layout = CacheLayout.plan(windows_only, budget=10**6, max_num_seqs=2, max_model_len=10**6)
    manager = BlockManager(layout)
    seq = _seq(10**5)
    assert layout.num_blocks == 0 and manager.can_allocate(seq, 10**5)
    manager.allocate(seq, 10**5)
    assert seq.block_table == []


@pytest.mark.parametrize("fmt,rounding", [
    (FP8, lambda x: fp8_round(x, block=32)),
    (KV_FP4, lambda x: fp4_round(x, block=16, e4m3_scale=True)),
    (INDEX_FP4, lambda x: fp4_round(x, block=32, e4m3_scale=False)),
])
@pytest.mark.parametrize("seed", [0, 1])
def test_formats_store_rounded_values_exactly(fmt: EntryFormat, rounding, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 64, generator=g) * torch.logspace(-14, 8, 40)[:, None]  # subnormal scales to huge ones
    x[0] = 0.0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4)  # fp4 ties
    x[2, :16] = 1e-3  # a small block whose largest code is not 6
    values = rounding(x)
    parts = fmt.encode(values)
    assert [p.dtype for p in parts] == [p.dtype for p in fmt.storage((1,), 64)]
    back = fmt.decode(*parts)
    assert torch.equal(back.view(torch.int32), values.view(torch.int32))  # bit for bit, signs of zeros included


def test_fp4_encoding_refuses_values_off_the_grid() -> None:
    with pytest.raises(ValueError, match="fp4 grid"):
        KV_FP4.encode(torch.full((1, 16), 0.3) + torch.arange(16) * 1e-3)


def test_the_window_ring_keeps_the_last_positions() -> None:
    cache = PagedCache(CacheSpec(windows=((0, 32, 4, EntryFormat()),)), num_slots=2, num_blocks=0, block_size=2)
    state = SequenceState(cache=cache, slot=1)
    values = torch.arange(10 * 32, dtype=torch.float32).reshape(10, 32)
    cache.write_window(state, 0, values[:3], window=4)
    state.num_tokens = 3
    cache.write_window(state, 0, values[3:10], window=4)  # a chunk longer than the ring
    state.num_tokens = 10
    assert torch.equal(cache.read_window(state, 0, 3), values[7:10])


def test_paged_caches_give_the_unpaged_logits_bit_for_bit(compiled_fixture) -> None:
    """Scattered blocks, a ring that wraps (window 8), partial groups across chunks, the n-gram history."""
    model = compiled_fixture("v41-tiny-engram")
    spec = CacheSpec.from_graph(model.graph)
    cache = PagedCache(spec, num_slots=3, num_blocks=12, block_size=16)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (45, 9, 30)]
    paged = [SequenceState(cache=cache, slot=2 - i, block_table=[11 - i, 3 + i, 6 + i, i]) for i in range(3)]
    plain = [model.new_sequence() for _ in range(3)]
    for lo, hi in [(0, 5), (5, 6), (6, 45)]:
        chunks = [p[lo:hi] or [int(p[0])] for p in prompts]
        a = model.step(list(zip(paged, chunks, strict=True)), all_logits=True)
        b = model.step(list(zip(plain, chunks, strict=True)), all_logits=True)
        assert torch.equal(a, b)
    for token in (3, 77, 500):
        assert torch.equal(model.step([(s, [token]) for s in paged]), model.step([(s, [token]) for s in plain]))
