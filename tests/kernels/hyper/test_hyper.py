"""Hyper-connection kernels (mixes with Sinkhorn, collapse + RMSNorm, expand) against `dsl.ops.hyper`."""

from __future__ import annotations

import itertools

import pytest
import torch

import kernels.hyper.mixes as mixes
from dsl.ops import hyper as ref
from kernels import tickets
from kernels.hyper.hyper import hc_add_expand, hc_collapse_rms_norm, hc_expand
from kernels.hyper.mixes import hc_mixes, hc_update_mixes
from kernels.launch import jit_launch, use_launcher
from tests.conftest import fixture_dir
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
    """The mixes as one launch and as two (`mixes.ONE_LAUNCH_ROWS` set past n, then below it): the same bits, the
    kernels named, and the tile counters left at zero."""
    args = mix_inputs(n, d, device)
    outs = {}
    for rows, kernels in ((n, ["hc_mixes_kernel"]), (0, ["hc_mixes_partial_kernel", "hc_mixes_finish_kernel"])):
        monkeypatch.setattr(mixes, "ONE_LAUNCH_ROWS", rows)
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
    invariant = dict(mixes.mixes_config(1, HC * 64), one_launch=False)
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


def check_add_expand(n: int, d: int, device: str) -> None:
    """`hc_add_expand` is torch's add then `hc_expand`, bit for bit, for every pairing of fp32 and bf16 outputs (bf16
    with bf16 sums to bf16, as torch does), and close to the DSL's reference."""
    h = gen(n, HC, d, device=device, seed=n)
    post = gen(n, HC, device=device, seed=5)
    comb = gen(n, HC, HC, device=device, seed=6).softmax(-1)
    for a_dtype, b_dtype in itertools.product((torch.float32, torch.bfloat16), repeat=2):
        a = gen(n, d, device=device, seed=7).to(a_dtype)
        b = gen(n, d, device=device, seed=8).to(b_dtype)
        got = hc_add_expand(a, b, h, post, comb)
        assert torch.equal(got, hc_expand(a + b, h, post, comb)), (a_dtype, b_dtype)
        want = ref.add_hc_expand(a.cpu(), b.cpu(), h.cpu(), post.cpu(), comb.cpu())
        assert want.dtype == torch.float32 and rel_l2(got, want) < 1e-6


@pytest.mark.parametrize("n,d", [(1, 64), (3, 40), (2, 1100)])
def test_hc_add_expand_is_the_add_and_expand_bitwise(n, d, device) -> None:
    check_add_expand(n, d, device)


def test_hc_add_expand_names_a_bad_operand(device) -> None:
    h, post, comb = gen(2, HC, 8, device=device), gen(2, HC, device=device), gen(2, HC, HC, device=device)
    with pytest.raises(ValueError, match="hc_add_expand's b must be contiguous float32/bfloat16 \\[2, 8\\]"):
        hc_add_expand(gen(2, 8, device=device), gen(2, 9, device=device), h, post, comb)


def update_mixes_both_ways(n: int, d: int, add: bool, dtypes: tuple[torch.dtype, torch.dtype], device: str,
                           config: dict | None, monkeypatch) -> list[torch.Tensor]:
    """`hc_update_mixes` against the stream update's own launch and `hc_mixes` of its streams: the same bits, as one
    launch and as two (`mixes.ONE_LAUNCH_ROWS` past n, then 0), the counters left at zero."""
    h, fn, scale, base = mix_inputs(n, d, device)
    post = gen(n, HC, device=device, seed=5)
    comb = gen(n, HC, HC, device=device, seed=6).softmax(-1)
    a = gen(n, d, device=device, seed=7).to(dtypes[0])
    b = gen(n, d, device=device, seed=8).to(dtypes[1]) if add else None
    streams = hc_add_expand(a, b, h, post, comb) if add else hc_expand(a, h, post, comb)
    kw = dict(iters=ITERS, eps=EPS, norm_eps=NORM_EPS, config=config)
    want = [streams, *hc_mixes(streams, fn, scale, base, **kw)]
    for rows, kernels in ((n, ["hc_update_mixes_kernel"]), (0, ["hc_update_mixes_partial_kernel",
                                                               "hc_mixes_finish_kernel"])):
        monkeypatch.setattr(mixes, "ONE_LAUNCH_ROWS", rows)
        calls = []
        with use_launcher(lambda c: (calls.append(c.name), jit_launch(c))):
            got = hc_update_mixes(a, b, h, post, comb, fn, scale, base, **kw)
        assert calls == kernels
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w), (rows, add, dtypes)
    assert not tickets.tile_counters(h.device, 1).any()
    return want


@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("n,d,config", [
    (1, 64, None),
    (3, 40, dict(block_M=16, block_K=64, split_k=2, num_warps=4, num_stages=2)),  # tiles across two streams
    (18, 48, dict(block_M=16, block_K=32, split_k=3, num_warps=4, num_stages=2)),
])
def test_hc_update_mixes_is_the_update_and_the_mixes_bitwise(n, d, config, add, device, monkeypatch) -> None:
    update_mixes_both_ways(n, d, add, (torch.float32, torch.float32), device, config, monkeypatch)


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_hc_update_mixes_sums_bf16_outputs_as_torch(dtypes, device, monkeypatch) -> None:
    update_mixes_both_ways(2, 40, True, dtypes, device, None, monkeypatch)


