"""fp8 and fp4 cache rounding, bit for bit against the formulas of V41_SPEC.md written out independently."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsl.ops.rounding import fp4_round, fp8_round


def _e4m3_values() -> tuple[np.ndarray, np.ndarray]:
    """Every finite non-negative e4m3fn value in increasing order, and whether its code is even."""
    values, even = [], []
    for exp_bits in range(16):
        for mant in range(8):
            if exp_bits == 15 and mant == 7:
                continue  # NaN
            v = mant / 8 * 2.0**-6 if exp_bits == 0 else (1 + mant / 8) * 2.0 ** (exp_bits - 7)
            values.append(v)
            even.append(mant % 2 == 0)
    return np.array(values), np.array(even)


def _round_to_grid(x: float, grid: np.ndarray, even: np.ndarray) -> float:
    mag = abs(x)
    i = int(np.searchsorted(grid, mag))
    if i == len(grid):
        return float(np.copysign(grid[-1], x))
    if grid[i] == mag or i == 0:
        return float(np.copysign(grid[i], x))
    lo, hi = grid[i - 1], grid[i]
    if mag - lo < hi - mag or (mag - lo == hi - mag and even[i - 1]):
        return float(np.copysign(lo, x))
    return float(np.copysign(hi, x))


def _pow2_ceil(t: np.float32) -> float:
    m, e = np.frexp(np.float64(t))
    return 2.0 ** (e - 1) if m == 0.5 else 2.0**e


def _fp8_formula(x: np.ndarray) -> np.ndarray:
    grid, even = _e4m3_values()
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], 32):
            block = x[r, b : b + 32]
            amax = max(np.float32(np.abs(block).max()), np.float32(1e-4))
            scale = _pow2_ceil(np.float32(amax) * np.float32(1.0 / 448.0))
            q = np.clip(block / np.float32(scale), -448, 448)
            out[r, b : b + 32] = [_round_to_grid(v, grid, even) * scale for v in q]
    return out


FP4_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP4_EVEN = np.array([True, False, True, False, True, False, True, False])


def _fp4_formula(x: np.ndarray, block: int, e4m3_scale: bool) -> np.ndarray:
    grid, even = _e4m3_values()
    out = np.empty_like(x)
    for r in range(x.shape[0]):
        for b in range(0, x.shape[1], block):
            chunk = x[r, b : b + block]
            amax = np.float32(np.abs(chunk).max())
            if e4m3_scale:
                scale = _round_to_grid(float(np.float32(max(amax, np.float32(6 * 2.0**-9))) / np.float32(6)), grid, even)
            else:
                scale = _pow2_ceil(np.float32(max(amax, np.float32(6 * 2.0**-126))) * np.float32(1 / 6))
            q = np.clip(chunk.astype(np.float32) / np.float32(scale), -6, 6)
            out[r, b : b + block] = [_round_to_grid(v, FP4_GRID, FP4_EVEN) * np.float32(scale) for v in q]
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fp8_round_matches_formula(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 128, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    x[0, :32] = 0.0  # the 1e-4 floor on amax
    x[1, 5] = 448.0 * 4  # an amax that is exactly 448 * 2^k
    got = fp8_round(x).numpy()
    assert np.array_equal(got, _fp8_formula(x.numpy()))


@pytest.mark.parametrize("block,e4m3_scale", [(16, True), (32, False)])
def test_fp4_round_matches_formula(block: int, e4m3_scale: bool) -> None:
    g = torch.Generator().manual_seed(block)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-4, 2, 5)[:, None]
    # Every tie of the e2m1 grid, at a scale of exactly one: amax 6 in the block.
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 6.0, 0.0, 7.0, -6.0, 0.1, 3.0])
    x[0, :16] = ties
    got = fp4_round(x, block=block, e4m3_scale=e4m3_scale).numpy()
    assert np.array_equal(got, _fp4_formula(x.numpy(), block, e4m3_scale))


def test_fp4_ties_go_to_even_codes() -> None:
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2 + [0.0] * 16])
    got = fp4_round(x, block=32, e4m3_scale=False)[0, :8].tolist()
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_rounding_skipped_when_dim_not_a_multiple_of_the_block() -> None:
    x = torch.randn(3, 40)
    assert torch.equal(fp8_round(x), x)
    assert torch.equal(fp4_round(x, block=16, e4m3_scale=True), x)
