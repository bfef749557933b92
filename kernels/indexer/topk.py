"""The sparse indexer's selection (`dsl.ops.indexer`): `topk_select`, the indices of a row's highest scores, and
`candidate_blocks`, the entries of the blocks whose maxima rank highest (the block of the token's newest visible
entry always among them). One program per token row.

Both keep the k highest of a row's items (its entries, or its blocks of `block` entries scored by their max) by a
radix select on an integer key that orders as the fp32 values do: a histogram pass per byte of the key, most
significant first, narrows the k-th highest down to its exact key T and the number of items equal to T that the top
k hold; a last pass in ascending item order keeps the items above T and the first of those equal to T (ranked by
tl.cumsum within a tile and a running count across tiles). So:
- the kept set is torch.topk's wherever the k-th highest value is not tied; of the items tied at it the lowest
  indices are kept (the rule of the batch-invariant references, dsl/ops/indexer.py), -0.0 tying +0.0;
- `topk_select` writes its picks in ascending entry order, then -1: [N, min(topk, C)] as the reference, whose
  order (torch's, unspecified) nothing downstream relies on. The attention kernel sums over a token's picks in this
  order, the invariant reference's; a -1 adds exactly nothing to its softmax, so the trailing ones (the invariant
  reference's are `topk` wide) change no bit of its one-part (invariant) form;
- a row's result depends on its own scores alone: bitwise the same in any batch, under any config.
A row's scores are read once to 5 times, in tiles of block_N items: a row of at most k items skips the search, a row
with at most k finite items stops after one count, and the passes after the first read up to the row's last finite
score only (a static step's rows span the caches' static width, finite up to what each token sees). Scores hold no
NaN (sums of products of finite values); the key would rank a NaN above +inf, where torch keeps it among the top and
then reports it as -1.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit
def _keys(scores_ptr, cand_ptr, row, items, C, newest, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
          HAS_CANDIDATES: tl.constexpr):
    """Keys int32 [block_N] of a row's `items`, in the order of their values: an entry's score (-inf past C or outside
    the candidates), or with GROUP > 1 the max of a block of GROUP entries (+inf for the block `newest`)."""
    if GROUP == 1:
        inside = items < C
        x = tl.load(scores_ptr + row * C + items, mask=inside, other=float("-inf"))
        if HAS_CANDIDATES:
            chosen = tl.load(cand_ptr + row * C + items, mask=inside, other=0)
            x = tl.where(chosen != 0, x, float("-inf"))
    else:
        members = tl.arange(0, GROUP_P2)
        cols = items[:, None] * GROUP + members[None, :]  # [block_N, GROUP_P2]
        x = tl.load(scores_ptr + row * C + cols, mask=(cols < C) & (members < GROUP)[None, :], other=float("-inf"))
        x = tl.where(items == newest, float("inf"), tl.max(x, axis=1))
    bits = x.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483648, 0, bits)  # -0.0 as +0.0
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats order backwards: flip all but the sign


@triton.jit
def _digit(hist, need):
    """In a histogram [256] of one byte of the keys: the byte d of the need-th highest key, and how many keys of
    byte d the need highest hold."""
    bins = tl.arange(0, 256)
    at_least = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys whose byte is >= bins
    d = tl.max(tl.where(at_least >= need, bins, 0), axis=0)
    return d, need - tl.sum(tl.where(bins > d, hist, 0), axis=0)


@triton.jit
def _threshold(scores_ptr, cand_ptr, row, C, count, newest, K: tl.constexpr, GROUP: tl.constexpr,
               GROUP_P2: tl.constexpr, HAS_CANDIDATES: tl.constexpr, block_N: tl.constexpr):
    """(T, ties, extent) over a row's `count` items: the K-th highest finite key and how many items of key T the K
    highest hold, (the key of -inf, 0) where the row has at most K finite items, all of them kept; and an item bound
    past the row's last finite item (the first pass finds it, `count` without one): a static step's rows are as wide
    as its caches' static bound and finite only up to what each token sees, so the passes after the first, and the
    caller's, stop there. Items past it are -inf, which no threshold keeps."""
    threshold = tl.full((), -2139095041, tl.int32)  # the key of -inf: keys above it are finite
    ties = tl.full((), 0, tl.int32)
    extent = count
    if count > K:
        hist = tl.zeros([256], dtype=tl.int32)
        last = tl.full((), -1, tl.int32)
        for start in range(0, count, block_N):
            items = start + tl.arange(0, block_N)
            key = _keys(scores_ptr, cand_ptr, row, items, C, newest, GROUP, GROUP_P2, HAS_CANDIDATES)
            hist += tl.histogram((key >> 24) + 128, 256, mask=key > -2139095041)
            last = tl.maximum(last, tl.max(tl.where(key > -2139095041, items, -1), axis=0))
        extent = last + 1
        if tl.sum(hist, axis=0) > K:
            prefix, need = _digit(hist, K)
            prefix -= 128  # the top byte of the key, signed
            for i in tl.static_range(3):
                shift = 16 - 8 * i
                hist = tl.zeros([256], dtype=tl.int32)
                for start in range(0, extent, block_N):
                    key = _keys(scores_ptr, cand_ptr, row, start + tl.arange(0, block_N), C, newest, GROUP,
                                GROUP_P2, HAS_CANDIDATES)
                    match = ((key >> (shift + 8)) == prefix) & (key > -2139095041)
                    hist += tl.histogram((key >> shift) & 255, 256, mask=match)
                d, need = _digit(hist, need)
                prefix = prefix * 256 + d
            threshold, ties = prefix, need
    return threshold, ties, extent


