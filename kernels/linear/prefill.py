"""Linear for prefill (thousands of tokens): out = x @ W.T as one bf16 wgmma GEMM, over bf16 or fp8 32x32 weights.

`linear` (kernels/linear/linear.py) is built for decode: W is the large operand, the few tokens ride along as the
narrow side of out^T = W x^T, x is loaded as fp32 and converted inside the K loop, fp8 codes are scaled in
registers: at thousands of tokens that stays far from cuBLAS (bench/RESULTS.md). Here the product runs the other way
round, the shape of a fast Hopper GEMM:

- `linear_prefill(x, w, scale)`: x is cast to bf16 once (a torch cast, round to nearest even) when it is fp32;
  tiles of block_M x block_N, K in block_K steps with `tl.dot(a, tl.trans(b))` on a [block_M, block_K] tile of x
  and a [block_N, block_K] tile of W, both K-contiguous (wgmma's layout), fp32 accumulator, tiles visited in
  groups of `group_M` row tiles so a group's W tiles stay in L2. No split-K.
- fp8 weights are first expanded to a bf16 copy by `dequantize_weight` (e4m3 code x power-of-two block scale:
  exact in bf16, whose 8 significant bits hold e4m3's 4 and whose exponent range is fp32's), then run the same
  GEMM. The pass reads 1 byte and writes 2 per weight (the GEMM reads them back) against the GEMM's 2M FLOPs per
  weight, so its share of the time falls as 1 / M. A bf16 copy kept from load time would remove it at twice the fp8
  weight's memory; that is the executor's choice, not this file's.

Numerics: the products are those of `linear.linear` without `dot_fp32` (x rounded to bf16 to nearest even; W's
bf16 values, or code x scale exactly; bf16 x bf16 is exact in fp32), summed in fp32 in another order, so the result
is close to `linear.linear`'s but not bitwise equal to it. A row's result depends only on that row, W and the
config: no split-K, and rows past M read valid rows whose results are dropped. block_K is 64 in every default
config, but a config change (another tile or block_K) can change the summation order and so the last bits.

Used for prefill buckets where enough tiles fill the SMs (`serves`); decode stays on `linear.linear`. Groups
(block-diagonal linears, wo_a) are not supported here: kernels/linear/lowering.py runs them a group at a time.
"""

from __future__ import annotations

import torch

from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch
from kernels.tiles import grouped_tile, tile_dot

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 32
# Which linears plans run here rather than on linear.linear (`serves`; kernels/linear/lowering.py), from
# `bench_kernels.py --only prefill_switch` (bench/RESULTS.md): with no split-K, a launch of few output tiles leaves
# SMs idle through the whole K loop, so the count of 128 x 128 tiles decides, not the tokens alone.
MIN_TILES = 40  # one launch's output tiles, at least
MIN_TOKENS = 128  # linear.py's decode buckets (up to 64) are tuned; this GEMM's tiles are not
MIN_TOKENS_FP8 = 256  # fp8 weights are expanded to bf16 every call, which more tokens pay back
MIN_TOKENS_GROUPED = 2048  # one launch a group (wo_a: 8 launches of 64 tiles at 1024 tokens) pays off late
SMEM_BUDGET = 227 * 1024  # per block on sm_90
DEQUANT_BLOCK_K = 256  # columns of W per dequantize program (its rows: one 32-row scale block)


@triton.jit
def dequantize_weight_kernel(w_ptr, s_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, SCALE_COLS: tl.constexpr,
                             block_K: tl.constexpr):
    # one program: the 32 rows of one scale block, block_K columns of them
    pdl_prologue()
    pid_n = tl.program_id(0)
    offs_n = pid_n * 32 + tl.arange(0, 32)
    offs_k = tl.program_id(1) * block_K + tl.arange(0, block_K)
    mask_k = offs_k < K
    mask = (offs_n < N)[:, None] & mask_k[None, :]
    ptrs = offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [32, block_K]
    w = tl.load(w_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + pid_n * SCALE_COLS + offs_k // 32, mask=mask_k, other=0.0)  # [block_K]
    tl.store(out_ptr + ptrs, (w * s[None, :]).to(tl.bfloat16), mask=mask)  # e4m3 x 2^e: exact in bf16


@triton.jit(do_not_specialize=["M"])
def linear_prefill_kernel(a_ptr, b_ptr, out_ptr, M, N: tl.constexpr, K: tl.constexpr, block_M: tl.constexpr,
                          block_N: tl.constexpr, block_K: tl.constexpr, group_M: tl.constexpr):
    pdl_prologue()
    offs_m, offs_n = grouped_tile(M, N, block_M, block_N, group_M)
    acc = tile_dot(a_ptr, b_ptr, offs_m, offs_n, M, N, K, K, block_M, block_N, block_K, 0)  # bf16 products, fp32 sums
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], acc, mask=mask)


def serves(m: int, n: int, groups: int = 1, fp8: bool = False) -> bool:
    """Whether a linear of weight `groups` x [n, k] runs here for a bucket of `m` tokens (its top), rather than on
    `linear.linear`: enough tokens, and output tiles to fill the SMs (the constants above)."""
    if groups > 1:
        return m >= MIN_TOKENS_GROUPED
    return m >= (MIN_TOKENS_FP8 if fp8 else MIN_TOKENS) and triton.cdiv(m, 128) * triton.cdiv(n, 128) >= MIN_TILES


def smem_bytes(config: dict) -> int:
    """Shared memory of a config's pipelined x and W tiles (two bytes per bf16 value)."""
    return config["num_stages"] * config["block_K"] * (config["block_M"] + config["block_N"]) * 2


