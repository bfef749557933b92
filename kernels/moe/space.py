"""The MoE family's config spaces: the routed experts' grouped GEMMs, and the gate's projection (on the linear family's
decode GEMM), filtered by the shared memory a block may use."""

from __future__ import annotations

import itertools

from kernels.moe.lowering import ExpertsStatic, GateStatic
from kernels.targets import DEFAULT_GPU_TARGET, get_target


def moe_configs(static: ExpertsStatic, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Per GEMM: tile width (64 rows per warpgroup), K stage, pipeline depth, and for decode buckets split-K (few
    experts fill the GPU only with their K split; GEMM 1 reads K = d, GEMM 2 K = inter, each split two stages or
    more). fp4 at block_K 256 spills registers in GEMM 1: not a candidate. Prefill buckets (> 64 tokens: about
    bucket * topk / E pairs an expert) also try more slots a block, so each dequantized weight tile serves more
    of them."""
    splits = [1, 2, 4, 8] if bucket <= 16 else [1, 2, 4] if bucket <= 64 else [1]
    slots = [16] if bucket <= 64 else [16, 32, 64, 128]
    out = []
    for bm, bn, bk, stages, up, down in itertools.product(slots, [64, 128], [64, 128], [3, 4], splits, splits):
        if static.d // up < 2 * bk or static.inter // down < 2 * bk or down > up:
            continue
        warps = 8 if bn * bm >= 128 * 64 else bn // 16
        gemm = {"block_M": bm, "block_N": bn, "block_K": bk, "num_warps": warps, "num_stages": stages}
        # per stage: the codes of two weights (half a byte each), bf16 activations, two fp32 scales per 32 codes
        if stages * (bk * (bn + 2 * bm) + bn * bk // 4) <= get_target(target).smem_per_block:
            out.append({"up": dict(gemm, split_k=up), "down": dict(gemm, split_k=down)})
    return out


def gate_configs(static: GateStatic, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """The MoE gate's projection: linear.py with fp32 weights and fp32 products (routing is discrete), so its tiles
    are the FMA path's, not the tensor cores': decode buckets split K; prefill buckets try smaller K stages and
    more warps, whose fp32 operands and accumulators would otherwise spill."""
    if bucket <= 64:
        bm = min(64, max(16, 1 << (bucket - 1).bit_length()))
        grid = itertools.product([bm], [32, 64, 128], [64, 128], [1, 2, 4, 8], [4], [2, 3])
    else:
        grid = itertools.product([32, 64, 128], [32, 64, 128], [16, 32, 64], [1], [4, 8], [2, 3])
    out = []
    for bm, bn, bk, split, warps, stages in grid:
        if split > 1 and static.d // split < 2 * bk:
            continue
        config = {"block_M": bm, "block_N": bn, "block_K": bk, "split_k": split, "num_warps": warps,
                  "num_stages": stages}
        if stages * bk * (bn + bm) * 4 <= get_target(target).smem_per_block:
            out.append(config)
    return out


__all__ = ["gate_configs", "moe_configs"]
