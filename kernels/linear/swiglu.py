"""The shared expert's activation, h = silu(min(gate, L)) * clamp(up, -L, L), in one pass over its two projections.

`dsl.ops.moe.clamped_swiglu` runs it as four or five torch ops (two clamps, silu, the product), each a launch and a
round trip of [N, inter] fp32 through memory; here gate and up are read once and h written once. Same operations in
the same order (both clamps, then silu(gate) times up) through the routed experts' epilogue (kernels/moe/experts.py
`_swiglu`), whose silu is gate * sigmoid(gate) where torch's is gate / (1 + exp(-gate)): within a few ulps of the
reference, not bitwise (finite inputs; a NaN gate is clamped to L here). Elementwise, so a row's result does not
depend on the others.
"""

from __future__ import annotations

import torch

from kernels.lang import tl, triton
from kernels.launch import launch
from kernels.moe.experts import _swiglu

BLOCK = 1024  # values a program


@triton.jit(do_not_specialize=["total"])
def swiglu_kernel(gate_ptr, up_ptr, out_ptr, total, LIMIT: tl.constexpr, block: tl.constexpr):
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
    if not limit >= 0:
        raise ValueError(f"limit must be >= 0 (0: no clamps), got {limit}")
    out = torch.empty_like(gate)
    total = gate.numel()
    launch(swiglu_kernel, (triton.cdiv(total, BLOCK),), (gate, up, out, total),
           {"LIMIT": float(limit), "block": BLOCK}, 4, 1)
    return out


__all__ = ["swiglu", "swiglu_kernel"]
