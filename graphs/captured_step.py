"""The CUDA graphs of one token-count bucket and mode (`CapturedStep`: a `Run` for each captured segment, with the
static tensors it reads and writes), and one forward's way through a graph's segments (`Forward`): replaying a
segment's graph, capturing it (and, at a mode's first capture, the same segment for the buckets captured ahead), or
running its nodes eagerly over the bucket's padded rows. `CudaGraphs` (graphs/capture.py) chooses which for each
forward and keeps the captured steps.

All graphs share one memory pool. Within a forward, replays happen in capture order (a subset of it, where a
segment's inputs come out another shape, e.g. a step's logit rows, and it runs eagerly), so a segment's temporaries
can share the pool with earlier segments' temporaries but never with an output still to be read: every captured
segment's inputs and outputs stay referenced by its `Run`. Across buckets, one bucket's temporaries may lie where
another's outputs do: a forward replays one bucket's graphs only, and each replay writes every row of its outputs
before a later segment of the same forward reads them, so what another bucket's replays left there is never read.
The static inputs a replay copies into are made outside the pool. Graph outputs that are a replay's static tensors
are cloned before they leave the forward, since the next replay overwrites them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from dsl.step import StaticStep
from graphs.segments import Segment, Split

if TYPE_CHECKING:
    from graphs.capture import CudaGraphs


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


class Forward:
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


__all__ = ["CapturedStep", "Forward", "Run", "RunNodes"]
