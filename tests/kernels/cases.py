"""The shapes every kernel test draws from: small ones the interpreter runs in CI, and V4.1-Flash's own on the
GPU, with the corner cases (1 token, sizes that are not a multiple of the block)."""

from __future__ import annotations

import torch

ON_GPU = torch.cuda.is_available()

# Full V4.1-Flash: hidden 5120, q_lora 1280, 64 heads x 512, o_groups 8 x 1024, 384 experts top 6 of width 2304.
HIDDEN, Q_LORA, HEADS, HEAD_DIM, O_GROUPS, O_RANK = 5120, 1280, 64, 512, 8, 1024
EXPERTS, TOPK, MOE_INTER, WINDOW, INDEX_TOPK = 384, 6, 2304, 128, 512

# (name, out features per group, in features per group, groups)
V41_LINEARS = [("wq_a", Q_LORA, HIDDEN, 1), ("wq_b", HEADS * HEAD_DIM, Q_LORA, 1), ("wkv", HEAD_DIM, HIDDEN, 1),
               ("wo_a", O_RANK, HEADS // O_GROUPS * HEAD_DIM, O_GROUPS), ("wo_b", HIDDEN, O_GROUPS * O_RANK, 1)]
DECODE_TOKENS = [1, 7, 64]


def gen(*shape: int, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0,
        scale: float = 1.0) -> torch.Tensor:
    """Fresh random values (never zeros), reproducible per seed."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(device)


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)), "NaN/inf positions differ"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
