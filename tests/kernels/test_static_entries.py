"""A static step's compressed layers (dsl/ops/static_entries.py): the compressor's pooling and store through the step's
layout give the eager forms' entries and pools bit for bit, padding rows storing nothing; the indexer's scores and the
in-place attention over the picks, launched on the step's tensors over a cache's static width, give the eager
kernels' values bit for bit on the real rows and their torch references' within a tolerance. The sequences hold no
entry, one, a block's worth and more, with chunks that complete none, one and two groups."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.paged_ops as paged
from dsl.cache import CacheSpec, PagedCache
from dsl.context import ForwardContext, SequenceState
from dsl.ops.attention import cache_append
from dsl.ops.compressor import compress_pool
from dsl.ops.indexer import static_index_scores
from dsl.ops.rounding import fp4_round
from dsl.ops.static_attention import StaticWindow, static_attention
from dsl.ops.static_entries import StaticCompressed, StaticEntries
from dsl.step import StaticStep, table_width
from kernels.attention.paged_ops import paged_attention_op, static_attention_op
from kernels.indexer.index_scores import index_scores_op, reads_in_place
from tests.kernels.attention.test_paged_attention import POOL_FMT, make_step
from tests.kernels.attention.test_static_attention import PADDING, SPLIT, WHOLE, static_step
from tests.kernels.cases import gen, rel_l2

RATIO, BLOCK = 4, 8  # two entries a block
# (start position, chunk length): caches of 0, 1, 2 (a whole block) and more entries after the step
CHUNKS = [(0, 1), (3, 1), (7, 1), (12, 4), (9, 2)]


def chunks_holding(chunks: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """make_step's chunks, each cache holding the entries its positions complete by the end of the step."""
    return [(start, n, (start + n) // RATIO) for start, n in chunks]


@pytest.mark.parametrize("dot_fp32", [False, True])
@pytest.mark.parametrize("config", [WHOLE, SPLIT], ids=["whole", "split"])
def test_static_attention_over_picks_is_the_eager_kernel(dot_fp32: bool, config: dict, device: str) -> None:
    step = make_step(chunks_holding(CHUNKS), heads=2, dim=64, window=8, topk=6, spare=3, block_size=BLOCK,
                     ratio=RATIO, device=device)
    ctx, q, sink, topk = step["ctx"], step["q"], step["sink"], step["topk"]
    n, scale = ctx.num_tokens, 64**-0.5
    eager = paged_attention_op(q, step["view"], sink, step["compressed"], topk, window_size=8, scale=scale, ctx=ctx,
                               config=config, dot_fp32=dot_fp32)
    layout = static_step(step, n + PADDING)
    window, compressed = StaticWindow(layout, 0, 8), StaticCompressed(layout, "kv", 0, RATIO)
    padded_q = torch.cat([q, gen(PADDING, *q.shape[1:], seed=9, device=device)])
    padded_picks = torch.cat([topk, topk.new_zeros(PADDING, topk.shape[1])])
    got = static_attention_op(padded_q, window, sink, compressed, padded_picks, window_size=8, scale=scale,
                              config=config, dot_fp32=dot_fp32)
    assert torch.equal(got[:n], eager)
    want = static_attention(padded_q if dot_fp32 else padded_q.bfloat16().float(), window, sink, compressed,
                            padded_picks, window_size=8, scale=scale)
    assert rel_l2(got[:n], want[:n]) < (1e-5 if dot_fp32 else 4e-3)


@pytest.mark.parametrize("dot_fp32", [False, True])
def test_static_scores_are_the_eager_kernel_s(dot_fp32: bool, monkeypatch, device: str) -> None:
    """Scores read in place (`paged_index_scores`), eagerly over the longest cache and in a static step over its
    static width: bitwise alike; the gathered kernel's and the torch reference's within a tolerance (other sums)."""
    step = make_step(chunks_holding(CHUNKS), heads=2, dim=64, window=8, topk=6, spare=3, block_size=BLOCK,
                     ratio=RATIO, device=device)
    ctx, n = step["ctx"], step["ctx"].num_tokens
    q, weights = gen(n, 4, 64, seed=3, device=device), gen(n, 4, seed=4, device=device)
    config = {"block_H": 16, "block_D": 32, "block_L": 16, "num_warps": 4, "num_stages": 1}
    assert reads_in_place(step["compressed"], 64)
    eager = index_scores_op(q, weights, step["compressed"], ratio=RATIO, ctx=ctx, config=config, dot_fp32=dot_fp32)
    with monkeypatch.context() as m:
        m.setattr(paged, "IN_PLACE", False)
        assert not reads_in_place(step["compressed"], 64)
        gathered = index_scores_op(q, weights, step["compressed"], ratio=RATIO, ctx=ctx, config=config,
                                   dot_fp32=dot_fp32)
    finite = torch.isfinite(gathered)
    assert torch.equal(finite, torch.isfinite(eager)) and finite.any()
    assert rel_l2(eager[finite], gathered[finite]) < (1e-6 if dot_fp32 else 1e-2)
    layout = static_step(step, n + PADDING)
    keys = StaticCompressed(layout, "kv", 0, RATIO)
    padded_q = torch.cat([q, gen(PADDING, 4, 64, seed=5, device=device)])
    padded_w = torch.cat([weights, gen(PADDING, 4, seed=6, device=device)])
    got = index_scores_op(padded_q, padded_w, keys, ratio=RATIO, ctx=layout, config=config, dot_fp32=dot_fp32)
    width = eager.shape[1]
    assert got.shape == (n + PADDING, keys.width) and keys.width >= width
    assert torch.equal(got[:n, :width], eager) and (got[:n, width:] == float("-inf")).all()
    want = static_index_scores(padded_q if dot_fp32 else padded_q.bfloat16().float(), padded_w, keys, ratio=RATIO,
                               step=layout)
    finite = torch.isfinite(want[:n])
    assert torch.equal(finite, torch.isfinite(got[:n]))
    assert rel_l2(got[:n][finite], want[:n][finite]) < (1e-5 if dot_fp32 else 1e-2)
    with monkeypatch.context() as m:  # a key dim the in-place kernel does not take: the static step gathers too
        m.setattr(paged, "IN_PLACE", False)
        static_gathered = index_scores_op(padded_q, padded_w, keys, ratio=RATIO, ctx=layout, config=config,
                                          dot_fp32=dot_fp32)
    assert torch.equal(static_gathered[:n, :width], gathered) and (static_gathered[:n, width:] == float("-inf")).all()


@pytest.mark.parametrize("heads, block_h", [(4, 16), (32, 16)], ids=["one head block", "two head blocks"])
def test_in_place_scores_are_the_same_for_any_steps(heads: int, block_h: int, device: str) -> None:
    """A program of the in-place scores takes `steps` blocks of entries in turn: every entry's score is the one
    program a block gives, bit for bit, over caches of 0 to 52 entries (one step, several, past the last)."""
    step = make_step(chunks_holding([(0, 1), (3, 1), (150, 2), (201, 8)]), heads=2, dim=64, window=8, topk=6, spare=3,
                     block_size=BLOCK, ratio=RATIO, device=device)
    ctx, n = step["ctx"], step["ctx"].num_tokens
    q, weights = gen(n, heads, 64, seed=3, device=device), gen(n, heads, seed=4, device=device)
    config = {"block_H": block_h, "block_D": 32, "block_L": 16, "num_warps": 4, "num_stages": 1}
    want = index_scores_op(q, weights, step["compressed"], ratio=RATIO, ctx=ctx, config=config)
    assert want.shape == (n, 52) and (want[torch.isfinite(want)] != 0).sum() > 100
    for steps in (2, 3, 5):
        got = index_scores_op(q, weights, step["compressed"], ratio=RATIO, ctx=ctx, config=config | {"steps": steps})
        assert torch.equal(got, want), steps
    with pytest.raises(ValueError, match="positive int"):
        index_scores_op(q, weights, step["compressed"], ratio=RATIO, ctx=ctx, config=config | {"steps": -1})


def pools(dim: int, seed: int) -> tuple[PagedCache, list[SequenceState]]:
    """A compressor's pools: every chunk's sequence with its partial ring filled before its start, its table
    scattered; one more slot than sequences, unused."""
    spec = CacheSpec(compressed=(("kv", 0, dim, RATIO, POOL_FMT),), partials=((0, dim, RATIO),), spare=3)
    cache = PagedCache(spec, num_slots=len(CHUNKS) + 1, num_blocks=24, block_size=BLOCK)
    cache.partials[0].copy_(gen(*cache.partials[0].shape, seed=seed))
    for parts in cache.compressed[("kv", 0)][2]:
        parts.zero_()
    blocks = torch.randperm(24, generator=torch.Generator().manual_seed(seed)).tolist()
    states = []
    for i, (start, n) in enumerate(CHUNKS):
        need = -(-(start + n) // BLOCK)
        table, blocks = blocks[:need], blocks[need:]
        states.append(SequenceState(num_tokens=start, cache=cache, slot=len(CHUNKS) - 1 - i, block_table=table))
    return cache, states


def rounded(entries: torch.Tensor) -> torch.Tensor:
    """Entries as the model stores them: on the KV pool's fp4 grid."""
    return fp4_round(entries, block=16, e4m3_scale=True)


def test_the_static_compressor_stores_what_the_eager_one_does() -> None:
    dim = 32
    eager_cache, eager_states = pools(dim, seed=1)
    static_cache, static_states = pools(dim, seed=1)
    lengths = [n for _, n in CHUNKS]
    ctx = ForwardContext(eager_states, lengths, device="cpu")
    n = ctx.num_tokens
    kv, gate = gen(n + PADDING, dim, seed=2), gen(n + PADDING, dim, seed=3)
    want = compress_pool(kv[:n], gate[:n], layer=0, ratio=RATIO, ctx=ctx)
    cache_append(want.replace(rounded(want.values)), layer=0, name="kv", ctx=ctx)

    static_ctx = ForwardContext(static_states, lengths, device="cpu")
    width = table_width(max(len(s.block_table) for s in static_states))
    layout = StaticStep(n + PADDING, width, static_cache)
    layout.fill(static_ctx)
    got = compress_pool(kv, gate, layer=0, ratio=RATIO, ctx=layout)
    assert isinstance(got, StaticEntries) and got.values.shape == (n + PADDING, dim)
    done = ((layout.positions + 1) % RATIO == 0) & (layout.write_slots >= 0)
    assert done.sum() == want.values.shape[0] == sum(want.counts) > 0
    assert torch.equal(got.values[done], want.values) and (got.values[~done] == 0).all()
    view = cache_append(got.replace(rounded(got.values)), layer=0, name="kv", ctx=layout)
    assert torch.equal(view.lengths()[: len(CHUNKS)].long(), torch.tensor([(s + t) // RATIO for s, t in CHUNKS]))
    for a, b in zip(static_cache.compressed[("kv", 0)][2], eager_cache.compressed[("kv", 0)][2], strict=True):
        assert torch.equal(a, b)  # the same entries in the same places, nothing else written
    kept = static_cache.num_slots  # every slot's ring alike; the scratch slot past them took the padding rows
    assert torch.equal(static_cache.partials[0][:, :kept], eager_cache.partials[0][:, :kept])
