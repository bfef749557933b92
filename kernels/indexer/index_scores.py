"""The sparse indexer's scores: every query token against its chunk's compressed keys, in a fixed order.

score(t, s) = sum_h w_h(t) * relu(q_h(t) . k(s)) / sqrt(d) * H^-0.5, -inf where entry s is not complete at the
token's position p ((p + 1) // ratio <= s) or lies past its chunk's cache (`dsl.ops.indexer.index_scores`). A
program takes one token and `block_L` of its chunk's entries, counted from the chunk's first: it multiplies
`block_H` heads by the entries' keys in `block_D` steps over d (tl.dot), takes relu, weights the heads and sums
them, head block after head block. Every step is fixed by the config and the entry's index in its chunk, never by
the token count or the other chunks' caches, so a token's scores are bitwise the same in any batch; the torch
reference's padded GEMMs (cuBLAS picks kernels by shape) are not.

`paged_index_scores_kernel` computes the same scores over keys read where a paged pool keeps them (decode and
verification steps, static ones included: kernels/attention/paged_entries.py's tiles, fp4 codes decoded in
registers), so no step gathers the keys first; its sum over d goes even columns then odd ones, another order than
the gathered kernel's, and a step takes one kernel or the other by `reads_in_place` alone.
"""

from __future__ import annotations

import torch

