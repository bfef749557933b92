"""Decode and verification attention that reads the caches in place: the fp8 window ring and the paged fp4 pool.

The attention of kernels/attention/sparse_attention.py (one shared K=V head, a sink in the denominator) over the
same entries, but nothing is gathered first. A query token t of sequence (chunk) b at position pos sees:
- the window positions (pos - window_size, pos] from first[b] on (the first position its view shows), read from
  ring row p % RING of slot slots[b] (codes and block scales as dsl/cache_format.py stores them);
- its picks topk[t, k] (-1 = none; entries at or past the sequence's compressed length are skipped too), entry e
  read from block tables[b, e // PER], row e % PER, of the compressed pool.

One program takes one token, `block_H` heads (all 64 of V4.1's at once, so each entry is read and decoded once per
token: 64 heads make wgmma's M) and one part of the token's entry blocks: ceil(window / block_S) window blocks, then
ceil(K / block_S) pick blocks. A block's codes load one block ahead of its use, a pick block's ids two ahead, so
the next block's memory traffic overlaps this block's decoding and products. Its values come as two tiles, the even
and the odd columns (kernels/attention/paged_entries.py): q splits the same way, logits = q_e k_e^T + q_o k_o^T, and
the output accumulates in two halves stored back to their columns. The online softmax runs in base 2 (log2(e)
folded into the logit scale and the sink).

The parts of the entry list (`split`) are a count fixed by the config, never by the batch or the caches' lengths;
split > 1 writes each part's unnormalised output and (max, denominator), combined in a fixed order with the sink by
`paged_attention_combine_kernel`. The grid is (tokens, head blocks, parts) and every loop bound is static or set by
the config, so a step's launch can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from dsl.cache_format import EntryFormat
from kernels.attention.paged_entries import (
    bf16_halves,
    decode_tile,
    index_operand,
    load_tile,
    pick_ids,
    pick_rows,
    pool_operands,
    window_rows,
)
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit
def _attend(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, QK_SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
    """One block of entries (halves k_e, k_o [block_S, D / 2], K and V; `valid` [block_S]) into the running max m_i
    and denominator l_i [block_H] (base 2) and the output halves acc_e, acc_o [block_H, D / 2]."""
    if DOT_FP32:
        logits = tl.dot(q_o, tl.trans(k_o), tl.dot(q_e, tl.trans(k_e), input_precision="ieee"),
                        input_precision="ieee")
    else:
        logits = tl.dot(q_o, tl.trans(k_o), tl.dot(q_e, tl.trans(k_e)))  # [block_H, block_S]
    logits = tl.where(valid[None, :], logits * QK_SCALE, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc_e = tl.dot(p, k_e, acc_e * alpha[:, None], input_precision="ieee")
        acc_o = tl.dot(p, k_o, acc_o * alpha[:, None], input_precision="ieee")
    else:
        p = p.to(k_e.dtype)
        acc_e = tl.dot(p, k_e, acc_e * alpha[:, None])
        acc_o = tl.dot(p, k_o, acc_o * alpha[:, None])
    return m_new, l_i, acc_e, acc_o


@triton.jit(do_not_specialize=["RING", "PER", "TABLE_W", "BLOCKS_PER_SPLIT"])
def paged_attention_kernel(q_ptr, w_codes_ptr, w_scales_ptr, c_codes_ptr, c_scales_ptr, table_ptr, slot_ptr,
                           first_ptr, length_ptr, chunk_ptr, pos_ptr, topk_ptr, sink_ptr, out_ptr, ml_ptr, RING, PER,
                           TABLE_W, BLOCKS_PER_SPLIT, H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                           WINDOW: tl.constexpr, TOPK: tl.constexpr, W_KIND: tl.constexpr, W_BLOCK: tl.constexpr,
                           C_KIND: tl.constexpr, C_BLOCK: tl.constexpr, C_E4M3: tl.constexpr, SPLIT: tl.constexpr,
                           DOT_FP32: tl.constexpr, block_H: tl.constexpr, block_S: tl.constexpr):
    pdl_prologue()
    DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.bfloat16
    LOG2E: tl.constexpr = 1.4426950408889634
    NW: tl.constexpr = (WINDOW + block_S - 1) // block_S  # window blocks, then pick blocks
    NB: tl.constexpr = NW + (TOPK + block_S - 1) // block_S
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * block_H + tl.arange(0, block_H)
    split = tl.program_id(2)
    mask_h = heads < H
    chunk = tl.load(chunk_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + chunk).to(tl.int64)
    oldest = tl.maximum(pos - WINDOW + 1, tl.load(first_ptr + chunk))
    if DOT_FP32:
        q_rows = (t * H + heads)[:, None] * D + 2 * tl.arange(0, D // 2)[None, :]  # [block_H, D / 2]: even columns
        q_e = tl.load(q_ptr + q_rows, mask=mask_h[:, None], other=0.0)
        q_o = tl.load(q_ptr + q_rows + 1, mask=mask_h[:, None], other=0.0)
    else:  # bf16 q as 32-bit words [N, H, D / 2]: the even column in the low half
        q_rows = (t * H + heads)[:, None] * (D // 2) + tl.arange(0, D // 2)[None, :]
        q_e, q_o = bf16_halves(tl.load(q_ptr + q_rows, mask=mask_h[:, None], other=0).to(tl.uint32, bitcast=True))
    if SPLIT == 1:  # the sink's own term starts the softmax: running max = sink, denominator = 2^0
        m_i = tl.load(sink_ptr + heads, mask=mask_h, other=0.0).to(tl.float32) * LOG2E
        l_i = tl.full([block_H], 1.0, dtype=tl.float32)
    else:  # a part of the entries; the combine adds the sink. A finite floor keeps empty parts NaN-free.
        m_i = tl.full([block_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([block_H], dtype=tl.float32)
    acc_e = tl.zeros([block_H, D // 2], dtype=tl.float32)
    acc_o = tl.zeros([block_H, D // 2], dtype=tl.float32)
    QK_SCALE: tl.constexpr = SCALE * LOG2E
    b_begin = split * BLOCKS_PER_SPLIT
    b_end = tl.minimum(b_begin + BLOCKS_PER_SPLIT, NB)

    # The window's blocks of this part: rows are arithmetic, codes load one block ahead.
    w_end = tl.minimum(b_end, NW)
    rows, valid = window_rows(b_begin, oldest, pos, slot, RING, WINDOW, block_S)
    valid = valid & (b_begin < w_end)
    codes, scales = load_tile(w_codes_ptr, w_scales_ptr, rows, valid, D, W_KIND, W_BLOCK)
    for b in range(b_begin, w_end):
        rows, valid_next = window_rows(b + 1, oldest, pos, slot, RING, WINDOW, block_S)
        valid_next = valid_next & (b + 1 < w_end)
        codes_next, scales_next = load_tile(w_codes_ptr, w_scales_ptr, rows, valid_next, D, W_KIND, W_BLOCK)
        k_e, k_o = decode_tile(codes, scales, W_KIND, W_BLOCK, False, block_S, D, DTYPE)
        m_i, l_i, acc_e, acc_o = _attend(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, QK_SCALE, DOT_FP32)
        codes, scales, valid = codes_next, scales_next, valid_next

    if TOPK > 0:  # the picks' blocks of this part: ids load two blocks ahead, codes one
        length = tl.load(length_ptr + chunk)
        p_begin = tl.maximum(b_begin, NW) - NW
        p_end = b_end - NW
        rows, valid = pick_rows(pick_ids(topk_ptr, t, p_begin, TOPK, block_S), chunk, length, table_ptr, TABLE_W,
                                PER)
        valid = valid & (p_begin < p_end)
        codes, scales = load_tile(c_codes_ptr, c_scales_ptr, rows, valid, D, C_KIND, C_BLOCK)
        rows, valid_next = pick_rows(pick_ids(topk_ptr, t, p_begin + 1, TOPK, block_S), chunk, length, table_ptr,
                                     TABLE_W, PER)
        for b in range(p_begin, p_end):
            valid_next = valid_next & (b + 1 < p_end)
            codes_next, scales_next = load_tile(c_codes_ptr, c_scales_ptr, rows, valid_next, D, C_KIND, C_BLOCK)
            picks = pick_ids(topk_ptr, t, b + 2, TOPK, block_S)
            k_e, k_o = decode_tile(codes, scales, C_KIND, C_BLOCK, C_E4M3, block_S, D, DTYPE)
            m_i, l_i, acc_e, acc_o = _attend(q_e, q_o, k_e, k_o, valid, m_i, l_i, acc_e, acc_o, QK_SCALE, DOT_FP32)
            rows, valid_after = pick_rows(picks, chunk, length, table_ptr, TABLE_W, PER)
            codes, scales, valid, valid_next = codes_next, scales_next, valid_next, valid_after

    offs_d = tl.arange(0, D)[None, :]
    if SPLIT == 1:
        out = tl.reshape(tl.join(acc_e / l_i[:, None], acc_o / l_i[:, None]), [block_H, D])  # columns in order
        tl.store(out_ptr + (t * H + heads)[:, None] * D + offs_d, out, mask=mask_h[:, None])
    else:  # this part's state: out_ptr [T, SPLIT, H, D], ml_ptr [T, SPLIT, H, 2] (base 2)
        row = (t * SPLIT + split) * H + heads
        tl.store(out_ptr + row[:, None] * D + offs_d, tl.reshape(tl.join(acc_e, acc_o), [block_H, D]),
                 mask=mask_h[:, None])
        tl.store(ml_ptr + row * 2, m_i, mask=mask_h)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mask_h)


@triton.jit
def paged_attention_combine_kernel(part_ptr, ml_ptr, sink_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr,
                                   SPLIT: tl.constexpr, block_P: tl.constexpr):
    """out[t, h] from the SPLIT parts of token t, head h, in their order, with the sink's term (base 2)."""
    pdl_prologue()
    LOG2E: tl.constexpr = 1.4426950408889634
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    parts = tl.arange(0, block_P)
    offs_d = tl.arange(0, D)
    rows = (t * SPLIT + parts) * H + h  # [block_P]
    m = tl.load(ml_ptr + rows * 2, mask=parts < SPLIT, other=float("-inf"))
    sink = tl.load(sink_ptr + h).to(tl.float32) * LOG2E
    m_all = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp2(m - m_all)  # [block_P]
    denom = tl.sum(tl.load(ml_ptr + rows * 2 + 1, mask=parts < SPLIT, other=0.0) * w, axis=0) + tl.exp2(sink - m_all)
    part = tl.load(part_ptr + rows[:, None] * D + offs_d[None, :], mask=(parts < SPLIT)[:, None], other=0.0)
    tl.store(out_ptr + (t * H + h) * D + offs_d, tl.sum(part * w[:, None], axis=0) / denom)  # part: [block_P, D]


