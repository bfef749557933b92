"""Hyper-connection kernels (mixes with Sinkhorn, collapse + RMSNorm, expand) against `dsl.ops.hyper`."""

from __future__ import annotations

import pytest
import torch

import kernels.hyper.hyper as hyper
from dsl.ops import hyper as ref
from kernels import tickets
from kernels.hyper.hyper import hc_collapse_rms_norm, hc_expand, hc_mixes
from kernels.launch import jit_launch, use_launcher
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


def mixes_both_ways(n: int, d: int, device: str, config: dict | None, monkeypatch) -> list[torch.Tensor]:
    """The mixes as one launch and as two (`hyper.ONE_LAUNCH_ROWS` set past n, then below it): the same bits, the
    kernels named, and the tile counters left at zero."""
    args = mix_inputs(n, d, device)
    outs = {}
    for rows, kernels in ((n, ["hc_mixes_kernel"]), (0, ["hc_mixes_partial_kernel", "hc_mixes_finish_kernel"])):
        monkeypatch.setattr(hyper, "ONE_LAUNCH_ROWS", rows)
        calls = []
        with use_launcher(lambda c: (calls.append(c.name), jit_launch(c))):
            outs[rows] = hc_mixes(*args, iters=ITERS, eps=EPS, norm_eps=NORM_EPS, config=config)
        assert calls == kernels
    for one, two in zip(outs[n], outs[0], strict=True):
        assert torch.equal(one, two)
    assert not tickets.tile_counters(args[0].device, 1).any()
    return list(outs[n])


@pytest.mark.parametrize("n,d,config", [
    (1, 64, None),
    (1, 40, dict(block_M=16, block_K=64, split_k=1, num_warps=4, num_stages=2)),
    (3, 40, dict(block_M=16, block_K=64, split_k=2, num_warps=4, num_stages=2)),
    (18, 48, dict(block_M=16, block_K=32, split_k=2, num_warps=4, num_stages=2)),
])
def test_hc_mixes_one_launch_is_the_two_launches_bits(n, d, config, device, monkeypatch) -> None:
    mixes_both_ways(n, d, device, config, monkeypatch)


def test_one_token_mixes_run_as_one_launch_outside_invariant_configs(device) -> None:
    """One token: one launch; two tokens, or one under a batch-invariant config (`one_launch` False): two."""
    invariant = dict(hyper.mixes_config(1, HC * 64), one_launch=False)
    calls = []
    with use_launcher(lambda c: (calls.append(c.name), jit_launch(c))):
        hc_mixes(*mix_inputs(1, 64, device), iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
        hc_mixes(*mix_inputs(2, 64, device), iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
        hc_mixes(*mix_inputs(1, 64, device), iters=ITERS, eps=EPS, norm_eps=NORM_EPS, config=invariant)
    assert calls == ["hc_mixes_kernel"] + ["hc_mixes_partial_kernel", "hc_mixes_finish_kernel"] * 2


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


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16])
def test_hc_mixes_one_launch_v41_shapes(n, monkeypatch) -> None:
    """V4.1's streams (split 64 ways): one launch gives the two launches' bits, close to the reference."""
    got = mixes_both_ways(n, HIDDEN, "cuda", None, monkeypatch)
    want = ref.hc_mixes(*(a.cpu() for a in mix_inputs(n, HIDDEN, "cuda")), iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
    for g, w in zip(got, want, strict=True):
        assert rel_l2(g, w) < 2e-5
