"""The index tensors and rotations that eager cache-side ops make once per forward (`ForwardContext.memo`) and share
between layers: a later layer, with other values or another layout, gets what a fresh forward would give it; and the
pairwise rotation is bitwise the written-out formula."""

from __future__ import annotations

import random

import pytest
import torch

from dsl.context import ForwardContext, SequenceState, take_rows
from dsl.ops.attention import visible_entries
from dsl.ops.indexer import candidate_blocks, invariant_candidate_blocks, stable_top
from dsl.ops.rope import _freqs_on, inv_freq, rope_entries, rope_params, rotate
from dsl.ragged import Ragged
from tests.test_paged_batched import OPS_REF, TOPK, WINDOW, Twin, check_same, make_inputs, next_step, run_ops

YARN = rope_params({"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "rope_theta": 160000.0,
                    "original_max_position_embeddings": 65536, "attention_factor": 1.3})
PLAIN = rope_params({"rope_theta": 10000.0})


def written_out(x: torch.Tensor, positions: torch.Tensor, params, rope_dim: int, inverse: bool) -> torch.Tensor:
    """The rotation as V41_SPEC.md writes it: (even, odd) -> (even cos - odd sin, even sin + odd cos)."""
    magnitude = inv_freq(params, rope_dim)[1]
    angles = positions.float()[:, None] * _freqs_on(params, rope_dim, x.device)[None, :]
    cos, sin = angles.cos() * magnitude, angles.sin() * magnitude * (-1 if inverse else 1)
    for _ in range(x.dim() - 2):
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    even, odd = x[..., -rope_dim::2].float(), x[..., -rope_dim + 1::2].float()
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rope_dim], rotated.to(x.dtype)], dim=-1)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("params", [YARN, PLAIN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 64), (5, 3, 80), (0, 64), (9, 2, 4, 48)])
def test_rotate_is_bitwise_the_written_out_formula(params, dtype, shape) -> None:
    gen = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    for inverse in (False, True):
        x = (torch.randn(shape, generator=gen) * 10).to(dtype)
        x.view(-1)[::7], x.view(-1)[::11] = 0.0, -0.0  # signed zeros: a - b and a + (-b) must agree on them too
        positions = torch.randint(0, 100000, (shape[0],), generator=gen)
        assert torch.equal(bits(rotate(x, positions, params, 32, inverse)),
                           bits(written_out(x, positions, params, 32, inverse)))


def test_rope_entries_of_two_layouts_in_one_forward() -> None:
    """Entries of ratio 2 then 4 (other first indices and counts) and again 2 with other values, in one context: each
    rotated at its own positions, entry j of ratio r at j * r."""
    states = [SequenceState(num_tokens=n) for n in (0, 17, 300)]
    ctx = ForwardContext(states, [5, 1, 9])
    gen = torch.Generator().manual_seed(0)
    for ratio, first, counts in ((2, [0, 8, 150], [2, 1, 4]), (4, [0, 4, 75], [1, 0, 2]), (2, [0, 8, 150], [2, 1, 4])):
        values = torch.randn(sum(counts), 3, 48, generator=gen)
        got = rope_entries(Ragged(values, counts, first), params=YARN, rope_dim=32, ratio=ratio, ctx=ctx)
        positions = torch.tensor([(f + j) * ratio for f, n in zip(first, counts) for j in range(n)])
        assert torch.equal(got.values, written_out(values, positions, YARN, 32, inverse=False))
        assert (got.counts, got.first) == (counts, first)


