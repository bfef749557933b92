"""RMSNorm over the last dim: one program per row, the row held in registers, fp32 throughout."""

from __future__ import annotations

import torch

from kernels.launch import launch
from kernels.triton.lang import tl, triton


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr,
                    block_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, block_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + EPS)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, y, mask=mask)


def default_config(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    return {"num_warps": 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16}


def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float, config: dict | None = None) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim: x [..., D] float32/bfloat16 contiguous, w [D] or None.

    Returns fp32 [..., D].
    """
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"rms_norm needs contiguous float32/bfloat16 x, got {x.dtype}")
    d = x.shape[-1]
    if w is not None and (tuple(w.shape) != (d,) or not w.is_contiguous() or w.device != x.device):
        raise ValueError(f"rms_norm weight must be contiguous [{d}] on {x.device}, got {list(w.shape)}")
    config = config or default_config(d)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // d if d else 0
    if rows == 0:
        return out
    launch(rms_norm_kernel, (rows,), (x, x if w is None else w, out),
           dict(D=d, EPS=eps, HAS_W=w is not None, block_D=triton.next_power_of_2(d)), config["num_warps"], 1)
    return out


__all__ = ["rms_norm", "rms_norm_kernel", "default_config"]
