"""`fp8_round` and `fp4_round` (dsl/ops/rounding.py) in one launch each: values onto a format's grid and back.

Blocks of `block` consecutive values along the last dim never meet, so x is a flat [blocks, block] array and a program
rounds block_R of them, a [block_R, block] tile (a few rows' blocks: each row's result is its own); the arithmetic on
such a tile (`fp8_blocks`, `fp4_blocks`) also rounds the rope kernel's rows where a rounding follows a rope
(kernels/rope/rope.py's `rope_round_kernel`). Bit for bit the torch reference, from the fp32 bits (helpers shared
with the cache kernels, kernels/cache/rows.py):
- a ue8m0 scale pow2_ceil(amax * (1 / qmax)) (a product, as the reference) is the byte "exponent field, plus one for a
  non-zero mantissa"; dividing by 2^(byte - 127) is multiplying by 2^(127 - byte), exact;
- fp4's e4m3 scale is max(amax, 6 * 2^-9) / 6, divided exactly (`div_rn`), saturated at 448 and rounded to e4m3
  nearest even, as the reference (which divides tensor by tensor and clamps before its cast: torch's CUDA division
  by a number multiplies by the reciprocal, and some torch versions cast past 464 to NaN);
- e4m3 values nearest even, e2m1 codes ties to the even code, the sign kept (-0.0 included);
- non-finite inputs as the reference: a block holding a NaN is all NaN (its scale is NaN, or 2^128 = inf); so is a
  block holding an inf under a power-of-two scale (inf / inf, 0 * inf); under the e4m3 scale (448) an inf rounds to
  6 * 448 like a large value and the block stays finite.
"""

from __future__ import annotations

import torch

from kernels.cache.rows import _aligned, _e2m1_codes, _e2m1_value, _e4m3_bits, _e4m3_value, _pow2_byte, _pow2_value
from kernels.lang import pdl_prologue, tl, triton
from kernels.launch import launch

KERNEL_NAMES = ("fp8_round_kernel", "fp4_round_kernel")


@triton.jit
def _load_blocks(x_ptr, n_blocks, BLOCK: tl.constexpr, block_R: tl.constexpr, block_C: tl.constexpr):
    """This program's blocks as fp32 [block_R, block_C] (zeros past BLOCK and past the last block), their offsets and
    mask."""
    r = tl.program_id(0).to(tl.int64) * block_R + tl.arange(0, block_R)
    c = tl.arange(0, block_C)
    mask = (r < n_blocks)[:, None] & (c < BLOCK)[None, :]
    offs = r[:, None] * BLOCK + c[None, :]
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), offs, mask


@triton.jit
def _specials(x):
    """Per block (row) of fp32 x: whether it holds a NaN, and whether it holds an inf."""
    a = tl.abs(x)
    has_nan = tl.max((a != a).to(tl.int32), axis=1) > 0  # noqa: PLR0124 - NaN alone is unequal to itself
    has_inf = tl.max((a == float("inf")).to(tl.int32), axis=1) > 0
    return has_nan, has_inf


@triton.jit
def fp8_blocks(x):
    """fp32 x [R, C], each row a block (columns past the block zero), rounded as `fp8_round`: fp32 values."""
    has_nan, has_inf = _specials(x)
    nan_blocks = has_nan | has_inf
    x = tl.where(nan_blocks[:, None], 0.0, x)  # computed on zeros, written as NaN
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)  # [R]
    byte = _pow2_byte(amax * (1.0 / 448.0))
    inv = ((254 - byte) << 23).to(tl.float32, bitcast=True)[:, None]  # 1 / 2^(byte - 127)
    q = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
    y = _e4m3_value(_e4m3_bits(q)) * _pow2_value(byte)[:, None]
    return tl.where(nan_blocks[:, None], float("nan"), y)


