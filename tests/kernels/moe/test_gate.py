"""The gate's scores and top-k kernel against `dsl.ops.moe`'s torch: the three score functions, renormalised or not,
k = 1 to E, expert counts that are not a power of two; ties to the lowest expert; a row the same bits alone and in a
batch; one token's projection and top k in one launch, the two launches' bits; the launches the AOT builder records
for MOE_GATE; V4.1's 384 experts top 6 on the GPU."""

from __future__ import annotations

import pytest
import torch

from dsl.ops.moe import gate_topk as ref_gate_topk
from dsl.ops.moe import moe_gate, score
from kernels import tickets
from kernels.launch import jit_launch, use_launcher
from kernels.linear import linear
from kernels.lowering import PLAIN, Call
from kernels.moe.gate import FUNCS, gate_one_row, gate_topk
from kernels.moe.lowering import MOE_GATE, GateStatic
from tests.kernels.cases import EXPERTS, HIDDEN, TOPK, gen

RTOL = 1e-6  # weights: a few fp32 ulps (other exp/log1p under the interpreter, other orders of the sums)


def attrs(topk: int, func: str, normalize: bool = True, temp: float = 1.0, scaling: float = 1.5) -> dict:
    return dict(topk=topk, func=func, temp=temp, normalize=normalize, scaling=scaling)


def check(got: tuple, want: tuple, bitwise: bool = False) -> None:
    (weights, experts), (want_weights, want_experts) = got, want
    assert experts.dtype == torch.int64 and experts.shape == want_experts.shape
    assert torch.equal(experts, want_experts)
    if bitwise:
        assert torch.equal(weights, want_weights)
    else:
        torch.testing.assert_close(weights, want_weights, rtol=RTOL, atol=0)


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("n,e,d,topk,temp", [(9, 13, 24, 3, 1.0), (4, 40, 16, 8, 0.7), (5, 6, 8, 1, 1.0),
                                             (3, 5, 8, 5, 2.0)])
def test_gate_topk_matches_moe_gate(func, normalize, n, e, d, topk, temp, device) -> None:
    """The reference's projection (the same call, so the same logits), then the kernel against moe_gate."""
    x, w, bias = gen(n, d, device=device, seed=e), gen(e, d, device=device, seed=e + 1, scale=2 * d**-0.5), \
        gen(e, device=device, seed=e + 2, scale=0.3)
    kw = attrs(topk, func, normalize, temp)
    got = gate_topk(torch.nn.functional.linear(x, w), bias, **kw)
    check(got, moe_gate(x, w, bias, **kw))


