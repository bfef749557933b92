"""Routed experts (fp4 and bf16 grouped GEMMs, unsplit and split-K) against `dsl.ops.moe.moe_experts`, batch
invariance under a split config, one token unrouted against the routed path, and the launches the AOT builder
records (the routing layout's own tests: tests/kernels/moe/test_route.py)."""

from __future__ import annotations

import pytest
import torch

from autotune.space import get_configs
from dsl.ops.moe import moe_experts as ref_moe_experts
from kernels import tickets
from kernels.launch import jit_launch, use_launcher
from kernels.lowering import PLAIN, Call
from kernels.moe.experts import default_config, gemm_rows, moe_experts, pair_outputs, prescaled, sum_pairs, unrouted
from kernels.moe.fragments import fragment_codes
from kernels.moe.lowering import MOE_EXPERTS, ExpertsStatic
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


def routing(t: int, e: int, k: int, device: str, seed: int = 0,
            same: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights and k distinct experts per token (`same`: every token the same k experts, in one order)."""
    g = torch.Generator().manual_seed(seed)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k).long()
    if same and t:
        experts = experts[:1].expand(t, k).contiguous()
    weights = torch.rand(t, k, generator=g) + 0.1
    return weights.to(device), experts.to(device)


def check(t: int, e: int, inter: int, d: int, fmt: str, device: str, config: dict | None = None,
          tol: float = 2e-5, k: int = TOPK, same: bool = False) -> None:
    (w1, w2, w3), (s1, s2, s3) = make_experts(e, inter, d, fmt, device)
    weights, experts = routing(t, e, min(k, e), device, seed=t, same=same)
    x = gen(t, d, device=device, seed=t)
    dot_fp32 = fmt == "fp32"
    got = moe_experts(x, weights, experts, w1, w2, w3, s1, s2, s3, limit=LIMIT, config=config, dot_fp32=dot_fp32)
    if not dot_fp32:
        # the kernel's operands: x and the activation between the GEMMs are bf16; the reference keeps the
        # activation in fp32, which is the rest of the difference
        x = x.bfloat16().float()
    want = ref_moe_experts(x, weights, experts, w1, w2, w3, s1, s2, s3, limit=LIMIT)
    assert got.shape == want.shape
    assert rel_l2(got, want) < tol, rel_l2(got, want)


SMALL = dict(up=dict(block_M=16, block_N=32, block_K=64, num_warps=4, num_stages=2, split_k=1),
             down=dict(block_M=16, block_N=32, block_K=64, num_warps=4, num_stages=2, split_k=1))


def split(up: int, down: int, block_k: int = 64) -> dict:
    gemm = dict(block_M=16, block_N=32, block_K=block_k, num_warps=4, num_stages=2)
    return dict(up=dict(gemm, split_k=up), down=dict(gemm, split_k=down))


@pytest.mark.parametrize("t,e,inter,d,fmt", [
    (1, 8, 64, 96, "fp4"), (5, 8, 96, 64, "fp4"), (3, 4, 40, 48, "bf16"), (19, 6, 32, 64, "fp32"),
])
def test_moe_experts_match_reference(t, e, inter, d, fmt, device) -> None:
    tol = {"fp4": 5e-3, "bf16": 5e-3, "fp32": 1e-5}[fmt]
    check(t, e, inter, d, fmt, device, SMALL, tol)


# (t, e, inter, d, fmt, splits): K = d for GEMM 1, inter for GEMM 2; 96 / 64 leaves a short last split, 3 splits of
# K = 96 an empty one; t = 19 fills one expert past a block of 16 slots
SPLIT_CASES = [(1, 8, 64, 96, "fp4", (2, 2)), (1, 8, 64, 96, "fp4", (3, 1)), (19, 8, 96, 64, "fp4", (1, 3)),
               (19, 4, 64, 96, "fp4", (4, 2)), (1, 6, 40, 64, "bf16", (2, 2)), (7, 6, 64, 96, "bf16", (3, 2)),
               (5, 8, 64, 96, "fp32", (2, 3))]


@pytest.mark.parametrize("t,e,inter,d,fmt,splits", SPLIT_CASES)
def test_moe_split_k_matches_reference(t, e, inter, d, fmt, splits, device) -> None:
    check(t, e, inter, d, fmt, device, split(*splits), {"fp4": 5e-3, "bf16": 5e-3, "fp32": 1e-5}[fmt])


@pytest.mark.parametrize("splits", [(1, 1), (2, 3)])
def test_moe_tokens_on_the_same_experts(splits, device) -> None:
    """21 tokens on the same 2 experts: two blocks of slots per expert, the last one partial."""
    check(21, 6, 64, 96, "fp4", device, split(*splits), 5e-3, k=2, same=True)


@pytest.mark.usefixtures("row_independent_dot")  # the kernel's order, not the host BLAS's (conftest.py)
@pytest.mark.parametrize("splits", [(2, 2), (3, 1)])
def test_moe_token_is_bitwise_the_same_alone_and_in_a_batch(splits, device) -> None:
    """Under one split config a token's pairs land in other blocks and slots as the batch changes, and its row of
    the output is the same bits."""
    e, inter, d, k = 8, 64, 96, 3
    ws, ss = make_experts(e, inter, d, "fp4", device)
    weights, experts = routing(1, e, k, device, seed=5)
    x = gen(1, d, device=device, seed=6)
    alone = moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=split(*splits))
    for rows, at in [(5, 3), (20, 0), (33, 32)]:
        w_all, e_all = routing(rows, e, k, device, seed=rows)
        w_all[at], e_all[at] = weights[0], experts[0]
        x_all = gen(rows, d, device=device, seed=rows + 1)
        x_all[at] = x[0]
        got = moe_experts(x_all, w_all, e_all, *ws, *ss, limit=LIMIT, config=split(*splits))
        assert torch.equal(got[at], alone[0])


@pytest.mark.parametrize("t,d", [(1, 64), (3, 5120), (2, 2080)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dot_fp32", [False, True])
def test_gemm_rows_is_the_even_then_odd_copy_in_one_launch(t, d, dtype, dot_fp32, device) -> None:
    """`gemm_rows` (one launch of `split_rows_kernel`) gives torch.cat of the even and odd columns cast to the
    products' dtype, bit for bit: rounding ties to even, signed zeros, infinities and NaN included."""
    x = gen(t, d, device=device, seed=d) * 3
    x[0, :8] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -0.0, float("inf"), -float("inf"), float("nan"), 2**-130, -1e38])
    x = x.to(dtype)
    want = torch.cat([x[:, 0::2], x[:, 1::2]], 1).to(torch.float32 if dot_fp32 else torch.bfloat16)
    calls = []
    with use_launcher(lambda call: (calls.append(call.name), jit_launch(call))):
        got = gemm_rows(x, True, dot_fp32)
    assert calls == ["split_rows_kernel"]
    assert got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)  # NaN's payload may differ between casts: only where NaN is
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def routed(x, weights, experts, ws, ss, config, dot_fp32=False) -> torch.Tensor:
    """moe_experts through routing, GEMMs on the split rows and the slot sum: the path of two tokens and more."""
    fp4 = ws[0].dtype == torch.uint8
    y = pair_outputs(gemm_rows(x, fp4, dot_fp32), weights, experts, *ws, *ss, limit=LIMIT, config=config,
                     dot_fp32=dot_fp32)
    return sum_pairs(y, experts.shape[1])


