"""The routed experts' layout (kernels/moe/experts.py's grouped GEMMs read it): the gate's (token, slot) pairs sorted by
expert into blocks of `block_M` slots, each block one expert's.

`route(experts, num_experts, block_m)` takes experts int [T, k] (values in [0, E)) and returns rows int32
[B * block_m] (pair id t*k + slot, or -1) and block_expert int32 [B] (-1: an unused block). Expert e's pairs, in
pair order, fill its ceil(count_e / block_m) blocks from first_e = the blocks of the experts below it; the rest of
its last block, and the blocks past the used ones, hold -1. B = ceil((P + min(E, P) * (block_m - 1)) / block_m) for
P = T*k pairs bounds the blocks used: sizes fixed by the shapes, so neither this nor the GEMMs' grids needs a host
sync (CUDA graphs capture it).

Two launches of one program an expert, no atomics (the same bits every run, those of `route_ref`, the torch version:
a stable argsort, counts and cumsums in 27 torch ops): `route_count_kernel` counts each expert's pairs;
`route_place_kernel` sums the blocks of the experts below its own (its first block), scans the pairs in order again,
block_P at a time, and stores its own at their rank among them (tl.cumsum over the block's matches), then -1 over
the rest of its last block and its expert over its blocks; one more program writes -1 over the unused blocks. Every
program reads all P pairs: E * P reads a launch, from the L2 (150 MB at 8192 tokens of V4.1's 384 experts top 6;
a decode step's 6 to 384 pairs are one step of the scan).
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit(do_not_specialize=["P"])
def route_count_kernel(experts_ptr, counts_ptr, P, block_P: tl.constexpr):
    pdl_prologue()
    e = tl.program_id(0)
    hits = tl.zeros([block_P], dtype=tl.int32)
    for start in range(0, P, block_P):
        offs = start + tl.arange(0, block_P)
        hits += (tl.load(experts_ptr + offs, mask=offs < P, other=-1) == e).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(hits, axis=0))


@triton.jit(do_not_specialize=["P", "num_blocks"])
def route_place_kernel(experts_ptr, counts_ptr, rows_ptr, block_expert_ptr, P, num_blocks, E: tl.constexpr,
                       block_M: tl.constexpr, block_E: tl.constexpr, block_P: tl.constexpr):
    pdl_prologue()
    e = tl.program_id(0)
    ids = tl.arange(0, block_E)
    counts = tl.load(counts_ptr + ids, mask=ids < E, other=0)
    first = tl.sum(tl.where(ids < e, (counts + block_M - 1) // block_M, 0), axis=0)  # program E: all used blocks
    if e < E:
        count = tl.sum(tl.where(ids == e, counts, 0), axis=0)
        base = first * block_M
        placed = 0  # pairs of e before this block of pairs
        if count > 0:
            for start in range(0, P, block_P):
                offs = start + tl.arange(0, block_P)
                hit = tl.load(experts_ptr + offs, mask=offs < P, other=-1) == e
                rank = tl.cumsum(hit.to(tl.int32), axis=0)  # 1 for the block's first pair of e
                tl.store(rows_ptr + base + placed + rank - 1, offs, mask=hit)
                placed += tl.sum(hit.to(tl.int32), axis=0)
        blocks = (count + block_M - 1) // block_M
        pad = count + tl.arange(0, block_M)
        tl.store(rows_ptr + base + pad, -1, mask=pad < blocks * block_M)
        for b in range(0, blocks, block_P):
            bs = b + tl.arange(0, block_P)
            tl.store(block_expert_ptr + first + bs, e, mask=bs < blocks)
    else:
        for s in range(first * block_M, num_blocks * block_M, block_P):
            offs = s + tl.arange(0, block_P)
            tl.store(rows_ptr + offs, -1, mask=offs < num_blocks * block_M)
        for b in range(first, num_blocks, block_P):
            bs = b + tl.arange(0, block_P)
            tl.store(block_expert_ptr + bs, -1, mask=bs < num_blocks)


def num_route_blocks(pairs: int, num_experts: int, block_m: int) -> int:
    """B: the blocks of `block_m` slots that `pairs` pairs over `num_experts` experts can need at most."""
    return triton.cdiv(pairs + min(num_experts, pairs) * (block_m - 1), block_m)


def default_config() -> dict:
    return {"block_P": 1024, "num_warps": 4}


def route(experts: torch.Tensor, num_experts: int, block_m: int,
          config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows int32 [B * block_m] and block_expert int32 [B] for experts int32/int64 [T, k] (see the module's
    docstring); the bits of `route_ref`."""
    if experts.dim() != 2 or experts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"route's experts must be int32/int64 [T, k], got {experts.dtype} {list(experts.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"route's num_experts and block_m must be positive, got {num_experts}, {block_m}")
    flat = experts.reshape(-1).contiguous()
    p, dev = flat.numel(), flat.device
    num_blocks = num_route_blocks(p, num_experts, block_m)
    rows = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    if p == 0:
        return rows, block_expert
    config = config or default_config()
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    launch(route_count_kernel, (num_experts,), (flat, counts, p), dict(block_P=config["block_P"]),
           config["num_warps"], 1)
    launch(route_place_kernel, (num_experts + 1,), (flat, counts, rows, block_expert, p, num_blocks),
           dict(E=num_experts, block_M=block_m, block_E=triton.next_power_of_2(num_experts),
                block_P=config["block_P"]), config["num_warps"], 1)
    return rows, block_expert


def route_ref(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` in torch: a stable argsort by expert, the counts (scatter_add) and their cumsums."""
    flat = experts.reshape(-1)
    p = flat.numel()
    dev = flat.device
    num_blocks = num_route_blocks(p, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    first = torch.cumsum(counts, 0) - counts
    sorted_e = flat[order]
    slot = (block_end - blocks)[sorted_e] * block_m + torch.arange(p, device=dev) - first[sorted_e]
    rows = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    rows.scatter_(0, slot, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=dev), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return rows, block_expert


__all__ = ["default_config", "num_route_blocks", "route", "route_count_kernel", "route_place_kernel", "route_ref"]
