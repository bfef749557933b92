"""The shared expert's clamped SwiGLU in one kernel against `dsl.ops.moe.clamped_swiglu` (within a few ulps: its
silu is gate * sigmoid(gate)), and the `swiglu` lowering (projections, kernel, down projection) against the op."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsl.ops.moe import clamped_swiglu
from dsl.ops.moe import swiglu as ref_swiglu
from dsl.quant import quantize_fp8_block
from kernels import tickets
from kernels.launch import use_launcher
from kernels.linear.linear import gemv_config, linear
from kernels.linear.lowering import SWIGLU, SwigluStatic, project
from kernels.linear.swiglu import swiglu, swiglu_one_row
from kernels.lowering import PLAIN, Call
from tests.kernels.cases import DECODE_TOKENS, HIDDEN, MOE_INTER, gen, rel_l2

LIMIT = 10.0


def operands(m: int, inter: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up spread past the clamps (|x| up to ~60, two in five beyond 10)."""
    return gen(m, inter, seed=m, scale=12.0, device=device), gen(m, inter, seed=m + 1, scale=12.0, device=device)


def check(gate: torch.Tensor, up: torch.Tensor, limit: float) -> None:
    """Within 4e-6 relative; more where gate is very negative, as exp's argument rounds (|gate| / 10 times)."""
    got = swiglu(gate, up, limit=limit)
    gate, up = gate.cpu(), up.cpu()
    want = clamped_swiglu(gate, up, limit)
    assert got.shape == want.shape and got.dtype == torch.float32
    tol = 4e-6 * (gate.abs() / 10).clamp_min(1)
    assert ((got.cpu() - want).abs() <= tol * want.abs() + 1e-30).all()
    if limit:  # the clamps were met, on both sides of up
        assert (gate > limit).any() and (up > limit).any() and (up < -limit).any()


@pytest.mark.parametrize("m,inter", [(1, 40), (5, 300), (3, 2304)])
@pytest.mark.parametrize("limit", [0.0, LIMIT])
def test_swiglu_matches_reference(m, inter, limit, device) -> None:
    check(*operands(m, inter, device), limit)


def test_swiglu_rows_alone_and_empty(device) -> None:
    gate, up = operands(6, 200, device)
    out = swiglu(gate, up, limit=LIMIT)
    assert torch.equal(swiglu(gate[3:4].contiguous(), up[3:4].contiguous(), limit=LIMIT), out[3:4])
    assert swiglu(torch.empty(0, 8, device=device), torch.empty(0, 8, device=device), limit=LIMIT).shape == (0, 8)


def test_swiglu_rejects_bad_input(device) -> None:
    gate, up = operands(2, 16, device)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(gate, up[:, :8], limit=LIMIT)
    with pytest.raises(ValueError, match="float32"):
        swiglu(gate.bfloat16(), up, limit=LIMIT)
    with pytest.raises(ValueError, match="contiguous"):
        swiglu(gate.t(), up.t(), limit=LIMIT)
    with pytest.raises(ValueError, match="limit"):
        swiglu(gate, up, limit=-1.0)


def shared_expert(d: int, inter: int, fmt: str, device: str) -> list:
    """w1, w2, w3 and their scales: fp32 or bf16 weights, or fp8 32x32 blocks as the checkpoint stores the shared
    expert."""
    ws, ss = [], []
    for i, (o, k) in enumerate([(inter, d), (d, inter), (inter, d)]):
        w = gen(o, k, seed=10 + i, scale=4 * k**-0.5)  # w1 x and w3 x reach the clamps
        w, s = quantize_fp8_block(w) if fmt == "fp8" else (w.to(torch.bfloat16) if fmt == "bf16" else w, None)
        ws.append(w.to(device))
        ss.append(None if s is None else s.to(device))
    return ws + ss


@pytest.mark.parametrize("limit", [0.0, LIMIT])
def test_the_lowering_is_the_op(limit, device) -> None:
    """fp32 products (as the interpreter checks plans): the op's result but for the activation's few ulps. The
    builder records the kernel's launch beside the projections'."""
    m, d, inter = 5, 64, 96
    args = [gen(m, d, seed=3, device=device), *shared_expert(d, inter, "plain", device)]
    static = SwigluStatic(inter, d, "plain")
    gemms = SWIGLU.gemms(static, 16, True)
    call = Call(static, PLAIN, SWIGLU.default_config(static, 16, PLAIN, gemms), {"limit": limit}, True, gemms, args)
    got = SWIGLU.run(call)
    assert rel_l2(got, ref_swiglu(*(a.cpu() if a is not None else None for a in args), limit=limit)) < 1e-5
    names = []
    with use_launcher(lambda launched: names.append(launched.name)):
        SWIGLU.trace(Call(static, PLAIN, call.config, {"limit": limit}, False, SWIGLU.gemms(static, 16, False),
                          tokens=16))
    assert "swiglu_kernel" in names