def supports(dim: int) -> bool:
    """Whether the kernel takes entries of `dim` values: a power of two of at least 32 (halves of 16 or more)."""
    return dim >= 32 and dim & (dim - 1) == 0


def default_split(num_tokens: int, heads: int, num_sms: int = 132) -> int:
    """Parts of each token's entry list for `num_tokens` tokens and no plan: enough programs to fill the GPU (one a
    token and part at V4.1's 64 heads), at most 16."""
    programs, split = num_tokens * triton.cdiv(heads, 64), 1
    while programs * split < num_sms and split < 16:
        split *= 2
    return split


def bucket_parts(tokens: int, heads: int, num_sms: int = 132) -> int:
    """The parts a bucket of up to `tokens` tokens runs: the most (a power of two, at most 16) whose programs at the
    bucket's top still fit one wave, a program an SM (its 128 KB of shared memory allow no second). A program's time
    grows with its part's blocks, and a second wave costs a whole program's time: V4.1's 640 entries a token are 10
    blocks, so the 16-token bucket takes 8 parts (2 blocks each), the 64-token one 2 (5 each), larger ones 1."""
    programs, parts = tokens * triton.cdiv(heads, 64), 1
    while programs * parts * 2 <= num_sms and parts < 16:
        parts *= 2
    return parts


