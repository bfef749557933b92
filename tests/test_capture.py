"""CUDA-graph capture (graphs/capture.py): which nodes form the captured segments, and whether a segment's inputs and
outputs are exactly what the rest of the forward exchanges with it.

The second part needs no GPU: it runs the model with every segment isolated as a replay would be (its nodes see the
weights and its listed inputs only, and only its listed outputs leave it) and checks the logits are the plain run's.
A missed input is a KeyError, a missed output a KeyError downstream. On a GPU, tests/test_gpu_cuda_graphs.py checks
the replays themselves."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import pytest
import torch

from deepinfer.default_model import TRAINED_CHECKPOINT
from deepinfer.models import DeepseekV41Flash
from dsl.context import ForwardContext, SequenceState
from dsl.interpret import interpret
from dsl.ops import OPS
from dsl.passes import run_passes
from dsl.step import has_static_form
from graphs.capture import CONTEXT_TENSORS, GRAPH_BUCKETS, CudaGraphs, bucket, capturable, find_segments
from graphs.captured_step import _StaticContext
from graphs.plan import BUCKETS as PLAN_BUCKETS
from graphs.segments import _token_shaped
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


@pytest.mark.parametrize("name,drafting", [("v41-tiny-engram", False), ("trained", True)])
def test_static_segments_pass_only_token_rows_across_their_edges(name: str, drafting: bool) -> None:
    """A static step's segments (dsl/step.py) take in the cache ops with a static form, and no cache view crosses a
    segment's edge: the nodes that would pass one to a node outside stay out with it. (Head dims of 64: the in-place
    kernel that a static step's attention runs takes powers of two only.)"""
    _, found = graphs(name, drafting)
    for graph in found:
        plain, static = find_segments(graph), find_segments(graph, static=True)
        inside = {i for s in static for i in range(s.start, s.stop)}
        assert inside >= {i for s in plain for i in range(s.start, s.stop)}
        for s in static:
            assert all(_token_shaped(v) for v in s.inputs + s.outputs)
            for i in range(s.start, s.stop):
                node = graph.nodes[i]
                assert capturable(graph, i, static=True)
                assert not OPS[node.op].uses_context or node.op in CONTEXT_TENSORS or has_static_form(node)
        appends = [i for i, n in enumerate(graph.nodes) if n.op == "kv_window_append"]
        windows = [i for i in appends if all(capturable(graph, j, static=True) for j, r in enumerate(graph.nodes)
                                             if graph.nodes[i].outputs[0] in r.inputs)]
        assert bool(windows) == bool(appends)  # the main graph's window-only layers (a draft graph has no append)
        assert all(i in inside for i in windows)
        assert all(i not in inside for i in appends if i not in windows)


def run_nodes(graph, start: int, stop: int, env: dict, ctx) -> None:
    for node in graph.nodes[start:stop]:
        opdef = OPS[node.op]
        kwargs = dict(node.attrs, ctx=ctx) if opdef.uses_context else node.attrs
        result = opdef.reference(*[None if v is None else env[v] for v in node.inputs], **kwargs)
        env.update(zip(node.outputs, result if opdef.num_outputs > 1 else (result,), strict=True))


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
        assert not segment or all(not OPS[n.op].uses_context or n.op in CONTEXT_TENSORS for n in graph.nodes[index:stop])
        run_nodes(graph, index, stop, local, _StaticContext(ctx.positions.clone()) if segment else ctx)
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


def run_padded(graph, params: dict, ids: torch.Tensor, ctx: ForwardContext, padding: CudaGraphs) -> dict:
    """The graph's outputs with its segments run as a forward through `padding` runs them: over the token count's
    bucket of rows (no capture: on the CPU, the padding alone)."""
    env = {v: ids for v in graph.inputs.values()} | {v: params[n] for n, v in graph.params.items()}
    forward = padding.begin(ctx, ())
    index = 0
    while index < len(graph.nodes):
        segment = padding.at.get(index)
        if segment:
            forward.run(segment, env, lambda e, c, s=segment: run_nodes(graph, s.start, s.stop, e, c))
            index = segment.stop
        else:
            run_nodes(graph, index, index + 1, env, ctx)
            index += 1
    return forward.finish({name: env[v] for name, v in graph.outputs.items()})


@pytest.mark.parametrize("name", ["v41-smooth-engram", "trained"])
def test_padding_rows_never_reach_the_real_rows(name: str) -> None:
    """Segments run over a bucket of rows whose padding is NaN: a node mixing rows would spread it. The real rows
    come out as the unpadded forward's (close, not bitwise: the CPU's matmuls may block differently per row count)."""
    model, (graph,) = graphs(name, False)
    params = {k: v.float() if v.is_floating_point() and v.dtype != torch.float8_e4m3fn else v
              for k, v in model.params().items()}
    padding = CudaGraphs(graph, capture=False, pad=float("nan"))
    plain, padded = [SequenceState() for _ in range(3)], [SequenceState() for _ in range(3)]
    feeds = [[[5, 9, 13, 2, 7], [11, 3], [6, 1]], [[4], [8], [1]], [[6, 2, 9], [1], [3, 3]]]  # 9, 3 and 6 tokens
    for feed in feeds:
        outs = []
        for states, padded_run in ((plain, False), (padded, True)):
            ctx = ForwardContext(states, [len(f) for f in feed])
            ids = torch.tensor([t for f in feed for t in f])
            outs.append(run_padded(graph, params, ids, ctx, padding) if padded_run
                        else interpret(graph, {"input_ids": ids}, params, ctx))
            ctx.commit()
        expected, got = outs[0]["logits"], outs[1]["logits"]
        assert got.shape == expected.shape and not got.isnan().any()
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_buckets_hold_the_plans_bucket_bounds() -> None:
    """A padded step must pick the kernel configs its token count would: the plan's bounds are buckets too."""
    assert all(b in GRAPH_BUCKETS for b in PLAN_BUCKETS if b <= GRAPH_BUCKETS[-1])
    assert [bucket(n) for n in (1, 3, 5, 16, 17, 65, 193, 512)] == [1, 4, 8, 16, 24, 80, 224, 512]


