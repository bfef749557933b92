"""The TileLang RMSNorm against `dsl.ops.dense.rms_norm`: on the H200 its cubin, launched through the CUDA driver, at
V4.1-Flash's widths; without a cubin (CPU) its launch, which runs the op's torch equivalent. Building it for sm_90a and
sm_100a: tests/kernels/test_tilelang_build.py."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.dense import rms_norm as ref_rms_norm
from kernels.launch import Launch, use_launcher
from kernels.norm.rms_norm_tilelang import default_config, rms_norm
from kernels.tilelang_kernel import TileLangKernel
from tests.kernels.cases import gen, rel_l2
from tests.kernels.tilelang_cubins import NORM_CASES, record

EPS = 1e-20


def meta_launch(d: int, dtype: torch.dtype = torch.float32, has_w: bool = True, m: int = 7,
                config: dict | None = None) -> Launch:
    (call,) = record(lambda: rms_norm(torch.empty(m, d, dtype=dtype, device="meta"),
                                      torch.empty(d, device="meta") if has_w else None, eps=EPS,
                                      config=config)).values()
    return call


def test_wrapper_launches_and_runs_its_torch_equivalent_without_a_cubin() -> None:
    call = meta_launch(128, m=7)  # 4 rows a block: 7 rows in 2 blocks
    assert isinstance(call.kernel, TileLangKernel) and call.grid == (2,) and call.args[-1] == 7
    assert call.signature() == ["*fp32", "*fp32", "*fp32", "i32"] and 32 * call.num_warps == 128
    x, w = gen(5, 40, seed=3, scale=3.0), gen(40, seed=4)
    for weight in (w, None):
        out = rms_norm(x, weight, eps=EPS)  # Triton's JIT launcher: the TileLang launch runs in torch
        assert out.dtype == torch.float32 and torch.equal(out, ref_rms_norm(x, weight, eps=EPS))
    assert rms_norm(torch.empty(0, 8), eps=EPS).shape == (0, 8)
    with pytest.raises(ValueError):
        rms_norm(x, w.bfloat16(), eps=EPS)
    with pytest.raises(ValueError):
        rms_norm(x, w, eps=EPS, config={"block_M": 3, "threads": 128})


def test_default_configs_at_v41_widths() -> None:
    """256 threads a row at 5120 (20 values each); a warp a row, 4 rows a block, at 128 (and the padded 40)."""
    for d, threads, block_m in ((5120, 256, 1), (1280, 128, 1), (512, 128, 2), (128, 128, 4), (40, 128, 4)):
        assert default_config(d) == {"block_M": block_m, "threads": threads}


# ---- on the GPU: the cubin through the CUDA driver ----------------------------------------------------------------


def reference64(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    x64 = x.double()  # [m, d]
    y = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + EPS)
    return y if w is None else y * w.double()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 64, 4097])
@pytest.mark.parametrize("d,dtype,has_w", NORM_CASES)
def test_cubin_matches_the_reference_at_v41_widths(tilelang_launcher, m, d, dtype, has_w) -> None:
    x = gen(m, d, dtype=dtype, device="cuda", seed=m + d, scale=3.0)
    w = gen(d, device="cuda", seed=1) if has_w else None
    before = tilelang_launcher.launches
    with use_launcher(tilelang_launcher):
        out = rms_norm(x, w, eps=EPS)
    assert tilelang_launcher.launches == before + 1 and out.dtype == torch.float32 and out.shape == x.shape
    assert rel_l2(out, reference64(x, w)) < 1e-6
    assert rel_l2(out, ref_rms_norm(x, w, eps=EPS)) < 1e-6
    assert (out - ref_rms_norm(x, w, eps=EPS)).abs().max() <= 1e-5 * ref_rms_norm(x, w, eps=EPS).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("d", [512, 128])  # 2 and 4 rows a block
def test_cubin_row_is_the_same_in_any_batch(tilelang_launcher, d) -> None:
    row, w = gen(1, d, device="cuda", seed=1), gen(d, device="cuda", seed=2)
    with use_launcher(tilelang_launcher):
        alone = rms_norm(row, w, eps=EPS)
        for rows, at in ((5, 3), (37, 36), (70, 17)):
            others = gen(rows, d, device="cuda", seed=rows)
            batch = torch.cat([others[:at], row, others[at + 1:]])
            assert torch.equal(rms_norm(batch, w, eps=EPS)[at], alone[0])
