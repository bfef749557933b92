"""The linear family's config spaces, filtered by what the hardware allows (shared memory per block, the smallest
`tl.dot` tile, the fp8 scale block), in the style of Triton's matmul tutorial `get_configs()`."""

from __future__ import annotations

import itertools

from kernels.linear.lowering import LinearStatic
from kernels.targets import DEFAULT_GPU_TARGET, get_target


def linear_configs(static: LinearStatic, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Decode buckets: tile width, K stage, pipeline depth and split-K (the levers of a weight-streaming
    kernel); larger buckets: square-ish tiles."""
    fp8 = static.fmt == "fp8"
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
        if split > 1 and static.k // split < 2 * bk:
            continue
        config = {"block_M": bm, "block_N": bn, "block_K": bk, "split_k": split, "num_warps": warps,
                  "num_stages": stages}
        if dequant_w:
            config["fp8_dequant_w"] = True
        if stages * bk * (bn * wbytes + bm * 4) <= get_target(target).smem_per_block:
            out.append(config)
    return out


__all__ = ["linear_configs"]
