"""CUDA-graph capture of a planned graph's static runs: the stretches of nodes between the ops that read caches.

A forward's nodes split into *segments*, maximal runs of nodes whose every value is a plain tensor with a shape
set by the forward's token count alone (dims in `N` and constants) and which read nothing of the forward's context
but a per-token tensor (rope's positions), and the nodes between them, which read and write the caches (window
appends, attention, the compressor, the indexer) and whose shapes follow the caches' lengths. The segments hold
most of a decode step's launches (the linears, MoE, hyper-connection mixes, norms, rope, rounding): on a decode
step of a few tokens each launch costs far more on the host than on the GPU, so replaying them as CUDA graphs is
what makes the step GPU-bound.

`CudaGraphs` keeps one `CapturedStep` per (token count, mode): the first forward at a token count runs eagerly (it
loads kernels and fills per-device tables), the second captures every segment as it reaches it, in program order,
into one memory pool, and later forwards replay them. Replays happen in capture order (a subset of it, where a
segment's inputs come out another shape, e.g. a step's logit rows, and it runs eagerly), so a segment's
temporaries can share the pool with earlier segments' temporaries but never with an output still to be read:
every captured segment's inputs and outputs stay referenced by its `Run`. Graph outputs that are a replay's
static tensors are cloned before they leave the forward, since the next replay overwrites them.

Forwards of more than `max_tokens` tokens (prefill chunks, GPU-bound already) run eagerly; at most `max_steps`
token counts keep graphs, holding at most about `max_bytes` of device memory (the least recently used are dropped).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import sympy
import torch

from dsl.graph import Graph, Value
from dsl.ops import OPS
from dsl.tensor import OPAQUE_DTYPES, num_tokens

# Context-reading ops whose only use of the context is a tensor of one row per token: a captured segment reads
# it from a static buffer, refreshed before each replay.
CONTEXT_TENSORS = {"rope": "positions"}


@dataclass
class Segment:
    """Nodes [start, stop) of a graph: `inputs` are the values they read that come from outside (graph inputs or
    earlier nodes; weights excluded), `outputs` those they make that later nodes or the graph's outputs read."""

    start: int
    stop: int
    inputs: list[Value]
    outputs: list[Value]
    context: bool  # whether a node reads the context's per-token tensor


def _token_shaped(value: Value | None) -> bool:
    if value is None:
        return True
    t = value.type
    if t is None or t.dtype in OPAQUE_DTYPES:
        return False
    return all(isinstance(d, int) or sympy.sympify(d).free_symbols <= {num_tokens} for d in t.shape)


def capturable(graph: Graph, index: int) -> bool:
    node = graph.nodes[index]
    opdef = OPS[node.op]
    if opdef.uses_context and node.op not in CONTEXT_TENSORS:
        return False
    return all(_token_shaped(v) for v in node.inputs if v is None or v.name not in graph.params) \
        and all(_token_shaped(v) for v in node.outputs)


def find_segments(graph: Graph, min_nodes: int = 2) -> list[Segment]:
    """The graph's segments of at least `min_nodes` capturable nodes, in program order."""
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
        if i < len(graph.nodes) and capturable(graph, i):
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
            context = any(graph.nodes[j].op in CONTEXT_TENSORS for j in range(start, i))
            segments.append(Segment(start, i, inputs, outputs, context))
        start = None
    return segments


class _StaticContext:
    """What a captured node sees of the context: the per-token tensors, in static buffers."""

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions


