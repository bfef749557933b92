"""fp8 and fp4 rounding of cache entries: quantise onto the format's grid and back, as the model was trained.

The formulas are V41_SPEC.md's "Exact numerics": power-of-two (ue8m0) scales from the fp32 bits, e4m3
round-to-nearest-even, and the e2m1 grid with ties to even codes. Blocks run along the last dim and are
skipped when it is not a multiple of the block (small test configs).
"""

from __future__ import annotations

import functools

import torch

from dsl import native
from dsl.ops.registry import op, same_as_first
from dsl.ragged import ragged_map

FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between grid values, and whether a value exactly on one rounds up (the code above is even).
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_FP4_TIE_UP = (False, True, False, True, False, True, False)


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """`t.float()` without the dispatch where it is one already."""
    return t if t.dtype == torch.float32 else t.float()


def _as(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """fp32 `y` in `x`'s dtype (no dispatch where that is fp32)."""
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(t)) for positive fp32 `t`, from the bits: exponent - 127, plus one if the mantissa is non-zero.
    Adding 0x7FFFFF to the bits (sign cleared, in int64 so NaN's do not overflow) carries into the exponent exactly
    when the mantissa is non-zero: the same k for every input (0 and subnormals, inf and NaN included)."""
    bits = (_fp32(t).contiguous().view(torch.int32) & 0x7FFFFFFF).long()
    k = ((bits + 0x7FFFFF) >> 23) - 127
    return torch.exp2(k.float())


@functools.cache
def _fp4_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per device, once: the thresholds between e2m1 codes and the code -> value grid (16 codes, sign in bit 3).
    A value on a midpoint belongs to the upper code only when that keeps the code even."""
    mids = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32)
    tie_up = torch.tensor(_FP4_TIE_UP)
    thresholds = torch.where(tie_up, mids, torch.nextafter(mids, torch.full_like(mids, float("inf"))))
    grid = torch.tensor(FP4_GRID + tuple(-v for v in FP4_GRID), dtype=torch.float32)
    return thresholds.to(device), grid.to(device)


def fp4_codes(q: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, sign in bit 3) of fp32 values already clamped to [-6, 6]."""
    thresholds, _ = _fp4_tables(q.device)
    codes = (q.abs().unsqueeze(-1) >= thresholds).sum(-1).to(torch.uint8)
    return codes | (torch.signbit(q).to(torch.uint8) << 3)


def fp4_values(codes: torch.Tensor) -> torch.Tensor:
    return _fp4_tables(codes.device)[1][codes.long()]


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor | None:
    n = x.shape[-1]
    if n % block:
        return None
    return _fp32(x).reshape(*x.shape[:-1], n // block, block)


@op("fp8_round", same_as_first)
@ragged_map
def fp8_round(x: torch.Tensor, *, block: int = 32) -> torch.Tensor:
    """Round to e4m3 with one power-of-two scale per `block` values: x [..., D] -> [..., D] (same dtype). fp32 on the
    CPU runs the same arithmetic in C (dsl/native.c)."""
    if (fast := native.fp8_round(x, block, 1e-4, 1.0 / FP8_MAX)) is not None:
        return fast
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    scale = pow2_ceil(amax * (1.0 / FP8_MAX))  # a product, as the reference: not always amax / 448
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return _as(x, (q * scale).reshape(x.shape))


@op("fp4_round", same_as_first)
@ragged_map
def fp4_round(x: torch.Tensor, *, block: int, e4m3_scale: bool) -> torch.Tensor:
    """Round to e2m1 with one scale per `block` values: x [..., D] -> [..., D] (same dtype).

    `e4m3_scale` picks the compressed-KV scale (amax / 6 rounded to e4m3, amax floored at 6 * 2^-9, the scale at
    most 448);
    otherwise the indexer's power-of-two scale (amax floored at 6 * 2^-126). fp32 on the CPU runs the same arithmetic
    in C (dsl/native.c).
    """
    floor = FP4_MAX * (2.0**-9 if e4m3_scale else 2.0**-126)
    if (fast := native.fp4_round(x, block, e4m3_scale, floor, 1.0 / FP4_MAX)) is not None:
        return fast
    blocks = _blocks(x, block)
    if blocks is None:
        return x
    amax = blocks.abs().amax(-1, keepdim=True)
    if e4m3_scale:
        # amax / 6 divided exactly on every device (torch's CUDA division by a Python number multiplies by its
        # reciprocal), saturated at 448 before the cast (some torch versions cast past 464 to NaN)
        ratio = torch.div(amax.clamp_min(floor), torch.full_like(amax, FP4_MAX))
        scale = ratio.clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float()
    else:
        scale = pow2_ceil(amax.clamp_min(floor) * (1.0 / FP4_MAX))
    q = fp4_values(fp4_codes((blocks / scale).clamp(-FP4_MAX, FP4_MAX)))
    return _as(x, (q * scale).reshape(x.shape))


# The ops that end with a rounding, a rope fused with the rounding that alone reads it (and the norm before it:
# dsl/ops/rope.py, made by dsl/passes/fuse.py) -> that rounding op, which names the cache format of their values
# (dsl/cache_format.py).
ENDS_WITH = {"rope_fp8_round": "fp8_round", "rope_fp4_round": "fp4_round", "rope_entries_fp4_round": "fp4_round",
             "rms_norm_rope_fp8_round": "fp8_round", "rms_norm_rope_entries_fp4_round": "fp4_round"}
