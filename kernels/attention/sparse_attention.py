"""Sparse attention with a sink over gathered keys: one shared K=V head, any set of entries per query.

Each query token t names the entries it attends to, `idx[t, :]` (-1 = nothing), in one pool of keys `kv` [P, D]:
its visible window and its selected compressed entries. A program takes one token and `block_H` heads, streams
the token's entries in blocks of `block_S` (one gathered [block_S, D] tile serves as both K and V), and keeps an
online softmax whose running max starts at the head's sink logit with the sink's own term (exp(0) = 1) already in
the denominator, so the sink joins the denominator only and a token with no visible entry gets zeros.
"""

from __future__ import annotations

import torch

from dsl.context import cast
from dsl.ops.attention import visible_entries
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit(do_not_specialize=["S", "S_PER_SPLIT"])
def sparse_attention_kernel(q_ptr, kv_ptr, idx_ptr, sink_ptr, out_ptr, ml_ptr, S, S_PER_SPLIT, H: tl.constexpr,
                            D: tl.constexpr, SCALE: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
                            block_H: tl.constexpr, block_D: tl.constexpr, block_S: tl.constexpr):
    pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * block_H + tl.arange(0, block_H)
    split = tl.program_id(2)
    offs_d = tl.arange(0, block_D)
    mask_h = heads < H
    mask_d = offs_d < D
    q = tl.load(q_ptr + (t * H + heads)[:, None] * D + offs_d[None, :], mask=mask_h[:, None] & mask_d[None, :],
                other=0.0)  # [block_H, block_D]
    q = q.to(tl.float32) if DOT_FP32 else q.to(tl.bfloat16)
    if SPLIT == 1:  # the sink's own term starts the softmax: running max = sink, denominator = exp(0)
        m_i = tl.load(sink_ptr + heads, mask=mask_h, other=0.0).to(tl.float32)
        l_i = tl.full([block_H], 1.0, dtype=tl.float32)
    else:  # a part of the entries; the combine adds the sink. A finite floor keeps empty parts NaN-free.
        m_i = tl.full([block_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([block_H], dtype=tl.float32)
    acc = tl.zeros([block_H, block_D], dtype=tl.float32)
    s_begin = split * S_PER_SPLIT
    for s0 in range(0, S_PER_SPLIT, block_S):
        offs_s = s_begin + s0 + tl.arange(0, block_S)
        j = tl.load(idx_ptr + t * S + offs_s, mask=(offs_s < S) & (offs_s < s_begin + S_PER_SPLIT), other=-1)
        valid = j >= 0
        kv = tl.load(kv_ptr + j[:, None].to(tl.int64) * D + offs_d[None, :], mask=valid[:, None] & mask_d[None, :],
                     other=0.0)  # [block_S, block_D]: K and V
        if DOT_FP32:
            kv = kv.to(tl.float32)
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
        m_i = m_new
    if SPLIT == 1:
        tl.store(out_ptr + (t * H + heads)[:, None] * D + offs_d[None, :], acc / l_i[:, None],
                 mask=mask_h[:, None] & mask_d[None, :])
    else:  # partial state: out_ptr is [T, SPLIT, H, D], ml_ptr [T, SPLIT, H, 2]
        row = (t * SPLIT + split) * H + heads
        tl.store(out_ptr + row[:, None] * D + offs_d[None, :], acc, mask=mask_h[:, None] & mask_d[None, :])
        tl.store(ml_ptr + row * 2, m_i, mask=mask_h)
        tl.store(ml_ptr + row * 2 + 1, l_i, mask=mask_h)


@triton.jit
def sparse_attention_combine_kernel(part_ptr, ml_ptr, sink_ptr, out_ptr, H: tl.constexpr, D: tl.constexpr,
                                    SPLIT: tl.constexpr, block_D: tl.constexpr):
    pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_d = tl.arange(0, block_D)
    mask_d = offs_d < D
    rows = (t * SPLIT + tl.arange(0, SPLIT)) * H + h  # [SPLIT]
    m = tl.load(ml_ptr + rows * 2)
    sink = tl.load(sink_ptr + h).to(tl.float32)
    m_all = tl.maximum(tl.max(m, axis=0), sink)
    w = tl.exp(m - m_all)  # [SPLIT]
    denom = tl.sum(tl.load(ml_ptr + rows * 2 + 1) * w, axis=0) + tl.exp(sink - m_all)
    part = tl.load(part_ptr + rows[:, None] * D + offs_d[None, :], mask=mask_d[None, :], other=0.0)  # [SPLIT, block_D]
    out = tl.sum(part * w[:, None], axis=0) / denom
    tl.store(out_ptr + (t * H + h) * D + offs_d, out, mask=mask_d)


def default_config(num_tokens: int, heads: int, head_dim: int, num_sms: int = 132) -> dict:
    """One program per token and 16 heads; few tokens split the entries too (a fixed count per bucket), so the
    GPU has work. The parts' sizes follow the batch's widest entry list, so a token's result can change with its
    neighbours: batch-invariant runs take a config's whole form, split_kv 1 (kernels/attention/lowering.py)."""
    block_d = triton.next_power_of_2(head_dim)
    programs = num_tokens * triton.cdiv(heads, 16)
    split = 1
    while programs * split < num_sms and split < 8:
        split *= 2
    return {"block_H": 16, "block_S": 32 if block_d >= 256 else 64, "num_warps": 8 if block_d >= 256 else 4,
            "num_stages": 2, "split_kv": split}


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, sink: torch.Tensor, *, scale: float,
                     config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """out [T, H, D] fp32: per token t and head h, softmax over {q·kv[j] * scale : j in idx[t], j >= 0} with the
    sink logit sink[h] added to the denominator only, times kv[j].

    q [T, H, D] float32/bfloat16, kv [P, D] float32/bfloat16 (keys are values), idx int32 [T, S] (-1 = none),
    sink [H] float32; all contiguous.
    """
    if q.dim() != 3 or kv.dim() != 2 or idx.dim() != 2 or q.shape[2] != kv.shape[1] or idx.shape[0] != q.shape[0]:
        raise ValueError(f"shapes q {list(q.shape)}, kv {list(kv.shape)}, idx {list(idx.shape)} do not match")
    if idx.dtype != torch.int32:
        raise TypeError(f"idx must be int32, got {idx.dtype}")
    for t in (q, kv):
        if t.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"q and kv must be float32/bfloat16, got {t.dtype}")
    if tuple(sink.shape) != (q.shape[1],) or sink.dtype != torch.float32:
        raise ValueError(f"sink must be float32 [{q.shape[1]}], got {sink.dtype} {list(sink.shape)}")
    if not all(t.is_contiguous() for t in (q, kv, idx, sink)):
        raise ValueError("sparse_attention needs contiguous inputs")
    t_, h, d = q.shape
    config = config or default_config(t_, h, d)
    out = torch.empty(t_, h, d, dtype=torch.float32, device=q.device)
    if t_ == 0 or h == 0:
        return out
    split, width = config.get("split_kv", 1), idx.shape[1]
    per_split = triton.cdiv(triton.cdiv(width, split), config["block_S"]) * config["block_S"]
    block_d = triton.next_power_of_2(d)
    part, ml = out, sink
    if split > 1:
        part = torch.empty(t_, split, h, d, dtype=torch.float32, device=q.device)
        ml = torch.empty(t_, split, h, 2, dtype=torch.float32, device=q.device)
    launch(sparse_attention_kernel, (t_, triton.cdiv(h, config["block_H"]), split),
           (q, kv, idx, sink, part, ml, width, per_split),
           dict(H=h, D=d, SCALE=float(scale), SPLIT=split, DOT_FP32=dot_fp32, block_H=config["block_H"],
                block_D=block_d, block_S=config["block_S"]),
           config["num_warps"], config["num_stages"])
    if split > 1:
        launch(sparse_attention_combine_kernel, (t_, h), (part, ml, sink, out), dict(H=h, D=d, SPLIT=split,
                                                                                     block_D=block_d), 4, 1)
    return out


def gather_indices(window, compressed, topk: torch.Tensor | None, *, window_size: int, ctx,
                   dtype: torch.dtype = torch.bfloat16, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The DSL's cache views as one key pool and per-token entry lists: (kv [P, D], idx int32 [N, S]).

    `window` and `compressed` are `dsl.ops.cache_view.CacheView`s, `topk` [N, K] the selected compressed entries
    (-1 = none). A token sees the window entries whose positions lie in (pos - window_size, pos], a contiguous run of
    at most `window_size`, then its picks (`dsl.ops.attention.visible_entries`: a few tensor ops for any batch; the
    pools' entries are decoded as they are gathered); with `causal` False, its chunk's whole view (a DSpark block).
    """
    kv, idx = visible_entries(window, compressed, topk, window_size=window_size, ctx=ctx, dtype=dtype, causal=causal,
                              index_dtype=torch.int32)
    return kv.contiguous(), idx


def sparse_attention_op(q: torch.Tensor, window, sink: torch.Tensor, compressed=None, topk: torch.Tensor | None = None,
                        *, window_size: int, scale: float, ctx, causal: bool = True, config: dict | None = None,
                        dot_fp32: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The DSL op `sparse_attention` (same arguments) on the kernel: q [N, H, D] -> fp32 [N, H, D]; with `rows` [M]
    (token rows), fp32 [M, H, D] of those rows alone, bitwise their rows of the whole call (the entry lists keep
    their width)."""
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    kv, idx = gather_indices(window, compressed, topk, window_size=window_size, ctx=ctx, dtype=dtype, causal=causal)
    if rows is not None:
        q, idx = q[rows], idx[rows].contiguous()
    return sparse_attention(cast(q, dtype).contiguous(), kv, idx, cast(sink, torch.float32).contiguous(), scale=scale,
                            config=config, dot_fp32=dot_fp32)


__all__ = ["sparse_attention", "sparse_attention_op", "gather_indices", "default_config", "sparse_attention_kernel"]
