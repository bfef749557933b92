"""Decode and verification attention that reads the caches in place: the fp8 window ring and the paged fp4 pool.

The same attention as kernels/attention/sparse_attention.py (one shared K=V head, a sink in the denominator), over
the same entry lists, but nothing is gathered first. A query token t of sequence (chunk) b at position pos sees:
- the window positions (pos - window_size, pos] from first[b] on (the first position its view shows), oldest first,
  read from ring row p % RING of slot slots[b] (codes and block scales as dsl/cache_format.py stores them);
- then its picks topk[t, k] (-1 = none; entries at or past the sequence's compressed length are skipped too), entry
  e read from block tables[b, e // PER], row e % PER, of the compressed pool.
Lane j of block i is entry i * block_S + j of that list of window_size + K entries: the list `gather_indices` builds,
in the same blocks, so the online softmax runs the same operations on the same values as the gathered path (the
entries are decoded to the same fp32 values, then cast as the gathered pool is). The grid is (tokens, head blocks,
splits) and the loop runs over window_size + K entries whatever the caches' lengths: nothing here follows a length
on the host, so a step's launch can be captured.
"""

from __future__ import annotations

import os

import torch

from dsl.cache_format import EntryFormat
from kernels.attention.sparse_attention import default_config, sparse_attention_combine_kernel
from kernels.cache.rows import _e2m1_value, _e4m3_value, _pow2_value
from kernels.lang import tl, triton
from kernels.launch import launch

KINDS = {"fp32": 0, "fp8": 1, "fp4": 2}

# Whether the sparse_attention lowering takes this kernel where `reads_in_place` holds: DEEPINFER_PAGED_ATTENTION=1.
# Off by default: it equals the gathered path bit for bit under Triton's interpreter, but its GPU tests
# (tests/kernels/attention/test_paged_attention*.py -m gpu) and bench/bench_decode_attention.py have not run on an
# H200 yet, and the gathered path has.
IN_PLACE = os.environ.get("DEEPINFER_PAGED_ATTENTION", "0") == "1"


