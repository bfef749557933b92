"""DSpark drafting on the sm90 target: the draft graph planned and built beside the model's (on any machine), saved in
the artifact and read back; on the H200, drafting is lossless against decoding without it (greedy and seeded, in
batch-invariant mode) and its drafts are accepted."""

from __future__ import annotations

import json

import pytest
import torch

import deepinfer
from deepinfer import LLM, SamplingParams
from deepinfer.default_model import trained_model
from graphs import artifact
from tests.test_dspark import check_lossless_and_accepts
from tests.test_gpu_targets import run_python

DRAFTING = {"method": "dspark", "num_speculative_tokens": 5}


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter runs on CPU tensors; on a GPU "
                    "test_drafting_on_sm90_is_lossless_and_accepts covers the drafts")
def test_the_draft_plan_matches_the_cpu_drafts_under_the_interpreter() -> None:
    """The draft graph through the sm90 plan (fp32 products; on a CPU its Triton kernels run under the interpreter),
    the blocks' attention (every query over its block's whole view) on the attention kernel, against the cpu
    target's draft pass."""
    from dsl.context import ForwardContext
    from dsl.passes import run_passes
    from graphs.executor import Executor
    from graphs.passes import make_plan

    model = trained_model()
    cpu = deepinfer.compile(model, "cpu", drafting=True)
    graph = run_passes(model.draft_graph())
    plan = make_plan(graph, model.params(), "sm90", dot_fp32=True)
    state = cpu.new_sequence()
    cpu.step([(state, list(range(5, 45)))])
    block = [44, 3, 3, 3, 3]
    _, expected = cpu.draft([(state, block)])
    got = Executor(graph, plan, cpu.params, "cpu").run({"input_ids": torch.tensor(block)},
                                                       ForwardContext([state], [len(block)]))["logits"]
    assert float((got - expected).norm() / expected.norm()) < 1e-5
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


BUILD = """
import deepinfer
from deepinfer.default_model import trained_model
model = trained_model()
deepinfer.compile(model, "sm90", buckets=(16,), drafting=True).save({out!r})
deepinfer.compile(model, "sm90", buckets=(16,)).save({plain!r})
"""


def test_a_drafting_artifact_holds_the_draft_plan(tmp_path) -> None:
    """Built for real (a fresh process, no interpreter, an empty cubin cache), then read back here."""
    out, plain = tmp_path / "drafting", tmp_path / "plain"
    run_python(BUILD.format(out=str(out), plain=str(plain)), CUDA_VISIBLE_DEVICES="",
               DEEPINFER_CACHE=str(tmp_path / "cache"))
    assert json.loads((out / "manifest.json").read_text())["drafting"] is True
    _, plan, _, _, draft_plan = artifact.read(out)
    assert draft_plan is not None and draft_plan.kernel_nodes()
    assert all(n.template for n in draft_plan.nodes if n.op == "sparse_attention")  # the blocks: the kernel
    model = trained_model()
    loaded = deepinfer.load(out, model)  # rebuilds both graphs and checks the plans against them
    assert loaded.draft_graph is not None and len(loaded.draft_graph.nodes) == len(draft_plan.nodes)
    assert loaded.runtime.plan.to_json() == plan.to_json()
    assert artifact.read(plain)[4] is None
    assert deepinfer.load(plain, model).draft_graph is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("params", [SamplingParams(max_tokens=24, temperature=0),
                                    SamplingParams(max_tokens=24, temperature=0.7, top_p=0.95, seed=1)],
                         ids=["greedy", "seeded"])
def test_drafting_on_sm90_is_lossless_and_accepts(params: SamplingParams) -> None:
    model = trained_model()
    off = LLM(model, target="sm90", max_num_seqs=4)
    on = LLM(model, target="sm90", max_num_seqs=4, speculative_config=DRAFTING)
    check_lossless_and_accepts(off, on, params)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_greedy_drafts_replay_what_they_compute_eagerly() -> None:
    """The greedy proposer's CUDA graph (captured at a shape's second call) gives the eager loop's drafts and
    confidences bitwise, for new inputs at every call; another shape gets its own graph."""
    from deepinfer.dspark import DraftHead
    from deepinfer.engine.spec_decode.greedy_drafts import GreedyDrafts

    model = trained_model()
    head = DraftHead(model.params(), model.config, device="cuda")
    greedy = GreedyDrafts(head)
    gen = torch.Generator(device="cuda").manual_seed(0)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    for rows in (3, 3, 3, 3, 1, 1, 1):
        h = torch.randn(rows, 5, hidden, device="cuda", generator=gen)
        logits = torch.randn(rows, 5, vocab, device="cuda", generator=gen)
        previous = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
        picks, confidences = greedy(h, logits, previous)
        expected = greedy.run(h, logits, previous)
        assert torch.equal(picks, expected[0]) and torch.equal(confidences, expected[1])
    assert len(greedy.graphs) == 2
