"""fp8 and fp4 weight formats: exact codes on hand-picked values, scales bit for bit, round trips."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dsl.quant import (
    FP4_GRID,
    dequantize,
    dequantize_fp4_group,
    dequantize_fp8_block,
    dequantize_fp8_group,
    fp4_codes,
    fp4_values,
    pow2_ceil,
    quantize_fp4_group,
    quantize_fp8_block,
    quantize_fp8_group,
    scale_to_float,
)


def _pow2_ceil_ref(x: float) -> float:
    """2^ceil(log2 x) from frexp (x = m · 2^e, 0.5 <= m < 1): exact in double precision."""
    m, e = math.frexp(x)
    return math.ldexp(1.0, e - 1 if m == 0.5 else e)


def _block_scales_ref(w: torch.Tensor, rows: int, qmax: float, floor: float) -> np.ndarray:
    """The ue8m0 scale formula evaluated block by block in numpy fp32, independently of dsl.quant."""
    a = w.float().abs().numpy()
    o, i = a.shape
    out = np.zeros((-(-o // rows), -(-i // 32)), dtype=np.float32)
    for r in range(out.shape[0]):
        for c in range(out.shape[1]):
            amax = np.float32(max(a[r * rows:(r + 1) * rows, c * 32:(c + 1) * 32].max(), np.float32(floor)))
            out[r, c] = _pow2_ceil_ref(float(np.float32(amax / np.float32(qmax))))
    return out


def _to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two as ue8m0 bytes (the biased exponent)."""
    return ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def test_pow2_ceil_matches_frexp() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(4000, generator=gen) * 10.0 ** torch.randint(-30, 30, (4000,), generator=gen),
                   torch.tensor([2.0**-126, 2.0**-20, 0.25, 1.0, 1.0000001, 3.0, 448.0, 2.0**100])])
    want = torch.tensor([_pow2_ceil_ref(float(v)) for v in x], dtype=torch.float32)
    assert torch.equal(pow2_ceil(x), want)


@pytest.mark.parametrize("shape", [(64, 96), (33, 70), (1, 5), (100, 32)])
def test_fp8_block_scales_bit_exact_and_round_trip(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape, generator=gen) * 3)
    q, scale = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (-(-shape[0] // 32), -(-shape[1] // 32))
    assert np.array_equal(scale.numpy(), _block_scales_ref(w, 32, 448.0, 1e-4))
    full = scale.repeat_interleave(32, 0).repeat_interleave(32, 1)[: shape[0], : shape[1]]
    assert float((w / full).abs().max()) <= 448.0  # the scale always fits the block in range
    back = dequantize_fp8_block(q, scale)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; subnormals step by 2^-9 of the scale.
    assert bool(((back - w).abs() <= torch.maximum(w.abs() * 2.0**-4, full * 2.0**-10)).all())
    assert torch.equal(dequantize(q, scale), back)
    assert torch.equal(dequantize_fp8_block(q, _to_e8m0(scale)), back)


def test_fp8_exact_codes_and_ties() -> None:
    # Block amax 3.5: 3.5 / 448 = 2^-7 exactly, so the scale stays 2^-7 (no +1: the mantissa is zero).
    w = torch.zeros(32, 32)
    w[0, :6] = torch.tensor([448.0, 0.53125, 0.59375, -1.0625, 2.0**-9, 2.0**-11]) / 128
    q, scale = quantize_fp8_block(w)
    assert scale.item() == 2.0**-7
    # ties to even: 0.53125 -> 0.5, 0.59375 -> 0.625, 1.0625 -> 1.0; 2^-9 is the smallest subnormal, 2^-11 -> 0
    assert q[0, :6].float().tolist() == [448.0, 0.5, 0.625, -1.0, 2.0**-9, 0.0]
    w[0, 0] = 3.6  # amax just above 2^-7 · 448: the scale doubles
    assert quantize_fp8_block(w)[1].item() == 2.0**-6
    assert quantize_fp8_block(torch.zeros(2, 2))[1].item() == _pow2_ceil_ref(float(np.float32(1e-4) / 448))


def test_fp8_group_for_engram_tables() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 64, generator=gen) * torch.linspace(0.01, 100, 40)[:, None]
    q, scale = quantize_fp8_group(w)
    assert scale.shape == (40, 2)
    assert np.array_equal(scale.numpy(), _block_scales_ref(w, 1, 448.0, 1e-4))
    back = dequantize_fp8_group(q, scale)
    assert torch.equal(dequantize(q, scale), back)  # told apart from 32 x 32 blocks by the scale's shape
    assert float(((back - w).abs() / w.abs().clamp_min(1e-3)).max()) <= 2.0**-4


def test_fp4_grid_ties_to_even() -> None:
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.2499, 0.2501, 4.99, 5.01, 7.0, -0.25, -2.6, -100.0])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 4.0, 6.0, 6.0, -0.0, -3.0, -6.0]
    got = fp4_values(fp4_codes(x))
    assert got.tolist() == want
    assert fp4_codes(torch.tensor([-0.25])).item() == 8  # the sign is kept on values rounding to zero
    assert fp4_values(torch.arange(16, dtype=torch.uint8)).tolist() == list(FP4_GRID) + [-v for v in FP4_GRID]