def tiles(config: dict | None, num_tokens: int, heads: int, head_dim: int, dot_fp32: bool) -> dict:
    """The kernel's config from a plan's sparse_attention config, or None (then `default_split` for `num_tokens`):
    all of a token's heads in one program (up to 64: wgmma's M), blocks of 64 entries, 8 warps at V4.1's 512 dims;
    fp32 products (FMA dots, a test mode) take 16 heads and 16 entries. A plan's config gives the parts: its
    `parts` (`bucket_parts` of its bucket; `split_kv`, the gathered kernel's, in plans made before it), a count its
    bucket fixes (1 in batch-invariant runs), never the batch in it."""
    split = default_split(num_tokens, heads) if config is None else config.get("parts", config.get("split_kv", 1))
    if dot_fp32:
        return {"block_H": 16, "block_S": 16, "num_warps": 4, "num_stages": 1, "split": split}
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    return {"block_H": block_h, "block_S": 64, "num_warps": 8 if block_h * head_dim >= 8192 else 4, "num_stages": 1,
            "split": split}


def check_queries(q: torch.Tensor, sink: torch.Tensor) -> tuple[int, int, int]:
    """(N, H, D) of the in-place kernels' queries q [N, H, D] and sink [H], checked."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16) or not q.is_contiguous():
        raise ValueError(f"q must be contiguous float32/bfloat16 [N, H, D], got {q.dtype} {list(q.shape)}")
    n, h, d = q.shape
    if not supports(d):
        raise ValueError(f"in-place attention needs a power-of-two head dim of at least 32, got {d}")
    if tuple(sink.shape) != (h,) or sink.dtype != torch.float32 or not sink.is_contiguous():
        raise ValueError(f"sink must be contiguous float32 [{h}], got {sink.dtype} {list(sink.shape)}")
    return n, h, d


def paged_attention(q: torch.Tensor, sink: torch.Tensor, *, window_fmt: EntryFormat, window_parts: list[torch.Tensor],
                    slots: torch.Tensor, first: torch.Tensor, row_chunks: torch.Tensor, positions: torch.Tensor,
                    window_size: int, scale: float, pool_fmt: EntryFormat | None = None,
                    pool_parts: list[torch.Tensor] | None = None, tables: torch.Tensor | None = None,
                    lengths: torch.Tensor | None = None, topk: torch.Tensor | None = None, config: dict | None = None,
                    dot_fp32: bool = False) -> torch.Tensor:
    """out [N, H, D] fp32: `sparse_attention` over each query's window and picks, read where the caches keep them.

    q [N, H, D] fp32/bf16 (bf16 products unless `dot_fp32`), sink [H] fp32. The window: ring `window_parts` [slots,
    RING, ...] in `window_fmt`, position p of chunk b at row p % RING of slot slots[b] [B]; query t of chunk
    row_chunks[t] [N] at positions[t] [N] sees (positions[t] - window_size, positions[t]] from first[b] [B] on. The
    picks topk [N, K] (-1 = none; None: window only) name entries of the pool `pool_parts` [blocks, PER, ...] in
    `pool_fmt`, entry e of chunk b at block tables[b, e // PER] ([B, W]), row e % PER, those below lengths[b] [B].
    Index tensors of any integer type. `config`: the kernel's (`tiles`: block_H, block_S, num_warps, num_stages,
    split) or a plan's sparse_attention config.
    """
    n, h, d = check_queries(q, sink)
    b = slots.shape[0]
    w_codes, w_scales, w_c = pool_operands(window_fmt, window_parts, d, "window")
    index = [index_operand(slots, "slots", (b,)), index_operand(first, "first", (b,))]
    k, per, width = 0, 1, 1
    c_codes, c_scales, c_c = w_codes, w_scales, w_c
    if topk is not None:
        if pool_fmt is None or pool_parts is None or tables is None or lengths is None:
            raise ValueError("picks need the pool, its format, the block tables and the lengths")
        if topk.dim() != 2 or topk.shape[0] != n or tables.dim() != 2 or tables.shape[0] != b:
            raise ValueError(f"topk must be [{n}, K] and tables [{b}, W], got {list(topk.shape)}, "
                             f"{list(tables.shape)}")
        k, per, width = topk.shape[1], pool_parts[0].shape[1], tables.shape[1]
        c_codes, c_scales, c_c = pool_operands(pool_fmt, pool_parts, d, "pool")
        index += [index_operand(tables, "tables", tuple(tables.shape)), index_operand(lengths, "lengths", (b,)),
                  index_operand(topk, "topk", (n, k))]
    else:
        index += [index[0], index[0], index[0]]  # unread: the kernel has no picks to look up
    slots_i, first_i, tables_i, lengths_i, topk_i = index
    chunks_i, positions_i = index_operand(row_chunks, "row_chunks", (n,)), index_operand(positions, "positions", (n,))
    if "split" not in (config or {}):
        config = tiles(config, n, h, d, dot_fp32)
    out = torch.empty(n, h, d, dtype=torch.float32, device=q.device)
    if n == 0 or h == 0:
        return out
    q_words = q.float() if dot_fp32 else q.to(torch.bfloat16).view(torch.int32)  # bf16: two columns a word
    block_s = config["block_S"]
    blocks = triton.cdiv(window_size, block_s) + triton.cdiv(k, block_s)
    per_split = triton.cdiv(blocks, max(1, min(config["split"], blocks)))
    split = triton.cdiv(blocks, per_split)  # parts that hold blocks
    part, ml = out, sink
    if split > 1:
        part = torch.empty(n, split, h, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(n, split, h, 2, dtype=torch.float32, device=q.device)
    launch(paged_attention_kernel, (n, triton.cdiv(h, config["block_H"]), split),
           (q_words, w_codes, w_scales, c_codes, c_scales, tables_i, slots_i, first_i, lengths_i, chunks_i, positions_i,
            topk_i, sink, part, ml, window_parts[0].shape[1], per, width, per_split),
           dict(H=h, D=d, SCALE=float(scale), WINDOW=window_size, TOPK=k, W_KIND=w_c["KIND"], W_BLOCK=w_c["BLOCK"],
                C_KIND=c_c["KIND"], C_BLOCK=c_c["BLOCK"], C_E4M3=c_c["E4M3"], SPLIT=split, DOT_FP32=dot_fp32,
                block_H=config["block_H"], block_S=block_s),
           config["num_warps"], config["num_stages"])
    if split > 1:
        launch(paged_attention_combine_kernel, (n, h), (part, ml, sink, out),
               dict(H=h, D=d, SPLIT=split, block_P=triton.next_power_of_2(split)), 4, 1)
    return out


__all__ = ["bucket_parts", "check_queries", "default_split", "paged_attention", "paged_attention_combine_kernel",
           "paged_attention_kernel", "supports", "tiles"]
