"""The TileLang hyper-connection collapse + RMSNorm against `dsl.ops.hyper.hc_collapse_rms_norm`: on the H200 its
cubin through the CUDA driver at V4.1-Flash's hc_mult x hidden; without a cubin (CPU) its launch, which runs the op's
torch equivalent. Building it for sm_90a and sm_100a: tests/kernels/test_tilelang_build.py."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.hyper import hc_collapse_rms_norm as reference
from kernels.hyper.collapse_tilelang import hc_collapse_rms_norm
from kernels.launch import use_launcher
from kernels.tilelang_kernel import TileLangKernel
from tests.kernels.cases import gen, rel_l2
from tests.kernels.tilelang_cubins import HC_CASES, record

EPS = 1e-20


def streams(n: int, hc: int, d: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [n, hc, d], pre [n, hc] (softmax-like positive weights, as hc_mixes makes), w [d]."""
    h = gen(n, hc, d, device=device, seed=n + d, scale=2.0)
    pre = gen(n, hc, device=device, seed=n + 1).sigmoid()
    return h, pre, gen(d, device=device, seed=2)


def test_wrapper_launches_and_runs_its_torch_equivalent_without_a_cubin() -> None:
    h, pre, w = streams(7, 4, 40)
    (call,) = record(lambda: hc_collapse_rms_norm(h.to("meta"), pre.to("meta"), w.to("meta"), eps=EPS)).values()
    assert isinstance(call.kernel, TileLangKernel) and call.grid == (2,) and call.args[-1] == 7  # 4 rows a block
    out = hc_collapse_rms_norm(h, pre, w, eps=EPS)  # Triton's JIT launcher: the TileLang launch runs in torch
    assert out.shape == (7, 40) and torch.equal(out, reference(h, pre, w, eps=EPS))
    assert hc_collapse_rms_norm(h[:0], pre[:0], w, eps=EPS).shape == (0, 40)
    with pytest.raises(ValueError):
        hc_collapse_rms_norm(h, pre[:, :3].contiguous(), w, eps=EPS)
    with pytest.raises(ValueError):
        hc_collapse_rms_norm(h.transpose(0, 1), pre, w, eps=EPS)



def reference64(h: torch.Tensor, pre: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    x = (pre.double().unsqueeze(-1) * h.double()).sum(1)  # [n, d]
    return w.double() * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 4097])
@pytest.mark.parametrize("hc,d", HC_CASES)
def test_cubin_matches_the_reference_at_v41_shapes(tilelang_launcher, n, hc, d) -> None:
    h, pre, w = streams(n, hc, d, "cuda")
    before = tilelang_launcher.launches
    with use_launcher(tilelang_launcher):
        out = hc_collapse_rms_norm(h, pre, w, eps=EPS)
    assert tilelang_launcher.launches == before + 1 and out.shape == (n, d)
    assert rel_l2(out, reference64(h, pre, w)) < 1e-6
    assert rel_l2(out, reference(h, pre, w, eps=EPS)) < 1e-6


@pytest.mark.gpu
def test_cubin_row_is_the_same_in_any_batch(tilelang_launcher) -> None:
    hc, d = 4, 64  # 4 rows a block
    h, pre, w = streams(1, hc, d, "cuda")
    with use_launcher(tilelang_launcher):
        alone = hc_collapse_rms_norm(h, pre, w, eps=EPS)
        for rows, at in ((5, 3), (37, 36), (70, 17)):
            hs, ps, _ = streams(rows, hc, d, "cuda")
            hs[at], ps[at] = h[0], pre[0]
            assert torch.equal(hc_collapse_rms_norm(hs, ps, w, eps=EPS)[at], alone[0])
