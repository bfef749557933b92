"""How many torch ops, host syncs and how much Python time each node of a decode step costs on the host, on a machine
without a GPU, through the code the sm90 target runs for its eager nodes (the ones between CUDA-graph segments, which
read and write the caches).

The step runs node by node as `graphs.executor.Executor` runs it on the GPU, with three stand-ins for what needs one:
- a `ForwardContext` that batches like the GPU's (`compute_per_chunk` False: the batched attention, pooling and
  scores);
- the attention, indexer-score, compressor-pooling and entries' rope kernels: their lowering's host code runs
  (gathering the keys, building the index tensors, the partial rows' reads and writes), the Triton launch is
  replaced by its torch equivalent, counted as one op;
- the pools' entry encoders and decoders: the cache kernels the GPU installs (kernels/cache/rows.py) are one launch
  each, so the torch code they replace is counted as one op.
Each aten op dispatched counts (views too: a proxy for launches plus Python), `_local_scalar_dense` as a host sync.
Nodes inside the graph's segments are replayed as CUDA graphs on the GPU: their ops are summed on one line.

    python bench/op_counts.py [--model ../shared/fixtures/v41-smooth | slice] [--batches 1,16] [--context 300]
                              [--tokens 1]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_slice import slice_config, slice_weights
from slice_caches import Caches

import kernels.attention.sparse_attention as attention_kernels
import kernels.compressor.pool as compressor_kernels
import kernels.indexer.index_scores as indexer_kernels
import kernels.rope.rope as rope_kernels
from deepinfer.models import DeepseekV41Flash
from dsl.cache import PagedCache, load_rows, store_rows
from dsl.context import ForwardContext
from dsl.ops import OPS
from dsl.ops.attend import attend
from dsl.ops.compressor import pool_rows
from dsl.ops.indexer import mask_incomplete
from dsl.ops.rope import _rotated as rotated
from dsl.ops.rope import rotation_at
from dsl.passes import run_passes
from dsl.ragged import Ragged
from graphs.capture import find_segments
from graphs.passes import make_plan
from kernels.registry import LOWERINGS

CAPTURED = "(CUDA-graph segments)"
# Kernel nodes whose lowering does host work around the launch (layouts, the caches' reads and writes): run, with
# their launch stood in for; any other kernel node counts one op.
HOST_CODE = ("sparse_attention", "index_scores", "compress_pool", "rope_entries", "rope_entries_fp4_round",
             "rms_norm_rope_entries_fp4_round")


class GpuLayoutContext(ForwardContext):
    """A forward's context on the CPU that computes as the GPU's does: the whole batch at once."""

    @property
    def compute_per_chunk(self) -> bool:
        return False


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched (`ops`) and the host syncs among them (`syncs`) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.syncs += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


STAND_IN_SECONDS = [0.0]  # time spent in stand-ins so far, left out of the nodes' host time


def one_launch(fn):
    """`fn` run uncounted and untimed, counted as one op: a kernel the GPU launches once."""

    def run(*args, **kwargs):
        counter = _get_current_dispatch_mode()
        start = time.perf_counter()
        with _disable_current_modes():
            out = fn(*args, **kwargs)
        STAND_IN_SECONDS[0] += time.perf_counter() - start
        if isinstance(counter, OpCounter):
            counter.ops += 1
        return out
    return run


@contextlib.contextmanager
def kernels_replaced(cache: PagedCache):
    """The attention, indexer and cache kernels' launches replaced by their torch stand-ins, each one op."""
    kept = (attention_kernels.sparse_attention, indexer_kernels.index_scores, compressor_kernels.pool_groups,
            rope_kernels.rope)
    attention_kernels.sparse_attention = one_launch(attention_kernel)
    indexer_kernels.index_scores = one_launch(scores_kernel)
    compressor_kernels.pool_groups, rope_kernels.rope = one_launch(pool_kernel), one_launch(rope_kernel)
    cache.writer, cache.reader = one_launch(store_rows), one_launch(load_rows)
    try:
        yield
    finally:
        (attention_kernels.sparse_attention, indexer_kernels.index_scores, compressor_kernels.pool_groups,
         rope_kernels.rope) = kept
        cache.writer, cache.reader = store_rows, load_rows


