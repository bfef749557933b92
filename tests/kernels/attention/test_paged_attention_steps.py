"""In-place decode attention in the plan runtime: a planned model's steps over paged pools give the same logits,
within a tolerance, whether attention reads the caches in place (decode and verification steps) or gathers them
first (the two kernels sum in different orders), and bit for bit with CUDA graphs and without. On the CPU the plan's
kernels run under Triton's interpreter; on the GPU the compiled cubins, eager and captured."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.paged_ops as paged
import kernels.indexer.index_scores as scores
from deepinfer.default_model import trained_model
from dsl.cache import CacheSpec, PagedCache
from dsl.context import SequenceState
from dsl.passes import run_passes
from graphs.compiled_model import CompiledModel
from graphs.passes import make_plan
from graphs.plan_runtime import PlanRuntime
from kernels.attention.paged_attention import supports
from tests.kernels.cases import rel_l2

SPARE = 3  # drafts a verification step may take back: its chunks hold up to SPARE + 1 tokens
LOGIT_TOLERANCE = 1e-2  # relative L2 of a step's logits, in place against gathered
IN_PLACE_MARGIN = 1.25  # on the GPU: in place's distance from fp32 logits, over the gathered path's (H100: <= 1.12)


def planned(model, dot_fp32: bool) -> CompiledModel:
    """`model` planned for sm90, run by the plan runtime on the CPU (kernels under the interpreter)."""
    graph = run_passes(model.graph())
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,), dot_fp32=dot_fp32)
    return CompiledModel(model.config, graph, "sm90", PlanRuntime(graph, plan, {}, {}, model.params(), device="cpu"),
                         None)


def run_steps(compiled: CompiledModel, steps: list[tuple[list[int], bool]], device: str) -> list[torch.Tensor]:
    """Logits of every token of each step (chunk lengths per sequence, batch-invariant or not) over two fresh
    sequences in pools with scattered block tables; the same token ids every call."""
    cache = PagedCache(CacheSpec.from_graph(compiled.graph, spare=SPARE), 3, 24, 16, device=device)
    states = [SequenceState(cache=cache, slot=2 - i, block_table=[2 * (5 * j % 12) + i for j in range(12)])
              for i in range(2)]
    gen = torch.Generator().manual_seed(0)
    out = []
    for lengths, invariant in steps:
        feed = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in lengths]
        out.append(compiled.step(list(zip(states, feed, strict=True)), all_logits=True, batch_invariant=invariant))
    return out


def in_place_calls(monkeypatch) -> list[int]:
    """Turn the in-place kernel on (DEEPINFER_PAGED_ATTENTION=1) and count its calls (one a layer and step that
    takes it)."""
    monkeypatch.setattr(paged, "IN_PLACE", True)
    calls, kernel = [], paged.paged_attention
    monkeypatch.setattr(paged, "paged_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    return calls


STEPS = [([5, 3], False), ([1, 1], True), ([4, 2], True), ([1, 1], False)]  # prefill, decode, verification, decode


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs where there is no GPU")
@pytest.mark.slow
def test_steps_read_the_caches_in_place_as_they_gather_them(monkeypatch) -> None:
    compiled = planned(trained_model(), dot_fp32=False)
    calls = in_place_calls(monkeypatch)
    got = run_steps(compiled, STEPS, "cpu")
    layers = compiled.config.num_hidden_layers
    # every layer of every step: the decode and verification steps whole, the first step's chunk of 3 tokens from
    # the ring and its chunk of 5 (past the ring's spare positions + 1) from its window's snapshot: two launches
    assert len(calls) == 5 * layers
    monkeypatch.setattr(paged, "IN_PLACE", False)  # DEEPINFER_PAGED_ATTENTION=0: the gathered path
    want = run_steps(compiled, STEPS, "cpu")
    assert len(calls) == 5 * layers
    for g, w in zip(got, want, strict=True):
        assert rel_l2(g, w) < LOGIT_TOLERANCE


@pytest.mark.gpu
def test_gpu_steps_in_place_eager_and_captured_are_the_gathered_path(monkeypatch) -> None:
    """Steps that cross the window (128) and the pools' blocks: in place, with CUDA graphs and without, bitwise the
    same; against the cpu target's fp32 logits, in place as close as the attention gathered (both compute in bf16
    and sum in other orders: 1-5% from fp32 on this model, up to 1.3% from each other)."""
    import deepinfer

    model = trained_model()
    compiled = deepinfer.compile(model, "sm90")
    steps = [([140, 20], True)] + [([1, 1], True)] * 3 + [([4, 3], True), ([1, 2], True)] + [([1, 1], True)] * 8
    calls = in_place_calls(monkeypatch)
    captured = run_steps(compiled, steps, "cuda")
    assert calls
    compiled.runtime.cuda_graphs = False
    eager = run_steps(compiled, steps, "cuda")
    monkeypatch.setattr(paged, "IN_PLACE", False)  # DEEPINFER_PAGED_ATTENTION=0: the gathered path
    # the indexer's scores still in place: read in place they sum in another order too, and on this model's relu
    # scores (many near 0) a rounding swaps picks often enough that the logits drift 2-5% over the steps
    monkeypatch.setattr(scores, "reads_in_place",
                        lambda keys, dim: supports(dim) and getattr(keys, "paged", None) is not None)
    gathered = run_steps(compiled, steps, "cuda")
    reference = run_steps(deepinfer.compile(model, "cpu"), steps, "cpu")
    for step, (c, e, g, r) in enumerate(zip(captured, eager, gathered, reference, strict=True)):
        assert torch.equal(c, e), f"step {step}: captured and eager differ by {(c - e).abs().max():.3g}"
        near, far = rel_l2(e.float().cpu(), r), rel_l2(g.float().cpu(), r)
        assert near < IN_PLACE_MARGIN * far and rel_l2(e, g) < 2 * LOGIT_TOLERANCE, (
            f"step {step}: from fp32, in place {near:.3g}, gathered {far:.3g}; from each other {rel_l2(e, g):.3g}")
