"""RMSNorm over the last dim: one program per row, the row held in registers, fp32 throughout.

Its norm of a row held in registers (`_rms`) also serves the norms that round to e4m3 (kernels/norm/e4m3.py).
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit
def _rms(x, w_ptr, offs, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr):
    """x [block_D] fp32 at columns `offs` (0 past D) normed, times w [D] with HAS_W."""
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + EPS)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    return y


@triton.jit
def _normed(x_ptr, w_ptr, row, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr, block_D: tl.constexpr):
    """Row `row` of x [rows, D] normed: [block_D] fp32, 0 past D."""
    offs = tl.arange(0, block_D)
    x = tl.load(x_ptr + row * D + offs, mask=offs < D, other=0.0).to(tl.float32)
    return _rms(x, w_ptr, offs, D, EPS, HAS_W)


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr,
                    block_D: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, block_D)
    tl.store(out_ptr + row * D + offs, _normed(x_ptr, w_ptr, row, D, EPS, HAS_W, block_D), mask=offs < D)


def default_config(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    return {"num_warps": 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16}


def check_input(x: torch.Tensor, w: torch.Tensor | None) -> None:
    """ValueError unless x is contiguous float32/bfloat16 [..., D] and w None or contiguous [D] on x's device."""
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"rms_norm needs contiguous float32/bfloat16 x, got {x.dtype}")
    d = x.shape[-1]
    if w is not None and (tuple(w.shape) != (d,) or not w.is_contiguous() or w.device != x.device):
        raise ValueError(f"rms_norm weight must be contiguous [{d}] on {x.device}, got {list(w.shape)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float, config: dict | None = None) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim: x [..., D] float32/bfloat16 contiguous, w [D] or None.

    Returns fp32 [..., D].
    """
    check_input(x, w)
    d = x.shape[-1]
    config = config or default_config(d)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // d if d else 0
    if rows == 0:
        return out
    launch(rms_norm_kernel, (rows,), (x, x if w is None else w, out),
           dict(D=d, EPS=eps, HAS_W=w is not None, block_D=triton.next_power_of_2(d)), config["num_warps"], 1)
    return out


__all__ = ["check_input", "default_config", "rms_norm", "rms_norm_kernel"]