@pytest.mark.usefixtures("row_independent_dot")
@pytest.mark.parametrize("fmt,splits,dtype", [
    ("fp4", (1, 1), torch.float32), ("fp4", (2, 3), torch.float32), ("fp4", (1, 1), torch.bfloat16),
    ("fragments", (1, 1), torch.float32), ("fragments", (3, 2), torch.bfloat16), ("bf16", (2, 2), torch.float32),
    ("fp32", (1, 2), torch.float32),
])
def test_one_token_unrouted_is_bitwise_the_routed_path(fmt, splits, dtype, device) -> None:
    """One token's pairs run unrouted, and GEMM 2's last program of each output tile adds them in slot and split
    order. The result is the bits of routing, the GEMMs and `moe_sum_kernel`, in the two GEMMs' launches after fp4's
    copy of x (and the activation's with a split GEMM 1), and the tile counters are left at zero (a second call gives
    the same bits)."""
    e, inter, d = 8, 64, 96
    ws, ss = make_experts(e, inter, d, "fp4" if fmt == "fragments" else fmt, device)
    if fmt == "fragments":
        ws = [fragment_codes(w) for w in ws]
    weights, experts = routing(1, e, 3, device, seed=7)
    x = gen(1, d, device=device, seed=8).to(dtype)
    dot_fp32, config = fmt == "fp32", split(*splits, block_k=32)
    want = routed(x, weights, experts, ws, ss, config, dot_fp32)
    calls = []
    with use_launcher(lambda call: (calls.append(call), jit_launch(call))):
        got = moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=config, dot_fp32=dot_fp32)
    assert [c.name for c in calls] == ["split_rows_kernel"] * (fmt in ("fp4", "fragments")) + ["moe_gemm_kernel"] + \
        ["moe_swiglu_kernel"] * (splits[0] > 1) + ["moe_gemm_kernel"]
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want)
    assert not torch.any(tickets.tile_counters(torch.device(device), 1))
    again = moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=config, dot_fp32=dot_fp32)
    assert torch.equal(again, want)


