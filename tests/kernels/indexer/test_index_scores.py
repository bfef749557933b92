"""The indexer's scores against `dsl.ops.indexer.index_scores`, and a token's scores bitwise the same in any batch."""

from __future__ import annotations

import pytest
import torch

from dsl.context import ForwardContext, SequenceState
from dsl.ops.cache_view import CacheView
from dsl.ops.indexer import index_scores as ref_index_scores
from graphs.plan import INVARIANT_TOKENS
from kernels.indexer.index_scores import index_scores_op
from kernels.registry import LOWERINGS
from tests.kernels.cases import gen, rel_l2

INDEX_HEADS, INDEX_DIM = 64, 128  # V4.1-Flash's index_n_heads, index_head_dim


def make_inputs(chunks: list[tuple[int, int, int]], heads: int, dim: int, device: str, seed: int = 0):
    """chunks: (start position, tokens, cached entries) per sequence. Returns q, weights, keys and the context."""
    ctx = ForwardContext([SequenceState(num_tokens=start) for start, _, _ in chunks], [n for _, n, _ in chunks],
                         device=device)
    keys = CacheView([gen(e, dim, device=device, seed=seed + 10 * i) for i, (_, _, e) in enumerate(chunks)])
    q = gen(ctx.num_tokens, heads, dim, device=device, seed=seed + 99)
    weights = gen(ctx.num_tokens, heads, device=device, seed=seed + 98)
    return q, weights, keys, ctx


def check(chunks, heads, dim, ratio, device, config=None, dot_fp32=False, tol=1e-5) -> None:
    q, weights, keys, ctx = make_inputs(chunks, heads, dim, device)
    got = index_scores_op(q, weights, keys, ratio=ratio, ctx=ctx, config=config, dot_fp32=dot_fp32)
    if not dot_fp32:  # the kernel's operands: q and keys in bf16
        q, keys = q.bfloat16().float(), CacheView([k.bfloat16().float() for k in keys.keys])
    want = ref_index_scores(q, weights, keys, ratio=ratio, ctx=ctx)
    assert got.shape == want.shape and got.dtype == torch.float32
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite) and torch.equal(got[~finite], want[~finite])  # -inf where hidden
    if finite.any():
        assert rel_l2(got[finite], want[finite]) < tol


SMALL = {"block_H": 16, "block_D": 16, "block_L": 16, "num_warps": 4, "num_stages": 2}  # several head and d steps, L blocks

CASES = [  # (start, tokens, cached entries) per chunk; heads; dim
    ([(0, 1, 0)], 4, 32),  # the first token: nothing cached, every row -inf-padded to width 0
    ([(40, 1, 21), (7, 1, 0), (90, 1, 45), (3, 1, 2)], 20, 40),  # decode, one empty cache, 20 heads of 40 (masked)
    ([(17, 9, 37), (0, 6, 3)], 8, 32),  # prefill chunks after earlier tokens: entries complete mid-chunk
    ([(0, 0, 0), (60, 3, 70)], 16, 48),  # a chunk of no tokens; more entries cached than any token sees
]


@pytest.mark.parametrize("chunks,heads,dim", CASES)
@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("dot_fp32", [False, True])
@pytest.mark.parametrize("config", [SMALL, None], ids=["small", "default"])
def test_index_scores_match_reference(chunks, heads, dim, ratio, dot_fp32, config, device) -> None:
    check(chunks, heads, dim, ratio, device, config, dot_fp32, tol=1e-5)


def test_index_scores_of_no_tokens(device) -> None:
    q, weights, keys, ctx = make_inputs([(5, 0, 3)], 4, 32, device)
    assert index_scores_op(q, weights, keys, ratio=2, ctx=ctx).shape == (0, 3)


def test_index_scores_reject_mismatched_shapes(device) -> None:
    from kernels.indexer.index_scores import index_scores

    q, ints = gen(3, 4, 32, device=device), torch.zeros(3, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="do not match"):
        index_scores(q, gen(3, 5, device=device), gen(7, 32, device=device), ints, ints, ints, ratio=1, width=7)
    with pytest.raises(ValueError, match="int32"):
        index_scores(q, gen(3, 4, device=device), gen(7, 32, device=device), ints.long(), ints, ints, ratio=1,
                     width=7)


def invariant_config(heads: int, dim: int) -> dict:
    lowering = LOWERINGS["index_scores"]
    return lowering.invariant(lowering.default_config(lowering.static_type(heads, dim), INVARIANT_TOKENS))


@pytest.mark.usefixtures("row_independent_dot")  # the kernel's order, not the host BLAS's (conftest.py)
@pytest.mark.parametrize("config", [SMALL, None], ids=["small", "invariant"])
@pytest.mark.parametrize("dot_fp32", [False, True])
def test_a_token_scores_the_same_in_any_batch(config, dot_fp32, device) -> None:
    """Chunk (70, 1, 35) alone, then third among chunks with longer and shorter caches and more tokens: its row is
    bitwise the same, padded with -inf to the batch's longest cache."""
    heads, dim, ratio, mine = 8, 32, 2, (70, 1, 35)
    config = config or invariant_config(heads, dim)
    q1, w1, k1, ctx1 = make_inputs([mine], heads, dim, device, seed=5)
    alone = index_scores_op(q1, w1, k1, ratio=ratio, ctx=ctx1, config=config, dot_fp32=dot_fp32)[0]
    assert torch.isfinite(alone).all()
    for others in ([(400, 1, 200), (9, 1, 4)], [(0, 30, 15), (100, 7, 53), (300, 1, 150), (2, 1, 1)]):
        q, weights, keys, ctx = make_inputs(others[:2] + [mine] + others[2:], heads, dim, device, seed=7)
        row = sum(n for _, n, _ in others[:2])
        q[row], weights[row] = q1[0], w1[0]
        keys = CacheView(keys.keys[:2] + k1.keys + keys.keys[3:])
        got = index_scores_op(q, weights, keys, ratio=ratio, ctx=ctx, config=config, dot_fp32=dot_fp32)[row]
        assert torch.equal(got[:35], alone) and torch.isneginf(got[35:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_index_scores_v41_decode(num_seqs) -> None:
    chunks = [(4000 + 37 * i, 1, (4001 + 37 * i) // 4 + 3) for i in range(num_seqs)]
    check(chunks, INDEX_HEADS, INDEX_DIM, 4, "cuda", tol=1e-5)
    check(chunks, INDEX_HEADS, INDEX_DIM, 4, "cuda", dot_fp32=True, tol=1e-5)


@pytest.mark.gpu
def test_index_scores_v41_prefill_chunk() -> None:
    check([(300, 45, 86), (0, 600, 150), (9, 1, 0)], INDEX_HEADS, INDEX_DIM, 4, "cuda", tol=1e-5)


@pytest.mark.gpu
def test_a_token_scores_the_same_in_any_batch_on_the_gpu() -> None:
    test_a_token_scores_the_same_in_any_batch(None, False, "cuda")
