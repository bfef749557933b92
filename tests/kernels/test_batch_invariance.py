"""Batch invariance of the kernels under a fixed config (what a plan's batch-invariant config is, graphs/plan.py):
a row's output is bitwise the same alone and among other rows, wherever it sits and however many there are, and
still matches the reference. Sparse attention also needs a token's entries in one part: split, the parts follow the
batch's widest entry list.

What is checked is the part the kernel controls: the reduction order its config fixes (tiles over K, split-K counts
and ranges, the combine of parts) does not follow the batch. Under Triton's interpreter a `tl.dot` is the host
BLAS's matmul, whose row results can follow the block's other rows, so these tests take the row-at-a-time dot of
tests/kernels/conftest.py (`row_independent_dot`); on a GPU (`pytest -m gpu`) they run the real `tl.dot`."""

from __future__ import annotations

import pytest
import torch

from dsl.ops import hyper as hyper_ref
from dsl.quant import quantize_fp8_block
from graphs.plan import INVARIANT_TOKENS
from kernels.attention.sparse_attention import sparse_attention
from kernels.hyper.mixes import hc_mixes
from kernels.linear.linear import linear
from kernels.lowering import PLAIN
from kernels.moe.experts import moe_experts
from kernels.norm.rms_norm import rms_norm
from kernels.registry import LOWERINGS
from tests.kernels.cases import gen, rel_l2
from tests.kernels.linear.test_linear import reference as linear_reference
from tests.kernels.moe.test_experts import make_experts, routing

pytestmark = pytest.mark.usefixtures("row_independent_dot")

BATCHES = [(1, 0), (5, 3), (37, 36), (70, 17)]  # (rows, where the row sits): one M tile, several, a partial last one


def invariant_config(op: str, fields: dict) -> dict:
    """The config batch-invariant runs take for a node of these static shapes: INVARIANT_TOKENS's, made invariant."""
    lowering = LOWERINGS[op]
    static = lowering.static_type(**fields)
    gemms = lowering.gemms(static, INVARIANT_TOKENS, False)
    return lowering.invariant(lowering.default_config(static, INVARIANT_TOKENS, PLAIN, gemms))


def among_others(row: torch.Tensor, rows: int, at: int, seed: int) -> torch.Tensor:
    """`row` [1, ...] at index `at` of `rows` rows, the others fresh random values."""
    others = gen(rows, *row.shape[1:], device=row.device, seed=seed).to(row.dtype)
    return torch.cat([others[:at], row, others[at + 1:]])


LINEAR_CASES = [  # (n, k, fmt, config): split-K in fixed K ranges, fp8 scales on x or on W
    (40, 96, "bf16", dict(block_M=16, block_N=32, block_K=32, split_k=2, num_warps=4, num_stages=2)),
    (64, 160, "fp8", dict(block_M=16, block_N=32, block_K=32, split_k=3, num_warps=4, num_stages=2)),
    (96, 80, "fp8", dict(block_M=16, block_N=64, block_K=32, split_k=2, num_warps=4, num_stages=2,
                         fp8_dequant_w=True)),
    (48, 80, "bf16", None),  # the lowering's own invariant config for this shape
]


@pytest.mark.parametrize("n,k,fmt,config", LINEAR_CASES)
def test_linear_row_is_the_same_in_any_batch(n, k, fmt, config, device) -> None:
    # the configs in their invariant form: with fp8 weights one token stays on the tensor cores (`gemv` False)
    config = LOWERINGS["linear"].invariant(config) if config else invariant_config(
        "linear", {"n": n, "k": k, "groups": 1, "fmt": "plain"})
    w = gen(n, k, seed=1, scale=k**-0.5)
    w, s = quantize_fp8_block(w) if fmt == "fp8" else (w.bfloat16(), None)
    w, s = w.to(device), None if s is None else s.to(device)
    row = gen(1, k, device=device, seed=2)
    alone = linear(row, w, s, config=config)
    assert rel_l2(alone, linear_reference(row, w, s, 1, False)) < 2e-5
    for rows, at in BATCHES:
        assert torch.equal(linear(among_others(row, rows, at, seed=rows), w, s, config=config)[at], alone[0])


