"""Routed experts (fp4 and bf16 grouped GEMMs) against `dsl.ops.moe.moe_experts`, and the routing layout."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.moe import moe_experts as ref_moe_experts
from kernels.triton.moe import moe_experts, route
from tests.kernels.cases import EXPERTS, HIDDEN, MOE_INTER, TOPK, gen, rel_l2

LIMIT = 10.0


def make_experts(e: int, inter: int, d: int, fmt: str, device: str) -> tuple[list, list]:
    """w1, w2, w3 and their scales. fp4 codes are random bytes (every byte is two valid codes) with random
    power-of-two scales, drawn on `device`: the full 384-expert shapes need no quantization pass."""
    g = torch.Generator(device=device).manual_seed(e + inter)
    ws, ss = [], []
    for o, k in [(inter, d), (d, inter), (inter, d)]:
        if fmt == "fp4":
            ws.append(torch.randint(0, 256, (e, o, k // 2), generator=g, device=device, dtype=torch.uint8))
            exponent = torch.randint(-7, -3, (e, o, k // 32), generator=g, device=device)
            ss.append(torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent))
        else:
            w = torch.randn(e, o, k, generator=g, device=device) * (4 * k**-0.5)  # hits the +-10 clamp sometimes
            ws.append(w.to(torch.bfloat16 if fmt == "bf16" else torch.float32))
            ss.append(None)
    return ws, ss


def routing(t: int, e: int, k: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    weights = torch.rand(t, k, generator=g) + 0.1
    return weights.to(device), experts.to(device)


def check(t: int, e: int, inter: int, d: int, fmt: str, device: str, config: dict | None = None,
          tol: float = 2e-5) -> None:
    (w1, w2, w3), (s1, s2, s3) = make_experts(e, inter, d, fmt, device)
    weights, experts = routing(t, e, min(TOPK, e), device, seed=t)
    x = gen(t, d, device=device, seed=t)
    dot_fp32 = fmt == "fp32"
    got = moe_experts(x, weights, experts, w1, w2, w3, s1, s2, s3, limit=LIMIT, config=config, dot_fp32=dot_fp32)
    if not dot_fp32:
        # the kernel's operands: x and the activation between the GEMMs are bf16; the reference keeps the
        # activation in fp32, which is the rest of the difference
        x = x.bfloat16().float()
    want = ref_moe_experts(x, weights, experts, w1, w2, w3, s1, s2, s3, limit=LIMIT)
    assert got.shape == want.shape
    assert rel_l2(got, want) < tol


def test_route_lays_out_every_pair_once_in_blocks_of_one_expert() -> None:
    weights, experts = routing(9, 8, 3, "cpu", seed=3)
    rows, block_expert = route(experts, 8, 4)
    pairs = rows[rows >= 0]
    assert sorted(pairs.tolist()) == list(range(27))
    for b, e in enumerate(block_expert.tolist()):
        block = rows[4 * b: 4 * b + 4]
        assert all(experts.reshape(-1)[p] == e for p in block[block >= 0].tolist())
        assert e >= 0 or (block < 0).all()


SMALL = dict(up=dict(block_M=16, block_N=32, block_K=64, num_warps=4, num_stages=2),
             down=dict(block_M=16, block_N=32, block_K=64, num_warps=4, num_stages=2))


@pytest.mark.parametrize("t,e,inter,d,fmt", [
    (1, 8, 64, 96, "fp4"), (5, 8, 96, 64, "fp4"), (3, 4, 40, 48, "bf16"), (19, 6, 32, 64, "fp32"),
])
def test_moe_experts_match_reference(t, e, inter, d, fmt, device) -> None:
    tol = {"fp4": 5e-3, "bf16": 5e-3, "fp32": 1e-5}[fmt]
    check(t, e, inter, d, fmt, device, SMALL, tol)


def test_moe_empty_input(device) -> None:
    (w1, w2, w3), (s1, s2, s3) = make_experts(4, 32, 64, "fp4", device)
    weights, experts = routing(0, 4, 2, device)
    out = moe_experts(torch.empty(0, 64, device=device), weights, experts, w1, w2, w3, s1, s2, s3, limit=LIMIT)
    assert out.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 64])
def test_moe_v41_shapes_fp4(t) -> None:
    check(t, EXPERTS, MOE_INTER, HIDDEN, "fp4", "cuda", tol=5e-3)


@pytest.mark.gpu
def test_moe_fp32_products_on_gpu() -> None:
    check(7, 16, 256, 512, "fp32", "cuda", tol=1e-5)
