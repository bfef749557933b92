"""RMSNorm, and the hyper-connections' collapse + RMSNorm, rounded to e4m3 in the same pass: written as e4m3 rows
(codes and a power-of-two scale per row, kernels/linear/fp8.py) instead of fp32.

Plans with fp8 activations run them where only fp8-activation linears read a norm (graphs/plan.py): the attention's
collapse + norm (read by wq_a and wkv), its q_norm (wq_b, the indexer's wq_b), DSpark's main_norm. Those linears then
skip their own rounding pass over the rows, and the fp32 rows are never written. One program per row, the row in
registers: normed as the fp32 kernels norm it (kernels/norm/rms_norm.py `_rms`; the streams summed as
kernels/hyper/hyper.py sums them), rounded as `quantize_rows` rounds it (`store_e4m3_row`). So the codes and scales
are `quantize_rows`' of those kernels' output: bit for bit under Triton's interpreter; compiled for sm_90a, the scales
are and all but a few codes are (bench/RESULTS.md: each such code one e4m3 step off, where the two compilations'
normed values differ in their last bit, for a reason not known). A row's bytes do not depend on the other rows.
"""

from __future__ import annotations

import torch

from kernels.hyper.hyper import _check_streams
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.linear.fp8 import e4m3_rows, store_e4m3_row
from kernels.norm.rms_norm import _normed, _rms, check_input, default_config


@triton.jit
def rms_norm_e4m3_kernel(x_ptr, w_ptr, q_ptr, s_ptr, D: tl.constexpr, EPS: tl.constexpr, HAS_W: tl.constexpr,
                         ROW: tl.constexpr, block_D: tl.constexpr):
    """Row r's codes to q_ptr + r * ROW (uint8), its scale to s_ptr + r * ROW / 4 (fp32): e4m3 rows of ROW bytes."""
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    y = _normed(x_ptr, w_ptr, row, D, EPS, HAS_W, block_D)
    store_e4m3_row(q_ptr + row * ROW, s_ptr + row * (ROW // 4), y, tl.arange(0, block_D), ROW)


@triton.jit
def hc_collapse_rms_norm_e4m3_kernel(h_ptr, pre_ptr, w_ptr, q_ptr, s_ptr, HC: tl.constexpr, D: tl.constexpr,
                                     EPS: tl.constexpr, ROW: tl.constexpr, block_D: tl.constexpr):
    """sum_k pre[r, k] * h[r, k] normed, as e4m3 rows of ROW bytes (as above). The sum is hyper.py's
    `hc_collapse_rms_norm_kernel`'s, written out here: hyper.py's kernels key the collapse's tuned configs."""
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, block_D)
    x = tl.zeros([block_D], dtype=tl.float32)
    for k in tl.static_range(HC):
        x += tl.load(pre_ptr + row * HC + k) * tl.load(h_ptr + (row * HC + k) * D + offs, mask=offs < D, other=0.0)
    store_e4m3_row(q_ptr + row * ROW, s_ptr + row * (ROW // 4), _rms(x, w_ptr, offs, D, EPS, True), offs, ROW)


def _block(d: int) -> int:
    """A row's registers: its values and the zeros after them up to the scale (the next multiple of 16)."""
    return max(16, triton.next_power_of_2(d))


def rms_norm_e4m3(x: torch.Tensor, w: torch.Tensor | None = None, *, eps: float,
                  config: dict | None = None) -> torch.Tensor:
    """`rms_norm(x, w)` rounded to e4m3 per row as `quantize_rows` rounds it: x [M, D] float32/bfloat16 contiguous,
    D > 0, w [D] or None; `config` as rms_norm's. Returns e4m3 rows, uint8 [M, bytes] (`linear_fp8.unpack_rows(rows,
    D)`: the codes float8_e4m3fn [M, D] and scales float32 [M])."""
    check_input(x, w)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"rms_norm_e4m3 needs x [M, D] with D > 0, got {list(x.shape)}")
    (m, d), config = x.shape, config or default_config(x.shape[1])
    rows, _, sx = e4m3_rows(m, d, x.device)
    launch(rms_norm_e4m3_kernel, (m,), (x, x if w is None else w, rows, sx),
           {"D": d, "EPS": eps, "HAS_W": w is not None, "ROW": rows.shape[1], "block_D": _block(d)},
           config["num_warps"], 1)
    return rows


def hc_collapse_rms_norm_e4m3(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor, *, eps: float) -> torch.Tensor:
    """`hyper.hc_collapse_rms_norm(h, pre, w)` rounded to e4m3 per row as `quantize_rows` rounds it: h [N, hc, D], pre
    [N, hc] float32 contiguous, w [D] contiguous, D > 0. Returns e4m3 rows, uint8 [N, bytes] (`unpack_rows`)."""
    _check_streams(h, "hc_collapse_rms_norm_e4m3")
    n, hc, d = h.shape
    if tuple(pre.shape) != (n, hc) or pre.dtype != torch.float32 or not pre.is_contiguous():
        raise ValueError(f"pre must be contiguous float32 [{n}, {hc}], got {pre.dtype} {list(pre.shape)}")
    if tuple(w.shape) != (d,) or not w.is_contiguous() or d == 0:
        raise ValueError(f"the norm weight must be contiguous [{d}] with D > 0, got {list(w.shape)}")
    rows, _, sx = e4m3_rows(n, d, h.device)
    block_d = _block(d)
    launch(hc_collapse_rms_norm_e4m3_kernel, (n,), (h, pre, w, rows, sx),
           {"HC": hc, "D": d, "EPS": eps, "ROW": rows.shape[1], "block_D": block_d}, 4 if block_d <= 2048 else 8, 1)
    return rows


__all__ = ["hc_collapse_rms_norm_e4m3", "hc_collapse_rms_norm_e4m3_kernel", "rms_norm_e4m3", "rms_norm_e4m3_kernel"]