@triton.jit
def _kept(key, threshold, ties, tied):
    """Which items of a tile to keep: above the threshold, or at it and among the first `ties` of the row (`tied` at
    it in earlier tiles). Returns (kept, the tile's items at the threshold)."""
    at = (key == threshold).to(tl.int32)
    return (key > threshold) | ((at != 0) & (tied + tl.cumsum(at, axis=0) - at < ties)), tl.sum(at, axis=0)


@triton.jit(do_not_specialize=["C"])
def topk_select_kernel(scores_ptr, cand_ptr, out_ptr, C, K: tl.constexpr, HAS_CANDIDATES: tl.constexpr,
                       block_N: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    width = K
    threshold, ties, extent = _threshold(scores_ptr, cand_ptr, row, C, C, -1, K, 1, 1, HAS_CANDIDATES, block_N)
    taken = tl.full((), 0, tl.int32)
    tied = tl.full((), 0, tl.int32)
    for start in range(0, extent, block_N):
        items = start + tl.arange(0, block_N)
        key = _keys(scores_ptr, cand_ptr, row, items, C, -1, 1, 1, HAS_CANDIDATES)
        kept, at = _kept(key, threshold, ties, tied)
        slots = taken + tl.cumsum(kept.to(tl.int32), axis=0) - kept.to(tl.int32)
        tl.store(out_ptr + row * width + slots, items.to(tl.int64), mask=kept)
        taken += tl.sum(kept.to(tl.int32), axis=0)
        tied += at
    for start in range(0, width, block_N):  # the slots no pick filled
        slots = start + tl.arange(0, block_N)
        tl.store(out_ptr + row * width + slots, tl.full([block_N], -1, tl.int64),
                 mask=(slots >= taken) & (slots < width))


@triton.jit(do_not_specialize=["C"])
def candidate_blocks_kernel(scores_ptr, pos_ptr, out_ptr, C, RATIO: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_P2: tl.constexpr, TOPK_BLOCKS: tl.constexpr, block_N: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    visible = (tl.load(pos_ptr + row) + 1) // RATIO
    count = tl.cdiv(C, BLOCK)
    # the block of the newest visible entry; none when no entry is visible, or when it lies past the C scores (as the
    # reference's block layout: a block index past the last would otherwise land on the tile's padding items)
    newest = tl.where(visible > 0, (visible - 1) // BLOCK, -1)
    newest = tl.where(newest < count, newest, -1)
    threshold, ties, _ = _threshold(scores_ptr, scores_ptr, row, C, count, newest, TOPK_BLOCKS, BLOCK, BLOCK_P2,
                                    False, block_N)  # every block's mask is written: the last pass spans them all
    tied = tl.full((), 0, tl.int32)
    members = tl.arange(0, BLOCK_P2)
    for start in range(0, count, block_N):
        items = start + tl.arange(0, block_N)
        key = _keys(scores_ptr, scores_ptr, row, items, C, newest, BLOCK, BLOCK_P2, False)
        kept, at = _kept(key, threshold, ties, tied)
        cols = items[:, None] * BLOCK + members[None, :]
        tl.store(out_ptr + row * C + cols, tl.broadcast_to(kept[:, None], [block_N, BLOCK_P2]).to(tl.uint8),
                 mask=(cols < C) & (members < BLOCK)[None, :])
        tied += at


def default_config(block: int = 1, tokens: int = 1) -> dict:
    """Tiles of 4096 scores (block_N items of `block` entries) over 8 warps; `topk_select` over more than 64 tokens
    (prefill) 1024 over 2 warps, more rows on an SM at once: the H200 sweep `bench_kernels.py --only topk_tiles`
    (bench/RESULTS.md) chose them. Any config picks the same items."""
    if block == 1 and tokens > 64:
        return {"block_N": 1024, "num_warps": 2}
    return {"block_N": max(1, 4096 // triton.next_power_of_2(block)), "num_warps": 8}


def _check_scores(name: str, scores: torch.Tensor) -> None:
    if scores.dim() != 2 or scores.dtype != torch.float32 or not scores.is_contiguous():
        raise ValueError(f"{name}'s scores must be contiguous float32 [N, C], got {scores.dtype} {list(scores.shape)}")


def topk_select(scores: torch.Tensor, candidates: torch.Tensor | None = None, *, topk: int,
                config: dict | None = None) -> torch.Tensor:
    """Indices int64 [N, topk] of each row's `topk` highest finite scores (inside `candidates` where given) in
    ascending order, then -1 where the row has fewer; of scores tied at the last one kept, the lowest indices. The
    width is `topk` whatever C, so the attention reading them runs as many blocks of picks for any cache length
    (a static step's, over a cache's static width, and the eager step's, over its longest).

    scores float32 [N, C], candidates bool [N, C]; contiguous.
    """
    _check_scores("topk_select", scores)
    if candidates is not None and (candidates.shape != scores.shape or candidates.dtype != torch.bool
                                   or not candidates.is_contiguous()):
        raise ValueError(f"topk_select's candidates must be contiguous bool {list(scores.shape)}, got "
                         f"{candidates.dtype} {list(candidates.shape)}")
    if topk < 0:
        raise ValueError(f"topk_select's topk must be >= 0, got {topk}")
    n, c = scores.shape
    out = torch.empty(n, topk, dtype=torch.int64, device=scores.device)
    if out.numel() == 0 or c == 0:  # nothing to pick from: none
        return out.fill_(-1)
    config = config or default_config(1, n)
    chosen = scores if candidates is None else candidates.view(torch.uint8)
    launch(topk_select_kernel, (n,), (scores, chosen, out, c),
           {"K": topk, "HAS_CANDIDATES": candidates is not None, "block_N": config["block_N"]}, config["num_warps"], 1)
    return out


def candidate_blocks(scores: torch.Tensor, positions: torch.Tensor, *, ratio: int, block: int, topk_blocks: int,
                     config: dict | None = None) -> torch.Tensor:
    """Mask bool [N, C] of the entries in each row's kept blocks: blocks of `block` entries scored by their max, the
    block of entry (positions + 1) // ratio - 1 always kept, then the `topk_blocks` highest finite blocks (of
    blocks tied at the last one kept, the lowest).

    scores float32 [N, C], positions int64 [N]; contiguous.
    """
    _check_scores("candidate_blocks", scores)
    n, c = scores.shape
    if positions.dtype != torch.int64 or tuple(positions.shape) != (n,) or not positions.is_contiguous():
        raise ValueError(f"candidate_blocks' positions must be contiguous int64 [{n}], got {positions.dtype} "
                         f"{list(positions.shape)}")
    if ratio < 1 or block < 1 or topk_blocks < 0:
        raise ValueError(f"candidate_blocks needs ratio >= 1, block >= 1 and topk_blocks >= 0, got {ratio}, {block} "
                         f"and {topk_blocks}")
    out = torch.empty(n, c, dtype=torch.bool, device=scores.device)
    if out.numel() == 0:
        return out
    config = config or default_config(block, n)
    launch(candidate_blocks_kernel, (n,), (scores, positions, out.view(torch.uint8), c),
           {"RATIO": ratio, "BLOCK": block, "BLOCK_P2": triton.next_power_of_2(block), "TOPK_BLOCKS": topk_blocks,
            "block_N": config["block_N"]}, config["num_warps"], 1)
    return out


def candidate_blocks_op(scores: torch.Tensor, *, ratio: int, block: int, topk_blocks: int, ctx,
                        config: dict | None = None) -> torch.Tensor:
    """The DSL op `candidate_blocks` (same arguments) on the kernel: each token's newest entry from `ctx.positions`."""
    return candidate_blocks(scores.contiguous(), ctx.positions, ratio=ratio, block=block, topk_blocks=topk_blocks,
                            config=config)


__all__ = ["candidate_blocks", "candidate_blocks_kernel", "candidate_blocks_op", "default_config",
           "topk_select", "topk_select_kernel"]
