"""Sparse attention with sink (window + selected compressed entries) against `dsl.ops.attention`."""

from __future__ import annotations

import pytest
import torch

from dsl.context import ForwardContext, SequenceState
from dsl.ops.attention import sparse_attention as ref_sparse_attention
from dsl.ops.cache_view import CacheView
from kernels.attention.sparse_attention import sparse_attention_op
from tests.kernels.cases import HEAD_DIM, HEADS, INDEX_TOPK, WINDOW, gen, rel_l2


def make_inputs(chunks: list[tuple[int, int]], heads: int, dim: int, window: int, entries: int, topk: int,
                device: str, seed: int = 0):
    """chunks: (start position, length) per sequence. Returns the DSL op's arguments and its context."""
    states = [SequenceState(num_tokens=start) for start, _ in chunks]
    ctx = ForwardContext(states, [n for _, n in chunks], device=device)
    g = torch.Generator().manual_seed(seed)
    keys, positions, comp = [], [], []
    for i, (start, n) in enumerate(chunks):
        held = min(start, window - 1) + n  # kept entries from earlier forwards, then this chunk
        keys.append(gen(held, dim, device=device, seed=seed + 10 * i))
        positions.append(torch.arange(start + n - held, start + n))
        comp.append(gen(entries, dim, device=device, seed=seed + 10 * i + 1))
    total = ctx.num_tokens
    topk_ids = torch.stack([torch.randperm(entries, generator=g)[:topk] for _ in range(total)])
    topk_ids[torch.rand(total, topk, generator=g) < 0.2] = -1  # some slots pick nothing
    q = gen(total, heads, dim, device=device, seed=seed + 99)
    sink = gen(heads, device=device, seed=seed + 98)
    return (q, CacheView(keys, positions), sink, CacheView(comp), topk_ids.to(device)), ctx


def check(chunks, heads, dim, window, entries, topk, device, config=None, dot_fp32=False, tol=1e-5) -> None:
    args, ctx = make_inputs(chunks, heads, dim, window, entries, topk, device)
    scale = dim**-0.5
    got = sparse_attention_op(*args, window_size=window, scale=scale, ctx=ctx, config=config, dot_fp32=dot_fp32)
    q, win, sink, comp, picks = args
    if not dot_fp32:  # the kernel's operands: q and keys in bf16
        q = q.bfloat16().float()
        win = CacheView([k.bfloat16().float() for k in win.keys], win.positions)
        comp = CacheView([k.bfloat16().float() for k in comp.keys])
    want = ref_sparse_attention(q, win, sink, comp, picks, window_size=window, scale=scale, ctx=ctx)
    assert got.shape == want.shape
    assert rel_l2(got, want) < tol


SMALL = dict(block_H=16, block_S=16, num_warps=4, num_stages=2, split_kv=1)
SPLIT = dict(SMALL, split_kv=4)  # entries split in 4 parts, combined with the sink afterwards


@pytest.mark.parametrize("chunks,heads,dim,window,entries,topk", [
    ([(0, 1)], 4, 40, 8, 5, 3),  # the first token: a window of one, few entries
    ([(20, 1), (3, 1), (9, 1)], 4, 64, 8, 30, 12),  # decode: one token per sequence
    ([(5, 11)], 2, 40, 8, 12, 6),  # prefill chunk after earlier tokens
])
@pytest.mark.parametrize("dot_fp32", [False, True])
@pytest.mark.parametrize("config", [SMALL, SPLIT], ids=["whole", "split"])
def test_sparse_attention_matches_reference(chunks, heads, dim, window, entries, topk, dot_fp32, config,
                                            device) -> None:
    check(chunks, heads, dim, window, entries, topk, device, config, dot_fp32, tol=1e-5 if dot_fp32 else 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_sparse_attention_v41_decode(num_seqs) -> None:
    chunks = [(1000 + 37 * i, 1) for i in range(num_seqs)]
    check(chunks, HEADS, HEAD_DIM, WINDOW, 2000, INDEX_TOPK, "cuda", tol=1e-2)
    check(chunks, HEADS, HEAD_DIM, WINDOW, 2000, INDEX_TOPK, "cuda", dot_fp32=True, tol=1e-5)
    for split in (1, 8):  # both paths at the real shape, whatever the heuristic picks for this token count
        config = dict(block_H=16, block_S=32, num_warps=8, num_stages=2, split_kv=split)
        check(chunks, HEADS, HEAD_DIM, WINDOW, 2000, INDEX_TOPK, "cuda", config=config, tol=1e-2)


@pytest.mark.gpu
def test_sparse_attention_v41_prefill_chunk() -> None:
    check([(300, 45), (0, 3)], HEADS, HEAD_DIM, WINDOW, 700, INDEX_TOPK, "cuda", tol=1e-2)
