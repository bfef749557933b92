"""The fp8-activation path (kernels/linear/fp8.py): per-token e4m3 rounding bit for bit its torch reference,
the load-time rowwise weight exact or within its bound, the fp8 GEMM against fp32 products of the same operands, its
batch invariance, and the end-to-end error against the fp32 linear of the original weight (dsl.ops.dense)."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.dense import linear as ref_linear
from dsl.quant import dequantize_fp8_block, quantize_fp8_block
from kernels.linear.fp8 import (
    SMEM_BUDGET,
    default_config,
    linear_rowwise,
    linear_rowwise_ref,
    quantize_rows,
    quantize_rows_ref,
    rowwise_weight,
    smem_bytes,
)
from tests.kernels.cases import HIDDEN, V41_LINEARS, gen, rel_l2

FP8 = torch.float8_e4m3fn
SMALL = {"block_M": 16, "block_N": 32, "block_K": 64, "group_M": 2, "promote_K": 0, "num_warps": 4, "num_stages": 2}
E2E_TOL = 3.5e-2  # e4m3's 3 mantissa bits on the activations: ~2.7e-2 on Gaussian rows


def assert_same_codes(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (q_ref, s_ref) = got, want
    assert q.dtype == FP8 and s.dtype == torch.float32 and q.shape == q_ref.shape and s.shape == s_ref.shape
    assert torch.equal(s.cpu().view(torch.int32), s_ref.cpu().view(torch.int32)), "scales differ"
    bad = q.cpu().view(torch.uint8) != q_ref.cpu().view(torch.uint8)
    assert not bad.any(), f"{int(bad.sum())} codes differ, first at {bad.nonzero()[0].tolist()}"


def special_rows(k: int) -> torch.Tensor:
    """Rows the scale and the rounding can get wrong: zeros and -0.0, huge and tiny magnitudes, an amax exactly on a
    scale boundary (448 * 2^j) and one ulp either side, e4m3 ties, values that underflow the row's subnormals."""
    rows = torch.zeros(8, k)
    rows[1] = -0.0
    rows[2] = gen(k, seed=2) * 1e30
    rows[3] = gen(k, seed=3) * 1e-30
    for i, amax in enumerate([448.0 * 2**-5, float(torch.nextafter(torch.tensor(448.0 * 4), torch.tensor(0.0))),
                              float(torch.nextafter(torch.tensor(448.0 / 8), torch.tensor(1e9)))]):
        rows[4 + i] = gen(k, seed=4 + i).clamp(-1, 1) * amax * 0.99
        rows[4 + i, 0] = -amax
    e4m3 = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # every finite e4m3 value >= 0
    ties = (e4m3[1:] + e4m3[:-1]) / 2
    line = torch.cat([ties, -ties, e4m3 * 2**-10, torch.tensor([448.0])])  # amax 448: the scale is 1
    rows[7] = line.repeat(-(-k // line.numel()))[:k]
    return rows


# (m, k, dtype): M=1, K below, above and past one block of the kernel (8192), fp32 and bf16
QUANT_CASES = [(1, 96, torch.float32), (5, 300, torch.bfloat16), (3, 1000, torch.float32), (2, 8200, torch.float32)]


@pytest.mark.parametrize("m,k,dtype", QUANT_CASES)
def test_quantize_rows_bitwise(m, k, dtype, device) -> None:
    x = torch.cat([gen(m, k, seed=k) * 10 ** (m % 4), special_rows(k)]).to(dtype).to(device)
    got = quantize_rows(x)
    assert_same_codes(got, quantize_rows_ref(x.cpu()))
    q, s = got[0].cpu().float(), got[1].cpu()
    assert torch.equal(torch.frexp(s).mantissa, torch.full_like(s, 0.5)), "scales are powers of two"
    amax = q.abs().amax(dim=1)
    assert ((amax >= 224) | (x.cpu().abs().amax(dim=1) < 1e-4 * 448 / 224)).all(), "the row's max fills e4m3's range"
    xf = x.cpu().float()
    normal = xf.abs() >= 2**-6 * s[:, None]  # e4m3 normals: relative error at most half a step, 2^-4
    assert ((q * s[:, None] - xf).abs() <= 2**-4 * xf.abs())[normal].all()


def test_quantize_rows_rejects_bad_input(device) -> None:
    with pytest.raises(TypeError):
        quantize_rows(gen(2, 64, device=device).half())
    with pytest.raises(TypeError):
        quantize_rows(gen(64, 2, device=device).t())
    with pytest.raises(ValueError):
        quantize_rows(gen(64, device=device))
    q, s = quantize_rows(torch.empty(0, 64, device=device))
    assert q.shape == (0, 64) and s.shape == (0,)


def test_rowwise_weight_exact_when_block_scales_agree() -> None:
    n, k = 80, 100
    codes = (gen(n, k, seed=1) * 100).clamp(-448, 448).to(FP8)
    exponents = torch.randint(-20, 5, (3, 1)).expand(3, 4)  # one scale per 32-row block, all of its K blocks
    scale = torch.ldexp(torch.ones(3, 4), exponents)
    wq, sw = rowwise_weight(codes, scale)
    assert torch.equal(wq.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(wq.float() * sw[:, None], dequantize_fp8_block(codes, scale))
    wq8, sw8 = rowwise_weight(codes, scale.to(torch.float8_e8m0fnu))  # ue8m0 scales as the checkpoint stores them
    assert torch.equal(wq8.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(sw8, sw)


def test_rowwise_weight_error_bound_on_mixed_scales() -> None:
    n, k = 256, HIDDEN
    q, s = quantize_fp8_block(gen(n, k, seed=5, scale=k**-0.5))  # a realistic weight: ~90% of rows' scales differ
    wq, sw = rowwise_weight(q, s)
    exact, got = dequantize_fp8_block(q, s), wq.float() * sw[:, None]
    err = (got - exact).abs()
    assert (err <= 2**-10 * sw[:, None]).all()
    top = (s == s.amax(dim=1, keepdim=True)).repeat_interleave(32, 0).repeat_interleave(32, 1)[:n, :k]
    assert not err[top].any(), "blocks holding the row block's largest scale are unchanged"
    changed = float((err > 0).float().mean())  # ~1e-4 of the values: codes shifted below 2^-6
    assert 0 < changed < 1e-3 and rel_l2(got, exact) < 1e-6


def test_rowwise_weight_rejects_other_scales() -> None:
    q, s = quantize_fp8_block(gen(64, 64))
    with pytest.raises(ValueError, match="power-of-two"):
        rowwise_weight(q, s * 1.5)
    with pytest.raises(ValueError, match="power-of-two"):
        rowwise_weight(q, -s)
    with pytest.raises(ValueError):
        rowwise_weight(q, s[:, :1])
    with pytest.raises(TypeError):
        rowwise_weight(q.float(), s)


def operands(m: int, n: int, k: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    q, s = quantize_fp8_block(gen(n, k, seed=seed + 1, scale=k**-0.5))
    wq, sw = rowwise_weight(q.to(device), s.to(device))
    xq, sx = quantize_rows(gen(m, k, seed=seed, device=device) * 3)
    return xq, sx, wq, sw


# (m, n, k, config): M = 1, 7, 33; N and K not multiples of the block; the default config once
GEMM_CASES = [(1, 80, 160, SMALL), (7, 96, 200, SMALL), (33, 80, 160, {**SMALL, "block_K": 32, "group_M": 1}),
              (7, 40, 96, None)]


@pytest.mark.parametrize("m,n,k,config", GEMM_CASES)
def test_linear_rowwise_matches_fp32_products(m, n, k, config, device) -> None:
    xq, sx, wq, sw = operands(m, n, k, device, seed=m)
    want = linear_rowwise_ref(xq.cpu(), sx.cpu(), wq.cpu(), sw.cpu())  # products of e4m3 values are exact in fp32
    out = linear_rowwise(xq, sx, wq, sw, config=config)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_l2(out, want) < 1e-6  # only the summation order differs
    out = linear_rowwise(xq, sx, wq, sw, out_dtype=torch.bfloat16, config=config).cpu()
    assert out.dtype == torch.bfloat16 and ((out.float() - want).abs() <= 2**-8 * want.abs() + 1e-6).all()


@pytest.mark.usefixtures("row_independent_dot")  # the kernel's order, not the host BLAS's (conftest.py)
@pytest.mark.parametrize("config", [SMALL, None])
def test_linear_rowwise_batch_invariant(config, device) -> None:
    xq, sx, wq, sw = operands(37, 72, 160, device, seed=3)
    full = linear_rowwise(xq, sx, wq, sw, config=config)
    for r in (0, 17, 36):
        alone = linear_rowwise(xq[r:r + 1], sx[r:r + 1], wq, sw, config=config)
        assert torch.equal(alone[0].view(torch.int32), full[r].view(torch.int32)), f"row {r}"


def test_quantized_linear_end_to_end_error(device) -> None:
    m, n, k = 16, 96, 512
    x = gen(m, k, seed=7, device=device)
    q, s = quantize_fp8_block(gen(n, k, seed=8, scale=k**-0.5))
    wq, sw = rowwise_weight(q.to(device), s.to(device))
    out = linear_rowwise(*quantize_rows(x), wq, sw, config=SMALL)
    err = rel_l2(out, ref_linear(x.cpu(), q, s))
    print(f"quantize_rows + linear_rowwise vs fp32 linear: rel L2 {err:.2e}")
    assert 1e-2 < err < E2E_TOL  # activations really rounded, and no worse than e4m3 allows


def test_linear_rowwise_rejects_bad_input(device) -> None:
    xq, sx, wq, sw = operands(4, 64, 64, device)
    assert linear_rowwise(xq[:0], sx[:0], wq, sw).shape == (0, 64)
    for args, error in [((xq.float(), sx, wq, sw), TypeError), ((xq, sx, wq[:, :32].contiguous(), sw), ValueError),
                        ((xq, sx[:2], wq, sw), ValueError), ((xq, sx.double(), wq, sw), TypeError),
                        ((xq, sx, wq.t(), sw), ValueError)]:
        with pytest.raises(error):
            linear_rowwise(*args)
    with pytest.raises(TypeError):
        linear_rowwise(xq, sx, wq, sw, out_dtype=torch.float16)
    with pytest.raises(ValueError):
        linear_rowwise(xq, sx, wq, sw, config={**SMALL, "promote_K": 96})
    with pytest.raises(ValueError, match="shared memory"):
        linear_rowwise(xq, sx, wq, sw, config={**SMALL, "block_M": 256, "block_N": 256, "block_K": 256, "num_stages": 3})


def test_default_config_keeps_block_k_and_fits_shared_memory() -> None:
    configs = [default_config(m, n, k) for m in (1, 64, 65, 4096, 8192) for _, n, k, _ in V41_LINEARS]
    assert {c["block_K"] for c in configs} == {128}  # one K order for every token count: batch invariance
    assert all(smem_bytes(c) <= SMEM_BUDGET for c in configs)
    assert default_config(1, 32768, 1280)["block_M"] == 64 and default_config(4096, 32768, 1280)["block_N"] == 256
    assert default_config(4096, 512, HIDDEN)["block_N"] == 128  # 128 x 256 would leave most SMs idle
    assert default_config(1024, HIDDEN, 8192)["block_N"] == 128 and default_config(8192, HIDDEN, 8192)["block_N"] == 256


GPU_LINEARS = [(name, n, k) for name, n, k, groups in V41_LINEARS if groups == 1]


def gpu_tol(k: int) -> float:
    """promote_K=0 leaves the whole K to the tensor cores' narrower adder: rel L2 6e-4 at K=1280, 1.5e-3 at 5120 and
    2e-3 at 8192 on the H200 (as _scaled_mm's fast accumulation), growing like sqrt(K)."""
    return 4e-5 * k**0.5


@pytest.mark.gpu
@pytest.mark.parametrize("k,dtype", [(HIDDEN, torch.float32), (HIDDEN, torch.bfloat16), (1280, torch.float32),
                                     (8192, torch.bfloat16)])
def test_quantize_rows_bitwise_gpu(k, dtype) -> None:
    x = torch.cat([gen(4096, k, seed=k) * 5, special_rows(k)]).to(dtype).cuda()
    assert_same_codes(quantize_rows(x), quantize_rows_ref(x))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 4096])
@pytest.mark.parametrize("name,n,k", GPU_LINEARS)
def test_linear_rowwise_v41_shapes(name, n, k, m) -> None:
    xq, sx, wq, sw = operands(m, n, k, "cuda", seed=m)
    err = rel_l2(linear_rowwise(xq, sx, wq, sw), linear_rowwise_ref(xq, sx, wq, sw))
    assert err < gpu_tol(k), f"{name} M={m}: rel L2 {err:.2e}"


@pytest.mark.gpu
def test_linear_rowwise_promoted_accumulation() -> None:
    xq, sx, wq, sw = operands(256, 5120, 8192, "cuda")  # wo_b
    config = {**default_config(256, 5120, 8192), "block_M": 256, "block_N": 128, "num_stages": 3, "promote_K": 128}
    err = rel_l2(linear_rowwise(xq, sx, wq, sw, config=config), linear_rowwise_ref(xq, sx, wq, sw))
    assert err < 3e-4, f"rel L2 {err:.2e}"  # 1.3e-4 on the H200, as _scaled_mm's default; 2e-3 unpromoted


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", GPU_LINEARS)
def test_linear_rowwise_batch_invariant_gpu(name, n, k) -> None:
    xq, sx, wq, sw = operands(4096, n, k, "cuda", seed=11)  # default configs: 64-row tiles at M <= 64, 128 above
    full = linear_rowwise(xq, sx, wq, sw)
    some = linear_rowwise(xq[:37], sx[:37], wq, sw)
    for r in (0, 36):
        alone = linear_rowwise(xq[r:r + 1], sx[r:r + 1], wq, sw)
        assert torch.equal(alone[0], some[r]) and torch.equal(alone[0], full[r]), f"{name} row {r}"


@pytest.mark.gpu
@pytest.mark.parametrize("name,n,k", GPU_LINEARS)
def test_quantized_linear_end_to_end_error_gpu(name, n, k) -> None:
    x = gen(256, k, seed=3, device="cuda")
    q, s = quantize_fp8_block(gen(n, k, seed=4, scale=k**-0.5).cuda())
    out = linear_rowwise(*quantize_rows(x), *rowwise_weight(q, s), out_dtype=torch.bfloat16)
    assert 1e-2 < rel_l2(out, ref_linear(x, q, s)) < E2E_TOL
