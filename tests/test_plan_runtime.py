"""The plan runtime (graphs/plan_runtime.py) on a machine without a GPU: the plan's kernels launched as they are
(Triton's interpreter on CPU tensors; no cubins, no CUDA graphs), through `CompiledModel` as a GPU target's model
runs, against the cpu target; the sequences in the engine's paged pools, whose entries the cache kernels store and
load for each step. On the H200 the same path runs on the cubins: tests/test_gpu_*.py."""

from __future__ import annotations

import pytest
import torch

import dsl.cache
import kernels.cache.rows as cache_kernels
from deepinfer.default_model import trained_model
from deepinfer.models import DeepseekV41Flash
from dsl.cache import CacheSpec, PagedCache
from dsl.context import SequenceState
from dsl.passes import run_passes
from graphs.compiled_model import CompiledModel
from graphs.passes import make_plan
from graphs.plan_runtime import PlanRuntime
from tests.conftest import fixture_dir, rel_l2

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs where there is no GPU")


def planned_model(model: DeepseekV41Flash, drafting: bool = False) -> CompiledModel:
    """`model` planned for sm90 (fp32 products), run by the plan runtime on the CPU."""
    graphs = [run_passes(model.graph(dspark=drafting))] + ([run_passes(model.draft_graph())] if drafting else [])
    plans = [make_plan(g, model.params(), "sm90", buckets=(16,), dot_fp32=True) for g in graphs]
    draft = (graphs[1], plans[1]) if drafting else None
    runtime = PlanRuntime(graphs[0], plans[0], {}, {}, model.params(), draft=draft, device="cpu")
    return CompiledModel(model.config, graphs[0], "sm90", runtime, graphs[1] if drafting else None)


@pytest.mark.slow
def test_steps_in_pools_match_the_cpu_target(compiled_fixture, monkeypatch) -> None:
    model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-smooth"))
    planned, cpu = planned_model(model), compiled_fixture("v41-smooth")
    assert planned.device == torch.device("cpu") and not planned.runtime.cuda_graphs
    calls = []
    for name in ("store_rows", "load_rows"):
        kernel = getattr(cache_kernels, name)
        monkeypatch.setattr(cache_kernels, name, lambda *a, kernel=kernel, **k: calls.append(kernel) or kernel(*a, **k))
    cache = PagedCache(CacheSpec.from_graph(planned.graph), 2, 8, 16)
    pooled = [SequenceState(cache=cache, slot=i, block_table=[3 - i, 5 + i, 7 - 6 * i]) for i in range(2)]
    own = [SequenceState(), SequenceState()]
    gen = torch.Generator().manual_seed(0)
    for n, invariant in ((5, False), (1, True), (3, False), (1, True)):  # prefill chunks, then decodes
        feed = [torch.randint(4, 500, (n + i,), generator=gen).tolist() for i in range(2)]
        got = planned.step(list(zip(pooled, feed, strict=True)), all_logits=True, batch_invariant=invariant)
        want = cpu.step(list(zip(own, feed, strict=True)), all_logits=True)
        assert rel_l2(got.numpy(), want.numpy()) < 1e-4
        assert cache.writer is dsl.cache.store_rows and cache.reader is dsl.cache.load_rows  # the pools' own again
    assert planned.runtime.launcher is None and planned.runtime.executors()[0].kernel_calls > 0
    assert {k.__name__ for k in calls} == {"store_rows", "load_rows"}


def test_drafts_run_on_the_draft_plan_beside_the_main_one() -> None:
    """The draft graph's executor shares the main one's converted weights; its drafts are the cpu target's."""
    import deepinfer

    model = trained_model()
    cpu = deepinfer.compile(model, "cpu", drafting=True)
    planned = planned_model(model, drafting=True)
    state = cpu.new_sequence()
    cpu.step([(state, list(range(5, 45)))])
    block = [44, 3, 3, 3, 3]
    want_hidden, want = cpu.draft([(state, block)])
    hidden, got = planned.draft([(state, block)])
    assert rel_l2(got.numpy(), want.numpy()) < 1e-5 and torch.equal(got.argmax(-1), want.argmax(-1))
    assert rel_l2(hidden.numpy(), want_hidden.numpy()) < 1e-5 and state.num_tokens == 40
    main, draft = planned.runtime.executors()
    assert draft is not None and draft.formatted is main.formatted and draft.kernel_calls > 0