@pytest.mark.parametrize("seed", [0, 1])
def test_visible_entries_of_each_layer_as_in_a_fresh_forward(seed: int) -> None:
    """Two layers' picks over a window view and a draft block's view (causal or not) in one paged forward: the entry lists and keys are those a fresh
    context gives, in int32 as in int64."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    twin = Twin(4, rng, "cpu")
    for _ in range(4):
        step = next_step(rng, twin)
        lengths = [n for _, n in step]
        states = [twin.paged[i] for i, _ in step]
        ctx = ForwardContext(states, lengths)
        out = run_ops(ctx, make_inputs(sum(lengths), gen, "cpu"), OPS_REF)
        width = max(out["kv2"].lengths)
        for window, causal in ((out["window0"], True), (out["block0"], True), (out["block0"], False)):
            for _ in range(2):
                picks = torch.randint(-1, max(width, 1), (sum(lengths), TOPK), generator=gen)
                picks = torch.minimum(picks, torch.tensor(out["kv2"].lengths)[ctx.row_chunks][:, None] - 1)
                want = visible_entries(window, out["kv2"], picks, window_size=WINDOW, causal=causal,
                                       ctx=ForwardContext(states, lengths), dtype=torch.float32)
                for index_dtype in (torch.int64, torch.int32):
                    kv, idx = visible_entries(window, out["kv2"], picks, window_size=WINDOW, causal=causal, ctx=ctx,
                                              dtype=torch.float32, index_dtype=index_dtype)
                    assert idx.dtype == index_dtype and torch.equal(idx.long(), want[1]) and torch.equal(kv, want[0])
        ctx.commit()


def _pool_tensors(cache) -> list[torch.Tensor]:
    return ([t for _, parts in cache.windows.values() for t in parts]
            + [t for _, _, parts in cache.compressed.values() for t in parts] + [*cache.partials.values(), cache.history])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cache_ops_run_again_in_one_forward_as_in_a_fresh_one(seed: int) -> None:
    """Every cache op run twice on one paged context, the pools put back in between (what a later layer of the same
    layouts meets), with other values the second time: the memoized layouts give what the per-chunk path gives."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    twin = Twin(5, rng, "cpu")
    for _ in range(6):
        step = next_step(rng, twin)
        lengths = [n for _, n in step]
        before = [t.clone() for t in _pool_tensors(twin.cache)]
        ctx, plain = ForwardContext([twin.paged[i] for i, _ in step], lengths), [twin.plain[i] for i, _ in step]
        run_ops(ctx, make_inputs(sum(lengths), gen, "cpu"))
        inputs = make_inputs(sum(lengths), gen, "cpu")
        for t, kept in zip(_pool_tensors(twin.cache), before, strict=True):
            t.copy_(kept)
        plain_ctx = ForwardContext(plain, lengths)
        check_same(run_ops(ctx, inputs), run_ops(plain_ctx, inputs))
        ctx.commit()
        plain_ctx.commit()