# (d, inter): K under a stage and unsplit; K split (gemv_config splits k >= 2048 at few tiles), N past a tile
@pytest.mark.parametrize("fmt", ["fp8", "bf16"])
@pytest.mark.parametrize("d,inter", [(96, 40), (2080, 40), (2100, 96)])
@pytest.mark.parametrize("limit", [0.0, LIMIT])
def test_one_token_shared_expert_in_one_launch(d, inter, limit, fmt, device) -> None:
    """One token over fp8 or plain weights: h in one launch (`swiglu_one_row`) is bitwise the two one-row projections
    and the activation kernel, leaves the tile counters at zero, and the lowering runs it (two launches in all, with
    down)."""
    x = gen(1, d, seed=d, scale=4.0, device=device)
    w1, w2, w3, s1, s2, s3 = shared_expert(d, inter, fmt, device)
    separate = swiglu(linear(x, w1, s1), linear(x, w3, s3), limit=limit)
    fused = swiglu_one_row(x, w1, s1, w3, s3, limit=limit)
    assert torch.equal(fused, separate)
    assert not torch.any(tickets.tile_counters(torch.device(device), 1))
    if d >= 2048:
        assert gemv_config(inter, d)["split_k"] > 1
    static = SwigluStatic(inter, d, "fp8" if fmt == "fp8" else "plain")
    gemms = SWIGLU.gemms(static, 1, False)
    call = Call(static, PLAIN, SWIGLU.default_config(static, 1, PLAIN, gemms), {"limit": limit}, False, gemms,
                [x, w1, w2, w3, s1, s2, s3])
    names = []
    with use_launcher(lambda launched: names.append(launched.name)):
        SWIGLU.trace(replace(call, args=(), tokens=1))
    assert names == ["gemv_swiglu_kernel", "gemv_kernel"]
    assert torch.equal(SWIGLU.run(call), linear(separate, w2, s2))
    with pytest.raises(ValueError, match="one token"):
        swiglu_one_row(x.expand(2, d).contiguous(), w1, s1, w3, s3, limit=limit)
    with pytest.raises(ValueError, match="one shape and dtype"):
        swiglu_one_row(x, w1, s1, w3.to(torch.float16), s3, limit=limit)


def test_one_token_shared_expert_past_the_counters_is_refused(device) -> None:
    """More output tiles than tile counters: a clear error, nothing launched."""
    n = (tickets.COUNTERS + 1) * gemv_config(1 << 20, 32)["block_N"]
    w, s = quantize_fp8_block(torch.zeros(n, 32))
    w, s = w.to(device), s.to(device)
    with pytest.raises(ValueError, match="COUNTERS"):
        swiglu_one_row(torch.zeros(1, 32, device=device), w, s, w, s, limit=LIMIT)


@pytest.mark.gpu
@pytest.mark.parametrize("m", DECODE_TOKENS)
@pytest.mark.parametrize("limit", [0.0, LIMIT])
def test_swiglu_v41_shared_expert(m, limit) -> None:
    """V4.1's shared expert (hidden 5120, one expert of width 2304): the kernel on its own, then the lowering against
    the eager torch ops it replaced (same projections, bf16 products) and against the op in fp32."""
    check(*operands(m, MOE_INTER, "cuda"), limit)
    args = [gen(m, HIDDEN, seed=m, device="cuda"), *shared_expert(HIDDEN, MOE_INTER, "fp8", "cuda")]
    x, w1, w2, w3, s1, s2, s3 = args
    static = SwigluStatic(MOE_INTER, HIDDEN, "fp8")
    (g_up, g_down) = gemms = SWIGLU.gemms(static, m, False)
    config = SWIGLU.default_config(static, m, PLAIN, gemms)
    got = SWIGLU.run(Call(static, PLAIN, config, {"limit": limit}, False, gemms, args))
    gate, up = project(x, w1, s1, g_up, config["up"], False), project(x, w3, s3, g_up, config["up"], False)
    eager = project(clamped_swiglu(gate, up, limit), w2, s2, g_down, config["down"], False)
    assert rel_l2(got, eager) < 1e-4  # h differs by ulps, then rounds to bf16 in the down projection
    want = ref_swiglu(*(a.cpu() for a in args), limit=limit)
    assert rel_l2(got, want) < 1e-2  # x and h rounded to bf16: 3e-3 emulated in torch