def attention_kernel(q, kv, idx, sink, *, scale, config=None, dot_fp32=False) -> torch.Tensor:
    """The attention kernel's result in torch (the DSL's batched attention over the gathered keys): q [T, H, D],
    kv [P, D], idx int32 [T, S] -> fp32 [T, H, D]."""
    return attend(q.float(), kv.float()[idx.long().clamp(min=0)], idx >= 0, sink, scale)


def scores_kernel(q, weights, keys, start, length, positions, *, ratio, width, config=None,
                  dot_fp32=False) -> torch.Tensor:
    """The indexer kernel's result in torch: fp32 [N, width]."""
    out = torch.full((q.shape[0], width), float("-inf"))
    for t in range(q.shape[0]):
        k = keys[int(start[t]): int(start[t]) + int(length[t])].float()  # [L, d]
        s = (torch.einsum("hd,ld->hl", q[t].float(), k).relu() * q.shape[2] ** -0.5 * weights[t, :, None]
             * q.shape[1] ** -0.5).sum(0)
        out[t, : k.shape[0]] = mask_incomplete(s[None], positions[t: t + 1].long(), ratio)[0]
    return out


def pool_kernel(kv, gate, kept_kv, kept_gate, source, config=None) -> torch.Tensor:
    """The compressor's pooling kernel in torch: [G, D]."""
    return pool_rows(kv, gate, kept_kv, kept_gate, source)


def rope_kernel(x, positions, freqs, *, magnitude=1.0, inverse=False, config=None) -> torch.Tensor:
    """The rope kernel in torch."""
    return rotated(x, rotation_at(positions, freqs, magnitude, inverse))


@dataclasses.dataclass
class Stats:
    """Per op name (or CAPTURED): aten ops, host syncs, node calls, and each call's host ms."""

    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    syncs: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ms: dict[str, list[float]] = dataclasses.field(default_factory=dict)


class Step:
    """A decode step of `model` node by node, as the GPU's executor orders it (module docstring)."""

    def __init__(self, model: DeepseekV41Flash) -> None:
        self.graph = run_passes(model.graph())
        self.params = model.params()
        self.plan = make_plan(self.graph, self.params, "sm90", dot_fp32=True)
        self.captured = {i for s in find_segments(self.graph) for i in range(s.start, s.stop)}

    def key(self, index: int) -> str:
        return CAPTURED if index in self.captured else self.graph.nodes[index].op

    @torch.inference_mode()
    def run(self, batch, stats: Stats, counter: OpCounter | None) -> None:
        graph, env = self.graph, {}
        ids = torch.tensor([t for _, tokens in batch for t in tokens])
        rows = torch.tensor([len(t) for _, t in batch]).cumsum(0) - 1
        ctx = GpuLayoutContext([s for s, _ in batch], [len(t) for _, t in batch], logit_rows=rows)
        env |= {value: ids for value in graph.inputs.values()}
        env |= {value: self.params[name] for name, value in graph.params.items()}
        for index, node in enumerate(graph.nodes):
            key, before = self.key(index), (counter.ops, counter.syncs) if counter else None
            start = time.perf_counter() - STAND_IN_SECONDS[0]
            result = self._node(index, [None if v is None else env[v] for v in node.inputs], ctx)
            stats.ms.setdefault(key, []).append(1e3 * (time.perf_counter() - STAND_IN_SECONDS[0] - start))
            stats.calls[key] += 1
            if counter:
                stats.ops[key] += counter.ops - before[0]
                stats.syncs[key] += counter.syncs - before[1]
            for value, r in zip(node.outputs, result if OPS[node.op].num_outputs > 1 else (result,), strict=True):
                env[value] = r
        ctx.commit()

    def _node(self, index: int, args: list, ctx):
        node, entry, opdef = self.graph.nodes[index], self.plan.nodes[index], OPS[self.graph.nodes[index].op]
        kwargs = dict(node.attrs, ctx=ctx) if opdef.uses_context else node.attrs
        if not entry.template:
            return opdef.reference(*args, **kwargs)
        if node.op in HOST_CODE:  # their host code, and a stand-in for the launch
            rows = args[0].values if isinstance(args[0], Ragged) else args[0]  # entries' lowerings take the Ragged
            chosen = entry.at(rows.shape[0], self.plan.buckets)
            return LOWERINGS[node.op].run(entry.call(chosen, node.attrs, True, args, ctx))
        return one_launch(opdef.reference)(*args, **kwargs)  # another kernel: one launch