def default_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """The heuristic tile for `m` tokens (a bucket's upper end) and a weight [n, k]; block_K is always 64.

    128 x 256 tiles (8 warps, 3 stages: 144 KB) when they make two waves or more on `num_sms` SMs, else 128 x 128
    (8 warps, 4 stages: 128 KB): fewer, larger tiles would leave SMs idle in the last wave. The same rule as
    `linear_fp8.default_config` at twice the bytes per value (block_K 64 here, 128 there). No smaller tile: below
    a few hundred tokens `linear.linear` is the kernel to use.
    """
    if triton.cdiv(m, 128) * triton.cdiv(n, 256) >= 2 * num_sms:
        block_n, stages = 256, 3
    else:
        block_n, stages = 128, 4
    return {"block_M": 128, "block_N": block_n, "block_K": 64, "group_M": 8, "num_warps": 8, "num_stages": stages}


def _check_weight(w: torch.Tensor, scale: torch.Tensor | None) -> None:
    if w.dim() != 2:
        raise ValueError(f"linear_prefill needs a weight [N, K], got {list(w.shape)}")
    if w.dtype == FP8:
        want = (triton.cdiv(w.shape[0], SCALE_BLOCK), triton.cdiv(w.shape[1], SCALE_BLOCK))
        if scale is None or tuple(scale.shape) != want:
            raise ValueError(f"an fp8 weight {list(w.shape)} needs block scales of shape {list(want)}, "
                             f"got {None if scale is None else list(scale.shape)}")
        if scale.dtype != torch.float32 or not scale.is_contiguous():
            raise TypeError(f"fp8 block scales must be contiguous float32, got {scale.dtype}")
        if scale.device != w.device:
            raise ValueError(f"w is on {w.device}, its scale on {scale.device}")
    elif w.dtype != torch.bfloat16:
        raise TypeError(f"w must be bfloat16 or float8_e4m3fn (with scale), got {w.dtype}")
    elif scale is not None:
        raise ValueError("a bfloat16 weight takes no scale")
    if not w.is_contiguous():
        raise ValueError("linear_prefill needs a contiguous w")


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, groups: int, config: dict) -> None:
    if groups != 1:
        raise ValueError(f"linear_prefill runs plain linears only, got groups={groups}: use linear.linear")
    _check_weight(w, scale)
    if x.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_prefill needs x [M, K] and w [N, K], got {list(x.shape)} and {list(w.shape)}")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"x must be float32 or bfloat16, got {x.dtype}")
    if not x.is_contiguous():
        raise ValueError("linear_prefill needs a contiguous x")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, w on {w.device}")
    if config["block_K"] % 16 or config["block_M"] % 16 or config["block_N"] % 16:
        raise ValueError(f"block_M, block_N and block_K are multiples of 16 (the bf16 MMA's), got {config}")
    if smem_bytes(config) > SMEM_BUDGET:
        raise ValueError(f"config needs {smem_bytes(config)} bytes of shared memory, over {SMEM_BUDGET}: {config}")


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 W [N, K] = w [N, K] float8_e4m3fn x its 32x32 block scales [ceil(N/32), ceil(K/32)] float32.

    Exact (bit for bit `dsl.quant.dequantize_fp8_block(w, scale).bfloat16()`) when the scales are powers of two,
    as the checkpoint's are; otherwise each value is rounded to bf16 once, to nearest even.
    """
    if w.dtype != FP8:
        raise TypeError(f"dequantize_weight needs a float8_e4m3fn weight, got {w.dtype}")
    _check_weight(w, scale)
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=w.device)
    grid = (triton.cdiv(n, SCALE_BLOCK), triton.cdiv(k, DEQUANT_BLOCK_K))
    launch(dequantize_weight_kernel, grid, (w, scale, out),
           {"N": n, "K": k, "SCALE_COLS": scale.shape[1], "block_K": DEQUANT_BLOCK_K}, num_warps=4, num_stages=1)
    return out


def linear_prefill(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, config: dict | None = None,
                   *, groups: int = 1) -> torch.Tensor:
    """out [M, N] fp32 = x [M, K] @ W [N, K]^T: bf16 products, fp32 accumulation.

    x: float32 (cast to bf16 first, to nearest even) or bfloat16, contiguous. W: bfloat16, or float8_e4m3fn with
    `scale` float32 [ceil(N/32), ceil(K/32)] (power-of-two 32x32 block scales; expanded by `dequantize_weight`).
    `groups` is accepted only as 1, so a block-diagonal call written for `linear.linear` fails clearly.
    """
    m = x.shape[0] if x.dim() == 2 else 0
    n, k = (w.shape[0], w.shape[1]) if w.dim() == 2 else (0, 0)
    config = config or default_config(max(m, 1), n, k)
    _check(x, w, scale, groups, config)
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    wb = dequantize_weight(w, scale) if w.dtype == FP8 else w
    xb = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
    grid = (triton.cdiv(m, config["block_M"]) * triton.cdiv(n, config["block_N"]),)
    tile = {name: config[name] for name in ("block_M", "block_N", "block_K")}
    launch(linear_prefill_kernel, grid, (xb, wb, out, m),
           {"N": n, "K": k, **tile, "group_M": config.get("group_M", 8)}, config["num_warps"], config["num_stages"])
    return out


__all__ = ["default_config", "dequantize_weight", "dequantize_weight_kernel", "linear_prefill",
           "linear_prefill_kernel", "smem_bytes"]
