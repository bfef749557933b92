"""The shared expert's activation, h = silu(min(gate, L)) * clamp(up, -L, L), in one pass over its two projections.

`dsl.ops.moe.clamped_swiglu` runs it as four or five torch ops (two clamps, silu, the product), each a launch and a
round trip of [N, inter] fp32 through memory; here gate and up are read once and h written once. Same operations in
the same order (both clamps, then silu(gate) times up) through the routed experts' epilogue (kernels/moe/experts.py
`_swiglu`), whose silu is gate * sigmoid(gate) where torch's is gate / (1 + exp(-gate)): within a few ulps of the
reference, not bitwise (finite inputs; a NaN gate is clamped to L here). Elementwise, so a row's result does not
depend on the others.

`swiglu_one_row` is the whole of h for one token (a batch-1 decode step off the batch-invariant configs): gate, up and
the activation in one launch of gemv.py's `gemv_swiglu_kernel`, bitwise what the two one-row projections and this
module's kernel give.
"""

from __future__ import annotations

import torch

from kernels import tickets
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.linear import gemv
from kernels.linear.linear import check, gemv_config, k_per_split
from kernels.moe.experts import _swiglu

BLOCK = 1024  # values a program


@triton.jit(do_not_specialize=["total"])
def swiglu_kernel(gate_ptr, up_ptr, out_ptr, total, LIMIT: tl.constexpr, block: tl.constexpr):
    pdl_prologue()
    offs = tl.program_id(0) * block + tl.arange(0, block)
    mask = offs < total
    gate = tl.load(gate_ptr + offs, mask=mask, other=0.0)
    up = tl.load(up_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _swiglu(gate, up, 1.0, LIMIT), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, limit: float) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit), no clamps when `limit` is 0: gate and up [M, I] float32,
    contiguous, on one device. Returns fp32 [M, I]."""
    if gate.dim() != 2 or gate.shape != up.shape:
        raise ValueError(f"swiglu needs gate and up of one shape [M, I], got {list(gate.shape)} and {list(up.shape)}")
    if gate.dtype != torch.float32 or up.dtype != torch.float32 or not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError(f"swiglu needs contiguous float32 gate and up, got {gate.dtype} and {up.dtype}")
    if gate.device != up.device:
        raise ValueError(f"gate is on {gate.device}, up on {up.device}")
    _check_limit(limit)
    out = torch.empty_like(gate)
    total = gate.numel()
    launch(swiglu_kernel, (triton.cdiv(total, BLOCK),), (gate, up, out, total),
           {"LIMIT": float(limit), "block": BLOCK}, 4, 1)
    return out


def _check_limit(limit: float) -> None:
    if not limit >= 0:
        raise ValueError(f"limit must be >= 0 (0: no clamps), got {limit}")


def swiglu_one_row(x: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor | None, w3: torch.Tensor,
                   s3: torch.Tensor | None, *, limit: float) -> torch.Tensor:
    """h fp32 [1, N] = swiglu(x W1^T, x W3^T) with `limit` (as `swiglu`) for one token x [1, K] (fp32 or bf16) over
    W1 and W3 [N, K] of one dtype: fp8 32 x 32-block weights with their float32 scales, or plain (bf16, fp32) ones
    without; in one launch."""
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"swiglu_one_row takes one token x [1, K], got {list(x.shape)}")
    if w1.shape != w3.shape or w1.dtype != w3.dtype:
        raise ValueError(f"swiglu_one_row needs W1 and W3 of one shape and dtype, got {w1.dtype} {list(w1.shape)} "
                         f"and {w3.dtype} {list(w3.shape)}")
    _check_limit(limit)
    n, k = w1.shape
    fp8 = w1.dtype == torch.float8_e4m3fn
    config = gemv_config(n, k, w_bytes=w1.element_size())
    check(x, w1, s1, 1, config)
    check(x, w3, s3, 1, config)
    out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    if n == 0:
        return out
    split, block_k, block_n = config["split_k"], config["block_K"], config["block_N"]
    ws = torch.empty(2, split, n, dtype=torch.float32, device=x.device)
    launch(gemv.gemv_swiglu_kernel, (triton.cdiv(n, block_n), 2 * split),
           (x, w1, s1 if fp8 else w1, w3, s3 if fp8 else w3, ws, out,
            tickets.tile_counters(x.device, triton.cdiv(n, block_n))),
           dict(N=n, K=k, SCALE_COLS=s1.shape[1] if fp8 else 0, FP8=fp8, SPLIT_K=split,
                K_PER_SPLIT=k_per_split(k, split, block_k), LIMIT=float(limit),
                block_N=block_n, block_K=block_k), config["num_warps"], config["num_stages"])
    return out


__all__ = ["swiglu", "swiglu_kernel", "swiglu_one_row"]