def test_equal_scores_go_lowest_expert_first(device) -> None:
    """Logits of five values and a bias of two: many equal score + bias, ordered as a stable descending sort orders
    them (torch.topk leaves the order of ties open)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randint(-2, 3, (12, 20), generator=g).float().to(device)
    bias = (torch.randint(0, 2, (20,), generator=g) * 0.5).to(device)
    for func in FUNCS:
        experts = gate_topk(logits, bias, **attrs(7, func))[1]
        want = torch.sort(score(logits, func) + bias, dim=1, descending=True, stable=True)[1][:, :7]
        assert torch.equal(experts, want), func


def test_a_row_is_the_same_bits_alone_and_among_others(device) -> None:
    logits, bias = gen(17, 30, device=device, seed=7, scale=2.0), gen(30, device=device, seed=8, scale=0.3)
    weights, experts = gate_topk(logits, bias, **attrs(4, "sqrtsoftplus"))
    for r in (0, 5, 16):
        alone = gate_topk(logits[r:r + 1].contiguous(), bias, **attrs(4, "sqrtsoftplus"))
        assert torch.equal(alone[0][0], weights[r]) and torch.equal(alone[1][0], experts[r])


def test_empty_input(device) -> None:
    weights, experts = gate_topk(torch.empty(0, 12, device=device), gen(12, device=device), **attrs(2, "sigmoid"))
    assert weights.shape == experts.shape == (0, 2)


def test_bad_arguments_name_the_argument(device) -> None:
    logits, bias = gen(3, 8, device=device), gen(8, device=device)
    with pytest.raises(ValueError, match="logits"):
        gate_topk(logits.double(), bias, **attrs(2, "sigmoid"))
    with pytest.raises(ValueError, match="bias"):
        gate_topk(logits, bias[:4], **attrs(2, "sigmoid"))
    with pytest.raises(ValueError, match="topk"):
        gate_topk(logits, bias, **attrs(9, "sigmoid"))
    with pytest.raises(ValueError, match="func"):
        gate_topk(logits, bias, **attrs(2, "relu"))
    with pytest.raises(ValueError, match="temp"):
        gate_topk(logits, bias, **attrs(2, "sigmoid", temp=0.0))


def test_aot_trace_records_the_projection_and_the_top_k() -> None:
    """MOE_GATE's trace runs the wrappers on meta tensors, for the bucket's tokens and for one: the projection's
    launches then the top-k's (one token's in one launch, `gate_one_row_kernel`; on the tensor cores then the top k
    in batch-invariant configs), with libdevice's functions (the GPU's)."""
    static = GateStatic(EXPERTS, HIDDEN)
    for invariant in (False, True):
        config = MOE_GATE.default_config(static, 16)
        calls = []
        with use_launcher(calls.append):
            MOE_GATE.trace(Call(static, PLAIN, MOE_GATE.invariant(config) if invariant else config,
                                attrs(TOPK, "sqrtsoftplus"), tokens=16))
        tops = [c for c in calls if c.name in ("gate_topk_kernel", "gate_one_row_kernel")]
        assert all(c.constexprs["EXACT"] and c.constexprs["E"] == EXPERTS for c in tops)
        if invariant:  # one token on the tensor cores, then the top k
            assert [(c.name, c.grid) for c in tops] == [("gate_topk_kernel", (16,)), ("gate_topk_kernel", (1,))]
            assert calls[-1] is tops[-1] and "gemv_kernel" not in [c.name for c in calls]
        else:  # one token's projection and top k in one launch
            assert [c.name for c in tops] == ["gate_topk_kernel", "gate_one_row_kernel"] and calls[-1] is tops[-1]
            assert "gemv_kernel" not in [c.name for c in calls]


@pytest.mark.parametrize("invariant", [False, True])
def test_one_token_gate_projection_in_fp32(invariant, device) -> None:
    """One token's projection on the one-row kernel (or, invariant, the tensor cores' fp32 products): the reference's
    logits to fp32 rounding, so its experts."""
    e, d = 24, 2100  # K split on the one-row kernel
    x, w, bias = gen(1, d, device=device, seed=1), gen(e, d, device=device, seed=2, scale=2 * d**-0.5), \
        gen(e, device=device, seed=3, scale=0.3)
    static = GateStatic(e, d)
    config = MOE_GATE.default_config(static, 16)
    kw = attrs(4, "sqrtsoftplus")
    got = MOE_GATE.run(Call(static, PLAIN, MOE_GATE.invariant(config) if invariant else config, kw, True, (),
                            [x, w, bias], tokens=1))
    want = moe_gate(x.cpu().double(), w.cpu().double(), bias.cpu().double(), **kw)
    assert torch.equal(got[1].cpu(), want[1])
    torch.testing.assert_close(got[0].cpu().double(), want[0].double(), rtol=1e-5, atol=0)


def two_launches(x, w, bias, **kw) -> tuple:
    """One token's gate as two launches: the one-row projection (kernels/linear), then `gate_topk`."""
    return gate_topk(linear.linear(x, w, config=linear.default_config(1, *w.shape, w_bytes=4), dot_fp32=True), bias,
                     **kw)


