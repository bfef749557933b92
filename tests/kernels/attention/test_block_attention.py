"""DSpark's draft block attention on the in-place kernel (kernels/attention/block_attention.py) against the DSL
reference in float64, within the in-place decode kernel's tolerances (tests/kernels/attention/test_paged_attention.py),
and a static step's launch against the eager one, bit for bit."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.block_attention as block
from dsl.ops.attention import sparse_attention as ref_sparse_attention
from dsl.ops.static_attention import StaticBlock
from dsl.step import StaticStep
from tests.kernels.attention.test_paged_attention import TOLERANCE, make_step
from tests.kernels.cases import HEAD_DIM, HEADS, WINDOW, rel_l2


@pytest.mark.parametrize("dot_fp32", [False, True])
def test_draft_blocks_read_the_ring_in_place(dot_fp32: bool, device) -> None:
    """DSpark's draft block attention (non-causal, over `kv_window_block`'s view: the window before the chunk, then
    the chunk's own keys) on the in-place kernel: the float64 reference's within the tolerance, for chunks at a
    sequence's start, inside the window, past the ring's wrap and at the window's edge, of 1 to 5 tokens; a static
    step's launch over the same layout gives the same values."""
    window = WINDOW
    step = make_step([(0, 3, 0), (6, 5, 0), (3 * window + 7, 5, 0), (window - 1, 1, 0), (window + 2, 4, 0)],
                     heads=HEADS, dim=HEAD_DIM, window=window, topk=1, spare=4, block_size=16, device=device)
    ctx, q, sink, view = step["ctx"], step["q"], step["sink"], step["eager"]
    scale = q.shape[-1] ** -0.5
    assert block.block_chunks(view)
    got = block.block_attention_op(q, view, sink, window_size=window, scale=scale, ctx=ctx, dot_fp32=dot_fp32)
    ref_q = q if dot_fp32 else q.bfloat16()
    want = ref_sparse_attention(ref_q.double(), view, sink.double(), window_size=window, scale=scale, causal=False,
                                ctx=ctx)
    assert got.dtype == torch.float32 and rel_l2(got, want) < TOLERANCE[dot_fp32]
    layout = StaticStep(32, 8, ctx.chunks[0].state.cache)
    layout.fill(ctx)
    static = block.static_block_attention_op(torch.cat([q, q.new_zeros(32 - q.shape[0], *q.shape[1:])]),
                                             StaticBlock(layout, 0, window, torch.cat([view.block, view.block.new_zeros(
                                                 32 - q.shape[0], view.block.shape[1])])),
                                             sink, window_size=window, scale=scale, dot_fp32=dot_fp32)
    assert torch.equal(static[: q.shape[0]], got)
