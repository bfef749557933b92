"""The hyper-connection mixes' Sinkhorn loop in numpy (few tokens on the CPU) gives torch's bits, and the mixes of a
token do not depend on how many tokens share the call, across the size where numpy hands over to torch."""

from __future__ import annotations

import pytest
import torch

from dsl.ops import hyper
from dsl.ops.hyper import NUMPY_SINKHORN_ROWS, invariant_hc_mixes, sinkhorn


def torch_sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """The loop as the reference writes it."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, NUMPY_SINKHORN_ROWS])
@pytest.mark.parametrize("hc", [4, 3])
def test_numpy_sinkhorn_is_torch_bit_for_bit(rows: int, hc: int) -> None:
    g = torch.Generator().manual_seed(rows * 10 + hc)
    for _ in range(20):
        comb = torch.softmax(torch.randn(rows, hc, hc, generator=g) * 4, dim=-1) + 1e-6
        expected = torch_sinkhorn(comb, 20, 1e-6)
        assert torch.equal(sinkhorn(comb.clone(), 20, 1e-6), expected)


def test_the_numpy_loop_ran() -> None:
    """The small case really goes through numpy: the result is the input tensor, normalised in place."""
    comb = torch.softmax(torch.randn(2, 4, 4), dim=-1) + 1e-6
    assert sinkhorn(comb, 20, 1e-6) is comb


def test_mixes_rows_alike_in_any_batch(monkeypatch) -> None:
    g = torch.Generator().manual_seed(5)
    h, fn = torch.randn(48, 4, 32, generator=g), torch.randn(24, 128, generator=g) * 0.1
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn(24, generator=g) * 0.1
    alone = [invariant_hc_mixes(h[i : i + 1], fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20) for i in range(48)]
    for n in (5, NUMPY_SINKHORN_ROWS, NUMPY_SINKHORN_ROWS + 1, 48):
        together = invariant_hc_mixes(h[:n], fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20)
        for i in range(n):
            assert all(torch.equal(t[i], a[0]) for t, a in zip(together, alone[i], strict=True))
    monkeypatch.setattr(hyper, "NUMPY_SINKHORN_ROWS", 0)  # torch's loop throughout
    for i in (0, 31, 47):
        assert all(torch.equal(t[0], a[0]) for t, a in zip(
            invariant_hc_mixes(h[i : i + 1], fn, scale, base, iters=20, eps=1e-6, norm_eps=1e-20), alone[i],
            strict=True))
