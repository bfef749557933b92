"""Config spaces per kernel template, filtered by what the hardware allows (shared memory per block, the
smallest `tl.dot` tile, the fp8 scale block), in the style of Triton's matmul tutorial `get_configs()`."""

from __future__ import annotations

import itertools

from kernels.targets import DEFAULT_GPU_TARGET, get_target


def _pipelined_bytes(config: dict, per_stage: int) -> int:
    return per_stage * config.get("num_stages", 1)


def linear_configs(static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Decode buckets: tile width, K stage, pipeline depth and split-K (the levers of a weight-streaming
    kernel); larger buckets: square-ish tiles."""
    fp8 = static["fmt"] == "fp8"
    wbytes = 1 if fp8 else 2
    out = []
    if bucket <= 64 and fp8:  # both ways of applying the block scales: on copies of x, or on W in registers
        bm = min(64, max(16, 1 << (bucket - 1).bit_length()))
        grid = itertools.product([bm], [64, 128], [64, 128], [1, 2, 4, 8], [8] if bm >= 32 else [4], [3, 4],
                                 [False, True])
    elif bucket <= 64:
        bm = min(64, max(16, 1 << (bucket - 1).bit_length()))
        grid = itertools.product([bm], [32, 64, 128], [128, 256], [1, 2, 4, 8], [4], [3, 4], [False])
    else:
        grid = itertools.product([64, 128], [64, 128, 256], [64, 128], [1], [4, 8], [3, 4], [fp8])
    for bm, bn, bk, split, warps, stages, dequant_w in grid:
        if split > 1 and static["k"] // split < 2 * bk:
            continue
        config = {"block_M": bm, "block_N": bn, "block_K": bk, "split_k": split, "num_warps": warps,
                  "num_stages": stages}
        if dequant_w:
            config["fp8_dequant_w"] = True
        if _pipelined_bytes(config, bk * (bn * wbytes + bm * 4)) <= get_target(target).smem_per_block:
            out.append(config)
    return out


def moe_configs(static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Per GEMM: tile width (64 rows per warpgroup), K stage, pipeline depth, and for decode buckets split-K (few
    experts fill the GPU only with their K split; GEMM 1 reads K = d, GEMM 2 K = inter, each split two stages or
    more). fp4 at block_K 256 spills registers in GEMM 1: not a candidate. Prefill buckets (> 64 tokens: about
    bucket * topk / E pairs an expert) also try more slots a block, so each dequantized weight tile serves more
    of them."""
    splits = [1, 2, 4, 8] if bucket <= 16 else [1, 2, 4] if bucket <= 64 else [1]
    slots = [16] if bucket <= 64 else [16, 32, 64, 128]
    out = []
    for bm, bn, bk, stages, up, down in itertools.product(slots, [64, 128], [64, 128], [3, 4], splits, splits):
        if static["d"] // up < 2 * bk or static["inter"] // down < 2 * bk or down > up:
            continue
        warps = 8 if bn * bm >= 128 * 64 else bn // 16
        gemm = {"block_M": bm, "block_N": bn, "block_K": bk, "num_warps": warps, "num_stages": stages}
        # per stage: the codes of two weights (half a byte each), bf16 activations, two fp32 scales per 32 codes
        if _pipelined_bytes(gemm, bk * (bn + 2 * bm) + bn * bk // 4) <= get_target(target).smem_per_block:
            out.append({"up": dict(gemm, split_k=up), "down": dict(gemm, split_k=down)})
    return out


def gate_configs(static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
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
        if split > 1 and static["d"] // split < 2 * bk:
            continue
        config = {"block_M": bm, "block_N": bn, "block_K": bk, "split_k": split, "num_warps": warps,
                  "num_stages": stages}
        if _pipelined_bytes(config, bk * (bn + bm) * 4) <= get_target(target).smem_per_block:
            out.append(config)
    return out


def attention_configs(static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    d = 1 << (static["d"] - 1).bit_length()
    out = []
    for bs, warps, stages, split in itertools.product([16, 32, 64], [4, 8], [2, 3], [1, 2, 4, 8]):
        if bs * d * 2 * stages + 16 * d * 2 <= get_target(target).smem_per_block:
            out.append({"block_H": 16, "block_S": bs, "num_warps": warps, "num_stages": stages, "split_kv": split})
    return out


def mixes_configs(static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Decode buckets: 16 tokens a program and K split 4 to 64 ways (few tokens fill the GPU only so); prefill
    buckets: 32 or 64 tokens a program (each tile of the projection read from L2 serves more of them), little or
    no split."""
    if bucket <= 64:
        grid = itertools.product([16], [32, 64], [4, 8, 16, 32, 64], [4], [2, 3])
    else:
        grid = itertools.product([32, 64], [32, 64], [1, 2, 4], [4, 8], [2, 3])
    return [{"block_M": bm, "block_K": bk, "split_k": s, "num_warps": w, "num_stages": st}
            for bm, bk, s, w, st in grid if static["hc"] * static["d"] // s >= bk]


def norm_configs(static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    return [{"num_warps": w} for w in (4, 8, 16)]


SPACES = {"linear": linear_configs, "moe_gate": gate_configs, "moe_experts": moe_configs,
          "sparse_attention": attention_configs, "hc_mixes": mixes_configs, "rms_norm": norm_configs}


def get_configs(template: str, static: dict, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Every candidate config of `template` for these static shapes and token bucket (empty: nothing to tune)."""
    space = SPACES.get(template)
    return [] if space is None else space(static, bucket, target)


__all__ = ["get_configs", "SPACES"]