def test_fp4_packing_low_nibble_is_even_column() -> None:
    w = torch.zeros(2, 32)
    w[0, :4] = torch.tensor([1.0, -6.0, 0.5, 3.0])  # amax 6: scale 1; codes 2, 15, 1, 5
    w[1, 0] = 6.0
    packed, scale = quantize_fp4_group(w)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 16)
    assert scale.tolist() == [[1.0], [1.0]]
    assert packed[0, :2].tolist() == [2 | (15 << 4), 1 | (5 << 4)]
    assert torch.equal(dequantize_fp4_group(packed, scale), w)


@pytest.mark.parametrize("shape", [(64, 128), (3, 96), (7, 40)])
def test_fp4_scales_bit_exact_and_nearest_grid_point(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    w = torch.randn(shape, generator=gen) * torch.exp(torch.randn(shape[0], 1, generator=gen) * 4)
    packed, scale = quantize_fp4_group(w)
    assert packed.shape == (shape[0], shape[1] // 2) and scale.shape == (shape[0], -(-shape[1] // 32))
    assert np.array_equal(scale.numpy(), _block_scales_ref(w, 1, 6.0, 6.0 * 2.0**-126))
    full = scale.repeat_interleave(32, 1)[:, : shape[1]]
    back = dequantize_fp4_group(packed, scale)
    x, grid = (w / full), torch.tensor(FP4_GRID)
    nearest = (x.abs()[..., None] - grid).abs().min(dim=-1).values
    assert torch.equal((back / full - x).abs(), nearest)  # every value went to a nearest grid point
    assert torch.equal(dequantize(packed, scale), back)
    assert torch.equal(dequantize(packed.view(torch.int8), _to_e8m0(scale)), back)
    assert torch.equal(dequantize(packed.view(torch.float4_e2m1fn_x2), scale), back)


def test_scale_to_float_decodes_ue8m0() -> None:
    byte = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = scale_to_float(byte.view(torch.float8_e8m0fnu))
    assert got[:-1].tolist() == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**127] and math.isnan(got[-1])


def test_dequantize_dispatch_and_errors() -> None:
    w = torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(dequantize(w), w.float())
    q, scale = quantize_fp8_block(torch.randn(64, 64))
    with pytest.raises(ValueError, match=r"\[64, 64\].*\[2, 2\].*\[3, 2\]"):
        dequantize(q, torch.ones(3, 2))
    with pytest.raises(ValueError, match="needs its scale"):
        dequantize(q)
    packed, s4 = quantize_fp4_group(torch.randn(8, 64))
    with pytest.raises(ValueError, match=r"\[8, 2\].*got \[8, 3\]"):
        dequantize(packed, torch.ones(8, 3))
    with pytest.raises(ValueError, match="int32"):
        dequantize(torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="even"):
        quantize_fp4_group(torch.randn(2, 33))
    with pytest.raises(ValueError, match="scale"):
        dequantize(q, scale.to(torch.float8_e4m3fn))