@dataclass
class Run:
    """One captured segment: its graph, the static tensors it reads and writes, and the input shapes it was
    captured at."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    shapes: list[torch.Size]


@dataclass
class CapturedStep:
    """The graphs of one (token count, mode): captured during one forward, replayed in the later ones."""

    pool: tuple
    positions: torch.Tensor | None = None
    runs: dict[int, Run] = field(default_factory=dict)
    bytes: int = 0  # device memory the capture took (the growth of torch's reserved memory over it)


RunNodes = Callable[[dict, object], None]  # runs a segment's nodes eagerly over an env and a context


class CudaGraphs:
    """Captured segments of one executor's graph, per token count and mode (see the module's docstring)."""

    def __init__(self, graph: Graph, max_tokens: int = 256, max_steps: int = 32, max_bytes: int = 4 << 30) -> None:
        self.segments = find_segments(graph)
        self.at = {s.start: s for s in self.segments}
        self.max_tokens, self.max_steps, self.max_bytes = max_tokens, max_steps, max_bytes
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.seen: set[tuple] = set()
        self.broken: set[int] = set()  # segments that failed to capture: eager from then on
        self.replays = self.captures = 0

    def begin(self, ctx, mode: tuple) -> _Forward | None:
        """This forward's way through the segments, or None to run every node eagerly."""
        n = ctx.num_tokens
        if n > self.max_tokens or not self.segments:
            return None
        key = (n, *mode)
        if key in self.steps:
            self.steps.move_to_end(key)
            return _Forward(self, self.steps[key], ctx, capturing=False)
        if key not in self.seen:  # the warm-up forward
            self.seen.add(key)
            return None
        self.evict()
        step = self.steps[key] = CapturedStep(torch.cuda.graph_pool_handle())
        return _Forward(self, step, ctx, capturing=True)

    def evict(self) -> None:
        """Drop the least recently used token counts' graphs until one more fits: fewer than `max_steps` kept, and
        less than `max_bytes` of device memory held by them (a full model's static tensors at 256 tokens are GBs)."""
        while self.steps and (len(self.steps) >= self.max_steps
                              or sum(s.bytes for s in self.steps.values()) >= self.max_bytes):
            self.steps.popitem(last=False)

    def clear(self) -> None:
        self.steps.clear()
        self.seen.clear()


class _Forward:
    def __init__(self, owner: CudaGraphs, step: CapturedStep, ctx, capturing: bool) -> None:
        self.owner, self.step, self.ctx, self.capturing = owner, step, ctx, capturing
        self.static: set[int] = set()  # ids of the static tensors this forward's env holds
        self.positions_ready = False
        self.reserved = torch.cuda.memory_reserved() if capturing else 0

    def run(self, segment: Segment, env: dict, run_nodes: RunNodes) -> None:
        """Run `segment` over `env`: replay its graph, capture it, or run its nodes eagerly."""
        args = [env[v] for v in segment.inputs]
        step, index = self.step, segment.start
        if index in self.owner.broken or any(not isinstance(a, torch.Tensor) for a in args):
            run_nodes(env, self.ctx)
            return
        if segment.context and not self.positions_ready:
            self._positions()
        run = step.runs.get(index)
        if run is not None:
            if any(a.shape != s for a, s in zip(args, run.shapes, strict=True)):
                run_nodes(env, self.ctx)
                return
            for a, buf in zip(args, run.inputs, strict=True):
                if a is not buf:
                    buf.copy_(a)
            run.graph.replay()
            self.owner.replays += 1
        elif self.capturing:
            run = self._capture(segment, env, args, run_nodes)
            if run is None:
                run_nodes(env, self.ctx)
                return
        else:
            run_nodes(env, self.ctx)
            return
        for v, t in zip(segment.outputs, run.outputs, strict=True):
            env[v] = t
            self.static.add(id(t))

    def _positions(self) -> None:
        step, positions = self.step, self.ctx.positions
        if step.positions is None:
            step.positions = positions.clone()
        else:
            step.positions.copy_(positions)
        self.positions_ready = True

    def _capture(self, segment: Segment, env: dict, args: list[torch.Tensor], run_nodes: RunNodes) -> Run | None:
        # an input that is an earlier segment's static output is read in place; others get a buffer of their own
        inputs = [a if id(a) in self.static else a.clone() for a in args]
        local = dict(env)
        local.update(zip(segment.inputs, inputs, strict=True))
        ctx = _StaticContext(self.step.positions) if segment.context else None
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.step.pool):
                run_nodes(local, ctx)
        except RuntimeError as e:  # an op that syncs with the host, or allocates host memory: eager from now on
            self.owner.broken.add(segment.start)
            torch.cuda.synchronize()
            warnings.warn(f"nodes {segment.start}..{segment.stop - 1} cannot be captured ({type(e).__name__}: {e}); "
                          "they run eagerly", RuntimeWarning, stacklevel=3)
            return None
        graph.replay()
        self.owner.captures += 1
        run = Run(graph, inputs, [local[v] for v in segment.outputs], [a.shape for a in args])
        self.step.runs[segment.start] = run
        return run

    def finish(self, outputs: dict) -> dict:
        """The forward's outputs, with any replay's static tensor cloned (the next replay overwrites it)."""
        if self.capturing:
            self.step.bytes = max(0, torch.cuda.memory_reserved() - self.reserved)
        return {k: v.clone() if id(v) in self.static else v for k, v in outputs.items()}


__all__ = ["CONTEXT_TENSORS", "CudaGraphs", "Segment", "capturable", "find_segments"]
