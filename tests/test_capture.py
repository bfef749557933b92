"""CUDA-graph capture (graphs/capture.py): which nodes form the captured segments, and whether a segment's inputs and
outputs are exactly what the rest of the forward exchanges with it.

The second part needs no GPU: it runs the model with every segment isolated as a replay would be (its nodes see the
weights and its listed inputs only, and only its listed outputs leave it) and checks the logits are the plain run's.
A missed input is a KeyError, a missed output a KeyError downstream. On a GPU, tests/test_gpu_cuda_graphs.py checks
the replays themselves."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from deepinfer.default_model import TRAINED_CHECKPOINT
from deepinfer.models import DeepseekV41Flash
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.ops import OPS
from dsl.passes import run_passes
from graphs.capture import CONTEXT_TENSORS, _StaticContext, capturable, find_segments
from tests.conftest import fixture_dir

CACHE_OPS = {"kv_window_append", "kv_window_store", "kv_window_block", "cache_append", "sparse_attention",
             "compress_pool", "index_scores", "candidate_blocks", "select_rows", "engram_ngrams"}


def graphs(name: str, drafting: bool):
    model = DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT if name == "trained" else fixture_dir(name))
    graph = run_passes(model.graph(dspark=drafting))
    return model, [graph, run_passes(model.draft_graph())] if drafting else [graph]


@pytest.mark.parametrize("name,drafting", [("v41-smooth", False), ("v41-smooth-engram", False), ("trained", True)])
def test_segments_hold_no_cache_op_and_most_nodes(name: str, drafting: bool) -> None:
    _, found = graphs(name, drafting)
    for graph in found:
        segments = find_segments(graph)
        inside = {i for s in segments for i in range(s.start, s.stop)}
        assert all(capturable(graph, i) for i in inside)
        assert not {graph.nodes[i].op for i in inside} & CACHE_OPS
        assert all(s.stop - s.start >= 2 for s in segments)
        assert all(a.stop <= b.start for a, b in pairwise(segments))
        # a capturable node outside every segment is alone: a run of one, between nodes that touch the caches
        for i in range(len(graph.nodes)):
            if i not in inside and capturable(graph, i):
                assert not any(0 <= j < len(graph.nodes) and capturable(graph, j) for j in (i - 1, i + 1))
        assert len(inside) > 0.6 * len(graph.nodes)


def run_isolated(graph, params: dict, ids: torch.Tensor, ctx: ForwardContext) -> dict:
    """The graph's outputs with each segment run as a replay sees the forward: its inputs, the weights and the
    per-token context tensor only; of what it makes, its outputs only."""
    env = {v: ids for v in graph.inputs.values()} | {v: params[n] for n, v in graph.params.items()}
    weights = {v: params[n] for n, v in graph.params.items()}
    segments = {s.start: s for s in find_segments(graph)}
    index = 0
    while index < len(graph.nodes):
        segment = segments.get(index)
        stop = segment.stop if segment else index + 1
        local = (weights | {v: env[v] for v in segment.inputs}) if segment else env
        seen = _StaticContext(ctx.positions.clone()) if segment else ctx
        for node in graph.nodes[index:stop]:
            opdef = OPS[node.op]
            assert not segment or not opdef.uses_context or node.op in CONTEXT_TENSORS
            kwargs = dict(node.attrs, ctx=seen) if opdef.uses_context else node.attrs
            result = opdef.reference(*[None if v is None else local[v] for v in node.inputs], **kwargs)
            local.update(zip(node.outputs, result if opdef.num_outputs > 1 else (result,), strict=True))
        if segment:
            env.update({v: local[v] for v in segment.outputs})
        index = stop
    return {name: env[v] for name, v in graph.outputs.items()}


@pytest.mark.parametrize("name", ["v41-smooth", "v41-smooth-engram"])
def test_isolated_segments_give_the_plain_forward(name: str) -> None:
    model, (graph,) = graphs(name, False)
    params = {k: v.float() if v.is_floating_point() and v.dtype != torch.float8_e4m3fn else v
              for k, v in model.params().items()}
    plain, isolated = [SequenceState(), SequenceState()], [SequenceState(), SequenceState()]
    feeds = [[[5, 9, 13, 2, 7], [11, 3]], [[4], [8]], [[6], [1]]]  # a prefill, then two decode steps
    for feed in feeds:
        for states, run in ((plain, interpret), (isolated, run_isolated)):
            ctx = ForwardContext(states, [len(f) for f in feed])
            ids = torch.tensor([t for f in feed for t in f])
            if run is interpret:
                out = interpret(graph, {"input_ids": ids}, params, ctx)
            else:
                out = run_isolated(graph, params, ids, ctx)
            ctx.commit()
            if run is interpret:
                expected = out["logits"]
        assert torch.equal(out["logits"], expected)


def test_the_least_recently_used_token_counts_make_room() -> None:
    """Eviction by count and by the device memory the captures took (no GPU needed: the records alone)."""
    from graphs.capture import CapturedStep, CudaGraphs

    _, (graph,) = graphs("v41-smooth", False)
    keep = CudaGraphs(graph, max_steps=3, max_bytes=100)
    for n, size in ((1, 10), (2, 20), (3, 30)):
        keep.steps[(n, False)] = CapturedStep(pool=(0, n), bytes=size)
    keep.steps.move_to_end((1, False))  # token count 1 used last
    keep.evict()  # three kept: the oldest, token count 2, goes
    assert list(keep.steps) == [(3, False), (1, False)]
    keep.steps[(4, False)] = CapturedStep(pool=(0, 4), bytes=70)  # 110 bytes held: over the budget
    keep.evict()
    assert list(keep.steps) == [(1, False), (4, False)]
    keep.evict()  # 80 bytes, two kept: nothing to drop
    assert list(keep.steps) == [(1, False), (4, False)]
