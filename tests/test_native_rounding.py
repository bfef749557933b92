"""The fp8 / fp4 roundings and cache codes in C (dsl/native.c) give the bits of their torch code (dsl/ops/rounding.py,
dsl/cache_format.py), on ordinary values and on the edges: zeros of both signs, NaN, infinities, subnormals, values
past the formats' ranges, and every midpoint between neighbouring e4m3 and e2m1 values."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dsl import native
from dsl.cache_format import EntryFormat
from dsl.ops.rounding import FP4_GRID, fp4_round, fp8_round

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH")


@pytest.fixture
def torch_only(monkeypatch):
    """Run a function on the torch code: the library's functions all see no library."""

    def run(fn, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(native, "library", lambda: None)
            return fn(*args, **kwargs)

    return run


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtypes, shapes and bytes (NaN's payloads and zeros' signs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def e4m3_values() -> torch.Tensor:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def edge_values() -> torch.Tensor:
    """Each finite e4m3 value and each midpoint between neighbours, a float either side of each, the e2m1 grid and its
    midpoints, and the special and extreme floats."""
    v = e4m3_values()
    v = torch.unique(v[~v.isnan()].abs())
    mids = (v[1:] + v[:-1]) / 2
    grid = torch.tensor(FP4_GRID)
    fp4_mids = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([v, mids, grid, fp4_mids, torch.tensor([464.0, 479.0, 480.0, 500.0, 1e30, 2.0**-9 / 2])])
    near = torch.cat([points, torch.nextafter(points, torch.tensor(float("inf"))),
                      torch.nextafter(points, torch.tensor(0.0))])
    special = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 1e-40, 2.0**-126, 3.4e38])
    every = torch.cat([near, special])
    return torch.cat([every, -every])


def cases(block: int) -> list[torch.Tensor]:
    """Rows of blocks: random values over many magnitudes, the edge values in blocks (some scaled so they are the
    block's amax, some beside a large value), zero blocks, a NaN or an inf in an otherwise plain block."""
    g = torch.Generator().manual_seed(block)
    out = []
    for exponent in (-40, -12, -3, 0, 3, 9, 20):
        out.append(torch.randn(6, 4 * block, generator=g) * 2.0**exponent)
    edges = edge_values()
    pad = (-edges.numel()) % block
    edges = torch.cat([edges, torch.zeros(pad)]).reshape(-1, block)
    out += [edges, edges * 0.75, edges.flip(0), torch.zeros(2, block), -torch.zeros(2, block)]
    with_large = edges.clone()
    with_large[:, 0] = 448.0
    out.append(with_large)
    plain = torch.randn(3, block, generator=g)
    plain[0, 1], plain[1, 2], plain[2, 3] = float("nan"), float("inf"), -float("inf")
    out.append(plain)
    return out


@pytest.mark.parametrize("block", [32, 64, 16])
def test_fp8_round_is_torch_bit_for_bit(block: int, torch_only) -> None:
    for x in cases(block):
        assert same_bits(fp8_round(x, block=block), torch_only(fp8_round, x, block=block))
    assert native.fp8_round(torch.ones(2, block), block, 1e-4, 1 / 448) is not None, native.reason()


@pytest.mark.parametrize("e4m3_scale", [True, False])
@pytest.mark.parametrize("block", [16, 32])
def test_fp4_round_is_torch_bit_for_bit(block: int, e4m3_scale: bool, torch_only) -> None:
    for x in cases(block):
        assert same_bits(fp4_round(x, block=block, e4m3_scale=e4m3_scale),
                         torch_only(fp4_round, x, block=block, e4m3_scale=e4m3_scale))
    assert native.fp4_round(torch.ones(2, block), block, e4m3_scale, 1.0, 1 / 6) is not None, native.reason()


def finite_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x's rows without a block holding NaN or an infinity (a cache never stores those)."""
    ok = x.reshape(x.shape[0], -1, block).isfinite().all(-1).all(-1)
    return x[ok]


@pytest.mark.parametrize(("kind", "block", "e4m3_scale"),
                         [("fp8", 32, False), ("fp8", 64, False), ("fp4", 16, True), ("fp4", 32, False)])
def test_encode_and_decode_are_torch_bit_for_bit(kind: str, block: int, e4m3_scale: bool, torch_only) -> None:
    fmt = EntryFormat(kind, block, e4m3_scale)
    for x in cases(block):
        on_grid = fp8_round(x, block=block) if kind == "fp8" else fp4_round(x, block=block, e4m3_scale=e4m3_scale)
        if e4m3_scale:
            on_grid = finite_blocks(on_grid, block)  # torch's encode refuses NaN blocks too: tested below
        parts = fmt.encode(on_grid)
        reference = torch_only(fmt.encode, on_grid)
        assert all(same_bits(a, b) for a, b in zip(parts, reference, strict=True))
        values = fmt.decode(*parts)
        assert same_bits(values, torch_only(fmt.decode, *parts))
        finite = on_grid.isfinite().all()
        if finite:
            assert same_bits(values, on_grid)  # codes and scales lose nothing
    assert native.encode(torch.ones(1, block), kind, block, e4m3_scale) is not None, native.reason()


def test_encode_refuses_values_off_the_fp4_grid(torch_only) -> None:
    fmt = EntryFormat("fp4", 16, True)
    x = torch.ones(3, 32)
    x[1, 20] = 1.1  # not an e2m1 value under any e4m3 scale with the block's amax
    with pytest.raises(ValueError, match="block 3 of 6"):
        fmt.encode(x)
    with pytest.raises(ValueError, match="not on the fp4 grid"):
        torch_only(fmt.encode, x)
    x[1, 20] = float("nan")
    with pytest.raises(ValueError, match="block 3 of 6"):
        fmt.encode(x)


def test_other_inputs_keep_the_torch_code() -> None:
    """bf16, views and dims that are not whole blocks are left to torch (None from the C wrappers)."""
    x = torch.randn(4, 64)
    assert native.fp8_round(x.bfloat16(), 32, 1e-4, 1 / 448) is None
    assert native.fp8_round(x[:, ::2], 32, 1e-4, 1 / 448) is None
    assert native.fp8_round(x[:, :48], 32, 1e-4, 1 / 448) is None
    assert native.encode(x[:, :48], "fp8", 32, False) is None
    assert native.decode(torch.zeros(4, 48, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8), "fp8", 32,
                         False) is None
    assert fp8_round(x.bfloat16(), block=32).dtype == torch.bfloat16
    part = x[:, :48]
    assert fp8_round(part, block=32) is part  # not whole blocks: torch's code leaves the values as they are