def test_the_least_recently_used_token_counts_make_room() -> None:
    """Eviction by count and by the device memory the captures took (no GPU needed: the records alone)."""
    from graphs.capture import CudaGraphs
    from graphs.captured_step import CapturedStep

    _, (graph,) = graphs("v41-smooth", False)
    keep = CudaGraphs(graph, max_steps=3, max_bytes=100)
    for n, size in ((1, 10), (2, 20), (3, 30)):
        keep.steps[(n, False)] = CapturedStep(bytes=size)
    keep.steps.move_to_end((1, False))  # token count 1 used last
    keep.evict()  # three kept: the oldest, token count 2, goes
    assert list(keep.steps) == [(3, False), (1, False)]
    keep.steps[(4, False)] = CapturedStep(bytes=70)  # 110 bytes held: over the budget
    keep.evict()
    assert list(keep.steps) == [(1, False), (4, False)]
    keep.evict()  # 80 bytes, two kept: nothing to drop
    assert list(keep.steps) == [(1, False), (4, False)]
    keep.evict(room=2)  # buckets captured ahead beside a forward's: room for two, one goes
    assert list(keep.steps) == [(4, False)]


def _step_context(tokens: int, cache=None, slot: int = 0):
    """The fields of a `ForwardContext` that `CudaGraphs.begin` reads: one chunk of `tokens` tokens of a sequence in
    `slot` of `cache` (None: a sequence without pools, whose steps are never static)."""
    state = SimpleNamespace(cache=cache, slot=slot, block_table=[0, 1])
    return SimpleNamespace(num_tokens=tokens, chunks=[SimpleNamespace(state=state)], lengths=[tokens],
                           logit_rows=None, visible_from=None)


def test_a_static_step_drops_only_the_static_steps_graphs() -> None:
    """Static steps' graphs read and write one set of pools, so a static step over other pools drops them; the other
    steps' graphs read no pool and stay, with their warm-ups. Were the first static step to forget them, a prompt's
    bucket would run its eager warm-up again and capture every bucket ahead anew in the next `generate` call."""
    from graphs.captured_step import CapturedStep

    _, (graph,) = graphs("v41-smooth", False)
    keep = CudaGraphs(graph, capture=False)
    pools = [SimpleNamespace(spec=SimpleNamespace(spare=3)) for _ in range(2)]
    prompt = (bucket(5), False, 0, True)  # (rows, static, table width, mode)
    keep.begin(_step_context(5), (True,))  # a prompt's step: not static (no pools)
    assert keep.seen == {prompt}
    keep.steps[prompt] = CapturedStep()
    keep.ahead_done.add(prompt[1:])
    keep.begin(_step_context(1, pools[0]), (True,))  # the first static step
    decode = (1, True, 8, True)
    assert keep.seen == {prompt, decode} and list(keep.steps) == [prompt]
    keep.steps[decode] = CapturedStep()
    keep.ahead_done.add(decode[1:])
    keep.begin(_step_context(1, pools[0]), (True,))  # the same pools: its graphs replay
    assert list(keep.steps) == [prompt, decode]
    keep.begin(_step_context(1, pools[1]), (True,))  # other pools: the static graphs go, the prompt's stay
    assert list(keep.steps) == [prompt] and keep.ahead_done == {prompt[1:]}
    assert keep.seen == {prompt, decode}  # the decode bucket's warm-up over the new pools, just now


def test_only_decode_sized_steps_capture_the_decode_buckets_ahead() -> None:
    """A mode's first capture of a bucket up to `ahead` takes every other such bucket beside its own, largest first,
    static or not (sequences without pools decode through steps that are not static); a prompt's chunk past that
    range captures its own bucket only."""
    _, (graph,) = graphs("v41-smooth", False)
    pools = SimpleNamespace(spec=SimpleNamespace(spare=3))
    for ctx, ahead in ((_step_context(5), []), (_step_context(3), [2, 1]), (_step_context(1, pools), [4, 2])):
        keep = CudaGraphs(graph, ahead=4)
        keep.pool = object()  # no GPU here: the pool only goes to the captures, which these forwards never start
        assert not keep.begin(ctx, (True,)).capturing  # a bucket's first forward: the eager warm-up
        forward = keep.begin(ctx, (True,))
        assert forward.capturing and [rows for rows, _ in forward.others] == ahead
