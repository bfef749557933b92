"""DSpark draft-block attention that reads the window ring in place: a draft block's queries over the window before
the block and the block's own keys.

A DSpark draft block attends without a causal mask (the DSL op `sparse_attention` over a `kv_window_block` view,
dsl/ops/attention.py): query t of chunk b sees the `window_size` - 1 positions before the chunk's first from first[b]
on, read from ring row p % RING of slot slots[b] as kernels/attention/paged_attention.py reads a window, then every
row of its chunk's own keys kv [N, D], which the draft graph never stores. The kernel is that module's window loop
with the chunk's fp32 keys in place of the picks: the same block step (`_attend`: two halves of each entry, online
softmax in base 2, the sink starting it), configs (`tiles`, the parts always one) and query checks. One program takes
one token and `block_H` heads; the grid is (tokens, head blocks), so a static step's launch
(`static_block_attention_op`) can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dsl.cache_format import EntryFormat
from kernels.attention.paged_attention import _attend, check_queries, tiles
from kernels.attention.paged_entries import (
    bf16_halves,
    decode_tile,
    index_operand,
    load_tile,
    pool_operands,
    window_rows,
)
from kernels.attention.paged_ops import int32_index
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit(do_not_specialize=["RING"])
def block_attention_kernel(q_ptr, w_codes_ptr, w_scales_ptr, kv_ptr, slot_ptr, first_ptr, start_ptr, rows_ptr,
                           length_ptr, chunk_ptr, sink_ptr, out_ptr, RING, H: tl.constexpr, D: tl.constexpr,
                           SCALE: tl.constexpr, WINDOW: tl.constexpr, W_KIND: tl.constexpr, W_BLOCK: tl.constexpr,
                           DOT_FP32: tl.constexpr, block_H: tl.constexpr, block_S: tl.constexpr):
    """A DSpark draft block's attention (non-causal) in place: query t of chunk b sees the WINDOW positions before
    the chunk's first, start[b], from first[b] on, read from ring row p % RING of slot slots[b], then every row of its
    chunk, rows[b] .. rows[b] + length[b] - 1 of kv [N, D] (its own keys, never stored), in that order: a window
    view's order (dsl/ops/attention.py `kv_window_block`). The chunk's rows run in as many blocks as it has."""
    pdl_prologue()
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.bfloat16
    LOG2E: tl.constexpr = 1.4426950408889634
    NW: tl.constexpr = (WINDOW + block_S - 1) // block_S
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * block_H + tl.arange(0, block_H)
    mask_h = heads < H
    chunk = tl.load(chunk_ptr + t).to(tl.int64)
    slot = tl.load(slot_ptr + chunk).to(tl.int64)
    pos = tl.load(start_ptr + chunk) - 1  # the window's last position
    oldest = tl.maximum(pos - WINDOW + 1, tl.load(first_ptr + chunk))
    if DOT_FP32:
        q_rows = (t * H + heads)[:, None] * D + 2 * tl.arange(0, D // 2)[None, :]
        q_e = tl.load(q_ptr + q_rows, mask=mask_h[:, None], other=0.0)
        q_o = tl.load(q_ptr + q_rows + 1, mask=mask_h[:, None], other=0.0)
    else:
        q_rows = (t * H + heads)[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
        q_e, q_o = bf16_halves(tl.load(q_ptr + q_rows, mask=mask_h[:, None], other=0).to(tl.uint32, bitcast=True))
    m_i = tl.load(sink_ptr + heads, mask=mask_h, other=0.0).to(tl.float32) * LOG2E
    l_i = tl.full([block_H], 1.0, dtype=tl.float32)
    acc_e = tl.zeros([block_H, D // 2], dtype=tl.float32)
    acc_o = tl.zeros([block_H, D // 2], dtype=tl.float32)
    QK_SCALE: tl.constexpr = SCALE * LOG2E
    for b in range(NW):
        rows, valid = window_rows(b, oldest, pos, slot, RING, WINDOW, block_S)
        codes, scales = load_tile(w_codes_ptr, w_scales_ptr, rows, valid, D, W_KIND, W_BLOCK)
        k_e, k_o = decode_tile(codes, scales, W_KIND, W_BLOCK, False, block_S, D, DTYPE)
        m_i, l_i, acc_e, acc_o = _attend(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, QK_SCALE, DOT_FP32)
    first_row = tl.load(rows_ptr + chunk).to(tl.int64)
    count = tl.load(length_ptr + chunk)
    cols = 2 * tl.arange(0, D // 2)[None, :]
    for b in range(tl.cdiv(count, block_S)):
        li = b * block_S + tl.arange(0, block_S)
        valid = li < count
        r = (first_row + li)[:, None] * D
        k_e = tl.load(kv_ptr + r + cols, mask=valid[:, None], other=0.0).to(DTYPE)
        k_o = tl.load(kv_ptr + r + cols + 1, mask=valid[:, None], other=0.0).to(DTYPE)
        m_i, l_i, acc_e, acc_o = _attend(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, QK_SCALE, DOT_FP32)
    out = tl.reshape(tl.join(acc_e / l_i[:, None], acc_o / l_i[:, None]), [block_H, D])
    tl.store(out_ptr + (t * H + heads)[:, None] * D + tl.arange(0, D)[None, :], out, mask=mask_h[:, None])


def block_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, *, window_fmt: EntryFormat,
                    window_parts: list[torch.Tensor], slots: torch.Tensor, first: torch.Tensor, starts: torch.Tensor,
                    chunk_rows: torch.Tensor, lengths: torch.Tensor, row_chunks: torch.Tensor, window_size: int,
                    scale: float, config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """out [N, H, D] fp32: `sparse_attention` of DSpark draft blocks (non-causal) over each chunk's `window_size` - 1
    ring entries before it and its own keys kv [N, D], the ring read where it is (`block_attention_kernel`).

    q [N, H, D] fp32/bf16, sink [H] fp32; per chunk b [B]: its slot, the first position its view shows, its first
    position, first row and row count; per row [N] its chunk. The ring `window_parts` [slots, RING, ...] in
    `window_fmt`. `config`: block_H, block_S, num_warps (`tiles`'s; the parts are always one)."""
    n, h, d = check_queries(q, sink)
    if kv.dim() != 2 or tuple(kv.shape) != (n, d) or kv.dtype != torch.float32 or not kv.is_contiguous():
        raise ValueError(f"kv must be contiguous float32 [{n}, {d}], got {kv.dtype} {list(kv.shape)}")
    b = slots.shape[0]
    w_codes, w_scales, w_c = pool_operands(window_fmt, window_parts, d, "window")
    index = [index_operand(t, name, (b,)) for t, name in ((slots, "slots"), (first, "first"), (starts, "starts"),
                                                          (chunk_rows, "chunk_rows"), (lengths, "lengths"))]
    chunks = index_operand(row_chunks, "row_chunks", (n,))
    config = tiles(config, n, h, d, dot_fp32)
    out = torch.empty(n, h, d, dtype=torch.float32, device=q.device)
    if n == 0 or h == 0:
        return out
    q_words = q.float() if dot_fp32 else q.to(torch.bfloat16).view(torch.int32)
    launch(block_attention_kernel, (n, triton.cdiv(h, config["block_H"])),
           (q_words, w_codes, w_scales, kv, *index, chunks, sink, out, window_parts[0].shape[1]),
           dict(H=h, D=d, SCALE=float(scale), WINDOW=window_size - 1, W_KIND=w_c["KIND"], W_BLOCK=w_c["BLOCK"],
                DOT_FP32=dot_fp32, block_H=config["block_H"], block_S=config["block_S"]),
           config["num_warps"], config["num_stages"])
    return out


def block_chunks(window) -> bool:
    """Whether `block_attention_op` serves a draft block attention (non-causal) over `window`: a paged view of a
    `kv_window_block`, its ring named (DSpark's draft graph stores nothing, so the ring still holds what the view
    shows when its attention runs)."""
    return getattr(window, "ring", None) is not None and getattr(window, "block", None) is not None


def block_attention_op(q: torch.Tensor, window, sink: torch.Tensor, *, window_size: int, scale: float, ctx,
                       config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """The DSL op `sparse_attention` (non-causal, no picks) over a paged `kv_window_block` view, on the in-place
    kernel: q [N, H, D] -> fp32 [N, H, D]. A static step's (`static_block_attention_op`) gives the same values."""
    ring = window.ring
    fmt, parts = ring.cache.windows[ring.layer]
    _, _, first = window.layout(ctx.device)
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    return block_attention(q.to(dtype).contiguous(), window.block.float().contiguous(), sink.float().contiguous(),
                           window_fmt=fmt, window_parts=parts, slots=int32_index(ctx, ring.slots),
                           first=int32_index(ctx, first),
                           starts=int32_index(ctx, ctx.chunk_starts), chunk_rows=int32_index(ctx, ctx.chunk_rows),
                           lengths=int32_index(ctx, ctx.chunk_lengths), row_chunks=int32_index(ctx, ctx.row_chunks),
                           window_size=window_size, scale=scale, config=config, dot_fp32=dot_fp32)


def static_block_attention_op(q: torch.Tensor, block, sink: torch.Tensor, *, window_size: int, scale: float,
                              config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """`block_attention_op` of a static step (`dsl.ops.static_attention.StaticBlock`): every index from the step's
    tensors. The first position a chunk's view shows is the eager view's, max(start - window_size + 1, floor)."""
    step = block.step
    fmt, parts = step.cache.windows[block.layer]
    first = torch.maximum(step.chunk_starts - (window_size - 1), step.floors)
    lengths = step.chunk_ends - step.chunk_starts
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    return block_attention(q.to(dtype).contiguous(), block.kv.float().contiguous(), sink.float().contiguous(),
                           window_fmt=fmt, window_parts=parts, slots=step.chunk_slots, first=first,
                           starts=step.chunk_starts, chunk_rows=step.chunk_rows, lengths=lengths,
                           row_chunks=step.row_chunks, window_size=window_size, scale=scale, config=config,
                           dot_fp32=dot_fp32)


def trace_block(heads: int, dim: int, *, window_size: int, scale: float, window_fmt: EntryFormat, config: dict,
                dot_fp32: bool, device: str = "meta") -> None:
    """Call `block_attention` once on an empty ring of `device` for a draft block attention node (the AOT builder, on
    meta, records its launch: one variant per config and format)."""
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    with torch.device(device):
        index = torch.zeros(1, dtype=torch.int32)
        block_attention(torch.zeros(1, heads, dim, dtype=dtype), torch.zeros(1, dim), torch.zeros(heads),
                        window_fmt=window_fmt, window_parts=window_fmt.storage((1, 1), dim), slots=index, first=index,
                        starts=index, chunk_rows=index, lengths=index, row_chunks=index, window_size=window_size,
                        scale=scale, config=config, dot_fp32=dot_fp32)


__all__ = ["block_attention", "block_attention_kernel", "block_attention_op", "block_chunks",
           "static_block_attention_op", "trace_block"]
