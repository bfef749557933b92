"""How a step's nodes run on a target: the stretches replayed as CUDA graphs and the nodes run one by one between.

`find_segments` finds a graph's *segments*, the runs of nodes graphs/capture.py captures (its docstring says which
nodes qualify), for forwards in general and for static steps (dsl/step.py). `CompiledModel.graph_segments(
num_tokens=N)` reads `step_segments`: for a GPU target, the segments `CudaGraphs` captures and the runs of nodes
between them, in program order; for the interpreter, every node eager.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from dsl.graph import Graph, Value
from dsl.ops import OPS
from dsl.step import has_static_form
from dsl.tensor import OPAQUE_DTYPES, num_entries, num_tokens
from kernels.attention import paged_ops as paged

# The token counts segments are captured at; each of the plan's tuning buckets (graphs/plan.py) up to 512 is one.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)

# Context-reading ops whose only use of the context is a tensor of one row per token: a captured segment reads
# it from a static buffer, refreshed before each replay.
CONTEXT_TENSORS = {op: "positions" for op in ("rope", "rope_fp8_round", "rope_fp4_round", "rms_norm_rope_fp8_round")}


@dataclass
class Segment:
    """Nodes [start, stop) of a graph: `inputs` are the values they read that come from outside (graph inputs or
    earlier nodes; weights excluded), `outputs` those they make that later nodes or the graph's outputs read."""

    start: int
    stop: int
    inputs: list[Value]
    outputs: list[Value]
    context: bool  # whether a node reads the context's per-token tensor

    def __post_init__(self) -> None:
        self.row_inputs = [_rows(v) for v in self.inputs]  # which inputs and outputs padding extends
        self.row_outputs = [_rows(v) for v in self.outputs]


def _fixed(dim) -> bool:
    return isinstance(dim, int) or not sympy.sympify(dim).free_symbols


def _token_shaped(value: Value | None) -> bool:
    """Whether the value is absent, a tensor of fixed shape, or one of one row per token ([N, fixed dims...])."""
    if value is None:
        return True
    t = value.type
    if t is None or t.dtype in OPAQUE_DTYPES:
        return False
    rest = t.shape[1:] if t.shape and _rows(value) else t.shape
    return all(_fixed(d) for d in rest)


def _rows(value: Value) -> bool:
    """Whether the value has one row per token: a leading dim of N, the dim padding extends."""
    shape = value.type.shape
    return bool(shape) and not isinstance(shape[0], int) and sympy.sympify(shape[0]) == num_tokens


def _static_shaped(value: Value | None) -> bool:
    """In a static step (dsl/step.py): `_token_shaped`, or a value of one row per step row whose other dims follow
    static bounds there (compressed entries, one a row; scores over a compressed cache's static width). Only plain
    token rows cross a segment's edge (`find_segments`)."""
    if _token_shaped(value):
        return True
    shape = value.type.shape if value.type is not None else ()
    return bool(shape) and not isinstance(shape[0], int) and sympy.sympify(shape[0]) in (num_tokens, num_entries)


def capturable(graph: Graph, index: int, uncaptured: frozenset[str] = frozenset(), static: bool = False) -> bool:
    """Whether node `index` can sit in a segment; ops in `uncaptured` never do (the experts' exchange under expert
    parallelism, whose shapes follow what the other ranks send). With `static` (a step run over a `StaticStep`,
    dsl/step.py) the nodes with a static form can too."""
    node = graph.nodes[index]
    opdef = OPS[node.op]
    if node.op in uncaptured:
        return False
    if static and has_static_form(node):
        # a static step's attention is the in-place kernel's, as the eager steps' is where that serves the head dim
        return node.op != "sparse_attention" or paged.serves(int(node.inputs[0].type.shape[-1]))
    if opdef.uses_context and node.op not in CONTEXT_TENSORS:
        return False
    shaped = _static_shaped if static else _token_shaped
    return all(shaped(v) for v in node.inputs if v is None or v.name not in graph.params) \
        and all(shaped(v) for v in node.outputs)


def find_segments(graph: Graph, min_nodes: int = 2, uncaptured: frozenset[str] = frozenset(),
                  static: bool = False) -> list[Segment]:
    """The graph's segments of at least `min_nodes` capturable nodes (no op of `uncaptured`), in program order; with
    `static`, as a static step runs them. A value that is no tensor of token rows (a cache view) never crosses a
    segment's edge: the nodes that would pass one across stay out."""
    allowed = {i for i in range(len(graph.nodes)) if capturable(graph, i, uncaptured, static)}
    index_of = {id(node): i for i, node in enumerate(graph.nodes)}
    while True:
        segments = _runs(graph, allowed, min_nodes)
        dropped = set()
        for s in segments:
            for v in s.inputs:  # made outside: its readers inside leave
                if not _token_shaped(v):
                    dropped |= {i for i in range(s.start, s.stop) if any(u is v for u in graph.nodes[i].inputs)}
            dropped |= {index_of[id(v.producer)] for v in s.outputs if not _token_shaped(v)}  # read outside
        if not dropped:
            return segments
        allowed -= dropped


def _runs(graph: Graph, allowed: set[int], min_nodes: int) -> list[Segment]:
    """The maximal runs of at least `min_nodes` nodes of `allowed`, as segments."""
    last_read: dict[int, int] = {}  # id(value) -> index of the last node reading it (len(nodes) for outputs)
    for i, node in enumerate(graph.nodes):
        for v in node.inputs:
            if v is not None:
                last_read[id(v)] = i
    for v in graph.outputs.values():
        last_read[id(v)] = len(graph.nodes)
    params = {id(v) for v in graph.params.values()}
    segments, start = [], None
    for i in range(len(graph.nodes) + 1):
        if i < len(graph.nodes) and i in allowed:
            start = i if start is None else start
            continue
        if start is not None and i - start >= min_nodes:
            made = {id(v) for node in graph.nodes[start:i] for v in node.outputs}
            inputs, outputs, seen = [], [], set()
            for node in graph.nodes[start:i]:
                for v in node.inputs:
                    if v is not None and id(v) not in made and id(v) not in params and id(v) not in seen:
                        seen.add(id(v))
                        inputs.append(v)
                outputs += [v for v in node.outputs if last_read.get(id(v), -1) >= i]
            context = any(OPS[graph.nodes[j].op].uses_context for j in range(start, i))
            segments.append(Segment(start, i, inputs, outputs, context))
        start = None
    return segments


@dataclass
class Split:
    """A graph's segments as one kind of forward runs them: `at` by first node, and each segment output's maker
    `made_by` (id of the value -> (segment start, index among its outputs))."""

    segments: list[Segment]
    broken: set[int] = field(default_factory=set)  # segments that failed to capture: eager from then on

    def __post_init__(self) -> None:
        self.at = {s.start: s for s in self.segments}
        self.made_by = {id(v): (s.start, i) for s in self.segments for i, v in enumerate(s.outputs)}



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


__all__ = ["CONTEXT_TENSORS", "GRAPH_BUCKETS", "Segment", "Split", "StepSegment", "capturable", "find_segments",
           "node_names", "step_segments"]
