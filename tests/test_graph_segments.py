"""`CompiledModel.graph_segments(num_tokens=N)` (graphs/segments.py): how a step's nodes run on a target, read without
a GPU. On a GPU target the captured segments are capture.py's, the nodes between them run one by one, and every node
of the graph is in exactly one segment, in program order; the interpreter and forwards past the largest CUDA-graph
bucket run every node eagerly."""

from __future__ import annotations

import pytest

import deepinfer
from deepinfer.default_model import TRAINED_CHECKPOINT
from deepinfer.models import DeepseekV41Flash
from dsl.passes import run_passes
from dsl.step import STATIC_OPS
from graphs.capture import GRAPH_BUCKETS, find_segments
from graphs.compiled_model import CompiledModel
from graphs.passes import make_plan
from graphs.plan_runtime import PlanRuntime
from graphs.segments import node_names
from tests.conftest import fixture_dir


@pytest.fixture(scope="module")
def model() -> DeepseekV41Flash:
    return DeepseekV41Flash.from_pretrained(fixture_dir("v41-tiny"))


def planned(model: DeepseekV41Flash, cuda_graphs: bool = True, drafting: bool = False) -> CompiledModel:
    """`model` planned for sm90 and held by the plan runtime as on a GPU machine (nothing runs, so none is needed)."""
    graphs = [run_passes(model.graph(dspark=drafting))] + ([run_passes(model.draft_graph())] if drafting else [])
    plans = [make_plan(g, model.params(), "sm90", buckets=(16,)) for g in graphs]
    runtime = PlanRuntime(graphs[0], plans[0], {}, {}, model.params(), cuda_graphs=cuda_graphs,
                          draft=(graphs[1], plans[1]) if drafting else None)
    return CompiledModel(model.config, graphs[0], "sm90", runtime, graphs[1] if drafting else None)


@pytest.mark.parametrize("num_tokens", [1, 2, 7, 64, 512])
def test_a_decode_step_runs_every_node_once_in_order(model: DeepseekV41Flash, num_tokens: int) -> None:
    compiled = planned(model)
    segments = compiled.graph_segments(num_tokens=num_tokens)
    assert [name for s in segments for name in s.nodes] == node_names(compiled.graph)
    captured = [s for s in segments if s.captured]
    found = find_segments(compiled.graph, static=True)
    assert [s.nodes for s in captured] == [tuple(node_names(compiled.graph)[f.start:f.stop]) for f in found]
    # segments alternate: two eager runs in a row would be one run
    assert all(a.captured or b.captured for a, b in zip(segments, segments[1:]))


@pytest.mark.parametrize("name", ["v41-tiny", "v41-tiny-engram", "embedded"])
def test_a_decode_step_of_up_to_512_tokens_is_one_captured_segment(name: str) -> None:
    """The contract: every node of a decode or verification step, the cache ops, the indexer, the compressor, Engram's
    n-grams and the head's rows included, in one CUDA graph per bucket (the embedded checkpoint's with DSpark's
    main keys stored too)."""
    if name == "embedded":
        compiled = planned(DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT), drafting=True)
    else:
        compiled = planned(DeepseekV41Flash.from_pretrained(fixture_dir(name)))
    names = tuple(node_names(compiled.graph))
    for n in range(1, GRAPH_BUCKETS[-1] + 1):
        assert [(s.captured, s.nodes) for s in compiled.graph_segments(num_tokens=n)] == [(True, names)], n


def test_only_static_steps_capture_the_cache_ops(model: DeepseekV41Flash) -> None:
    """A static step's segment holds every op with a static form (dsl/step.py); other forwards (a prefill chunk)
    keep each of them out of their segments."""
    compiled = planned(model)
    graph = compiled.graph
    static = {graph.nodes[i].op for f in find_segments(graph, static=True) for i in range(f.start, f.stop)}
    # no DSpark nor Engram; each rope_entries is fused with the rounding after it (rope_entries_fp4_round)
    assert set(STATIC_OPS) - {"kv_window_store", "kv_window_block", "engram_ngrams", "rope_entries"} <= static
    assert all(graph.nodes[i].op not in STATIC_OPS for f in find_segments(graph) for i in range(f.start, f.stop))


def test_a_draft_pass_is_one_captured_segment() -> None:
    """DSpark's draft pass (blocks of dspark_block_size tokens a sequence) is one captured segment too: its window
    block views and their attention have static forms."""
    compiled = planned(DeepseekV41Flash.from_pretrained(TRAINED_CHECKPOINT), drafting=True)  # it has a DSpark head
    names = tuple(node_names(compiled.draft_graph))
    block = compiled.config.dspark_block_size
    for n in (block, 2 * block, 64 * block):
        assert [(s.captured, s.nodes) for s in compiled.graph_segments(num_tokens=n, draft=True)] == [(True, names)]


def test_no_capture_past_the_largest_bucket_or_with_graphs_off(model: DeepseekV41Flash) -> None:
    names = tuple(node_names(planned(model).graph))
    beyond = planned(model).graph_segments(num_tokens=GRAPH_BUCKETS[-1] + 1)
    assert [(s.captured, s.nodes) for s in beyond] == [(False, names)]
    off = planned(model, cuda_graphs=False).graph_segments(num_tokens=1)
    assert [(s.captured, s.nodes) for s in off] == [(False, names)]


def test_the_interpreter_runs_every_node_eagerly(model: DeepseekV41Flash) -> None:
    compiled = deepinfer.compile(model, target="cpu")
    segments = compiled.graph_segments(num_tokens=3)
    assert [(s.captured, s.nodes) for s in segments] == [(False, tuple(node_names(compiled.graph)))]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_token_counts_are_named(model: DeepseekV41Flash, bad) -> None:
    with pytest.raises(ValueError, match="num_tokens"):
        planned(model).graph_segments(num_tokens=bad)


def test_draft_segments_need_a_drafting_model(model: DeepseekV41Flash) -> None:
    with pytest.raises(RuntimeError, match="drafting=True"):
        planned(model).graph_segments(num_tokens=1, draft=True)