def test_hc_mixes_row_is_the_same_in_any_batch(device) -> None:
    hc, d = 4, 40
    config = invariant_config("hc_mixes", {"hc": hc, "d": d}) | {"split_k": 2, "block_K": 32}
    fn = gen((2 + hc) * hc, hc * d, device=device, seed=1, scale=(hc * d) ** -0.5)
    scale, base = gen(3, device=device, seed=2).abs() + 0.5, gen((2 + hc) * hc, device=device, seed=3)
    row = gen(1, hc, d, device=device, seed=4)
    alone = hc_mixes(row, fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20, config=config)
    want = hyper_ref.hc_mixes(row.cpu(), fn.cpu(), scale.cpu(), base.cpu(), iters=20, eps=1e-6, norm_eps=1e-20)
    assert all(rel_l2(a, b) < 2e-5 for a, b in zip(alone, want, strict=True))
    for rows, at in BATCHES[1:]:
        got = hc_mixes(among_others(row, rows, at, seed=rows), fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20,
                       config=config)
        assert all(torch.equal(g[at], a[0]) for g, a in zip(got, alone, strict=True))


def test_moe_token_is_the_same_in_any_batch(device) -> None:
    """A token's pairs land in other slots of other blocks as the batch changes; its sum is the same."""
    e, inter, d, k = 8, 64, 64, 3
    config = invariant_config("moe_experts", {"e": e, "inter": inter, "d": d, "topk": k, "fmt": "fp4"})
    ws, ss = make_experts(e, inter, d, "fp4", device)
    weights, experts = routing(1, e, k, device, seed=5)
    x = gen(1, d, device=device, seed=6)
    alone = moe_experts(x, weights, experts, *ws, *ss, limit=10.0, config=config)
    for rows, at in BATCHES[1:3]:
        w_all, e_all = routing(rows, e, k, device, seed=rows)
        w_all[at], e_all[at] = weights[0], experts[0]
        got = moe_experts(among_others(x, rows, at, seed=rows), w_all, e_all, *ws, *ss, limit=10.0, config=config)
        assert torch.equal(got[at], alone[0])


def test_rms_norm_row_is_the_same_in_any_batch(device) -> None:
    row, w = gen(1, 96, device=device, seed=1), gen(96, device=device, seed=2)
    alone = rms_norm(row, w, eps=1e-6, config=invariant_config("rms_norm", {"d": 96, "has_w": True, "eps": 1e-6}))
    for rows, at in BATCHES[1:]:
        assert torch.equal(rms_norm(among_others(row, rows, at, seed=rows), w, eps=1e-6)[at], alone[0])


def attention_batch(width: int, heads: int, dim: int, device: str):
    """Token 0's q and entry list (40 entries in a list `width` wide, -1 after), among 4 tokens with up to `width`
    entries each, in a pool where token 0's keys sit after the others'."""
    q = gen(4, heads, dim, device=device, seed=1).bfloat16()
    pool = gen(4 * width, dim, device=device, seed=2).bfloat16()
    g = torch.Generator().manual_seed(3)
    idx = torch.full((4, width), -1, dtype=torch.int32)
    for t in range(4):
        n = 40 if t == 0 else width - t
        base = (3 * width if t == 0 else (t - 1) * width)
        idx[t, :n] = torch.randperm(width, generator=g)[:n].int() + base
    return q, pool, idx.to(device), gen(heads, device=device, seed=4)


@pytest.mark.parametrize("split", [1, 4])
def test_sparse_attention_token_is_the_same_with_wider_neighbours_only_whole(split, device) -> None:
    heads, dim = 4, 40
    config = invariant_config("sparse_attention", {"h": heads, "d": dim}) | {"block_S": 16, "split_kv": split}
    q, pool, idx, sink = attention_batch(256, heads, dim, device)
    alone = sparse_attention(q[:1], pool, idx[:1, :40].contiguous(), sink, scale=dim**-0.5, config=config)
    batched = sparse_attention(q, pool, idx, sink, scale=dim**-0.5, config=config)
    want = sparse_attention(q[:1].float(), pool.float(), idx[:1], sink, scale=dim**-0.5, dot_fp32=True,
                            config=dict(config, split_kv=1))
    assert rel_l2(alone, want) < 1e-2 and rel_l2(batched[:1], want) < 1e-2
    # whole, a token's entries run in the same blocks whatever the batch's width; split in 4, its 40 entries make
    # three parts of 16 alone and one part of 64 among lists 256 wide
    assert torch.equal(batched[0], alone[0]) == (split == 1)


def test_the_invariant_attention_config_is_whole() -> None:
    config = invariant_config("sparse_attention", {"h": 64, "d": 512})
    lowering = LOWERINGS["sparse_attention"]
    assert config["split_kv"] == 1 and lowering.default_config(lowering.static_type(64, 512), 1)["split_kv"] > 1