def test_ring_targets_are_the_written_out_rows() -> None:
    """The rows each token stores in a ring: rows + left // ring * ring (left: its chunk's rows after it), given as
    None where that is every row itself."""
    twin = Twin(4, random.Random(0), "cpu")
    for lengths in ([1, 1, 1, 1], [3, 1, 5, 2], [12, 1, 30, 4], [0, 2, 0, 1]):
        states = [SequenceState(num_tokens=7 * i, cache=twin.cache, slot=twin.slots[i]) for i in range(4)]
        ctx = ForwardContext(states, lengths)
        for ring in (5, 11, 2):
            slots, rows = ctx.paged.ring_targets(ring)
            want, begin = [], 0
            for n in lengths:
                want += [r + (begin + n - 1 - r) // ring * ring for r in range(begin, begin + n)]
                begin += n
            assert (rows is None) == (want == list(range(sum(lengths))))
            assert take_rows(torch.arange(sum(lengths)), rows).tolist() == want
            assert slots.tolist() == [twin.slots[i] for i, n in enumerate(lengths) for _ in range(n)]


def test_paged_batch_of_one_copy() -> None:
    """Slots and zero-padded block tables, the tables contiguous (as the cache kernels take them)."""
    twin = Twin(3, random.Random(1), "cpu")
    tables = [[5, 2], [], [7, 1, 4]]
    states = [SequenceState(cache=twin.cache, slot=s, block_table=t) for s, t in zip((4, 0, 2), tables)]
    batch = ForwardContext(states, [1, 2, 1]).paged
    assert batch.slots.tolist() == [4, 0, 2] and batch.tables.is_contiguous()
    assert batch.tables.tolist() == [[5, 2, 0], [0, 0, 0], [7, 1, 4]]


def test_entry_layouts_of_one_forward_as_written_out() -> None:
    """Per layout: lengths, offsets, and each new entry's chunk and index; None where no entry is new; a second
    layout in the same forward gets its own."""
    ctx = ForwardContext([SequenceState(num_tokens=n) for n in (0, 17, 300)], [5, 1, 9])
    for first, counts in (([0, 4, 75], [1, 0, 2]), ([0, 8, 150], [2, 1, 4]), ([0, 4, 75], [0, 0, 0]),
                          ([0, 4, 75], [1, 0, 2])):
        length, offset, run, index = ctx.entry_layout(first, counts)
        lengths = [f + n for f, n in zip(first, counts)]
        assert length.tolist() == lengths and offset.tolist() == [sum(lengths[:i]) for i in range(3)]
        if not sum(counts):
            assert run is None and index is None
            continue
        assert run.tolist() == [i for i, n in enumerate(counts) for _ in range(n)]
        assert index.tolist() == [f + j for f, n in zip(first, counts) for j in range(n)]


def test_rope_entries_without_entries_are_the_input() -> None:
    ctx = ForwardContext([SequenceState(num_tokens=n) for n in (1, 5)], [1, 1])
    x = Ragged(torch.randn(0, 48), [0, 0], [0, 1])
    assert rope_entries(x, params=YARN, rope_dim=32, ratio=4, ctx=ctx).values is x.values


def previous_candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, ratio: int, block: int,
                              topk_blocks: int, stable: bool = False) -> torch.Tensor:
    """`candidate_blocks` as it was written before its layout was memoized (`stable`: the batch-invariant form's)."""
    width = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -width % block), value=float("-inf"))
    blocks = padded.unflatten(-1, (-1, block)).amax(dim=-1)
    newest = ((positions.unsqueeze(-1) + 1) // ratio - 1) // block
    blocks = blocks.masked_fill(torch.arange(blocks.shape[-1]) == newest, float("inf"))
    if stable:
        top = stable_top(blocks, topk_blocks)[:, : blocks.shape[-1]]
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top, blocks.gather(-1, top) > float("-inf"))
    else:
        top = blocks.topk(min(topk_blocks, blocks.shape[-1]), dim=-1)
        keep = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
    return keep.repeat_interleave(block, dim=-1)[..., :width]


def test_candidate_blocks_of_several_layers_as_before() -> None:
    """Layers of other ratios, blocks and widths, and the same again with other scores, in one forward (positions
    from 0, where no entry is visible yet): the previous formulation's masks."""
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 3, 1, 40, 1]
    ctx = ForwardContext([SequenceState(num_tokens=n) for n in (0, 2, 9, 100, 4000)], lengths)
    for ratio, block, width, topk_blocks in ((4, 8, 37, 2), (4, 8, 40, 2), (128, 4, 32, 3), (4, 8, 37, 2),
                                             (4, 8, 37, 9)):
        scores = torch.randn(sum(lengths), width, generator=gen)
        scores[scores < -1] = float("-inf")
        got = candidate_blocks(scores, ratio=ratio, block=block, topk_blocks=topk_blocks, ctx=ctx)
        assert torch.equal(got, previous_candidate_blocks(scores, ctx.positions, ratio, block, topk_blocks))
        ties = scores.clone()
        ties[:, 1::3] = 0.5  # equal block maxima: the invariant form's lowest-index tie-break
        got = invariant_candidate_blocks(ties, ratio=ratio, block=block, topk_blocks=topk_blocks, ctx=ctx)
        assert torch.equal(got, previous_candidate_blocks(ties, ctx.positions, ratio, block, topk_blocks, True))
