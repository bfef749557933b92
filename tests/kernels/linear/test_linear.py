"""The decode linear (plain and grouped; bf16, fp32 and fp8 32x32-block weights) against `dsl.ops.dense`, one token
on the one-row kernel (`gemv_kernel`, fp32 activations) and on the tensor cores (`gemv` False)."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.dense import grouped_linear as ref_grouped_linear
from dsl.ops.dense import linear as ref_linear
from dsl.quant import quantize_fp8_block
from kernels import tickets
from kernels.lang import triton
from kernels.launch import launch
from kernels.linear import gemv
from kernels.linear.linear import default_config, gemv_config, k_per_split, linear
from kernels.linear.lowering import LINEAR, SWIGLU, LinearStatic, SwigluStatic
from tests.kernels.cases import DECODE_TOKENS, V41_LINEARS, gen, rel_l2


def make_weight(n: int, k: int, fmt: str, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = gen(n, k, seed=seed, scale=k**-0.5)
    if fmt == "fp8":
        q, s = quantize_fp8_block(w)
        return q.to(device), s.to(device)
    return w.to(torch.bfloat16 if fmt == "bf16" else torch.float32).to(device), None


def reference(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, groups: int, dot_fp32: bool) -> torch.Tensor:
    x = x.float() if dot_fp32 else x.bfloat16().float()  # the kernel's operands: bf16 unless dot_fp32
    x, w, s = x.cpu(), w.cpu(), None if s is None else s.cpu()
    if groups == 1:
        return ref_linear(x, w, s)
    return ref_grouped_linear(x, w, s, groups=groups)


def check(m: int, n: int, k: int, groups: int, fmt: str, device: str, config: dict | None = None,
          dot_fp32: bool = False, tol: float = 2e-5) -> None:
    w, s = make_weight(groups * n, k, fmt, device, seed=m + n)
    x = gen(m, groups * k, device=device, seed=m)
    out = linear(x, w, s, groups=groups, config=config, dot_fp32=dot_fp32)
    assert out.shape == (m, groups * n) and out.dtype == torch.float32
    gemv = m == 1 and (config or {}).get("gemv", True)  # the one-row kernel: fp32 activations
    assert rel_l2(out, reference(x, w, s, groups, dot_fp32 or gemv)) < tol


# (m, n, k, groups, fmt, config): K and N not multiples of the block, split-K, several M tiles.
CPU_CASES = [
    (1, 40, 96, 1, "bf16", dict(block_M=16, block_N=32, block_K=64, split_k=1, num_warps=4, num_stages=2)),
    (5, 64, 160, 1, "fp8", dict(block_M=16, block_N=32, block_K=64, split_k=2, num_warps=4, num_stages=2)),
    (4, 80, 96, 1, "fp8", dict(block_M=16, block_N=64, block_K=64, split_k=1, num_warps=4, num_stages=2)),
    (2, 64, 64, 2, "fp8", dict(block_M=16, block_N=64, block_K=32, split_k=1, num_warps=4, num_stages=2)),
    (21, 96, 80, 1, "fp8", dict(block_M=16, block_N=64, block_K=32, split_k=2, num_warps=4, num_stages=2,
                                fp8_dequant_w=True)),
    (3, 32, 64, 2, "fp8", dict(block_M=16, block_N=32, block_K=32, split_k=1, num_warps=4, num_stages=2)),
    (17, 24, 48, 2, "fp32", dict(block_M=16, block_N=16, block_K=32, split_k=2, num_warps=4, num_stages=2)),
    (2, 48, 80, 1, "bf16", None),
]


@pytest.mark.parametrize("m,n,k,groups,fmt,config", CPU_CASES)
def test_linear_matches_reference(m, n, k, groups, fmt, config, device) -> None:
    check(m, n, k, groups, fmt, device, config, dot_fp32=fmt == "fp32", tol=1e-5 if fmt == "fp32" else 2e-5)


# (n, k, groups): K under a stage and past it, N under a tile and past it, groups, split K (k >= 2048 at few tiles)
GEMV_CASES = [(40, 96, 1), (96, 600, 1), (40, 2080, 1), (32, 96, 2), (64, 2100, 2)]


@pytest.mark.parametrize("fmt", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("n,k,groups", GEMV_CASES)
def test_one_token_runs_in_fp32(n, k, groups, fmt, device) -> None:
    """The one-row kernel sums fp32 products (the reference with fp32 activations, to rounding), with `dot_fp32` or
    without; `gemv` False keeps the token on the tensor cores, whose operands are rounded to bf16 (the reference with
    bf16 activations), or multiplied in fp32 where fp32 weights ask for `dot_fp32`, as the gate's do."""
    w, s = make_weight(groups * n, k, fmt, device, seed=n + k)
    x = gen(1, groups * k, device=device, seed=k)
    tiles = dict(block_M=16, block_N=32, block_K=32, split_k=1, num_warps=4, num_stages=2)
    exact = fmt == "fp32"
    one_row = linear(x, w, s, groups=groups, config=tiles)
    cores = linear(x, w, s, groups=groups, config=dict(tiles, gemv=False), dot_fp32=exact)
    assert rel_l2(one_row, reference(x, w, s, groups, True)) < 1e-6
    assert rel_l2(cores, reference(x, w, s, groups, exact)) < (1e-6 if exact else 2e-5)
    if fmt != "fp8":  # fp32 products whether asked for or not: one kernel, the same bits
        assert torch.equal(linear(x, w, s, groups=groups, config=tiles, dot_fp32=True), one_row)
    if not exact:
        assert not torch.equal(one_row, cores)
    if k >= 2048:
        assert gemv_config(n, k, groups)["split_k"] > 1