def measure(step: Step, caches: Caches, context, batch: int, repeats: int, tokens: int) -> tuple[Stats, Stats]:
    """(op counts of one step, wall times of `repeats` steps) of a decode batch of copies of `context`, `tokens`
    tokens a sequence a step (more than one: a DSpark verifying step's shape)."""
    states = caches.copies(context, batch)
    tokens = [[1] * tokens for _ in states]
    step.run(list(zip(states, tokens)), Stats(), None)  # warm-up
    counted = Stats()
    with OpCounter() as counter:
        step.run(list(zip(states, tokens)), counted, counter)
    timed = Stats()
    for _ in range(repeats):
        step.run(list(zip(states, tokens)), timed, None)
    return counted, timed


def report(name: str, counted: Stats, timed: Stats, repeats: int) -> None:
    print(f"\n{name}")
    print(f"{'op':28s} {'calls':>5s} {'ops':>6s} {'ops/call':>8s} {'syncs':>5s} {'host ms':>8s}")
    ms = {k: sum(v) / repeats for k, v in timed.ms.items()}  # per step
    eager = [k for k in counted.ops if k != CAPTURED]
    for key in sorted(eager, key=lambda k: -counted.ops[k]) + [CAPTURED]:
        calls = counted.calls[key]
        print(f"{key:28s} {calls:5d} {counted.ops[key]:6d} {counted.ops[key] / calls:8.1f} {counted.syncs[key]:5d} "
              f"{ms[key]:8.2f}")
    print(f"{'eager total':28s} {'':5s} {sum(counted.ops[k] for k in eager):6d} {'':8s} "
          f"{sum(counted.syncs[k] for k in eager):5d} {sum(ms[k] for k in eager):8.2f}")


def load(name: str, experts: int) -> DeepseekV41Flash:
    if name != "slice":
        return DeepseekV41Flash.from_pretrained(name)
    config = dataclasses.replace(slice_config(), n_routed_experts=experts)
    return DeepseekV41Flash(config, slice_weights(config, "cpu"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="../shared/fixtures/v41-smooth", help="a checkpoint directory, or 'slice'")
    p.add_argument("--experts", type=int, default=8, help="routed experts of the slice (the full 384 do not fit)")
    p.add_argument("--batches", default="1,16")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=1, help="tokens a sequence a step (a verifying step: 1 + drafts)")
    args = p.parse_args()
    torch.manual_seed(0)
    model = load(args.model, args.experts)
    step = Step(model)
    batches = [int(b) for b in args.batches.split(",")]
    caches = Caches(step.graph, True, max(batches), args.context + (args.repeats + 2) * args.tokens + 4, "cpu")
    context = caches.fresh(0)
    prompt = torch.randint(0, model.config.vocab_size, (args.context,)).tolist()
    with kernels_replaced(caches.cache):
        step.run([(context, prompt)], Stats(), None)
        for b in batches:
            counted, timed = measure(step, caches, context, b, args.repeats, args.tokens)
            report(f"{args.model}: decode B={b} x {args.tokens} tokens ctx={args.context}", counted, timed,
                   args.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
