"""Bounded replay on a GPU target's plan runtime (graphs/executor.py: the nodes after `decoder_context` run in its
view, eagerly where it drops rows), on a machine without a GPU: the plan's kernels under Triton's interpreter. Keeping
the whole prompt gives bit for bit the plan's exact forward; a truncated replay gives the cpu target's replay (the
same rows kept, the same windows cut) within the kernels' rounding; a step whose rows all lie before the boundary
computes none of the decoder layers. On the H200: tests/test_gpu_targets.py's replay test."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.models import DeepseekV41Flash
from dsl.cache import CacheSpec, PagedCache
from dsl.context import SequenceState
from dsl.passes import run_passes
from graphs.compiled_model import CompiledModel
from graphs.passes import make_plan
from graphs.plan_runtime import PlanRuntime
from tests.conftest import fixture_dir, rel_l2

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs where there is no GPU")

NAME = "v41-smooth"


def planned(model: DeepseekV41Flash, replay: bool) -> CompiledModel:
    """`model` planned for sm90 (fp32 products), bounded replay's graph or the exact one, on the CPU."""
    graph = run_passes(model.graph(replay=replay))
    plan = make_plan(graph, model.params(), "sm90", buckets=(16,), dot_fp32=True)
    return CompiledModel(model.config, graph, "sm90", PlanRuntime(graph, plan, {}, {}, model.params(), device="cpu"))


@pytest.fixture(scope="module")
def model() -> DeepseekV41Flash:
    return DeepseekV41Flash.from_pretrained(fixture_dir(NAME))


def run(compiled: CompiledModel, prompts: list[list[int]], keeps: list[int], chunk: int, decode: int,
        pooled: bool) -> torch.Tensor:
    """Every logit row of each sequence's prefill in chunks of `chunk` tokens (replayed from its last `keeps[i]`),
    then `decode` decode steps, the sequences in paged pools (`pooled`) or in tensors of their own."""
    cache = PagedCache(CacheSpec.from_graph(compiled.graph), len(prompts), 8 * len(prompts), 16) if pooled else None
    states = [SequenceState(cache=cache, slot=i, block_table=list(range(8 * i, 8 * i + 8))) if pooled
              else SequenceState() for i in range(len(prompts))]
    for state, ids, keep in zip(states, prompts, keeps, strict=True):
        state.replay_from = max(0, len(ids) - keep)
    out, start = [], 0
    while start < max(map(len, prompts)):
        batch = [(s, ids[start:start + chunk]) for s, ids in zip(states, prompts, strict=True) if start < len(ids)]
        out.append(compiled.step(batch, all_logits=True, batch_invariant=True))
        start += chunk
    for step in range(decode):
        out.append(compiled.step([(s, [7 + step]) for s in states], all_logits=True, batch_invariant=True))
    return torch.cat(out)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (18, 16)]


@pytest.mark.slow
def test_the_plans_replay_is_exact_keeping_every_token_and_the_cpu_targets_replay_truncated(
        model: DeepseekV41Flash) -> None:
    ids, replay = prompts(), planned(model, True)
    exact = run(planned(model, False), ids, [64, 64], 9, 2, pooled=True)
    assert torch.equal(run(replay, ids, [64, 64], 9, 2, pooled=True), exact)
    keeps = [8, 6]  # both replay from 10: the first chunk's rows all lie before it
    got = run(replay, ids, keeps, 9, 2, pooled=True)
    want = run(deepinfer.compile(model, target="cpu", replay=True), ids, keeps, 9, 2, pooled=False)
    kept = ~torch.isnan(want[:, 0])
    assert torch.equal(kept, ~torch.isnan(got[:, 0]))  # the same rows not computed (NaN)
    assert not kept[:18].any() and kept[18:].any()  # the first step computed no decoder row
    assert rel_l2(got[kept].numpy(), want[kept].numpy()) < 1e-4
    assert rel_l2(got[kept].numpy(), exact[kept].numpy()) > 1e-4  # the replay did cut something
