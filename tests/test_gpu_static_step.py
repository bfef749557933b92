"""Static steps captured as CUDA graphs on the sm90 target, on the GPU (dsl/step.py, graphs/capture.py): decode and
verification steps captured whole (cache ops, compressor, indexer and attention included), their layout read from the
step's tensors, give the logits of the same steps run eagerly (CUDA graphs off, `DEEPINFER_CUDA_GRAPHS=0`) bit for
bit, in batch-invariant mode and with the buckets' own configs: across the window (128) and the pools' blocks, with
sequences joining, finishing, preempted and recomputed, drafts verified and taken back, and DSpark's draft pass
(captured whole too)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.default_model import trained_model
from dsl.step import StaticStep
from tests.schedules import SPARE, Pools, Schedule, mixed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def compiled():
    import deepinfer

    return deepinfer.compile(trained_model(), target="sm90", drafting=True)


def crossing(s: Schedule, batch_invariant: bool | None) -> list[torch.Tensor]:
    """Steps over the window's edge (positions 120 .. 150) and many blocks: prompts, decode and verification steps
    (drafts taken back), a sequence joining beside them, one finishing, one preempted and recomputed, a DSpark draft
    pass after each step (its hidden states and logits returned too). `batch_invariant` None alternates."""
    out = []

    def step(chunks: dict[str, int]) -> None:
        invariant = len(out) % 2 == 1 if batch_invariant is None else batch_invariant
        out.append(s.step(chunks, batch_invariant=invariant))
        out.extend(s.draft(list(chunks), batch_invariant=invariant))

    s.join("a")
    s.join("b")
    step({"a": 120, "b": 37})
    for i in range(8):
        step({"a": SPARE + 1, "b": 1 + i % 2})
        s.take_back("a", 1 + i % SPARE)
    s.join("c")
    step({"a": 1, "b": 1, "c": 9})
    s.leave("b")
    for _ in range(4):
        step({"c": 2, "a": 1})
    s.leave("a")  # preempted
    step({"c": 1})
    s.join("a")
    step({"a": len(s.tokens["a"]), "c": 4})  # recomputed
    s.take_back("c", 3)
    for _ in range(4):
        step({"a": 1, "c": 1})
    return out


def run(compiled, graphs: bool, schedule, batch_invariant: bool | None) -> tuple[list[torch.Tensor], int, int]:
    """The schedule's outputs with CUDA graphs on or off, how many static steps ran, and how many of its steps fit
    one (the draft passes' blocks of 5 tokens are past a verification step's SPARE + 1)."""
    compiled.runtime.cuda_graphs = graphs  # drops what was captured before
    fills = []
    fill = StaticStep.fill
    StaticStep.fill = lambda self, ctx: fills.append(1) or fill(self, ctx)
    try:
        s = Schedule(compiled, Pools.make(compiled, slots=4, blocks=96, device="cuda"))
        out = schedule(s, batch_invariant) if schedule is crossing else schedule(s)
    finally:
        StaticStep.fill = fill
    return [t.clone() for t in out], len(fills), s.num_fitting


@pytest.mark.parametrize("batch_invariant", [True, False, None])
def test_gpu_captured_static_steps_give_the_eager_logits(compiled, batch_invariant: bool | None) -> None:
    want, eager_fills, _ = run(compiled, False, crossing, batch_invariant)
    got, fills, fitting = run(compiled, True, crossing, batch_invariant)
    # 17 fitting steps and every draft pass (one after each of the 20 steps: its blocks store nothing, so they fit)
    assert eager_fills == 0 and fitting == 17 and fills == fitting + len(got) // 3
    graphs = compiled.runtime.executors()[0].cuda_graphs
    assert graphs.broken == set() and graphs.replays > 0
    drafts = compiled.runtime.executors()[1].cuda_graphs
    assert drafts.broken == set() and drafts.replays > 0
    static = graphs.splits[True].segments
    assert any(compiled.graph.nodes[i].op == "kv_window_append" for s in static for i in range(s.start, s.stop))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"output {i}: captured differs from eager"


def test_gpu_captured_short_steps_give_the_eager_logits(compiled) -> None:
    """The CPU test's schedule (tests/test_static_step.py), on the cubins: short chunks, blocks of 8."""
    want, _, _ = run(compiled, False, mixed, None)
    got, fills, _ = run(compiled, True, mixed, None)
    assert fills == 8
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(g, w), f"step {i}: captured differs from eager"


def test_gpu_engine_draws_inside_the_graph_and_feeds_the_next_step(monkeypatch) -> None:
    """The engine's plain decode steps draw their tokens inside the captured static step and feed them to the next step
    on the device, the host not waiting between steps: the same tokens as with CUDA graphs off (every draw launched
    after the forward) and as without asynchronous scheduling (every step's tokens waited for); greedy and sampled
    requests side by side."""
    from deepinfer.engine.sampler import Sampler
    from deepinfer.llm import LLM
    from deepinfer.sampling_params import SamplingParams

    prompts = ["def fib(n):\n", "import os\n", "class A:\n"]
    params = [SamplingParams(max_tokens=40, temperature=t, seed=3 + i, ignore_eos=True)
              for i, t in enumerate((0.0, 0.8, 1.2))]
    calls = []
    draw = Sampler.draw
    monkeypatch.setattr(Sampler, "draw", lambda self, *a: calls.append(1) or draw(self, *a))
    outputs, launched = {}, {}
    for graphs, overlap in ((True, True), (False, True), (True, False)):
        monkeypatch.setenv("DEEPINFER_CUDA_GRAPHS", "1" if graphs else "0")
        calls.clear()
        llm = LLM(trained_model(), target="sm90", async_scheduling=overlap)
        outputs[graphs, overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        launched[graphs, overlap] = len(calls)
    assert outputs[True, True] == outputs[False, True] == outputs[True, False]
    assert launched[False, True] >= 40 and launched[True, True] <= 2  # the prompts' step draws after its forward
