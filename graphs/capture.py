"""CUDA-graph capture of a planned graph's static runs: the stretches of nodes whose shapes follow the token count.

A forward's nodes split into *segments* (graphs/segments.py finds them), maximal runs of nodes whose every value is
a plain tensor with a shape set by the forward's token count alone (dims in `N` and constants) and which read nothing
of the forward's context but a per-token tensor (rope's positions), and the nodes between them, which read and
write the caches (window appends, attention, the compressor, the indexer) and whose shapes follow the caches'
lengths. The segments hold most of a decode step's launches (the linears, MoE, hyper-connection mixes, norms,
rope, rounding): on a decode step of a few tokens each launch costs far more on the host than on the GPU, so
replaying them as CUDA graphs is what makes the step GPU-bound.

A decode or verification step whose sequences share one set of pools and whose chunks fit the rings' spare
positions (`StaticStep.fits`, dsl/step.py) is a *static step*: its segments (`find_segments(..., static=True)`, a
`Split` of their own) also take in the ops with a static form (`dsl.step.STATIC_OPS`: the cache ops, the compressor,
the indexer, the attention, Engram's n-grams, the head's rows), which read the step's layout from one `StaticStep`
per captured bucket, refreshed by one copy before the first segment runs, and never pass a cache view across a
segment's edge: on the models here the whole step is one segment. Such a step's graphs read and write one set of
pools (a forward over another drops every graph) and are kept per block-table width (`table_width`) as well as per
bucket and mode.

Token counts are padded to buckets (`GRAPH_BUCKETS`): a segment always runs over `bucket(N)` rows, the forward's N and
padding rows after them (zeros, or whatever an earlier replay left there; every node in a segment works row by row,
so they never reach the real rows), and the rest of the forward sees the first N rows. `CudaGraphs` keeps one
`CapturedStep` per (bucket, mode): the first forward in a bucket runs its segments eagerly (that loads kernels and
fills per-device tables), the second captures every segment as it reaches it, in program order, into one memory
pool, and later forwards replay them. A drafting engine's steps, or a batch whose requests finish one by one, meet
a new token count at almost every step; the buckets let them replay graphs captured at another count. Kernel
configs follow the plan's buckets (graphs/plan.py), whose bounds are buckets here too, so a padded node runs the
config the unpadded one would; with batch-invariant configs a padded step's rows are bitwise the unpadded ones.

All graphs share one memory pool. Within a forward, replays happen in capture order (a subset of it, where a
segment's inputs come out another shape, e.g. a step's logit rows, and it runs eagerly), so a segment's temporaries
can share the pool with earlier segments' temporaries but never with an output still to be read: every captured
segment's inputs and outputs stay referenced by its `Run`. Across buckets, one bucket's temporaries may lie where
another's outputs do: a forward replays one bucket's graphs only, and each replay writes every row of its outputs
before a later segment of the same forward reads them, so what another bucket's replays left there is never read.
The static inputs a replay copies into are made outside the pool. Graph outputs that are a replay's static tensors
are cloned before they leave the forward, since the next replay overwrites them.

Decode buckets are captured ahead, largest first (`ahead`: the most tokens a decode step of the engine runs): a mode's
first capture captures every bucket up to `bucket(ahead)` too, each segment from the largest bucket down, on static
inputs of zeros (a segment's nodes compute the same whatever the rows hold; inputs another segment makes are that
segment's outputs, as in a real forward), each after one eager run that loads its kernels. The largest bucket's
temporaries are then free blocks the smaller ones fit into, and a step at any decode size replays from its first.

A static step also draws the token after each of its rows inside its graph (graphs/draws.py: `DRAWN`, an output of
the segment that makes the logits), so a step's tokens need no launch of their own.

Forwards of more than `max_tokens` tokens (prefill chunks, GPU-bound already) run eagerly, unpadded; at most
`max_steps` (bucket, mode) pairs keep graphs, holding at most about `max_bytes` of device memory (the least recently
used are dropped). Static and other steps are modes of their own, and each mode's first capture takes every decode
bucket up to `ahead` (23 at most), so the default keeps two modes' buckets whole: an engine whose steps alternate
between them would otherwise evict and capture again as it goes.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsl.graph import Graph
from dsl.step import STORING_OPS, StaticStep, table_width
from graphs.draws import _drawing
from graphs.segments import CONTEXT_TENSORS, GRAPH_BUCKETS, Segment, Split, capturable, find_segments


class _StaticContext:
    """What a segment's nodes see of the context: the per-token tensors, padded to the bucket."""

    def __init__(self, positions: torch.Tensor | None) -> None:
        self.positions = positions
        self._memo: dict = {}

    def memo(self, key: tuple, make: Callable[[], object]) -> object:
        """`make()`, once per segment run for each `key` (as `ForwardContext.memo` once per forward): a capture
        records it with the segment, so a replay computes it again from the refreshed positions."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


@dataclass
class Run:
    """One captured segment: its graph and the static tensors it reads and writes (`bucket` rows each where the value
    has one row per token)."""

    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]


@dataclass
class CapturedStep:
    """The graphs of one (bucket, mode): captured during one forward, replayed in the later ones."""

    positions: torch.Tensor | None = None
    static: StaticStep | None = None  # a static step's layout, which its graphs read
    runs: dict[int, Run] = field(default_factory=dict)
    bytes: int = 0  # device memory its captures took (the growth of torch's reserved memory over them)


RunNodes = Callable[[dict, object], None]  # runs a segment's nodes eagerly over an env and a context


def bucket(n: int, buckets: tuple[int, ...] = GRAPH_BUCKETS) -> int:
    """The smallest bucket holding `n` tokens."""
    return next(b for b in buckets if b >= n)


class CudaGraphs:
    """Captured segments of one executor's graph, per token-count bucket and mode (see the module's docstring).
    `capture=False` pads the segments without capturing them (what a forward in a new bucket does; on a CPU, the
    padding alone can be tested); `pad` fills the padding rows of tensors made for it (floating point only);
    `draws`: static steps draw their rows' next tokens (graphs/draws.py; not a DSpark draft graph's, which samples
    its own)."""

    def __init__(self, graph: Graph, max_tokens: int = GRAPH_BUCKETS[-1], max_steps: int = 64, max_bytes: int = 4 << 30,
                 capture: bool = True, pad: float = 0.0, ahead: int = 0,
                 uncaptured: frozenset[str] = frozenset(), draws: bool = True) -> None:
        if max_tokens > GRAPH_BUCKETS[-1]:
            raise ValueError(f"max_tokens {max_tokens} is past the largest bucket, {GRAPH_BUCKETS[-1]}")
        # the segments of forwards in general, and of static steps (dsl/step.py)
        static = find_segments(graph, uncaptured=uncaptured, static=True)
        self.splits = {False: Split(find_segments(graph, uncaptured=uncaptured)),
                       True: Split(_drawing(graph, static) if draws else static)}
        self.segments, self.at = self.splits[False].segments, self.splits[False].at
        self.stores = any(node.op in STORING_OPS for node in graph.nodes)  # else its static steps' chunks are free
        self.cache = None  # the pools the static steps' graphs read and write
        self.max_tokens, self.max_steps, self.max_bytes = max_tokens, max_steps, max_bytes
        self.capture, self.pad = capture, pad
        self.ahead = ahead
        self.pool = None  # one memory pool for every bucket's graphs, made at the first capture
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.seen: set[tuple] = set()
        self.ahead_done: set[tuple] = set()  # modes whose decode buckets were captured ahead
        self.replays = self.captures = self.eager = 0  # segment runs by kind (eager: padded, in a bucket's first)

    def begin(self, ctx, mode: tuple) -> _Forward | None:
        """This forward's way through the segments, or None to run every node eagerly and unpadded."""
        n = ctx.num_tokens
        static = n <= self.max_tokens and StaticStep.fits(ctx, self.stores)
        split = self.splits[static]
        if n > self.max_tokens or not split.segments:
            return None
        width = 0
        if static:  # graphs over other pools would write those: none kept
            cache = ctx.chunks[0].state.cache
            if cache is not self.cache:
                self.clear()
                self.cache = cache
            width = table_width(max(len(c.state.block_table) for c in ctx.chunks))
        mode = (static, width, *mode)
        rows = bucket(n)
        key = (rows, *mode)
        if key in self.steps:
            self.steps.move_to_end(key)
            return _Forward(self, split, self.steps[key], ctx, rows, width)
        if key not in self.seen or not self.capture:  # the warm-up forward: padded, eager
            self.seen.add(key)
            return _Forward(self, split, None, ctx, rows, width)
        ahead = []
        if self.ahead and mode not in self.ahead_done:
            self.ahead_done.add(mode)
            top = bucket(min(self.ahead, self.max_tokens))
            ahead = [b for b in GRAPH_BUCKETS if b <= top and b != rows and (b, *mode) not in self.steps]
            ahead = ahead[:self.max_steps - 1]  # the smallest, if max_steps cannot hold them all
        self.evict(1 + len(ahead))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        others = [(b, CapturedStep()) for b in sorted(ahead, reverse=True)]
        for b, other in others:
            self.steps[(b, *mode)] = other
        step = self.steps[key] = CapturedStep()
        return _Forward(self, split, step, ctx, rows, width, capturing=True, others=others)

    @property
    def broken(self) -> set[tuple[bool, int]]:
        """The segments that failed to capture, as (of a static step, first node)."""
        return {(static, start) for static, split in self.splits.items() for start in split.broken}

    def evict(self, room: int = 1) -> None:
        """Drop the least recently used buckets' graphs until `room` more fit: at most `max_steps` kept, and less
        than `max_bytes` of device memory held by them (a full model's static tensors at 512 tokens are GBs)."""
        while self.steps and (len(self.steps) + room > self.max_steps
                              or sum(s.bytes for s in self.steps.values()) >= self.max_bytes):
            self.steps.popitem(last=False)

    def clear(self) -> None:
        self.steps.clear()
        self.seen.clear()
        self.ahead_done.clear()
        self.pool = None
        self.cache = None


