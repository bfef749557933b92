"""Static steps (dsl/step.py) in the plan runtime on a machine without a GPU: a decode or verification step run as its
CUDA graphs would run it, over a bucket of rows whose cache ops read the step's layout from its tensors, gives the
eager path's logits bit for bit. The kernels run under Triton's interpreter, the segments padded without capture
(`CudaGraphs(capture=False)`); padding rows enter as NaN where a segment's inputs are padded, so a row that leaked
into a real one would show. On the GPU, tests/test_gpu_static_step.py replays the captured graphs."""

from __future__ import annotations

import pytest
import torch

import kernels.attention.paged_ops as paged
from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes
from dsl.step import StaticStep
from graphs.capture import CudaGraphs
from graphs.compiled_model import CompiledModel
from graphs.passes import make_plan
from graphs.plan_runtime import PlanRuntime
from tests.conftest import fixture_dir
from tests.schedules import Pools, Schedule, mixed

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs where there is no GPU"),
              pytest.mark.slow]


def planned(model: DeepseekV41Flash, dot_fp32: bool, padded: bool, drafting: bool = False) -> CompiledModel:
    """`model` planned for sm90 on the CPU: eager, or (`padded`) its forwards through the CUDA-graph segments
    uncaptured, static steps included; with `drafting`, its DSpark draft graph beside it."""
    graphs = [run_passes(model.graph(dspark=drafting))] + ([run_passes(model.draft_graph())] if drafting else [])
    plans = [make_plan(g, model.params(), "sm90", buckets=(16,), dot_fp32=dot_fp32) for g in graphs]
    draft = (graphs[1], plans[1]) if drafting else None
    runtime = PlanRuntime(graphs[0], plans[0], {}, {}, model.params(), draft=draft, device="cpu")
    if padded:
        for executor, graph in zip(runtime.executors(), graphs, strict=False):
            executor.cuda_graphs = CudaGraphs(graph, capture=False, pad=float("nan"), draws=executor.draws)
    return CompiledModel(model.config, graphs[0], "sm90", runtime, graphs[1] if drafting else None)


def spy(monkeypatch) -> dict[str, int]:
    """Counts of the static steps filled and of the static attention launches."""
    counts = {"fill": 0, "attention": 0}
    fill, attention = StaticStep.fill, paged.static_attention_op

    def counted_fill(self, ctx) -> None:
        counts["fill"] += 1
        fill(self, ctx)

    def counted_attention(*a, **k) -> torch.Tensor:
        counts["attention"] += 1
        return attention(*a, **k)
    monkeypatch.setattr(StaticStep, "fill", counted_fill)
    monkeypatch.setattr(paged, "static_attention_op", counted_attention)
    return counts


@pytest.mark.parametrize("name, dot_fp32, prefill", [("v41-tiny", True, False), ("v41-tiny-engram", False, True)])
def test_static_steps_give_the_eager_logits(name: str, dot_fp32: bool, prefill: bool, monkeypatch) -> None:
    model = DeepseekV41Flash.from_pretrained(fixture_dir(name))
    eager = planned(model, dot_fp32, padded=False)
    counts = spy(monkeypatch)
    want = mixed(Schedule(eager, Pools.make(eager)), prefill)
    assert counts == {"fill": 0, "attention": 0}
    static = planned(model, dot_fp32, padded=True)
    schedule = Schedule(static, Pools.make(static))
    got = mixed(schedule, prefill)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {i}: static logits differ from the eager ones"
    assert counts["fill"] == schedule.num_fitting == len(got) - 2 * prefill  # every step but the prefill chunks
    assert counts["attention"] == counts["fill"] * model.config.num_hidden_layers  # every layer's, in place


def test_a_static_step_draws_each_chunks_next_token_in_its_graph() -> None:
    """A static step asked for draws (dsl.context.Draws) draws the token after each chunk inside its segments, as
    `sample_plain` draws it from the step's logits (greedy and sampled chunks, chunks of 1 to 3 tokens); a step that
    runs eagerly leaves them to the caller."""
    from deepinfer.sampler import plain_args, sample_plain
    from dsl.context import Draws, SequenceState

    model = DeepseekV41Flash.from_pretrained(fixture_dir("v41-tiny"))
    for padded in (True, False):
        compiled = planned(model, dot_fp32=True, padded=padded)
        pools = Pools.make(compiled)
        states = [SequenceState(cache=pools.cache, slot=pools.free_slots.pop()) for _ in range(3)]
        for state in states:
            state.block_table = [pools.free_blocks.pop() for _ in range(2)]
        gen = torch.Generator().manual_seed(1)
        for lengths, temperatures in (([2, 3, 1], [0.0, 0.7, 1.3]), ([1, 1, 1], [0.9, 0.0, 0.5])):
            batch = [(s, torch.randint(4, 500, (n,), generator=gen).tolist()) for s, n in zip(states, lengths)]
            positions = [s.num_tokens + n for s, n in zip(states, lengths, strict=True)]
            seeds = [11, 2**64 - 5, 7]
            draws = Draws(*plain_args(temperatures, seeds))
            logits = compiled.step(batch, all_logits=True, draws=draws)
            last = torch.tensor(lengths).cumsum(0) - 1
            want = sample_plain(logits[last], temperatures, seeds, positions)
            if padded:
                assert draws.tokens is not None and torch.equal(draws.tokens, want)
            else:
                assert draws.tokens is None


def test_static_draft_passes_give_the_eager_ones(monkeypatch) -> None:
    """DSpark's draft pass as a static step (blocks of 5 tokens, past the rings' spare positions: it stores nothing)
    gives the eager pass's hidden states and logits bit for bit, both reading the window rings in place
    (`block_attention_kernel`; tests/kernels/attention/test_block_attention.py checks it against the reference),
    with sequences joining and leaving between the passes."""
    from deepinfer.default_model import TRAINED_CHECKPOINT
    from kernels.attention import block_attention

    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)

    def run(padded: bool) -> list[torch.Tensor]:
        compiled = planned(model, False, padded, drafting=True)
        s, out = Schedule(compiled, Pools.make(compiled)), []
        s.join("a")
        s.join("b")
        s.step({"a": 9, "b": 6}, batch_invariant=True)
        out += s.draft(["a", "b"], batch_invariant=True)
        s.step({"a": 4, "b": 1}, batch_invariant=False)
        out += s.draft(["b", "a"], batch_invariant=False)
        s.leave("b")
        s.join("c")
        s.step({"c": 3, "a": 1}, batch_invariant=True)
        out += s.draft(["a", "c"], batch_invariant=True)
        return out

    launches = []
    block = block_attention.block_attention
    monkeypatch.setattr(block_attention, "block_attention", lambda *a, **k: launches.append(1) or block(*a, **k))
    eager = run(False)
    assert len(launches) == 3 * 3  # each draft pass's three draft layers, in place
    static = run(True)
    assert len(launches) == 2 * 3 * 3
    for i, (got, want) in enumerate(zip(static, eager, strict=True)):
        assert torch.equal(got, want), f"output {i}: the static draft pass differs from the eager one"
