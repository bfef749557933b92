"""Hyper-connection kernels (mixes with Sinkhorn, collapse + RMSNorm, expand) against `dsl.ops.hyper`."""

from __future__ import annotations

import pytest
import torch

from dsl.ops import hyper as ref
from kernels.hyper.hyper import hc_collapse_rms_norm, hc_expand, hc_mixes
from tests.kernels.cases import HIDDEN, gen, rel_l2

HC, ITERS, EPS, NORM_EPS = 4, 20, 1e-6, 1e-20


def mix_inputs(n: int, d: int, device: str) -> tuple[torch.Tensor, ...]:
    h = gen(n, HC, d, device=device, seed=n)
    fn = gen((2 + HC) * HC, HC * d, device=device, seed=1, scale=(HC * d) ** -0.5)
    scale = gen(3, device=device, seed=2).abs() + 0.5
    base = gen((2 + HC) * HC, device=device, seed=3)
    return h, fn, scale, base


def check_mixes(n: int, d: int, device: str, config: dict | None = None) -> None:
    args = mix_inputs(n, d, device)
    got = hc_mixes(*args, iters=ITERS, eps=EPS, norm_eps=NORM_EPS, config=config)
    want = ref.hc_mixes(*(a.cpu() for a in args), iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert rel_l2(g, w) < 2e-5


@pytest.mark.parametrize("n,d,config", [
    (1, 64, None),
    (3, 40, dict(block_M=16, block_K=64, split_k=2, num_warps=4, num_stages=2)),
    (18, 48, dict(block_M=16, block_K=128, split_k=1, num_warps=4, num_stages=2)),
])
def test_hc_mixes_matches_reference(n, d, config, device) -> None:
    check_mixes(n, d, device, config)


def test_hc_mixes_comb_is_doubly_stochastic(device) -> None:
    _, _, comb = hc_mixes(*mix_inputs(2, 64, device), iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
    assert torch.allclose(comb.sum(-2).cpu(), torch.ones(2, HC), atol=1e-4)
    assert torch.allclose(comb.sum(-1).cpu(), torch.ones(2, HC), atol=1e-2)


def check_collapse_expand(n: int, d: int, device: str) -> None:
    h = gen(n, HC, d, device=device, seed=n)
    pre = gen(n, HC, device=device, seed=1).sigmoid()
    w = gen(d, device=device, seed=2)
    got = hc_collapse_rms_norm(h, pre, w, eps=NORM_EPS)
    assert rel_l2(got, ref.hc_collapse_rms_norm(h.cpu(), pre.cpu(), w.cpu(), eps=NORM_EPS)) < 1e-6
    assert rel_l2(hc_collapse_rms_norm(h, pre, norm=False), ref.hc_collapse(h.cpu(), pre.cpu())) < 1e-6
    y = gen(n, d, device=device, seed=4)
    post = gen(n, HC, device=device, seed=5)
    comb = gen(n, HC, HC, device=device, seed=6).softmax(-1)
    got = hc_expand(y, h, post, comb)
    assert rel_l2(got, ref.hc_expand(y.cpu(), h.cpu(), post.cpu(), comb.cpu())) < 1e-6


@pytest.mark.parametrize("n,d", [(1, 64), (5, 40), (2, 1100)])
def test_hc_collapse_and_expand_match_reference(n, d, device) -> None:
    check_collapse_expand(n, d, device)


def test_hc_empty_input(device) -> None:
    h = torch.empty(0, HC, 8, device=device)
    assert hc_expand(torch.empty(0, 8, device=device), h, torch.empty(0, HC, device=device),
                     torch.empty(0, HC, HC, device=device)).shape == (0, HC, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 513])
def test_hc_v41_shapes(n) -> None:
    check_mixes(n, HIDDEN, "cuda")
    check_collapse_expand(n, HIDDEN, "cuda")