@triton.jit
def fp4_blocks(x, E4M3_SCALE: tl.constexpr):
    """fp32 x [R, C], each row a block (columns past the block zero), rounded as `fp4_round`: fp32 values."""
    has_nan, has_inf = _specials(x)
    if E4M3_SCALE:
        nan_blocks = has_nan
    else:
        nan_blocks = has_nan | has_inf
    x = tl.where(nan_blocks[:, None], 0.0, x)
    amax = tl.max(tl.abs(x), axis=1)  # [R]
    if E4M3_SCALE:
        s = tl.math.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), tl.full(amax.shape, 6.0, tl.float32))
        scale = _e4m3_value(_e4m3_bits(s))  # saturated at 448, as the reference's clamp
        s2 = tl.broadcast_to(scale[:, None], x.shape)
        q = tl.math.div_rn(x, s2)
    else:
        byte = _pow2_byte(tl.maximum(amax, 6.0 * 2.0**-126) * (1.0 / 6.0))
        scale = _pow2_value(byte)
        q = x * ((254 - byte) << 23).to(tl.float32, bitcast=True)[:, None]
    # the reference's clamp to [-6, 6] changes no code: past 5 every value is code 7
    y = _e2m1_value(_e2m1_codes(q)) * scale[:, None]
    return tl.where(nan_blocks[:, None], float("nan"), y)


@triton.jit
def fp8_round_kernel(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, block_R: tl.constexpr, block_C: tl.constexpr):
    pdl_prologue()
    x, offs, mask = _load_blocks(x_ptr, n_blocks, BLOCK, block_R, block_C)
    tl.store(out_ptr + offs, fp8_blocks(x).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def fp4_round_kernel(x_ptr, out_ptr, n_blocks, BLOCK: tl.constexpr, E4M3_SCALE: tl.constexpr, block_R: tl.constexpr,
                     block_C: tl.constexpr):
    pdl_prologue()
    x, offs, mask = _load_blocks(x_ptr, n_blocks, BLOCK, block_R, block_C)
    tl.store(out_ptr + offs, fp4_blocks(x, E4M3_SCALE).to(out_ptr.dtype.element_ty), mask=mask)


def default_config(block: int) -> dict:
    """About 1024 values a program, whatever the token count (so every bucket launches the same variant)."""
    return {"block_R": max(1, 1024 // triton.next_power_of_2(block)), "num_warps": 4}


def _launch(kernel, x: torch.Tensor, block: int, consts: dict, config: dict | None) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"{kernel.__name__} needs float32/bfloat16 x, got {x.dtype}")
    if block < 1 or x.dim() == 0 or x.shape[-1] % block:
        raise ValueError(f"the last dim of x {list(x.shape)} is not a multiple of the block {block}")
    config = config or default_config(block)
    x = _aligned(x)
    out = torch.empty_like(x)
    n_blocks = x.numel() // block
    if n_blocks == 0:
        return out
    launch(kernel, (triton.cdiv(n_blocks, config["block_R"]),), (x, out, n_blocks),
           consts | {"BLOCK": block, "block_R": config["block_R"], "block_C": triton.next_power_of_2(block)},
           config["num_warps"], 1)
    return out


def fp8_round(x: torch.Tensor, *, block: int = 32, config: dict | None = None) -> torch.Tensor:
    """`dsl.ops.rounding.fp8_round` in one launch: e4m3 with a power-of-two scale per `block` values along the last
    dim. x [..., D] float32/bfloat16, D a multiple of `block`; returns [..., D] of x's dtype."""
    return _launch(fp8_round_kernel, x, block, {}, config)


def fp4_round(x: torch.Tensor, *, block: int, e4m3_scale: bool, config: dict | None = None) -> torch.Tensor:
    """`dsl.ops.rounding.fp4_round` in one launch: e2m1 with one scale per `block` values along the last dim, e4m3
    (`e4m3_scale`) or a power of two. x [..., D] float32/bfloat16, D a multiple of `block`; returns [..., D] of x's
    dtype."""
    return _launch(fp4_round_kernel, x, block, {"E4M3_SCALE": bool(e4m3_scale)}, config)


__all__ = ["KERNEL_NAMES", "default_config", "fp4_blocks", "fp4_round", "fp4_round_kernel", "fp8_blocks", "fp8_round",
           "fp8_round_kernel"]