def test_hc_update_mixes_names_a_bad_operand(device) -> None:
    h, fn, scale, base = mix_inputs(2, 8, device)
    post, comb = gen(2, HC, device=device), gen(2, HC, HC, device=device)
    with pytest.raises(ValueError, match="hc_update_mixes's a must be contiguous float32/bfloat16 \\[2, 8\\]"):
        hc_update_mixes(gen(2, 9, device=device), None, h, post, comb, fn, scale, base, iters=ITERS, eps=EPS,
                        norm_eps=NORM_EPS)
    with pytest.raises(ValueError, match="hc_update_mixes needs contiguous float32 \\[24, 32\\]"):
        hc_update_mixes(gen(2, 8, device=device), None, h, post, comb, fn[:, :16], scale, base, iters=ITERS,
                        eps=EPS, norm_eps=NORM_EPS)


def planned(fused: bool, ops: tuple[str, ...]):
    """v41-tiny's (graph, plan, params) for sm90, fused by the pass pipeline or not, with kernels for `ops` alone
    (every other node runs its reference)."""
    from deepinfer.models import DeepseekV41Flash
    from dsl.passes import infer_shapes, run_passes, verify
    from graphs.passes import make_plan

    model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-tiny"))
    graph = run_passes(model.graph()) if fused else verify(infer_shapes(model.graph()))
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,))
    for node in plan.nodes:
        if node.op not in ops:
            node.template = None
    return graph, plan, model.params()


def test_fused_graph_updates_the_streams_as_the_unfused_one_bitwise() -> None:
    """v41-tiny through the executor: the fused graph (each MoE's add in the stream update, each update but the last
    inside the next mixes' first launch) with the hyper-connection kernels against the unfused one with the mixes and
    update kernels and torch's add, over a prefill and two one-token decode steps (the mixes in one launch): the same
    logits bit for bit."""
    from dsl.context import ForwardContext, SequenceState
    from graphs.executor import Executor

    fused_ops = ("hc_mixes", "hc_expand_mixes", "add_hc_expand_mixes", "add_hc_expand")
    runs = [planned(True, fused_ops), planned(False, ("hc_mixes", "hc_expand"))]
    ops = [n.op for n in runs[0][0].nodes]
    assert {op for op in ops if op.startswith(("add", "hc_expand", "hc_mixes"))} == set(fused_ops)
    assert {n.op for n in runs[0][1].kernel_nodes()} == set(fused_ops)
    executors = [Executor(graph, plan, params, "cpu") for graph, plan, params in runs]
    states = {e: [SequenceState()] for e in executors}
    calls = []
    for ids in ([1, 5, 9, 2, 7], [11], [12]):
        logits = []
        for executor in executors:
            ctx = ForwardContext(states[executor], [len(ids)])
            with use_launcher(lambda c: (calls.append(c.name), jit_launch(c))):
                logits.append(executor.run({"input_ids": torch.tensor(ids)}, ctx)["logits"])
            ctx.commit()
        assert torch.equal(logits[0], logits[1])
    assert {"hc_update_mixes_kernel", "hc_update_mixes_partial_kernel", "hc_mixes_kernel",
            "hc_add_expand_kernel"} <= set(calls)


def test_hc_empty_input(device) -> None:
    h = torch.empty(0, HC, 8, device=device)
    assert hc_expand(torch.empty(0, 8, device=device), h, torch.empty(0, HC, device=device),
                     torch.empty(0, HC, HC, device=device)).shape == (0, HC, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 7, 64, 513])
def test_hc_v41_shapes(n) -> None:
    check_mixes(n, HIDDEN, "cuda")
    check_collapse_expand(n, HIDDEN, "cuda")
    check_add_expand(n, HIDDEN, "cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16, 300])
@pytest.mark.parametrize("add", [False, True])
def test_hc_update_mixes_v41_shapes(n, add, monkeypatch) -> None:
    """V4.1's streams: the update inside the mixes' launch gives the bits of its own launch and the mixes' (the fused
    multiply-adds alike in both), one launch or two; the mixes close to the reference."""
    new, *mixes = update_mixes_both_ways(n, HIDDEN, add, (torch.float32, torch.float32), "cuda", None, monkeypatch)
    want = ref.hc_mixes(new.cpu(), *(a.cpu() for a in mix_inputs(n, HIDDEN, "cuda")[1:]), iters=ITERS, eps=EPS,
                        norm_eps=NORM_EPS)
    for g, w in zip(mixes, want, strict=True):
        assert rel_l2(g, w) < 2e-5


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 16])
def test_hc_mixes_one_launch_v41_shapes(n, monkeypatch) -> None:
    """V4.1's streams (split 64 ways): one launch gives the two launches' bits, close to the reference."""
    got = mixes_both_ways(n, HIDDEN, "cuda", None, monkeypatch)
    want = ref.hc_mixes(*(a.cpu() for a in mix_inputs(n, HIDDEN, "cuda")), iters=ITERS, eps=EPS, norm_eps=NORM_EPS)
    for g, w in zip(got, want, strict=True):
        assert rel_l2(g, w) < 2e-5
