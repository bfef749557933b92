"""Sums written as elementwise torch ops, run in C (dsl/native.c): the MoE's expert outputs added in ascending id
(`add_slices`) and the indexer's heads weighted and added (`weighted_heads`) give the torch loops' bits, on values of
every magnitude, zeros of both signs, infinities and NaN, and on strided views."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from dsl import native

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler on PATH")


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32),
                                                                     b.contiguous().view(torch.int32))


def varied(*shape: int, seed: int) -> torch.Tensor:
    """Random values across many magnitudes, with -0, +-inf and NaN among them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-20, 20, shape, generator=g).float()
    flat = x.view(-1)
    flat[:: 17] = -0.0
    flat[5 :: 97] = float("inf")
    flat[7 :: 101] = -float("inf")
    flat[11 :: 103] = float("nan")
    return x


@pytest.mark.parametrize("which", [[], [0], [1, 3, 4], [0, 1, 2, 3, 4, 5]])
def test_add_slices_matches_torch(which):
    out = varied(6, 64, 11, seed=len(which)).transpose(1, 2)[:, :9]  # [k, n, d] strided, as the MoE's bmm output
    expected = torch.zeros(9, 64)
    for j in which:
        expected += out[j]
    assert same_bits(native.add_slices(out, which), expected)


def test_add_slices_declines_what_it_cannot_run():
    x = torch.randn(3, 4, 5)
    assert native.add_slices(x, [3]) is None  # past the slices: torch raises
    assert native.add_slices(x.double(), [0]) is None


@pytest.mark.parametrize("heads", [1, 2, 8])
def test_weighted_heads_matches_torch(heads):
    s, w = varied(3, 5, heads, 20, seed=heads), varied(3, 5, heads, seed=100 + heads)
    expected = s[:, :, 0] * w[..., :1]
    for h in range(1, heads):
        expected = expected + s[:, :, h] * w[..., h : h + 1]
    assert same_bits(native.weighted_heads(s, w), expected)


def test_weighted_heads_declines_what_it_cannot_run():
    s, w = torch.randn(2, 4, 6), torch.randn(2, 4)
    assert native.weighted_heads(s.transpose(0, 1).contiguous().transpose(0, 1), w) is None  # not contiguous
    assert native.weighted_heads(s, w[:, :3]) is None
