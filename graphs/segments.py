"""How a step's nodes run on a target: the stretches replayed as CUDA graphs and the nodes run one by one between.

`CompiledModel.graph_segments(num_tokens=N)` reads it: for a GPU target, the segments `CudaGraphs` captures
(graphs/capture.py) and the runs of nodes between them, in program order; for the interpreter, every node eager.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsl.graph import Graph
from graphs.capture import GRAPH_BUCKETS, find_segments


@dataclass(frozen=True)
class StepSegment:
    """A stretch of a step's nodes, in program order: replayed as one CUDA graph (`captured`) or run node by node.
    `nodes` name them "index:op" (the node's index in the graph, its op)."""

    captured: bool
    nodes: tuple[str, ...]


def node_names(graph: Graph) -> list[str]:
    return [f"{i}:{node.op}" for i, node in enumerate(graph.nodes)]


def step_segments(graph: Graph, num_tokens: int, captured: bool = True, max_tokens: int = GRAPH_BUCKETS[-1],
                  uncaptured: frozenset[str] = frozenset()) -> list[StepSegment]:
    """How a forward of `num_tokens` tokens runs `graph`'s nodes: the segments `CudaGraphs` replays (none where
    `captured` is off or the forward is past `max_tokens`; no op of `uncaptured` in them, as `CudaGraphs` is given
    them) and the runs of nodes between them, in order: a decode or verification step's, whose cache ops read the
    step's layout from device tensors (dsl/step.py), so those with a static form sit in the segments too. It is the
    plan's static split: at run time a captured segment whose inputs come with fewer rows than the forward's tokens
    (a prefill's logit rows) runs eagerly too, and a forward that is no such step (a prefill chunk, sequences
    outside one set of pools) runs the segments of `find_segments(graph)`."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise ValueError(f"num_tokens must be an integer of at least 1, got {num_tokens!r}")
    names = node_names(graph)
    if not captured or num_tokens > max_tokens:
        return [StepSegment(False, tuple(names))] if names else []
    out, at = [], 0
    for s in find_segments(graph, uncaptured=uncaptured, static=True):
        if s.start > at:
            out.append(StepSegment(False, tuple(names[at:s.start])))
        out.append(StepSegment(True, tuple(names[s.start:s.stop])))
        at = s.stop
    if at < len(names):
        out.append(StepSegment(False, tuple(names[at:])))
    return out


__all__ = ["StepSegment", "node_names", "step_segments"]
