"""Hyper-connections: the collapse fused with the sub-layer's RMSNorm, and the stream update (`hc_add_expand`: over
the sum of a sub-layer's two outputs, the MoE's routed and shared experts', made in the same launch). The mixes, and
the update made inside their first launch, are kernels/hyper/mixes.py's."""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch


@triton.jit
def hc_collapse_rms_norm_kernel(h_ptr, pre_ptr, w_ptr, out_ptr, HC: tl.constexpr, D: tl.constexpr,
                                EPS: tl.constexpr, NORM: tl.constexpr, block_D: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, block_D)
    mask = offs < D
    x = tl.zeros([block_D], dtype=tl.float32)
    for k in tl.static_range(HC):
        x += tl.load(pre_ptr + row * HC + k) * tl.load(h_ptr + (row * HC + k) * D + offs, mask=mask, other=0.0)
    if NORM:
        x = x * tl.rsqrt(tl.sum(x * x, axis=0) / D + EPS) * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * D + offs, x, mask=mask)


@triton.jit
def _expand(y, h_ptr, post_ptr, comb_ptr, out_ptr, row, offs, mask, HC: tl.constexpr, D: tl.constexpr):
    """Row `row`'s new streams over columns `offs` from its sub-layer output y [block_D] (fp32): post * y, then each
    old stream's share added by a fused multiply-add, in stream order (mixes.py's `_streams_tile` makes the same
    bits)."""
    ks = tl.arange(0, HC)
    acc = tl.load(post_ptr + row * HC + ks)[:, None] * y[None, :]  # [HC, block_D]
    for j in tl.static_range(HC):
        hj = tl.load(h_ptr + (row * HC + j) * D + offs, mask=mask, other=0.0)
        acc = tl.fma(tl.load(comb_ptr + row * HC * HC + j * HC + ks)[:, None], hj[None, :], acc)
    tl.store(out_ptr + (row * HC + ks[:, None]) * D + offs[None, :], acc, mask=mask[None, :])


@triton.jit
def hc_expand_kernel(y_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, HC: tl.constexpr, D: tl.constexpr,
                     block_D: tl.constexpr):
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * block_D + tl.arange(0, block_D)
    mask = offs < D
    y = tl.load(y_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    _expand(y, h_ptr, post_ptr, comb_ptr, out_ptr, row, offs, mask, HC, D)


@triton.jit
def hc_add_expand_kernel(a_ptr, b_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, HC: tl.constexpr, D: tl.constexpr,
                         ROUND_BF16: tl.constexpr, block_D: tl.constexpr):
    """`hc_expand_kernel` over y = a + b, summed as torch adds them: in fp32, rounded to bf16 where both are bf16."""
    pdl_prologue()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * block_D + tl.arange(0, block_D)
    mask = offs < D
    y = tl.load(a_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32) + \
        tl.load(b_ptr + row * D + offs, mask=mask, other=0.0).to(tl.float32)
    if ROUND_BF16:
        y = y.to(tl.bfloat16).to(tl.float32)
    _expand(y, h_ptr, post_ptr, comb_ptr, out_ptr, row, offs, mask, HC, D)


def _check_streams(h: torch.Tensor, what: str) -> None:
    if h.dim() != 3 or h.dtype != torch.float32 or not h.is_contiguous():
        raise ValueError(f"{what} needs contiguous float32 streams [N, hc, D], got {h.dtype} {list(h.shape)}")
    hc = h.shape[1]
    if hc & (hc - 1):
        raise ValueError(f"{what} needs a power-of-two stream count, got {hc}")


def hc_collapse_rms_norm(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor | None = None, *,
                         eps: float = 0.0, norm: bool = True) -> torch.Tensor:
    """sum_k pre[:, k] * h[:, k], then (when `norm`) w * x * rsqrt(mean(x^2) + eps): h [N, hc, D] fp32,
    pre [N, hc] fp32, w [D]. Returns fp32 [N, D]; one read of the streams."""
    _check_streams(h, "hc_collapse")
    n, hc, d = h.shape
    if tuple(pre.shape) != (n, hc) or pre.dtype != torch.float32 or not pre.is_contiguous():
        raise ValueError(f"pre must be contiguous float32 [{n}, {hc}], got {pre.dtype} {list(pre.shape)}")
    if norm and (w is None or tuple(w.shape) != (d,) or not w.is_contiguous()):
        raise ValueError(f"the norm weight must be contiguous [{d}]")
    out = torch.empty(n, d, dtype=torch.float32, device=h.device)
    if n == 0:
        return out
    block_d = triton.next_power_of_2(d)
    launch(hc_collapse_rms_norm_kernel, (n,), (h, pre, w if norm else pre, out),
           dict(HC=hc, D=d, EPS=eps, NORM=norm, block_D=block_d), 4 if block_d <= 2048 else 8, 1)
    return out


def _check_expand(outputs: dict[str, torch.Tensor], h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                  what: str) -> None:
    """The stream update's operands: the sub-layer's outputs (by name), the streams, post and comb."""
    _check_streams(h, what)
    n, hc, d = h.shape
    for name, y in outputs.items():
        if tuple(y.shape) != (n, d) or not y.is_contiguous() or y.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{what}'s {name} must be contiguous float32/bfloat16 [{n}, {d}], got {y.dtype} "
                             f"{list(y.shape)}")
    for t, shape in ((post, (n, hc)), (comb, (n, hc, hc))):
        if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{what} needs contiguous float32 {list(shape)}, got {t.dtype} {list(t.shape)}")


def _bf16_sum(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether torch's a + b is bf16 (both are), so a fused sum rounds to bf16 as it does (`ROUND_BF16`)."""
    return b is not None and a.dtype == b.dtype == torch.bfloat16


def _expand_grid(h: torch.Tensor) -> tuple[tuple[int, int], int]:
    n, _, d = h.shape
    block_d = min(1024, triton.next_power_of_2(d))
    return (n, triton.cdiv(d, block_d)), block_d


def hc_expand(y: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New streams out[:, k] = post[:, k] * y + sum_j comb[:, j, k] * h[:, j]: y [N, D] fp32/bf16,
    h [N, hc, D] fp32, post [N, hc], comb [N, hc, hc] fp32, all contiguous. Returns fp32 [N, hc, D]."""
    _check_expand({"y": y}, h, post, comb, "hc_expand")
    out = torch.empty_like(h)
    if h.shape[0] == 0:
        return out
    grid, block_d = _expand_grid(h)
    launch(hc_expand_kernel, grid, (y, h, post, comb, out), dict(HC=h.shape[1], D=h.shape[2], block_D=block_d), 4, 1)
    return out


def hc_add_expand(a: torch.Tensor, b: torch.Tensor, h: torch.Tensor, post: torch.Tensor,
                  comb: torch.Tensor) -> torch.Tensor:
    """`hc_expand(a + b, h, post, comb)` in one launch, the sum made as torch makes it (fp32, or bf16 where a and b
    both are): the bits of torch's add and `hc_expand`. a, b [N, D] fp32/bf16; the rest as `hc_expand`."""
    _check_expand({"a": a, "b": b}, h, post, comb, "hc_add_expand")
    out = torch.empty_like(h)
    if h.shape[0] == 0:
        return out
    grid, block_d = _expand_grid(h)
    launch(hc_add_expand_kernel, grid, (a, b, h, post, comb, out),
           dict(HC=h.shape[1], D=h.shape[2], ROUND_BF16=_bf16_sum(a, b), block_D=block_d), 4, 1)
    return out


__all__ = ["hc_add_expand", "hc_collapse_rms_norm", "hc_expand"]