@triton.jit
def _decode(codes_ptr, scales_ptr, row, valid, offs_d, mask_d, D: tl.constexpr, KIND: tl.constexpr,
            BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr):
    """fp32 values [block_S, block_D] of pool rows `row` [block_S] where `valid` (0 elsewhere), decoded as
    `EntryFormat.decode` does: code value times block scale."""
    mask = valid[:, None] & mask_d[None, :]
    r = row.to(tl.int64)[:, None]
    if KIND == 0:
        return tl.load(codes_ptr + r * D + offs_d[None, :], mask=mask, other=0.0)
    byte = tl.load(scales_ptr + r * (D // BLOCK) + (offs_d // BLOCK)[None, :], mask=mask, other=0).to(tl.int32)
    scale = _e4m3_value(byte) if E4M3_SCALE else _pow2_value(byte)
    if KIND == 1:
        code = tl.load(codes_ptr + r * D + offs_d[None, :], mask=mask, other=0).to(tl.int32)
        value = _e4m3_value(code) * scale
    else:  # two e2m1 codes a byte, the even column in the low nibble
        packed = tl.load(codes_ptr + r * (D // 2) + (offs_d // 2)[None, :], mask=mask, other=0).to(tl.int32)
        value = _e2m1_value((packed >> ((offs_d % 2) * 4)[None, :]) & 15) * scale
    return tl.where(mask, value, 0.0)


@triton.jit
def _window_entries(li, inside, oldest, pos, slot, RING, codes_ptr, scales_ptr, offs_d, mask_d, D: tl.constexpr,
                    WINDOW: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr):
    """Places li [block_S] of a token's list that are window entries: their values and which are visible."""
    p = oldest + li  # positions
    visible = inside & (li < WINDOW) & (p <= pos)
    return _decode(codes_ptr, scales_ptr, slot * RING + p % RING, visible, offs_d, mask_d, D, KIND, BLOCK,
                   False), visible


@triton.jit
def _picked_entries(li, inside, t, chunk, length, topk_ptr, table_ptr, TABLE_W, PER, codes_ptr, scales_ptr, offs_d,
                    mask_d, D: tl.constexpr, WINDOW: tl.constexpr, TOPK: tl.constexpr, KIND: tl.constexpr,
                    BLOCK: tl.constexpr, E4M3: tl.constexpr):
    """Places li [block_S] of a token's list that are picks: their entries' values and which exist."""
    pick = tl.load(topk_ptr + t * TOPK + (li - WINDOW), mask=inside & (li >= WINDOW), other=-1)
    picked = (pick >= 0) & (pick < length)
    block = tl.load(table_ptr + chunk * TABLE_W + pick // PER, mask=picked, other=0)
    return _decode(codes_ptr, scales_ptr, block * PER + pick % PER, picked, offs_d, mask_d, D, KIND, BLOCK,
                   E4M3), picked


@triton.jit
def _online_softmax(q, kv, valid, m_i, l_i, acc, SCALE: tl.constexpr, DOT_FP32: tl.constexpr):
    """One block of entries kv [block_S, block_D] (K and V; `valid` [block_S]) into the running max m_i, denominator
    l_i [block_H] and acc [block_H, block_D]: sparse_attention_kernel's step, operation for operation."""
    if DOT_FP32:
        logits = tl.dot(q, tl.trans(kv), input_precision="ieee") * SCALE
    else:
        kv = kv.to(tl.bfloat16)
        logits = tl.dot(q, tl.trans(kv)) * SCALE  # [block_H, block_S]
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if DOT_FP32:
        acc = tl.dot(p, kv, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(tl.bfloat16), kv, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["RING", "PER", "TABLE_W", "S_PER_SPLIT"])
def paged_attention_kernel(q_ptr, w_codes_ptr, w_scales_ptr, c_codes_ptr, c_scales_ptr, table_ptr, slot_ptr,
                           first_ptr, length_ptr, chunk_ptr, pos_ptr, topk_ptr, sink_ptr, out_ptr, ml_ptr, RING, PER,
                           TABLE_W, S_PER_SPLIT, H: tl.constexpr, D: tl.constexpr, SCALE: tl.constexpr,
                           WINDOW: tl.constexpr, TOPK: tl.constexpr, W_KIND: tl.constexpr, W_BLOCK: tl.constexpr,
                           C_KIND: tl.constexpr, C_BLOCK: tl.constexpr, C_E4M3: tl.constexpr, SPLIT: tl.constexpr,
                           DOT_FP32: tl.constexpr, block_H: tl.constexpr, block_D: tl.constexpr,
                           block_S: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * block_H + tl.arange(0, block_H)
    split = tl.program_id(2)
    offs_d = tl.arange(0, block_D)
    mask_h = heads < H
    mask_d = offs_d < D
    chunk = tl.load(chunk_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.load(slot_ptr + chunk).to(tl.int64)
    oldest = tl.maximum(pos - WINDOW + 1, tl.load(first_ptr + chunk))
    length = tl.load(length_ptr + chunk) if TOPK > 0 else 0
    q = tl.load(q_ptr + (t * H + heads)[:, None] * D + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :],
                other=0.0)  # [block_H, block_D]
    q = q.to(tl.float32) if DOT_FP32 else q.to(tl.bfloat16)
    if SPLIT == 1:  # the sink's own term starts the softmax, as in sparse_attention_kernel
        m_i = tl.load(sink_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)
        l_i = tl.full([block_H], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([block_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([block_H], dtype=tl.float32)
    acc = tl.zeros([block_H, block_D], dtype=tl.float32)
    if SPLIT == 1 and WINDOW % block_S == 0:  # the same blocks, each of one kind: window blocks, then pick blocks
        for s0 in range(0, WINDOW, block_S):
            li = s0 + tl.arange(0, block_S)
            kv, valid = _window_entries(li, li < WINDOW, oldest, pos, slot, RING, w_codes_ptr, w_scales_ptr, offs_d,
                                        mask_d, D, WINDOW, W_KIND, W_BLOCK)
            m_i, l_i, acc = _online_softmax(q, kv, valid, m_i, l_i, acc, SCALE, DOT_FP32)
        for s0 in range(WINDOW, WINDOW + TOPK, block_S):
            li = s0 + tl.arange(0, block_S)
            kv, valid = _picked_entries(li, li < WINDOW + TOPK, t, chunk, length, topk_ptr, table_ptr, TABLE_W, PER,
                                        c_codes_ptr, c_scales_ptr, offs_d, mask_d, D, WINDOW, TOPK, C_KIND, C_BLOCK,
                                        C_E4M3)
            m_i, l_i, acc = _online_softmax(q, kv, valid, m_i, l_i, acc, SCALE, DOT_FP32)
    else:  # blocks that may hold both kinds, or a split's part of the list
        s_begin = split * S_PER_SPLIT
        for s0 in range(0, S_PER_SPLIT, block_S):
            li = s_begin + s0 + tl.arange(0, block_S)  # [block_S]: places in the token's entry list
            inside = (li < WINDOW + TOPK) & (li < s_begin + S_PER_SPLIT)
            kv, valid = _window_entries(li, inside, oldest, pos, slot, RING, w_codes_ptr, w_scales_ptr, offs_d,
                                        mask_d, D, WINDOW, W_KIND, W_BLOCK)
            if TOPK > 0:
                kv_c, picked = _picked_entries(li, inside, t, chunk, length, topk_ptr, table_ptr, TABLE_W, PER,
                                               c_codes_ptr, c_scales_ptr, offs_d, mask_d, D, WINDOW, TOPK, C_KIND,
                                               C_BLOCK, C_E4M3)
                kv = tl.where(picked[:, None], kv_c, kv)
                valid = valid | picked
            m_i, l_i, acc = _online_softmax(q, kv, valid, m_i, l_i, acc, SCALE, DOT_FP32)
    if SPLIT == 1:
        tl.store(out_ptr + (t * H + heads)[:, None] * D + offs_d[None, :], acc / l_i[:, None],
                 mask=mask_h[:, None] & mask_d[None, :])
    else:  # partial state for sparse_attention_combine_kernel: out_ptr [T, SPLIT, H, D], ml_ptr [T, SPLIT, H, 2]
        row = (t * SPLIT + split) * H + heads
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], acc, mask=mask_h[:, None] & mask_d[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=mask_h)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mask_h)


def _index(t: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An index tensor as the kernel takes it: int32, contiguous, 16-byte aligned (the cubin launcher checks it)."""
    if t.is_floating_point() or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be integer {list(shape)}, got {t.dtype} {list(t.shape)}")
    t = t.to(torch.int32).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _pool(fmt: EntryFormat, parts: list[torch.Tensor], d: int, name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(codes, scales, constexprs) of a pool [blocks or slots, rows, ...] in `fmt` holding entries of d values."""
    if fmt.kind not in KINDS or (fmt.kind == "fp8" and fmt.e4m3_scale):
        raise ValueError(f"{name}: no in-place attention for {fmt}")
    width = d // 2 if fmt.kind == "fp4" else d
    if parts[0].dim() != 3 or parts[0].shape[2] != width or not all(p.is_contiguous() for p in parts):
        raise ValueError(f"{name}: {fmt} entries of {d} values need contiguous parts [*, rows, {width}], got "
                         f"{[list(p.shape) for p in parts]}")
    block = fmt.block if fmt.kind != "fp32" else d
    if fmt.kind != "fp32" and (d % block or parts[1].shape != (*parts[0].shape[:2], d // block)):
        raise ValueError(f"{name}: {fmt} scales must be [*, rows, {d // block}], got {list(parts[1].shape)}")
    as_bytes = [p.view(torch.uint8) if p.dtype == torch.float8_e4m3fn else p for p in parts]
    return as_bytes[0], as_bytes[-1], {"KIND": KINDS[fmt.kind], "BLOCK": block, "E4M3": fmt.e4m3_scale}


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
    Index tensors of any integer type. `config`: sparse_attention's (block_H, block_S, num_warps, num_stages, split_kv).
    """
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16) or not q.is_contiguous():
        raise ValueError(f"q must be contiguous float32/bfloat16 [N, H, D], got {q.dtype} {list(q.shape)}")
    n, h, d = q.shape
    if tuple(sink.shape) != (h,) or sink.dtype != torch.float32 or not sink.is_contiguous():
        raise ValueError(f"sink must be contiguous float32 [{h}], got {sink.dtype} {list(sink.shape)}")
    b = slots.shape[0]
    w_codes, w_scales, w_c = _pool(window_fmt, window_parts, d, "window")
    index = [_index(slots, "slots", (b,)), _index(first, "first", (b,))]
    k, per, width = 0, 1, 1
    c_codes, c_scales, c_c = w_codes, w_scales, w_c
    if topk is not None:
        if pool_fmt is None or pool_parts is None or tables is None or lengths is None:
            raise ValueError("picks need the pool, its format, the block tables and the lengths")
        if topk.dim() != 2 or topk.shape[0] != n or tables.dim() != 2 or tables.shape[0] != b:
            raise ValueError(f"topk must be [{n}, K] and tables [{b}, W], got {list(topk.shape)}, "
                             f"{list(tables.shape)}")
        k, per, width = topk.shape[1], pool_parts[0].shape[1], tables.shape[1]
        c_codes, c_scales, c_c = _pool(pool_fmt, pool_parts, d, "pool")
        index += [_index(tables, "tables", tuple(tables.shape)), _index(lengths, "lengths", (b,)),
                  _index(topk, "topk", (n, k))]
    else:
        index += [index[0], index[0], index[0]]  # unread: the kernel has no picks to look up
    slots_i, first_i, tables_i, lengths_i, topk_i = index
    chunks_i, positions_i = _index(row_chunks, "row_chunks", (n,)), _index(positions, "positions", (n,))
    config = config or default_config(n, h, d)
    out = torch.empty(n, h, d, dtype=torch.float32, device=q.device)
    if n == 0 or h == 0:
        return out
    split, block_s = config.get("split_kv", 1), config["block_S"]
    per_split = triton.cdiv(triton.cdiv(window_size + k, split), block_s) * block_s
    block_d = triton.next_power_of_2(d)
    part, ml = out, sink
    if split > 1:
        part = torch.empty(n, split, h, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(n, split, h, 2, dtype=torch.float32, device=q.device)
    launch(paged_attention_kernel, (n, triton.cdiv(h, config["block_H"]), split),
           (q, w_codes, w_scales, c_codes, c_scales, tables_i, slots_i, first_i, lengths_i, chunks_i, positions_i,
            topk_i, sink, part, ml, window_parts[0].shape[1], per, width, per_split),
           dict(H=h, D=d, SCALE=float(scale), WINDOW=window_size, TOPK=k, W_KIND=w_c["KIND"], W_BLOCK=w_c["BLOCK"],
                C_KIND=c_c["KIND"], C_BLOCK=c_c["BLOCK"], C_E4M3=c_c["E4M3"], SPLIT=split, DOT_FP32=dot_fp32,
                block_H=config["block_H"], block_D=block_d, block_S=block_s),
           config["num_warps"], config["num_stages"])
    if split > 1:
        launch(sparse_attention_combine_kernel, (n, h), (part, ml, sink, out), dict(H=h, D=d, SPLIT=split,
                                                                                   block_D=block_d), 4, 1)
    return out


def reads_in_place(window, compressed, topk: torch.Tensor | None, *, causal: bool) -> bool:
    """Whether `paged_attention_op` serves the DSL op's arguments: a causal attention over a paged window view whose
    ring still holds it (decode and verification steps: `dsl.ops.attention.PagedWindow.intact`) and, with picks, a
    paged compressed view. Prefill chunks and DSpark's draft blocks take the gathered path."""
    ring = getattr(window, "ring", None)
    if not causal or ring is None or not ring.intact():
        return False
    return compressed is None or topk is None or compressed.paged is not None


def _int32(ctx, t: torch.Tensor) -> torch.Tensor:
    """t as the kernel's int32 index, once per forward for each tensor the layers share (the memo keeps t alive, so
    its id stays its own)."""
    return ctx.memo(("int32 index", id(t)), lambda: (t, _index(t, "index", tuple(t.shape))))[1]


def paged_attention_op(q: torch.Tensor, window, sink: torch.Tensor, compressed=None, topk: torch.Tensor | None = None,
                       *, window_size: int, scale: float, ctx, config: dict | None = None,
                       dot_fp32: bool = False) -> torch.Tensor:
    """The DSL op `sparse_attention` (same arguments, causal) on the in-place kernel, where `reads_in_place`:
    q [N, H, D] -> fp32 [N, H, D], the gathered path's values bit for bit under the same config."""
    ring = window.ring
    fmt, parts = ring.cache.windows[ring.layer]
    _, _, first = window.layout(ctx.device)
    pool = {}
    if topk is not None and compressed is not None and sum(compressed.lengths):  # no entries anywhere: window only,
        # as the gathered path's entry lists then are
        entries = compressed.paged
        pool_fmt, _, pool_parts = entries.cache.compressed[(entries.name, entries.layer)]
        length, _, _ = compressed.layout(ctx.device)
        pool = dict(pool_fmt=pool_fmt, pool_parts=pool_parts, tables=_int32(ctx, entries.tables),
                    lengths=_int32(ctx, length), topk=_int32(ctx, topk))
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    q = q.to(dtype).contiguous()
    return paged_attention(q, sink.float().contiguous(), window_fmt=fmt, window_parts=parts,
                           slots=_int32(ctx, ring.slots), first=_int32(ctx, first),
                           row_chunks=_int32(ctx, ctx.row_chunks), positions=_int32(ctx, ctx.positions),
                           window_size=window_size, scale=scale, config=config, dot_fp32=dot_fp32, **pool)


def static_attention_op(q: torch.Tensor, window, sink: torch.Tensor, *, window_size: int, scale: float,
                        config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """The DSL op `sparse_attention` of a static step (dsl/step.py) over its window (`dsl.ops.attention.StaticWindow`):
    q [R, H, D] -> fp32 [R, H, D], every index the kernel reads taken from the step's tensors, so the launch reads
    whatever a later step writes there. The rows' values are the gathered path's (`paged_attention_op`) bit for bit:
    a token's oldest visible position is max(pos - window_size + 1, floor) either way."""
    step = window.step
    fmt, parts = step.cache.windows[window.layer]
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    return paged_attention(q.to(dtype).contiguous(), sink.float().contiguous(), window_fmt=fmt, window_parts=parts,
                           slots=step.chunk_slots, first=step.floors, row_chunks=step.row_chunks,
                           positions=step.positions32, window_size=window_size, scale=scale, config=config,
                           dot_fp32=dot_fp32)


def trace(heads: int, dim: int, *, window_size: int, scale: float, window_fmt: EntryFormat,
          pool_fmt: EntryFormat | None, topk: int, config: dict, dot_fp32: bool, device: str = "meta") -> None:
    """Call the wrapper once on empty pools of `device` for a node of `heads` x `dim` queries over a window in
    `window_fmt` and, with `topk` > 0, picks from a pool in `pool_fmt` (the AOT builder, on meta, records its launches:
    one variant per config and formats, whatever the number of rows or of sequences)."""
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    with torch.device(device):
        index = torch.zeros(1, dtype=torch.int32)
        pool = {}
        if topk and pool_fmt is not None:
            pool = dict(pool_fmt=pool_fmt, pool_parts=pool_fmt.storage((1, 1), dim), tables=index.view(1, 1),
                        lengths=index, topk=torch.zeros(1, topk, dtype=torch.int32))
        paged_attention(torch.zeros(1, heads, dim, dtype=dtype), torch.zeros(heads), window_fmt=window_fmt,
                        window_parts=window_fmt.storage((1, 1), dim), slots=index, first=index, row_chunks=index,
                        positions=index, window_size=window_size, scale=scale, config=config, dot_fp32=dot_fp32,
                        **pool)


__all__ = ["paged_attention", "paged_attention_kernel", "paged_attention_op", "reads_in_place", "static_attention_op",
           "trace"]