def test_batch_invariant_configs_route_one_token_too(device) -> None:
    """The experts' batch-invariant form (`unrouted` False) runs one token on the routed path's kernels, as every
    other count, and gives the bits the unrouted path gives."""
    e, inter, d = 8, 64, 96
    ws, ss = make_experts(e, inter, d, "fp4", device)
    weights, experts = routing(1, e, 3, device, seed=9)
    x = gen(1, d, device=device, seed=10)
    config = MOE_EXPERTS.invariant(split(1, 2, block_k=32))
    assert not unrouted(1, config) and unrouted(1, split(1, 2))
    calls = []
    with use_launcher(lambda call: (calls.append(call.name), jit_launch(call))):
        got = moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=config)
    assert calls == ["split_rows_kernel", "route_count_kernel", "route_place_kernel", "moe_gemm_kernel",
                     "moe_gemm_kernel", "moe_sum_kernel"]
    assert torch.equal(got, moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=split(1, 2, block_k=32)))


def test_moe_prescaled_scales_give_the_bits_of_fp32_scales(device) -> None:
    """The executor gives the kernel each power-of-two scale as the bf16 factor scale * 2^63: the same products as
    fp32 scales, bit for bit, over scales from 2^-127 (a subnormal fp32) up, split or not."""
    e, inter, d = 8, 64, 96
    (w1, w2, w3), _ = make_experts(e, inter, d, "fp4", device)
    g = torch.Generator().manual_seed(11)
    ss = [torch.ldexp(torch.ones(e, o, k // 32), torch.randint(-127, 9, (e, o, k // 32), generator=g)).to(device)
          for o, k in [(inter, d), (d, inter), (inter, d)]]
    for s in ss:
        s[0, 0, 0] = 2.0**-127
    weights, experts = routing(9, e, 3, device, seed=2)
    x = gen(9, d, device=device, seed=3)
    for splits in [(1, 1), (2, 3)]:
        want = moe_experts(x, weights, experts, w1, w2, w3, *ss, limit=LIMIT, config=split(*splits))
        got = moe_experts(x, weights, experts, w1, w2, w3, *map(prescaled, ss), limit=LIMIT, config=split(*splits))
        assert torch.isfinite(want).all() and want.abs().max() > 0
        assert torch.equal(got, want)


def test_prescaled_is_exact_for_every_ue8m0_scale_up_to_2_64() -> None:
    exponents = torch.arange(-127, 65)
    scales = torch.ldexp(torch.ones(exponents.shape), exponents)
    assert torch.equal(prescaled(scales).float(), torch.ldexp(torch.ones(exponents.shape), exponents + 63))
    ue8m0 = (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    assert torch.equal(prescaled(ue8m0), prescaled(scales))
    assert prescaled(torch.tensor([2.0**65])).isinf().all()


def test_default_config_runs_decode_unsplit_in_wide_tiles() -> None:
    """Every bucket: 128 outputs a program over two warpgroups, K whole; 16 slots a block up to 512 tokens, then 64."""
    for m in (1, 16, 64, 512, 8192):
        config = default_config(m)
        assert config["up"] == config["down"] and config["up"]["split_k"] == 1
        assert (config["up"]["block_N"], config["up"]["num_warps"]) == (128, 8)
        assert config["up"]["block_M"] == (16 if m <= 512 else 64)


@pytest.mark.parametrize("bucket", [16, 64, 8192])
def test_tuning_space_splits_k_within_the_shapes(bucket) -> None:
    configs = get_configs("moe_experts", ExpertsStatic(EXPERTS, MOE_INTER, HIDDEN, TOPK, "fp4"), bucket)
    assert configs
    for c in configs:
        up, down = c["up"], c["down"]
        assert HIDDEN // up["split_k"] >= 2 * up["block_K"] and MOE_INTER // down["split_k"] >= 2 * down["block_K"]
        assert up["block_M"] == down["block_M"]
        big = up["block_N"] * up["block_M"] >= 128 * 64  # a big tile takes two warpgroups
        assert up["num_warps"] == (8 if big else up["block_N"] // 16)
        assert up["block_M"] == 16 or bucket > 64  # decode blocks hold one or two pairs: 16 slots
    splits = {(c["up"]["split_k"], c["down"]["split_k"]) for c in configs}
    assert splits == {(1, 1)} if bucket > 64 else max(splits) >= (4, 2)


@pytest.mark.parametrize("m, splits", [(16, (4, 2)), (16, None), (512, None), (1, None), (1, (2, 2)), (8192, None)])
def test_aot_trace_records_every_launch_of_the_config(m, splits) -> None:
    """The AOT builder runs the wrapper on meta tensors (no values read): x's even/odd copy, the routing's two
    kernels (none for one token), then a split GEMM 1 adds the activation's kernel, and both GEMMs' split counts
    reach their launches (the heuristic's tiles, or them with K split); the slot sum is its own kernel past one
    token. A decode bucket's trace adds one token's launches under its config, which the bucket's smallest member
    runs."""
    static = ExpertsStatic(EXPERTS, MOE_INTER, HIDDEN, TOPK, "fp4")
    config = default_config(m)
    if splits:
        config = {g: dict(config[g], split_k=k) for g, k in zip(("up", "down"), splits, strict=True)}
    calls = []
    with use_launcher(calls.append):
        MOE_EXPERTS.trace(Call(static, PLAIN, config, {"limit": LIMIT}, tokens=m))
    split_up, split_down = config["up"]["split_k"], config["down"]["split_k"]
    runs = [m, 1] if 1 < m <= 512 else [m]

    def names(t: int) -> list[str]:
        return ["split_rows_kernel"] + ["route_count_kernel", "route_place_kernel"] * (t > 1) + ["moe_gemm_kernel"] + \
            ["moe_swiglu_kernel"] * (split_up > 1) + ["moe_gemm_kernel"] + ["moe_sum_kernel"] * (t > 1)

    assert [c.name for c in calls] == [n for t in runs for n in names(t)]
    gemms = [c for c in calls if c.name == "moe_gemm_kernel"]
    assert [c.constexprs["SPLIT_K"] for c in gemms] == [split_up, split_down] * len(runs)
    assert [c.grid[2] for c in gemms] == [split_up, split_down] * len(runs)
    assert [c.constexprs["ONE_TOKEN"] for c in gemms] == [t == 1 for t in runs for _ in range(2)]
    assert all(c.constexprs.get("ASM", True) for c in gemms)  # fp4 codes through PTX on the GPU
    assert calls[-1].grid[0] == (m if runs == [m] and m > 1 else TOPK)  # the sum's tokens, or one token's pairs


def test_moe_empty_input(device) -> None:
    (w1, w2, w3), (s1, s2, s3) = make_experts(4, 32, 64, "fp4", device)
    weights, experts = routing(0, 4, 2, device)
    out = moe_experts(torch.empty(0, 64, device=device), weights, experts, w1, w2, w3, s1, s2, s3, limit=LIMIT)
    assert out.shape == (0, 64)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("config", ["default", "narrow"])
def test_moe_v41_shapes_fp4(t, config) -> None:
    narrow = {"block_M": 16, "block_N": 64, "block_K": 128, "num_warps": 4, "num_stages": 3, "split_k": 1}
    check(t, EXPERTS, MOE_INTER, HIDDEN, "fp4", "cuda", {"up": narrow, "down": narrow} if config == "narrow" else None,
          5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 600])
def test_moe_v41_shapes_prescaled_scales_are_bitwise_fp32_scales(t) -> None:
    """On the GPU (the PTX path) prescaled scales give the bits of fp32 scales, at V4.1's shapes."""
    (w1, w2, w3), ss = make_experts(EXPERTS, MOE_INTER, HIDDEN, "fp4", "cuda")
    weights, experts = routing(t, EXPERTS, TOPK, "cuda", seed=t)
    x = gen(t, HIDDEN, device="cuda", seed=t)
    want = moe_experts(x, weights, experts, w1, w2, w3, *ss, limit=LIMIT)
    assert torch.equal(moe_experts(x, weights, experts, w1, w2, w3, *map(prescaled, ss), limit=LIMIT), want)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, (2, 2)])
def test_moe_v41_one_token_is_bitwise_the_routed_path(splits) -> None:
    """At V4.1's shapes, on codes in fragment order with prescaled scales (what plans give the kernel), through the
    PTX decoding: one token unrouted gives the routed path's bits, under the heuristic's tiles and split ones."""
    (w1, w2, w3), ss = make_experts(EXPERTS, MOE_INTER, HIDDEN, "fp4", "cuda")
    ws, ss = [fragment_codes(w) for w in (w1, w2, w3)], [prescaled(s) for s in ss]
    config = default_config(1)
    if splits:
        config = {g: dict(config[g], split_k=k) for g, k in zip(("up", "down"), splits, strict=True)}
    for seed in range(3):
        weights, experts = routing(1, EXPERTS, TOPK, "cuda", seed=seed)
        x = gen(1, HIDDEN, device="cuda", seed=seed)
        want = routed(x, weights, experts, ws, ss, config)
        assert torch.equal(moe_experts(x, weights, experts, *ws, *ss, limit=LIMIT, config=config), want)
