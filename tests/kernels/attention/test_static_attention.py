"""A static step's window layers (dsl/step.py): the window append stores through the step's layout what the eager
append stores, padding rows nothing; the in-place attention launched on the step's tensors gives the eager in-place
kernel's values bit for bit (hence the gathered path's: tests/kernels/attention/test_paged_attention.py) and its
torch reference's within a tolerance. Padding rows hold random queries and must not disturb the real rows."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.attention import kv_window_append
from dsl.ops.rounding import fp8_round
from dsl.ops.static_attention import StaticWindow, static_attention
from dsl.step import StaticStep, table_width
from kernels.attention.paged_ops import paged_attention_op, static_attention_op
from tests.kernels.attention.test_paged_attention import STEPS, make_step
from tests.kernels.cases import gen, rel_l2

# plan configs: the kernel takes its parts from `split_kv` (kernels/attention/paged_attention.py `tiles`)
WHOLE = dict(block_H=16, block_S=16, num_warps=4, num_stages=2, split_kv=1)
SPLIT = dict(WHOLE, split_kv=4)  # parts that cut the window, combined with the sink afterwards

PADDING = 3  # rows past the step's tokens, as a bucket pads them


def static_step(step: dict, rows: int) -> StaticStep:
    ctx = step["ctx"]
    width = table_width(max(len(c.state.block_table) for c in ctx.chunks))
    layout = StaticStep(rows, width, ctx.chunks[0].state.cache)
    layout.fill(ctx)
    return layout


def test_a_layout_lays_out_the_step() -> None:
    step = make_step(STEPS["verification"], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4)
    ctx = step["ctx"]
    n = ctx.num_tokens
    layout = static_step(step, n + PADDING)
    assert torch.equal(layout.positions[:n], ctx.positions) and torch.equal(layout.positions32[:n].long(),
                                                                            ctx.positions)
    assert torch.equal(layout.row_chunks[:n].long(), ctx.row_chunks)
    assert (layout.positions[n:] == 0).all() and (layout.row_chunks[n:] == 0).all()
    slots = torch.tensor([c.state.slot for c in ctx.chunks])
    assert torch.equal(layout.write_slots[:n].long(), slots[ctx.row_chunks]) and (layout.write_slots[n:] == -1).all()
    b = len(ctx.chunks)
    assert torch.equal(layout.chunk_slots[:b].long(), slots)
    assert torch.equal(layout.chunk_starts[:b].long(), ctx.chunk_starts)
    assert torch.equal(layout.chunk_rows[:b].long(), ctx.chunk_rows) and (layout.floors == 0).all()
    for i, c in enumerate(ctx.chunks):
        table = c.state.block_table
        assert layout.tables[i, :len(table)].tolist() == table and (layout.tables[i, len(table):] == 0).all()
    assert all(t.data_ptr() % 16 == 0 for t in (layout.positions32, layout.row_chunks, layout.tables))
    layout.fill(make_step([(3, 1, 0)], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4)["ctx"])
    assert (layout.write_slots[1:] == -1).all() and (layout.tables[1:] == 0).all()  # a refill leaves nothing behind


def test_a_step_that_does_not_fit_is_named() -> None:
    step = make_step(STEPS["verification"], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4)
    with pytest.raises(ValueError, match="does not fit a static step of 8 rows"):
        StaticStep(8, 8, step["ctx"].chunks[0].state.cache).fill(step["ctx"])
    assert StaticStep.fits(step["ctx"])
    assert not StaticStep.fits(make_step([(10, 5, 4)], heads=2, dim=64, window=8, topk=4, spare=3,
                                         block_size=4)["ctx"])  # a chunk past the rings' spare positions


@pytest.mark.parametrize("name", ["first token", "second token", "window edges", "verification"])
def test_the_static_append_stores_what_the_eager_one_does(name: str, device) -> None:
    want = make_step(STEPS[name], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4, device=device)
    got = make_step(STEPS[name], heads=2, dim=64, window=8, topk=4, spare=3, block_size=4, device=device)
    ctx, n = got["ctx"], got["ctx"].num_tokens
    _, parts = got["ctx"].chunks[0].state.cache.windows[0]
    for part in parts:  # the step's rows written over with other bytes: the static append must put them back
        part.view(torch.uint8)[:] = 0x55
    kv = fp8_round(gen(n + PADDING, 64, device=device, seed=50), block=32)
    kv[:n] = fp8_round(gen(n, 64, device=device, seed=50), block=32)  # make_step's own kv
    layout = static_step(got, n + PADDING)
    view = kv_window_append(kv, layer=0, window=8, ctx=layout)
    assert isinstance(view, StaticWindow) and view.step is layout
    _, want_parts = want["ctx"].chunks[0].state.cache.windows[0]
    ring = want_parts[0].shape[1]
    for part, want_part in zip(parts, want_parts, strict=True):
        for c in ctx.chunks:  # every position of the step in its slot's ring, as the eager append stored it
            rows = torch.arange(c.start_pos, c.start_pos + c.length, device=device) % ring
            assert torch.equal(part[c.state.slot, rows].view(torch.uint8), want_part[c.state.slot, rows].view(
                torch.uint8))
        untouched = torch.ones(part.shape[:2], dtype=torch.bool, device=device)
        for c in ctx.chunks:
            untouched[c.state.slot, torch.arange(c.start_pos, c.start_pos + c.length, device=device) % ring] = False
        assert (part.view(torch.uint8)[untouched] == 0x55).all()  # padding rows stored nothing


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("config", [WHOLE, SPLIT], ids=["whole", "split"])
@pytest.mark.parametrize("dot_fp32", [False, True])
def test_the_static_attention_is_the_eager_in_place_one(name: str, config: dict, dot_fp32: bool, device) -> None:
    step = make_step(STEPS[name], heads=4, dim=64, window=8, topk=6, spare=3, block_size=4, device=device)
    ctx, n = step["ctx"], step["ctx"].num_tokens
    layout = static_step(step, n + PADDING)
    q = torch.cat([step["q"], gen(PADDING, 4, 64, device=device, seed=9)])
    scale = 64**-0.5
    got = static_attention_op(q, StaticWindow(layout, 0, 8), step["sink"], window_size=8, scale=scale, config=config,
                              dot_fp32=dot_fp32)
    want = paged_attention_op(step["q"], step["view"], step["sink"], window_size=8, scale=scale, ctx=ctx,
                              config=config, dot_fp32=dot_fp32)
    assert got.shape == (n + PADDING, 4, 64) and got.isfinite().all()
    assert torch.equal(got[:n], want), f"max difference {float((got[:n] - want).abs().max())}"
    ref = static_attention(q if dot_fp32 else q.bfloat16().float(), StaticWindow(layout, 0, 8), step["sink"],
                           window_size=8, scale=scale)
    assert rel_l2(got, ref) < (1e-5 if dot_fp32 else 1e-2)
