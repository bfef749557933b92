"""The compressor's pooling (`dsl.ops.compressor`): each completed group of `ratio` rows becomes one entry, the
rows weighted by the softmax over the group of their gates, column by column.

`pool_groups(kv, gate, kept_kv, kept_gate, source)` takes a forward's rows kv and gate [N, D], the partial groups'
rows its sequences kept from earlier forwards [P, D], and each group's members `source` [G, ratio] (a row of the
forward below N, else kept row r - N), and writes the entries [G, D]: one program a group and block of columns,
three passes over its members (their gates' maximum; the sum of exp(gate - max); the rows times exp / sum, added in
member order), as the reference's softmax and sum. One launch where torch makes two concatenations, two gathers,
the softmax and the weighted sum; and a group's entry depends only on its members, not on how many groups there are
(torch's CUDA reductions split a sum by the tensor's size), so the same bits in any batch.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit
def _member(own_ptr, kept_ptr, r, N, cols, mask, D: tl.constexpr):
    """Row r of the forward's rows (r < N) or of the kept ones (r - N), columns `cols`."""
    mine = r < N
    a = tl.load(own_ptr + r * D + cols, mask=mask & mine, other=0.0)
    b = tl.load(kept_ptr + (r - N) * D + cols, mask=mask & (r >= N), other=0.0)
    return tl.where(mine, a, b)


@triton.jit(do_not_specialize=["N"])
def pool_groups_kernel(kv_ptr, gate_ptr, kept_kv_ptr, kept_gate_ptr, source_ptr, out_ptr, N, D: tl.constexpr,
                       RATIO: tl.constexpr, block_D: tl.constexpr):
    pdl_prologue()
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * block_D + tl.arange(0, block_D)
    mask = cols < D
    top = tl.full([block_D], float("-inf"), tl.float32)
    for j in range(RATIO):
        r = tl.load(source_ptr + g * RATIO + j)
        top = tl.maximum(top, _member(gate_ptr, kept_gate_ptr, r, N, cols, mask, D))
    total = tl.zeros([block_D], dtype=tl.float32)
    for j in range(RATIO):
        r = tl.load(source_ptr + g * RATIO + j)
        total += tl.exp(_member(gate_ptr, kept_gate_ptr, r, N, cols, mask, D) - top)
    acc = tl.zeros([block_D], dtype=tl.float32)
    for j in range(RATIO):
        r = tl.load(source_ptr + g * RATIO + j)
        weight = tl.exp(_member(gate_ptr, kept_gate_ptr, r, N, cols, mask, D) - top) / total
        acc += _member(kv_ptr, kept_kv_ptr, r, N, cols, mask, D) * weight
    tl.store(out_ptr + g * D + cols, acc, mask=mask)


def default_config(d: int) -> dict:
    """Up to 1024 columns a program (a group's D is read three times; the kept rows are few)."""
    return {"block_D": min(1024, triton.next_power_of_2(d)), "num_warps": 4}


def pool_groups(kv: torch.Tensor, gate: torch.Tensor, kept_kv: torch.Tensor, kept_gate: torch.Tensor,
                source: torch.Tensor, config: dict | None = None) -> torch.Tensor:
    """Entries fp32 [G, D] of the groups whose members `source` int64 [G, ratio] names among kv, gate fp32 [N, D]
    (rows below N) and kept_kv, kept_gate fp32 [P, D] (row r - N)."""
    n, d = kv.shape
    for name, t, rows in (("kv", kv, n), ("gate", gate, n), ("kept_kv", kept_kv, kept_gate.shape[0]),
                          ("kept_gate", kept_gate, kept_kv.shape[0])):
        if t.dim() != 2 or t.shape != (rows, d) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"pool_groups' {name} must be contiguous float32 [{rows}, {d}], got {t.dtype} "
                             f"{list(t.shape)}")
    if source.dim() != 2 or source.dtype != torch.int64:
        raise ValueError(f"pool_groups' source must be int64 [G, ratio], got {source.dtype} {list(source.shape)}")
    groups, ratio = source.shape
    out = torch.empty(groups, d, dtype=torch.float32, device=kv.device)
    if groups == 0:
        return out
    config = config or default_config(d)
    launch(pool_groups_kernel, (groups, triton.cdiv(d, config["block_D"])),
           (kv, gate, kept_kv, kept_gate, source.contiguous(), out, n),
           dict(D=d, RATIO=ratio, block_D=config["block_D"]), config["num_warps"], 1)
    return out


__all__ = ["default_config", "pool_groups", "pool_groups_kernel"]
