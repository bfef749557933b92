"""The caches' row reads and writes in C (dsl/native.c's load_rows and store_rows) give what dsl/cache.py's torch code
gives: the same decoded values from the same pool rows, the same bytes written, through block tables and rings, with
pairs given twice; pairs outside a pool leave the work (and the error) to torch."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dsl import cache, native
from dsl.cache_format import EntryFormat

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH")

FORMATS = [EntryFormat("fp8", 32), EntryFormat("fp4", 16, True), EntryFormat("fp4", 32, False)]


def torch_rows(fmt, parts, major, minor, tables):
    """load_rows as the torch code computes it."""
    blocks, rows = cache._pool_rows(parts, major, minor, tables)
    return fmt.decode(*[p[blocks, rows] for p in parts])


def filled_pool(fmt: EntryFormat, count: int, per: int, dim: int, g: torch.Generator) -> list[torch.Tensor]:
    """Parts of a pool whose every row holds an encoded random entry (a zero row and a NaN scale among them)."""
    values = torch.randn(count * per, dim, generator=g) * torch.logspace(-3, 3, count * per)[:, None]
    values[3] = 0.0
    codes, scales = fmt.encode(fmt_round(fmt, values))
    scales.view(torch.uint8)[5, 0] = 0x7F if fmt.e4m3_scale else 0xFF  # a NaN scale
    return [e.reshape(count, per, *e.shape[1:]).clone() for e in (codes, scales)]


def fmt_round(fmt: EntryFormat, x: torch.Tensor) -> torch.Tensor:
    from dsl.ops.rounding import fp4_round, fp8_round

    return fp8_round(x, block=fmt.block) if fmt.kind == "fp8" else fp4_round(x, block=fmt.block,
                                                                               e4m3_scale=fmt.e4m3_scale)


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("paged", [False, True])
def test_load_rows_matches_torch(fmt, paged):
    g = torch.Generator().manual_seed(0)
    count, per, dim, n = 7, 8, 64, 40
    parts = filled_pool(fmt, count, per, dim, g)
    if paged:  # 3 sequences' block tables, 4 blocks wide
        tables = torch.randint(0, count, (3, 4), generator=g)
        major, minor = torch.randint(0, 3, (n,), generator=g), torch.randint(0, 4 * per, (n,), generator=g)
    else:  # ring slots
        tables = None
        major, minor = torch.randint(0, count, (n,), generator=g), torch.randint(0, 100, (n,), generator=g)
    fast = native.load_rows(parts, major, minor, tables, fmt.kind, fmt.block, fmt.e4m3_scale)
    assert fast is not None
    expected = torch_rows(fmt, parts, major, minor, tables)
    assert torch.equal(fast.view(torch.int32), expected.view(torch.int32))  # NaNs and zeros' signs included
    assert torch.equal(cache.load_rows(fmt, parts, major, minor, tables).view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("fmt", FORMATS, ids=str)
@pytest.mark.parametrize("paged", [False, True])
def test_store_rows_matches_torch(fmt, paged):
    g = torch.Generator().manual_seed(1)
    count, per, dim, n = 6, 4, 64, 12
    values = fmt_round(fmt, torch.randn(n, dim, generator=g))
    if paged:
        tables = torch.randint(0, count, (2, 3), generator=g)
        major, minor = torch.randint(0, 2, (n,), generator=g), torch.randperm(3 * per, generator=g)[:n]
        # the same pair twice, with equal values
        major[1], minor[1], values[1] = major[0], minor[0], values[0]
    else:
        tables = None
        major, minor = torch.randint(0, count, (n,), generator=g), torch.arange(n) * 3
    pool_c = filled_pool(fmt, count, per, dim, g)
    pool_t = [p.clone() for p in pool_c]
    assert native.store_rows(pool_c, fmt.encode(values), major, minor, tables)
    blocks, rows = cache._pool_rows(pool_t, major, minor, tables)
    for part, codes in zip(pool_t, fmt.encode(values), strict=True):
        part[blocks, rows] = codes
    for a, b in zip(pool_c, pool_t, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("paged", [False, True])
def test_pairs_outside_the_pool_go_to_torch(paged):
    fmt = EntryFormat("fp8", 32)
    g = torch.Generator().manual_seed(2)
    parts = filled_pool(fmt, 3, 4, 32, g)
    before = [p.clone() for p in parts]
    tables = torch.tensor([[0, 1], [2, 7]]) if paged else None  # block 7 is past the pool
    major = torch.tensor([0, 1] if paged else [0, 3])  # slot 3 is past the pool
    minor = torch.tensor([1, 5] if paged else [1, 2])
    assert native.load_rows(parts, major, minor, tables, "fp8", 32, False) is None
    assert not native.store_rows(parts, fmt.encode(torch.zeros(2, 32)), major, minor, tables)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(parts, before, strict=True))
    with pytest.raises(IndexError):
        cache.load_rows(fmt, parts, major, minor, tables)
    negative = torch.tensor([0, -1])  # torch wraps it; C leaves it to torch
    assert native.load_rows(parts, negative, torch.tensor([0, 1]), None, "fp8", 32, False) is None
    assert torch.equal(cache.load_rows(fmt, parts, negative, torch.tensor([0, 1])).view(torch.int32),
                       torch_rows(fmt, parts, negative, torch.tensor([0, 1]), None).view(torch.int32))
