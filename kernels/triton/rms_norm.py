"""RMSNorm over the last dim: one program per row, the row held in registers, fp32 throughout.

`rms_norm_e4m3` rounds the normed row to e4m3 in the same pass, as `linear_fp8.quantize_rows` would (a power-of-two
scale from the row's amax), and writes e4m3 rows (kernels/triton/linear_fp8.py) instead of fp32: plans with fp8
activations run it where only fp8-activation linears read a norm (graphs/plan.py), which then skip their own
rounding pass. Both kernels norm a row with the same code (`_normed`), so the codes are `quantize_rows`' of
`rms_norm`'s output, bit for bit.
"""

from __future__ import annotations

import torch

from kernels.launch import launch
from kernels.triton.lang import tl, triton
from kernels.triton.linear_fp8 import e4m3_rows, store_e4m3_row


@triton.jit
def _normed(x_ptr, w_ptr, row, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr, block_D: tl.constexpr):
    """Row `row` of x normed (times w with HAS_W): [block_D] fp32, 0 past D."""
    offs = tl.arange(0, block_D)
    mask = offs < D
    x = tl.load(x_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + EPS)
    if HAS_W:
        y = y * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return y


@triton.jit
def rms_norm_kernel(x_ptr, w_ptr, out_ptr, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr,
                    block_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, block_D)
    tl.store(out_ptr + row * D + offs, _normed(x_ptr, w_ptr, row, D, EPS, HAS_W, block_D), mask=offs < D)


@triton.jit
def rms_norm_e4m3_kernel(x_ptr, w_ptr, q_ptr, s_ptr, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr,
                         ROW: tl.constexpr, block_D: tl.constexpr):
    """Row r's codes to q_ptr + r * ROW (uint8), its scale to s_ptr + r * ROW / 4 (fp32): e4m3 rows of ROW bytes."""
    row = tl.program_id(0).to(tl.int64)
    y = _normed(x_ptr, w_ptr, row, D, EPS, HAS_W, block_D)
    store_e4m3_row(q_ptr + row * ROW, s_ptr + row * (ROW // 4), y, tl.arange(0, block_D), D)


def default_config(d: int) -> dict:
    block_d = triton.next_power_of_2(d)
    return {"num_warps": 4 if block_d <= 2048 else 8 if block_d <= 8192 else 16}


def _check(x: torch.Tensor, w: torch.Tensor | None) -> None:
    if x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"rms_norm needs contiguous float32/bfloat16 x, got {x.dtype}")
    d = x.shape[-1]
    if w is not None and (tuple(w.shape) != (d,) or not w.is_contiguous() or w.device != x.device):
        raise ValueError(f"rms_norm weight must be contiguous [{d}] on {x.device}, got {list(w.shape)}")


def rms_norm(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float, config: dict | None = None) -> torch.Tensor:
    """w * x * rsqrt(mean(x^2) + eps) over the last dim: x [..., D] float32/bfloat16 contiguous, w [D] or None.

    Returns fp32 [..., D].
    """
    _check(x, w)
    d = x.shape[-1]
    config = config or default_config(d)
    out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // d if d else 0
    if rows == 0:
        return out
    launch(rms_norm_kernel, (rows,), (x, x if w is None else w, out),
           dict(D=d, EPS=eps, HAS_W=w is not None, block_D=triton.next_power_of_2(d)), config["num_warps"], 1)
    return out


def rms_norm_e4m3(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float,
                  config: dict | None = None) -> torch.Tensor:
    """`rms_norm(x, w)` rounded to e4m3 per row as `quantize_rows` rounds it: x [M, D] float32/bfloat16 contiguous,
    D > 0, w [D] or None. Returns e4m3 rows, uint8 [M, bytes] (`linear_fp8.unpack_rows(rows, D)`: the codes
    float8_e4m3fn [M, D] and scales float32 [M])."""
    _check(x, w)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"rms_norm_e4m3 needs x [M, D] with D > 0, got {list(x.shape)}")
    (m, d), config = x.shape, config or default_config(x.shape[1])
    rows, _, sx = e4m3_rows(m, d, x.device)
    launch(rms_norm_e4m3_kernel, (m,), (x, x if w is None else w, rows, sx),
           {"D": d, "EPS": eps, "HAS_W": w is not None, "ROW": rows.shape[1], "block_D": triton.next_power_of_2(d)},
           config["num_warps"], 1)
    return rows


__all__ = ["default_config", "rms_norm", "rms_norm_e4m3", "rms_norm_e4m3_kernel", "rms_norm_kernel"]