class _Forward:
    """One forward through the segments: `step` None runs them eagerly (padded), else replays or captures them."""

    def __init__(self, owner: CudaGraphs, split: Split, step: CapturedStep | None, ctx, rows: int, width: int = 0,
                 capturing: bool = False, others: list[tuple[int, CapturedStep]] = ()) -> None:
        self.owner, self.step, self.ctx, self.rows, self.capturing = owner, step, ctx, rows, capturing
        self.width = width  # a static step's block table width (0 for other forwards)
        self.split, self.at = split, split.at  # the segments this forward runs, by first node
        self.others = others  # (rows, step) of the buckets captured ahead beside this forward's, largest first
        self.padded: dict[int, torch.Tensor] = {}  # id of a segment output's first N rows -> its padded tensor
        self.static: set[int] = set()  # ids of the replays' static tensors (or views) this forward's env holds
        self.positions: torch.Tensor | None = None
        self.layout: StaticStep | None = None  # a static step's, filled for this forward

    def run(self, segment: Segment, env: dict, run_nodes: RunNodes) -> None:
        """Run `segment` over `env`: replay its graph, capture it, or run its nodes eagerly over padded rows."""
        args = [env[v] for v in segment.inputs]
        n = self.ctx.num_tokens
        if (segment.start in self.split.broken or any(not isinstance(a, torch.Tensor) for a in args)
                or any(r and a.shape[0] != n for a, r in zip(args, segment.row_inputs, strict=True))):
            run_nodes(env, self.ctx)  # e.g. a step's logit rows, fewer than its tokens: as they come
            return
        run = self.step.runs.get(segment.start) if self.step is not None else None
        if run is None and not self.capturing:
            outputs = self._eager(segment, env, args, run_nodes)
        else:
            if run is None:
                for rows, other in self.others:  # the larger buckets first, then this forward's, then the smaller
                    if rows < self.rows:
                        break
                    self._capture_ahead(segment, env, args, run_nodes, rows, other)
                run = self._capture(segment, env, args, run_nodes)
                for rows, other in self.others:
                    if rows < self.rows:
                        self._capture_ahead(segment, env, args, run_nodes, rows, other)
                if run is None:
                    run_nodes(env, self.ctx)
                    return
            else:
                self._fill(segment, args, run)
                run.graph.replay()
                self.owner.replays += 1
            outputs = run.outputs
        for v, t, r in zip(segment.outputs, outputs, segment.row_outputs, strict=True):
            if r:
                view = t[:n]
                self.padded[id(view)] = t
                t = view
            env[v] = t
            if run is not None:
                self.static.add(id(t))

    def _padded(self, segment: Segment, args: list[torch.Tensor]) -> list[torch.Tensor]:
        """The segment's inputs over the bucket's rows: an earlier segment's padded output as it is, others copied
        into a new tensor after their N rows of padding."""
        out = []
        for a, r in zip(args, segment.row_inputs, strict=True):
            full = self.padded.get(id(a)) if r else None
            if full is None and r:
                full = torch.full((self.rows, *a.shape[1:]), self.owner.pad if a.is_floating_point() else 0,
                                  dtype=a.dtype, device=a.device)
                full[:a.shape[0]] = a
            out.append(full if r else a)
        return out

    def _context(self, segment: Segment) -> _StaticContext | StaticStep | None:
        if not segment.context:
            return None
        if self.split is self.owner.splits[True]:
            return self._layout()
        if self.positions is None:  # padding rows at position 0
            positions = self.ctx.positions
            if self.step is not None and self.step.positions is not None:
                self.step.positions[:positions.shape[0]] = positions
                self.positions = self.step.positions
            else:
                self.positions = torch.zeros(self.rows, dtype=positions.dtype, device=positions.device)
                self.positions[:positions.shape[0]] = positions
                if self.step is not None:
                    self.step.positions = self.positions
        return _StaticContext(self.positions)

    def _layout(self) -> StaticStep:
        """The static step's layout (the captured step's own, which its graphs read), filled for this forward once."""
        if self.layout is None:
            layout = self.step.static if self.step is not None else None
            if layout is None:
                layout = StaticStep(self.rows, self.width, self.owner.cache)
                if self.step is not None:
                    self.step.static = layout
            layout.fill(self.ctx)
            self.layout = layout
        return self.layout

    def _eager(self, segment: Segment, env: dict, args: list[torch.Tensor], run_nodes: RunNodes) -> list:
        self.owner.eager += 1
        local = dict(env)
        local.update(zip(segment.inputs, self._padded(segment, args), strict=True))
        run_nodes(local, self._context(segment))
        return [local[v] for v in segment.outputs]

    def _fill(self, segment: Segment, args: list[torch.Tensor], run: Run) -> None:
        """Copy this forward's inputs into the replay's static tensors (an earlier replay's output is one already)."""
        for a, buf, r in zip(args, run.inputs, segment.row_inputs, strict=True):
            if (self.padded.get(id(a)) if r else a) is not buf:
                (buf[:a.shape[0]] if r else buf).copy_(a)
        self._context(segment)

    def _capture(self, segment: Segment, env: dict, args: list[torch.Tensor], run_nodes: RunNodes) -> Run | None:
        if segment.start in self.split.broken:  # a bucket captured ahead found it cannot be
            return None
        reserved = torch.cuda.memory_reserved()
        # an input that is an earlier replay's padded output is read in place; others get a static tensor of their own
        inputs = [p if id(a) in self.static else (p.clone() if p is a else p)
                  for a, p in zip(args, self._padded(segment, args), strict=True)]
        run = self._record(segment, env, inputs, self._context(segment), run_nodes, self.step, reserved)
        if run is not None:
            run.graph.replay()
        return run

    def _capture_ahead(self, segment: Segment, env: dict, args: list[torch.Tensor], run_nodes: RunNodes, rows: int,
                       step: CapturedStep) -> None:
        """Capture `segment` for another bucket of `rows` tokens into `step`, on zeros where this forward reads its
        own inputs (row inputs widened to `rows`; fixed-shape ones as they are) and, where another segment makes an
        input, on that segment's outputs in `step`, as a forward in that bucket reads them."""
        if segment.start in self.split.broken:
            return
        reserved = torch.cuda.memory_reserved()
        inputs = []
        for v, a, r in zip(segment.inputs, args, segment.row_inputs, strict=True):
            start, i = self.split.made_by.get(id(v), (None, 0))
            maker = step.runs.get(start)
            if maker is not None:
                inputs.append(maker.outputs[i])
            else:
                inputs.append(torch.zeros((rows, *a.shape[1:]) if r else a.shape, dtype=a.dtype, device=a.device))
        ctx = None
        if segment.context and self.split is self.owner.splits[True]:  # a layout of zeros: nothing stored
            if step.static is None:
                step.static = StaticStep(rows, self.width, self.owner.cache)
            ctx = step.static
        elif segment.context:
            if step.positions is None:
                step.positions = torch.zeros(rows, dtype=self.ctx.positions.dtype, device=self.ctx.positions.device)
            ctx = _StaticContext(step.positions)
        warm = dict(env)
        warm.update(zip(segment.inputs, inputs, strict=True))
        run_nodes(warm, ctx)  # loads the bucket's kernels: nothing is loaded while capturing
        self.owner.eager += 1
        self._record(segment, env, inputs, ctx, run_nodes, step, reserved)

    def _record(self, segment: Segment, env: dict, inputs: list[torch.Tensor], ctx, run_nodes: RunNodes,
                step: CapturedStep, reserved: int) -> Run | None:
        """Capture the segment's nodes over `inputs` into the shared pool as `step`'s run; None where they cannot
        be captured (then they run eagerly from now on, in every bucket). `step.bytes` grows by the device memory
        reserved since `reserved` was read (the static inputs, then the capture)."""
        local = dict(env)
        local.update(zip(segment.inputs, inputs, strict=True))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.owner.pool):
                run_nodes(local, ctx)
        except RuntimeError as e:  # an op that syncs with the host, or allocates host memory: eager from now on
            self.split.broken.add(segment.start)
            torch.cuda.synchronize()
            warnings.warn(f"nodes {segment.start}..{segment.stop - 1} cannot be captured ({type(e).__name__}: {e}); "
                          "they run eagerly", RuntimeWarning, stacklevel=4)
            return None
        step.bytes += max(0, torch.cuda.memory_reserved() - reserved)
        self.owner.captures += 1
        run = Run(graph, inputs, [local[v] for v in segment.outputs])
        step.runs[segment.start] = run
        return run

    def finish(self, outputs: dict) -> dict:
        """The forward's outputs, with any replay's static tensor cloned (the next replay overwrites it)."""
        return {k: v.clone() if id(v) in self.static else v for k, v in outputs.items()}


__all__ = ["CONTEXT_TENSORS", "GRAPH_BUCKETS", "CudaGraphs", "Segment", "Split", "bucket", "capturable",
           "find_segments"]
