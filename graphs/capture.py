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
pools (a static step over other pools drops every static graph; the other steps' graphs read no pool and stay) and
are kept per block-table width (`table_width`) as well as per bucket and mode.

Token counts are padded to buckets (`GRAPH_BUCKETS`): a segment always runs over `bucket(N)` rows, the forward's N and
padding rows after them (zeros, or whatever an earlier replay left there; every node in a segment works row by row,
so they never reach the real rows), and the rest of the forward sees the first N rows. `CudaGraphs` keeps one
`CapturedStep` per (bucket, mode): the first forward in a bucket runs its segments eagerly (that loads kernels and
fills per-device tables), the second captures every segment as it reaches it, in program order, into one memory
pool, and later forwards replay them. A drafting engine's steps, or a batch whose requests finish one by one, meet
a new token count at almost every step; the buckets let them replay graphs captured at another count. Kernel
configs follow the plan's buckets (graphs/plan.py), whose bounds are buckets here too, so a padded node runs the
config the unpadded one would; with batch-invariant configs a padded step's rows are bitwise the unpadded ones.

All graphs share one memory pool. How a forward replays, captures or runs its segments eagerly, and why one pool
serves every bucket's graphs: graphs/captured_step.py.

Decode buckets are captured ahead, largest first (`ahead`: the most tokens a decode step of the engine runs): a mode's
first capture of a bucket up to `bucket(ahead)` captures every other bucket up to there too, each segment from the
largest bucket down, on static inputs of zeros (a segment's nodes compute the same whatever the rows hold; inputs
another segment makes are that segment's outputs, as in a real forward), each after one eager run that loads its
kernels. The largest bucket's temporaries are then free blocks the smaller ones fit into, and a decode step at any
size replays from its first. A capture of a larger bucket (a prompt's chunk) takes its own bucket only: in an
offline batch such steps come in its first steps, and the decode buckets of their mode would cost a fresh engine's
first call an eager run and a capture each, for graphs that seldom replay.

A static step also draws the token after each of its rows inside its graph (graphs/draws.py: `DRAWN`, an output of
the segment that makes the logits), so a step's tokens need no launch of their own.

Forwards of more than `max_tokens` tokens (prefill chunks, GPU-bound already) run eagerly, unpadded; at most
`max_steps` (bucket, mode) pairs keep graphs, holding at most about `max_bytes` of device memory (the least recently
used are dropped). Static and other steps are modes of their own, and each mode's first decode-sized capture takes
every decode bucket up to `ahead` (23 at most), so the default keeps two modes' buckets whole: an engine whose steps
alternate between them would otherwise evict and capture again as it goes.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from dsl.graph import Graph
from dsl.step import STORING_OPS, StaticStep, table_width
from graphs.captured_step import CapturedStep, Forward
from graphs.draws import drawing_segments
from graphs.segments import CONTEXT_TENSORS, GRAPH_BUCKETS, Segment, Split, capturable, find_segments


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
                       True: Split(drawing_segments(graph, static) if draws else static)}
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

    def begin(self, ctx, mode: tuple) -> Forward | None:
        """This forward's way through the segments, or None to run every node eagerly and unpadded."""
        n = ctx.num_tokens
        static = n <= self.max_tokens and StaticStep.fits(ctx, self.stores)
        split = self.splits[static]
        if n > self.max_tokens or not split.segments:
            return None
        width = 0
        if static:  # static graphs over other pools would write those: none kept
            cache = ctx.chunks[0].state.cache
            if cache is not self.cache:
                self.forget_static()
                self.cache = cache
            width = table_width(max(len(c.state.block_table) for c in ctx.chunks))
        mode = (static, width, *mode)
        rows = bucket(n)
        key = (rows, *mode)
        if key in self.steps:
            self.steps.move_to_end(key)
            return Forward(self, split, self.steps[key], ctx, rows, width)
        if key not in self.seen or not self.capture:  # the warm-up forward: padded, eager
            self.seen.add(key)
            return Forward(self, split, None, ctx, rows, width)
        ahead = []
        top = bucket(min(self.ahead, self.max_tokens)) if self.ahead else 0
        if rows <= top and mode not in self.ahead_done:  # a decode-sized step: the decode buckets beside it
            self.ahead_done.add(mode)
            ahead = [b for b in GRAPH_BUCKETS if b <= top and b != rows and (b, *mode) not in self.steps]
            ahead = ahead[:self.max_steps - 1]  # the smallest, if max_steps cannot hold them all
        self.evict(1 + len(ahead))
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        others = [(b, CapturedStep()) for b in sorted(ahead, reverse=True)]
        for b, other in others:
            self.steps[(b, *mode)] = other
        step = self.steps[key] = CapturedStep()
        return Forward(self, split, step, ctx, rows, width, capturing=True, others=others)

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

    def forget_static(self) -> None:
        """Drop the static steps' graphs, and forget their warm-up forwards and the modes captured ahead: they read
        and write the pools of `self.cache`. The other steps' graphs read no pool, so they stay (with the memory
        pool they share), and so do their warm-ups: the first static step (`self.cache` still None) must not send
        the prompts' buckets back to an eager warm-up and a second capture."""
        self.steps = OrderedDict((key, step) for key, step in self.steps.items() if not key[1])
        self.seen = {key for key in self.seen if not key[1]}
        self.ahead_done = {mode for mode in self.ahead_done if not mode[0]}


__all__ = ["CONTEXT_TENSORS", "GRAPH_BUCKETS", "CudaGraphs", "Segment", "Split", "bucket", "capturable",
           "find_segments"]
