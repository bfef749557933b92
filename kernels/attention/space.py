"""The attention's config space, filtered by the shared memory a block may use."""

from __future__ import annotations

import itertools

from kernels.attention.lowering import HeadsStatic
from kernels.targets import DEFAULT_GPU_TARGET, get_target


def attention_configs(static: HeadsStatic, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    d = 1 << (static.d - 1).bit_length()
    out = []
    for bs, warps, stages, split in itertools.product([16, 32, 64], [4, 8], [2, 3], [1, 2, 4, 8]):
        if bs * d * 2 * stages + 16 * d * 2 <= get_target(target).smem_per_block:
            out.append({"block_H": 16, "block_S": bs, "num_warps": warps, "num_stages": stages, "split_kv": split})
    return out


__all__ = ["attention_configs"]
