"""The prefill GEMM (kernels/linear/prefill.py): bf16 and fp8 32x32 weights against the fp32 linear of the same
bf16-rounded operands (dsl.ops.dense; the products are exact in fp32, so only the summation order differs), the fp8
expansion bit for bit `dequantize_fp8_block`, batch invariance at a fixed config, and the wrapper's checks."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.dense import linear as ref_linear
from dsl.quant import dequantize_fp8_block, quantize_fp8_block
from kernels.linear.prefill import SMEM_BUDGET, default_config, dequantize_weight, linear_prefill, smem_bytes
from tests.kernels.cases import V41_LINEARS, gen, rel_l2

FP8 = torch.float8_e4m3fn
SMALL = {"block_M": 16, "block_N": 32, "block_K": 64, "group_M": 2, "num_warps": 4, "num_stages": 2}


def make_weight(n: int, k: int, fmt: str, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = gen(n, k, seed=seed, scale=k**-0.5, device=device)  # [N, K]
    if fmt == "fp8":
        return quantize_fp8_block(w)  # ([N, K] e4m3, [N/32, K/32] fp32)
    return w.bfloat16(), None


def check(m: int, n: int, k: int, fmt: str, device: str, config: dict | None = None,
          x_dtype: torch.dtype = torch.float32, tol: float = 1e-5) -> None:
    w, s = make_weight(n, k, fmt, device, seed=m + n)
    x = gen(m, k, seed=m, device=device).to(x_dtype)  # [M, K]
    out = linear_prefill(x, w, s, config=config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    want = ref_linear(x.bfloat16().float(), w if s is not None else w.float(), s)  # the kernel's exact operands
    err = rel_l2(out, want)
    assert err < tol, f"{fmt} M={m} N={n} K={k}: rel L2 {err:.2e}"


# (m, n, k, fmt, config, x dtype): N and K not multiples of the blocks (K a multiple of block_K once: the unmasked
# loop), several row tiles and a partial group of them (M=130), the default config once per format
CPU_CASES = [(1, 80, 160, "bf16", SMALL, torch.float32), (7, 96, 200, "fp8", SMALL, torch.bfloat16),
             (33, 80, 160, "fp8", {**SMALL, "block_K": 32, "group_M": 1}, torch.float32),
             (130, 40, 96, "bf16", SMALL, torch.bfloat16), (1, 72, 100, "fp8", None, torch.float32),
             (7, 40, 96, "bf16", None, torch.float32), (33, 48, 128, "bf16", SMALL, torch.float32),
             (130, 40, 70, "fp8", {**SMALL, "block_N": 16, "block_K": 16}, torch.float32)]


@pytest.mark.parametrize("m,n,k,fmt,config,x_dtype", CPU_CASES)
def test_linear_prefill_matches_reference(m, n, k, fmt, config, x_dtype, device) -> None:
    check(m, n, k, fmt, device, config, x_dtype)


def all_finite_codes(n: int, k: int) -> torch.Tensor:
    """Every finite e4m3 code (subnormals, ±0, ±448) laid over [n, k], shifted by row so blocks differ."""
    codes = torch.cat([torch.arange(0, 0x7F), torch.arange(0x80, 0xFF)]).to(torch.uint8)  # 0x7F, 0xFF: NaN
    flat = codes.repeat(-(-n * k // codes.numel()) + 1)
    return torch.stack([flat[r:r + k] for r in range(n)]).view(FP8)  # [n, k]


def check_dequantize(n: int, k: int, device: str) -> None:
    q, s = quantize_fp8_block(gen(n, k, seed=n, scale=k**-0.5, device=device))
    got, want = dequantize_weight(q, s), dequantize_fp8_block(q, s).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    codes = all_finite_codes(n, k).to(device)
    exponents = torch.randint(-40, 10, s.shape, generator=torch.Generator().manual_seed(k))
    s = torch.ldexp(torch.ones(s.shape), exponents).to(device)  # power-of-two scales far from 1 either way
    got, want = dequantize_weight(codes, s), dequantize_fp8_block(codes, s).bfloat16()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("n,k", [(70, 300), (32, 256), (5, 33)])
def test_dequantize_weight_bitwise(n, k, device) -> None:
    check_dequantize(n, k, device)


def check_batch_invariant(m: int, n: int, k: int, device: str, config: dict) -> None:
    w, _ = make_weight(n, k, "bf16", device, seed=1)
    x = gen(m, k, seed=2, device=device)
    full = linear_prefill(x, w, config=config)
    some = linear_prefill(x[:37], w, config=config)
    for r in (0, 17, 36):
        alone = linear_prefill(x[r:r + 1], w, config=config)
        assert torch.equal(alone[0], full[r]) and torch.equal(alone[0], some[r]), f"row {r}"


@pytest.mark.usefixtures("row_independent_dot")  # the kernel's order, not the host BLAS's (conftest.py)
def test_linear_prefill_batch_invariant(device) -> None:
    check_batch_invariant(50, 72, 160, device, SMALL)


def test_linear_prefill_rejects_bad_input(device) -> None:
    x, (w, _), (q, s) = gen(4, 64, device=device), make_weight(40, 64, "bf16", device, 0), make_weight(40, 64, "fp8",
                                                                                                      device, 0)
    assert linear_prefill(x[:0], w).shape == (0, 40)
    assert torch.equal(linear_prefill(x[:, :0], w[:, :0].contiguous()).cpu(), torch.zeros(4, 40))
    cases = [((x.half(), w), TypeError, "x must be"), ((x, w.float()), TypeError, "w must be"),
             ((x[:, :32].contiguous(), w), ValueError, r"x \[M, K\]"), ((x, w[:, :32]), ValueError, "contiguous w"),
             ((gen(64, 4, device=device).t(), w), ValueError, "contiguous x"), ((x, q), ValueError, "block scales"),
             ((x, q, s[:, :1].contiguous()), ValueError, "block scales"), ((x, q, s.double()), TypeError, "float32"),
             ((x, w, s), ValueError, "no scale"), ((x[0], w), ValueError, r"x \[M, K\]")]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            linear_prefill(*args)
    with pytest.raises(ValueError, match="groups"):
        linear_prefill(x, w, groups=2)
    with pytest.raises(ValueError, match="shared memory"):
        linear_prefill(x, w, config={**SMALL, "block_M": 256, "block_N": 256, "block_K": 128, "num_stages": 3})
    with pytest.raises(ValueError, match="multiples of 16"):
        linear_prefill(x, w, config={**SMALL, "block_K": 24})
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_weight(w, s)


def test_default_config_keeps_block_k_and_fits_shared_memory() -> None:
    configs = [default_config(m, n, k) for m in (512, 1024, 8192) for _, n, k, _ in V41_LINEARS]
    assert {c["block_K"] for c in configs} == {64}  # one K order for every token count
    assert all(smem_bytes(c) <= SMEM_BUDGET for c in configs)
    assert default_config(1024, 32768, 1280)["block_N"] == 256 and default_config(512, 1280, 5120)["block_N"] == 128
    assert default_config(1024, 5120, 8192)["block_N"] == 128 and default_config(8192, 5120, 8192)["block_N"] == 256


GPU_LINEARS = [(name, n, k) for name, n, k, groups in V41_LINEARS if groups == 1]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("m", [1, 300, 4096])
@pytest.mark.parametrize("name,n,k", GPU_LINEARS)
def test_linear_prefill_v41_shapes(name, n, k, m, fmt) -> None:
    check(m, n, k, fmt, "cuda", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", GPU_LINEARS)
def test_dequantize_weight_bitwise_gpu(name, n, k) -> None:
    check_dequantize(n, k, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", GPU_LINEARS)
def test_linear_prefill_batch_invariant_gpu(name, n, k) -> None:
    check_batch_invariant(4096, n, k, "cuda", default_config(4096, n, k))