def check_one_row(e: int, d: int, func: str, normalize: bool, device: str, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> None:
    """`gate_one_row` against `two_launches`, bit for bit, in one launch; its tile counters left at zero, and a second
    call the same bits."""
    x, w, bias = gen(1, d, device=device, seed=seed, dtype=dtype), \
        gen(e, d, device=device, seed=seed + 1, scale=2 * d**-0.5), gen(e, device=device, seed=seed + 2, scale=0.3)
    kw = attrs(min(6, e), func, normalize, temp=0.8)
    calls = []
    with use_launcher(lambda c: (calls.append(c.name), jit_launch(c))):
        got = gate_one_row(x, w, bias, **kw)
    assert calls == ["gate_one_row_kernel"]
    check(got, two_launches(x, w, bias, **kw), bitwise=True)
    assert not tickets.tile_counters(x.device, 1).any()
    again = gate_one_row(x, w, bias, **kw)
    assert torch.equal(again[0], got[0]) and torch.equal(again[1], got[1])


@pytest.mark.parametrize("func", FUNCS)
@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("e,d", [(24, 2100), (70, 300)])  # K split 8 ways, one tile; not split, two tiles
def test_one_token_gate_in_one_launch_is_the_two_launches(func, normalize, e, d, device) -> None:
    assert (linear.gemv_config(e, d, w_bytes=4)["split_k"] > 1) == (d > 1000)
    check_one_row(e, d, func, normalize, device)


def test_one_token_gate_takes_bf16_rows(device) -> None:
    check_one_row(24, 2100, "sqrtsoftplus", True, device, dtype=torch.bfloat16)


def test_one_token_gate_checks_its_inputs(device) -> None:
    x, w, bias = gen(1, 64, device=device), gen(8, 64, device=device), gen(8, device=device)
    with pytest.raises(ValueError, match="x must be one contiguous float32/bfloat16 row"):
        gate_one_row(gen(2, 64, device=device), w, bias, **attrs(2, "sigmoid"))
    with pytest.raises(ValueError, match="w must be contiguous float32 \\[E, 64\\]"):
        gate_one_row(x, w.bfloat16(), bias, **attrs(2, "sigmoid"))
    with pytest.raises(ValueError, match="topk"):
        gate_one_row(x, w, bias, **attrs(9, "sigmoid"))


@pytest.mark.gpu
@pytest.mark.parametrize("func", FUNCS)
def test_one_token_gate_v41_shapes_on_the_gpu(func) -> None:
    """384 experts top 6 over 5120 inputs: one launch, the two launches' bits."""
    for seed in range(3):
        check_one_row(EXPERTS, HIDDEN, func, True, "cuda", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 8192])
def test_gate_topk_v41_shapes_on_the_gpu(n) -> None:
    """V4.1's gate, 384 experts top 6 by sqrtsoftplus: the selection and the unnormalised weights are torch's bits
    (the same CUDA math functions); renormalised weights within fp32 rounding (another order of the sum)."""
    logits = gen(n, EXPERTS, device="cuda", seed=n, scale=1.5)
    bias = gen(EXPERTS, device="cuda", seed=n + 1, scale=0.1)
    for normalize in (True, False):
        kw = attrs(TOPK, "sqrtsoftplus", normalize, scaling=2.5)
        check(gate_topk(logits, bias, **kw), ref_gate_topk(logits, bias, **kw), bitwise=not normalize)
    alone = gate_topk(logits[-1:], bias, **kw)
    assert torch.equal(alone[0][0], gate_topk(logits, bias, **kw)[0][-1])


@pytest.mark.gpu
@pytest.mark.parametrize("func", ["sigmoid", "softmax"])
def test_gate_topk_other_scores_on_the_gpu(func) -> None:
    logits, bias = gen(64, EXPERTS, device="cuda", seed=3), gen(EXPERTS, device="cuda", seed=4, scale=0.1)
    for normalize in (True, False):
        kw = attrs(TOPK, func, normalize, temp=0.8)
        check(gate_topk(logits, bias, **kw), ref_gate_topk(logits, bias, **kw),
              bitwise=func == "sigmoid" and not normalize)
