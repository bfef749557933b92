"""CUDA-graph replays on the sm90 target (graphs/capture.py), on the GPU: the logits of steps that replay captured
segments, padded to their token count's bucket, are bitwise those of the same steps run eagerly and unpadded, with
batch-invariant configs and with the buckets' own (a bucket's config is the same padded or not, and no op in a
segment lets a row's result depend on how many rows there are), every segment captures (no op syncs with the host
inside one), and logits a step returned are not overwritten by the next step's replays."""

from __future__ import annotations

import pytest
import torch

from dsl.context import SequenceState
from deepinfer.default_model import TRAINED_CHECKPOINT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def sm90_models():
    import deepinfer
    from deepinfer.models import DeepseekV41Flash

    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT)  # every kind of layer, Engram; ships its tokenizer
    eager = deepinfer.compile(model, target="sm90")
    eager.runtime.cuda_graphs = False
    graphs = deepinfer.compile(model, target="sm90")
    graphs.runtime.cuda_graphs = True
    return eager, graphs


def feeds() -> list[list[list[int]]]:
    """Per step, each sequence's tokens: three prompts, decode steps of 3 tokens (warm-up, capture, replays), a fourth
    sequence joining with its prompt (a prefill step beside decodes), then decode steps of 4."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (n,), generator=gen).tolist() for n in (37, 5, 130)]
    steps = [prompts] + [[[int(t)] for t in torch.randint(4, 500, (3,), generator=gen)] for _ in range(6)]
    steps.append([[7], [8], [9], torch.randint(4, 500, (20,), generator=gen).tolist()])
    steps += [[[int(t)] for t in torch.randint(4, 500, (4,), generator=gen)] for _ in range(5)]
    return steps


def run(model, batch_invariant: bool) -> list[torch.Tensor]:
    states: list[SequenceState] = []
    out = []
    for feed in feeds():
        states += [model.new_sequence() for _ in range(len(feed) - len(states))]
        out.append(model.step(list(zip(states, feed, strict=True)), all_logits=True, batch_invariant=batch_invariant))
    return out


def test_replayed_steps_give_the_eager_logits_bitwise(sm90_models) -> None:
    eager, graphs = sm90_models
    expected = run(eager, batch_invariant=True)
    got = run(graphs, batch_invariant=True)
    captured = graphs.runtime.executors()[0].cuda_graphs
    assert captured.broken == set(), "some segments could not be captured"
    # 3 and 4 tokens a step share the bucket of 4: captured at 3 (padded), replayed at 3 and at 4; the prefills
    # (172 and 23 tokens) run their buckets' first, eager forwards
    assert captured.captures == len(captured.segments)
    assert captured.replays == 9 * len(captured.segments)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert torch.equal(a, b), f"step {i}"


def test_replays_match_eager_with_the_tuned_configs(sm90_models) -> None:
    """Bitwise too: a tolerance hid torch's reductions (Engram's gate, before its kernel), whose last bits followed
    the padded row count and, through a flipped top-k pick, moved later steps' logits by 1.7e-2."""
    eager, graphs = sm90_models
    graphs.runtime.cuda_graphs = True  # drop the previous test's graphs
    for i, (a, b) in enumerate(zip(run(graphs, False), run(eager, False), strict=True)):
        assert torch.equal(a, b), f"step {i}: {(a - b).abs().max()}"


def test_returned_logits_survive_the_next_replay(sm90_models) -> None:
    _, graphs = sm90_models
    graphs.runtime.cuda_graphs = True
    states = [graphs.new_sequence() for _ in range(2)]
    graphs.step([(states[0], [5, 6, 7]), (states[1], [9])])
    kept = []
    for t in range(5):
        logits = graphs.step([(states[0], [10 + t]), (states[1], [20 + t])])
        kept.append((logits, logits.clone()))
    assert graphs.runtime.executors()[0].cuda_graphs.replays > 0
    for logits, copy in kept:
        assert torch.equal(logits, copy)


def test_decode_buckets_captured_ahead_replay_from_their_first_step(sm90_models) -> None:
    """With decode steps of up to 8 tokens captured ahead, the first capture (the feed's second step of 3 tokens,
    bucket 4) captures buckets 8, 4, 2 and 1 in one pool, largest first, on zeros: the feed's logits stay the eager
    ones bitwise, and steps of 8 and 2 tokens met for the first time replay at once."""
    eager, graphs = sm90_models
    graphs.runtime.cuda_graphs = True
    graphs.capture_ahead(8)
    try:
        expected, got = run(eager, batch_invariant=True), run(graphs, batch_invariant=True)
        captured = graphs.runtime.executors()[0].cuda_graphs
        assert captured.broken == set()
        assert captured.captures == 4 * len(captured.segments)
        assert sorted(rows for rows, *_ in captured.steps) == [1, 2, 4, 8]
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert torch.equal(a, b), f"step {i}"
        replays = captured.replays
        steps = [[[5, 6, 7, 8, 9], [11, 12, 13]], [[14], [15]]]  # 8 tokens, then 2: buckets never met before
        pairs = [[m.new_sequence() for _ in range(2)] for m in (graphs, eager)]
        for feed in steps:
            a, b = (m.step(list(zip(s, feed, strict=True)), all_logits=True, batch_invariant=True)
                    for m, s in zip((graphs, eager), pairs, strict=True))
            assert torch.equal(a, b)
        assert captured.replays == replays + 2 * len(captured.segments)
    finally:
        graphs.capture_ahead(0)