@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("n,k,groups,split", [(40, 2080, 1, 4), (64, 2100, 2, 2), (96, 600, 1, 3)])
def test_one_row_split_sums_in_split_order_inside_one_launch(n, k, groups, split, fmt, device) -> None:
    """A split launch of `gemv_kernel` writes out as the last program sees it: its splits' partials summed in split
    order (what `splitk_reduce_kernel` gives, the same bits whichever program is last), and leaves its tile counters
    at zero for the next launch, which then gives the same bits."""
    w, s = make_weight(groups * n, k, fmt, device, seed=n + split)
    x = gen(1, groups * k, device=device, seed=split)
    block_n, block_k = 32, 64
    counters = tickets.tile_counters(torch.device(device), triton.cdiv(n, block_n) * groups)
    runs = []
    for _ in range(2):
        ws = torch.full((split, groups * n), float("nan"), device=device)
        out = torch.full((1, groups * n), float("nan"), device=device)
        scales = w if s is None else s  # unread without FP8
        launch(gemv.gemv_kernel, (triton.cdiv(n, block_n), groups * split), (x, w, scales, ws, out, counters),
               dict(N=n, K=k, GROUPS=groups, SCALE_COLS=0 if s is None else s.shape[1], FP8=s is not None,
                    SPLIT_K=split, K_PER_SPLIT=k_per_split(k, split, block_k), block_N=block_n, block_K=block_k),
               4, 2)
        total = torch.zeros(groups * n, device=device)
        for part in ws:
            total += part
        assert torch.equal(out[0], total)
        assert not torch.any(counters)
        runs.append(out)
    assert torch.equal(runs[0], runs[1])
    assert rel_l2(runs[0], reference(x, w, s, groups, True)) < 1e-6


def test_invariant_configs_keep_one_token_on_the_tensor_cores() -> None:
    static = LinearStatic(n=512, k=5120, groups=1, fmt="fp8")
    assert LINEAR.invariant(LINEAR.default_config(static, 64))["gemv"] is False
    assert "gemv" not in LINEAR.default_config(static, 16)
    shared = SWIGLU.invariant(SWIGLU.default_config(SwigluStatic(inter=2048, d=5120, fmt="fp8"), 64))
    assert shared["up"]["gemv"] is False and shared["down"]["gemv"] is False


def test_linear_empty_input_and_bad_shapes(device) -> None:
    w = gen(32, 64, dtype=torch.bfloat16, device=device)
    assert linear(torch.empty(0, 64, device=device), w).shape == (0, 32)
    with pytest.raises(ValueError):
        linear(gen(2, 63, device=device), w)
    with pytest.raises(ValueError):
        q, s = quantize_fp8_block(gen(32, 64))
        linear(gen(2, 64, device=device), q.to(device), s[:, :1].contiguous().to(device))


def test_default_config_splits_k_only_when_tiles_are_few() -> None:
    assert default_config(1, 32768, 1280)["split_k"] == 1
    assert default_config(1, 512, 5120)["split_k"] > 1
    assert default_config(1, 512, 5120, fp8=True)["block_N"] % 32 == 0


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("m", DECODE_TOKENS + [300])
@pytest.mark.parametrize("name,n,k,groups", V41_LINEARS)
def test_linear_v41_shapes(name, n, k, groups, m, fmt) -> None:
    check(m, n, k, groups, fmt, "cuda", tol=2e-5)


@pytest.mark.gpu
def test_linear_fp32_products_on_gpu() -> None:
    check(7, 512, 5120, 1, "fp32", "cuda", dot_fp32=True, tol=1e-5)