import kernels.attention.paged_ops as paged
from dsl.cache_format import EntryFormat
from dsl.context import cast
from dsl.ops.static_entries import StaticCompressed
from kernels.attention.paged_attention import supports
from kernels.attention.paged_entries import decode_tile, index_operand, load_tile, pick_rows, pool_operands
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit(do_not_specialize=["C"])
def index_scores_kernel(q_ptr, w_ptr, k_ptr, start_ptr, length_ptr, pos_ptr, out_ptr, C, H: tl.constexpr,
                        D: tl.constexpr, RATIO: tl.constexpr, D_SCALE: tl.constexpr, H_SCALE: tl.constexpr,
                        DOT_FP32: tl.constexpr, block_H: tl.constexpr, block_D: tl.constexpr,
                        block_L: tl.constexpr):
    pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * block_L
    offs_l = first + tl.arange(0, block_L)
    start = tl.load(start_ptr + t).to(tl.int64)  # the chunk's first key row
    visible = tl.minimum((tl.load(pos_ptr + t) + 1) // RATIO, tl.load(length_ptr + t))
    keep = offs_l < visible
    total = tl.zeros([block_L], dtype=tl.float32)
    if first < visible:  # blocks past the visible entries only write -inf
        for h0 in tl.static_range(0, H, block_H):
            heads = h0 + tl.arange(0, block_H)
            mask_h = heads < H
            acc = tl.zeros([block_H, block_L], dtype=tl.float32)
            for d0 in tl.static_range(0, D, block_D):
                offs_d = d0 + tl.arange(0, block_D)
                mask_d = offs_d < D
                q = tl.load(q_ptr + (t * H + heads)[:, None] * D + offs_d[None, :],
                            mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [block_H, block_D]
                k = tl.load(k_ptr + (start + offs_l)[None, :] * D + offs_d[:, None],
                            mask=keep[None, :] & mask_d[:, None], other=0.0)  # [block_D, block_L]
                if DOT_FP32:
                    acc = tl.dot(q.to(tl.float32), k.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(q.to(tl.bfloat16), k.to(tl.bfloat16), acc)
            w = tl.load(w_ptr + t * H + heads, mask=mask_h, other=0.0) * H_SCALE  # [block_H]
            total += tl.sum(tl.maximum(acc, 0.0) * D_SCALE * w[:, None], axis=0)
    tl.store(out_ptr + t * C + offs_l, tl.where(keep, total, float("-inf")), mask=offs_l < C)


@triton.jit(do_not_specialize=["C", "TABLE_W", "PER", "STEPS"])
def paged_index_scores_kernel(q_ptr, w_ptr, codes_ptr, scales_ptr, table_ptr, length_ptr, chunk_ptr, pos_ptr, out_ptr,
                              C, TABLE_W, PER, STEPS, H: tl.constexpr, D: tl.constexpr, RATIO: tl.constexpr,
                              D_SCALE: tl.constexpr, H_SCALE: tl.constexpr, KIND: tl.constexpr, BLOCK: tl.constexpr,
                              E4M3: tl.constexpr, DOT_FP32: tl.constexpr, block_H: tl.constexpr,
                              block_L: tl.constexpr):
    """`index_scores_kernel` over keys read where the pool keeps them: entry e of token t's chunk (row_chunks) at
    row e % PER of block tables[chunk, e // PER], decoded in registers as even and odd columns (the q . k sum goes
    over the even columns, then the odd ones). A program takes STEPS blocks of block_L entries in turn (those holding
    visible entries, then writes -inf over the rest), loading the token's queries once where one head block holds
    them all; an entry's score is the same for any STEPS."""
    pdl_prologue()
    t = tl.program_id(0).to(tl.int64)
    base = tl.program_id(1) * STEPS * block_L
    chunk = tl.load(chunk_ptr + t).to(tl.int64)
    visible = tl.minimum((tl.load(pos_ptr + t) + 1) // RATIO, tl.load(length_ptr + chunk))
    done = tl.maximum(tl.minimum(STEPS, tl.cdiv(visible - base, block_L)), 0)  # the steps holding visible entries
    if done > 0:
        DTYPE: tl.constexpr = tl.float32 if DOT_FP32 else tl.bfloat16
        ONE_BLOCK: tl.constexpr = block_H >= H
        half = tl.arange(0, D // 2)
        if ONE_BLOCK:  # every head in one block: the queries and weights stay in registers across the steps
            heads = tl.arange(0, block_H)
            at = q_ptr + (t * H + heads)[:, None] * D + 2 * half[None, :]
            q_even = tl.load(at, mask=(heads < H)[:, None], other=0.0).to(DTYPE)  # [block_H, D / 2]
            q_odd = tl.load(at + 1, mask=(heads < H)[:, None], other=0.0).to(DTYPE)
            w = tl.load(w_ptr + t * H + heads, mask=heads < H, other=0.0) * H_SCALE  # [block_H]
        for step in range(0, done):
            offs_l = base + step * block_L + tl.arange(0, block_L)
            keep = offs_l < visible
            rows, valid = pick_rows(offs_l, chunk, visible, table_ptr, TABLE_W, PER)
            codes, scales = load_tile(codes_ptr, scales_ptr, rows, valid, D, KIND, BLOCK)
            k_even, k_odd = decode_tile(codes, scales, KIND, BLOCK, E4M3, block_L, D, DTYPE)  # [block_L, D / 2]
            total = tl.zeros([block_L], dtype=tl.float32)
            for h0 in tl.static_range(0, H, block_H):
                if not ONE_BLOCK:
                    heads = h0 + tl.arange(0, block_H)
                    at = q_ptr + (t * H + heads)[:, None] * D + 2 * half[None, :]
                    q_even = tl.load(at, mask=(heads < H)[:, None], other=0.0).to(DTYPE)
                    q_odd = tl.load(at + 1, mask=(heads < H)[:, None], other=0.0).to(DTYPE)
                    w = tl.load(w_ptr + t * H + heads, mask=heads < H, other=0.0) * H_SCALE
                acc = tl.zeros([block_H, block_L], dtype=tl.float32)
                if DOT_FP32:
                    acc = tl.dot(q_even, tl.trans(k_even), acc, input_precision="ieee")
                    acc = tl.dot(q_odd, tl.trans(k_odd), acc, input_precision="ieee")
                else:
                    acc = tl.dot(q_even, tl.trans(k_even), acc)
                    acc = tl.dot(q_odd, tl.trans(k_odd), acc)
                total += tl.sum(tl.maximum(acc, 0.0) * D_SCALE * w[:, None], axis=0)
            tl.store(out_ptr + t * C + offs_l, tl.where(keep, total, float("-inf")), mask=offs_l < C)
    for step in range(done, STEPS):
        offs_l = base + step * block_L + tl.arange(0, block_L)
        tl.store(out_ptr + t * C + offs_l, tl.full([block_L], float("-inf"), tl.float32), mask=offs_l < C)


# A program's steps (`paged_index_scores_steps`): the most of these that still leaves this many programs a launch.
STEP_CHOICES, MIN_PROGRAMS = (16, 4, 1), 256


def paged_index_scores_steps(tokens: int, blocks: int) -> int:
    """Blocks of entries a program of the in-place scores takes in turn, for `tokens` rows of `blocks` blocks each: the
    most of STEP_CHOICES that leaves MIN_PROGRAMS programs (H100 sweep of `bench/bench_indexer_decode.py --sweep`,
    bench/RESULTS.md: long rows of many tokens want 16, fewer programs starve the SMs, one token wants 1)."""
    for steps in STEP_CHOICES:
        if tokens * triton.cdiv(blocks, steps) >= MIN_PROGRAMS:
            return steps
    return 1


def default_config(num_tokens: int, heads: int, dim: int) -> dict:
    """All heads (up to 64) in one tile and d in steps of up to 128, so a tile of keys is read once per head block;
    blocks of 128 entries; prefill-sized batches over 8 warps. Decode and verification steps (the in-place kernel)
    take 4 warps and no pipelining, the fastest in the H100 sweep of `bench/bench_indexer_decode.py --sweep` at 16 to
    256 tokens (64-entry blocks were as fast at one token). Any config is batch-invariant, and the in-place kernel's
    blocks of 64 and 128 entries, 4 or 8 warps, give the same bits."""
    block_h = max(16, min(64, triton.next_power_of_2(heads)))
    block_d = max(16, min(128, triton.next_power_of_2(dim)))
    wide = num_tokens >= 512
    return {"block_H": block_h, "block_D": block_d, "block_L": 128, "num_warps": 8 if wide else 4,
            "num_stages": 2 if wide else 1}


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, start: torch.Tensor,
                 length: torch.Tensor, positions: torch.Tensor, *, ratio: int, width: int, config: dict | None = None,
                 dot_fp32: bool = False) -> torch.Tensor:
    """Scores fp32 [N, width]: token t against keys[start[t] : start[t] + length[t]], -inf past them and where
    (positions[t] + 1) // ratio <= s.

    q [N, H, d] float32/bfloat16, weights [N, H] float32, keys [P, d] float32/bfloat16, start, length and
    positions int32 [N]; all contiguous. bf16 products unless `dot_fp32`.
    """
    if q.dim() != 3 or keys.dim() != 2 or keys.shape[1] != q.shape[2] or weights.shape != q.shape[:2]:
        raise ValueError(f"shapes q {list(q.shape)}, weights {list(weights.shape)}, keys {list(keys.shape)} do not "
                         "match")
    for name, v in (("q", q), ("keys", keys)):
        if v.dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"{name} must be float32/bfloat16, got {v.dtype}")
    if weights.dtype != torch.float32:
        raise TypeError(f"weights must be float32, got {weights.dtype}")
    n, h, d = q.shape
    for name, v in (("start", start), ("length", length), ("positions", positions)):
        if v.dtype != torch.int32 or tuple(v.shape) != (n,):
            raise ValueError(f"{name} must be int32 [{n}], got {v.dtype} {list(v.shape)}")
    if ratio < 1 or width < 0:
        raise ValueError(f"ratio must be >= 1 and width >= 0, got {ratio} and {width}")
    if not all(v.is_contiguous() for v in (q, weights, keys, start, length, positions)):
        raise ValueError("index_scores needs contiguous inputs")
    config = config or default_config(n, h, d)
    out = torch.empty(n, width, dtype=torch.float32, device=q.device)
    if n == 0 or width == 0:
        return out
    launch(index_scores_kernel, (n, triton.cdiv(width, config["block_L"])),
           (q, weights, keys, start, length, positions, out, width),
           {"H": h, "D": d, "RATIO": ratio, "D_SCALE": d**-0.5, "H_SCALE": h**-0.5, "DOT_FP32": dot_fp32,
            "block_H": config["block_H"], "block_D": config["block_D"], "block_L": config["block_L"]},
           config["num_warps"], config["num_stages"])
    return out


def paged_index_scores(q: torch.Tensor, weights: torch.Tensor, *, fmt: EntryFormat, parts: list[torch.Tensor],
                       tables: torch.Tensor, lengths: torch.Tensor, row_chunks: torch.Tensor, positions: torch.Tensor,
                       ratio: int, width: int, config: dict | None = None, dot_fp32: bool = False) -> torch.Tensor:
    """`index_scores` over keys read in place: scores fp32 [N, width] of token t against entries 0 .. of its chunk
    row_chunks[t] ([N]), entry e in pool `parts` ([blocks, PER, ...] in `fmt`) at block tables[chunk, e // PER]
    ([B, W]), -inf from min((positions[t] + 1) // ratio, lengths[chunk]) ([B]) on. q [N, H, d] float32/bfloat16
    (bf16 products unless `dot_fp32`), weights [N, H] float32; index tensors of any integer type. A program takes
    config["steps"] blocks of entries where the config names a count, else `paged_index_scores_steps`'s."""
    if q.dim() != 3 or q.dtype not in (torch.float32, torch.bfloat16) or not q.is_contiguous():
        raise ValueError(f"q must be contiguous float32/bfloat16 [N, H, d], got {q.dtype} {list(q.shape)}")
    n, h, d = q.shape
    if not supports(d):
        raise ValueError(f"in-place scores need a power-of-two key dim of at least 32, got {d}")
    if tuple(weights.shape) != (n, h) or weights.dtype != torch.float32 or not weights.is_contiguous():
        raise ValueError(f"weights must be contiguous float32 [{n}, {h}], got {weights.dtype} {list(weights.shape)}")
    if ratio < 1 or width < 0:
        raise ValueError(f"ratio must be >= 1 and width >= 0, got {ratio} and {width}")
    codes, scales, consts = pool_operands(fmt, parts, d, "keys")
    b = tables.shape[0]
    tables_i, lengths_i = index_operand(tables, "tables", tuple(tables.shape)), \
        index_operand(lengths, "lengths", (b,))
    chunks_i, positions_i = index_operand(row_chunks, "row_chunks", (n,)), \
        index_operand(positions, "positions", (n,))
    config = config or default_config(n, h, d)
    out = torch.empty(n, width, dtype=torch.float32, device=q.device)
    if n == 0 or width == 0:
        return out
    blocks = triton.cdiv(width, config["block_L"])
    steps = config.get("steps") or paged_index_scores_steps(n, blocks)
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"the in-place scores' steps must be a positive int, got {steps!r}")
    launch(paged_index_scores_kernel, (n, triton.cdiv(blocks, steps)),
           (q, weights, codes, scales, tables_i, lengths_i, chunks_i, positions_i, out, width, tables.shape[1],
            parts[0].shape[1], steps),
           {"H": h, "D": d, "RATIO": ratio, "D_SCALE": d**-0.5, "H_SCALE": h**-0.5, "KIND": consts["KIND"],
            "BLOCK": consts["BLOCK"], "E4M3": consts["E4M3"], "DOT_FP32": dot_fp32, "block_H": config["block_H"],
            "block_L": config["block_L"]},
           config["num_warps"], config["num_stages"])
    return out


def trace_paged(heads: int, dim: int, *, ratio: int, fmt: EntryFormat, config: dict, dot_fp32: bool,
                device: str = "meta") -> None:
    """Call `paged_index_scores` once on an empty pool of `device` in `fmt` for a node of `heads` x `dim` queries (the
    AOT builder, on meta, records its launches: one variant per config and format)."""
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    with torch.device(device):
        index = torch.zeros(1, dtype=torch.int32)
        paged_index_scores(torch.zeros(1, heads, dim, dtype=dtype), torch.zeros(1, heads), fmt=fmt,
                           parts=fmt.storage((1, 1), dim), tables=index.view(1, 1), lengths=index, row_chunks=index,
                           positions=index, ratio=ratio, width=1, config=config, dot_fp32=dot_fp32)


def reads_in_place(keys, dim: int) -> bool:
    """Whether `index_scores_op` reads `keys` where the pool keeps them (`paged_index_scores`): a static step's
    cache or a paged one, with in-place reads on (`paged.serves`, as the attention asks), else it gathers them."""
    return paged.serves(dim) and (isinstance(keys, StaticCompressed) or getattr(keys, "paged", None) is not None)


def index_scores_op(q: torch.Tensor, weights: torch.Tensor, keys, *, ratio: int, ctx, config: dict | None = None,
                    dot_fp32: bool = False) -> torch.Tensor:
    """The DSL op `index_scores` (same arguments) on the kernels: `keys` a `dsl.ops.cache_view.CacheView` (read in
    place where `reads_in_place`, else flat; each token finds its chunk's keys through `ctx.row_chunks`), or a static
    step's `StaticCompressed`. q [N, H, d] -> fp32 [N, C], C the longest cache (a static step's: its static width)."""
    dtype = torch.float32 if dot_fp32 else torch.bfloat16
    if reads_in_place(keys, q.shape[-1]):
        args = (cast(q, dtype).contiguous(), cast(weights, torch.float32).contiguous())
        common = dict(ratio=ratio, config=config, dot_fp32=dot_fp32)
        if isinstance(keys, StaticCompressed):  # a static step's (dsl/ops/static_entries.py): C its static width
            step = keys.step
            fmt, _, parts = step.cache.compressed[(keys.name, keys.layer)]
            return paged_index_scores(*args, fmt=fmt, parts=parts, tables=step.tables, lengths=keys.lengths(),
                                      row_chunks=step.row_chunks, positions=step.positions32, width=keys.width,
                                      **common)
        entries = keys.paged
        fmt, _, parts = entries.cache.compressed[(entries.name, entries.layer)]
        length, _, _ = keys.layout(q.device)
        chunks, positions = ctx.memo(("int32 rows",), lambda: (ctx.row_chunks.int(), ctx.positions.int()))
        return paged_index_scores(*args, fmt=fmt, parts=parts, tables=entries.tables, lengths=length,
                                  row_chunks=chunks, positions=positions, width=max(keys.lengths, default=0),
                                  **common)
    if isinstance(keys, StaticCompressed):  # gathered, every chunk's entries a static width wide
        step, width = keys.step, keys.width
        chunk = step.row_chunks
        return index_scores(cast(q, dtype).contiguous(), cast(weights, torch.float32).contiguous(),
                            cast(keys.chunk_keys().flatten(0, 1), dtype).contiguous(), (chunk * width).contiguous(),
                            keys.lengths()[chunk.long()].contiguous(), step.positions32, ratio=ratio, width=width,
                            config=config, dot_fp32=dot_fp32)

    def rows() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # per token: its keys' start and count, position
        length, offset, _ = keys.layout(q.device)
        chunk = ctx.row_chunks
        return offset[chunk].int(), length[chunk].int(), ctx.positions.int()
    start, length, positions = ctx.memo(("score rows", tuple(keys.lengths)), rows)  # every layer's, for a layout
    return index_scores(cast(q, dtype).contiguous(), cast(weights, torch.float32).contiguous(),
                        cast(keys.flat(), dtype).contiguous(),
                        start, length, positions, ratio=ratio, width=max(keys.lengths, default=0), config=config,
                        dot_fp32=dot_fp32)


__all__ = ["default_config", "index_scores", "index_scores_kernel", "index_scores_op", "paged_index_scores",
           "paged_index_scores_kernel", "reads_in_place", "trace_paged"]
