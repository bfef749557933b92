"""What the decode buckets' CUDA graphs hold on the full-width slice, three ways of capturing buckets 1 to 64:

- `ahead`: the engine's way (graphs/capture.py): the first capture takes every bucket up to 64, largest first, in
  one memory pool;
- `lazy, one pool`: each bucket captured at its own second forward (a warm-up forward first), smallest first, the
  pool shared;
- `lazy, a pool each`: the same with a new pool for every bucket (what capture did before one pool).

For each: the device memory torch reserved for it (after emptying the cache between ways), the graphs' own count of
it (the sum of each step's `bytes`), the seconds until every bucket replays, then one step in each bucket, all
replays, timed (median of 3).

    python bench/graphs_memory.py [--artifact artifacts/slice-sm90] [--up-to 64] [--context 1024]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_slice import slice_config, slice_weights, sm90_step  # noqa: E402
from slice_caches import Caches  # noqa: E402

from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.passes import run_passes  # noqa: E402
from graphs.capture import GRAPH_BUCKETS, CudaGraphs  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default="artifacts/slice-sm90")
    p.add_argument("--up-to", type=int, default=64)
    p.add_argument("--context", type=int, default=1024)
    args = p.parse_args()
    config = slice_config()
    model = DeepseekV41Flash(config, slice_weights(config, "cuda"))
    step = sm90_step(model, args.artifact, "cuda", cuda_graphs=True)
    compiled = step.__self__
    buckets = [b for b in GRAPH_BUCKETS if b <= args.up_to]
    caches = Caches(run_passes(model.graph()), True, buckets[-1], args.context + 256, "cuda")
    gen = torch.Generator().manual_seed(0)
    context = caches.fresh(0)
    step([(context, torch.randint(0, config.vocab_size, (args.context,), generator=gen).tolist())])
    states = caches.copies(context, buckets[-1])  # bucket b's steps decode the first b (each step one token more)
    batches = {b: states[:b] for b in buckets}

    def decode(b: int) -> None:
        step([(s, torch.randint(0, config.vocab_size, (1,), generator=gen).tolist()) for s in batches[b]])

    begin = CudaGraphs.begin
    print(f"{'way':22s} {'reserved MiB':>12s} {'graphs MiB':>10s} {'capture s':>9s}  step ms by bucket")
    for way in ("ahead", "lazy, one pool", "lazy, a pool each"):
        compiled.capture_ahead(args.up_to if way == "ahead" else 0)
        compiled.runtime.cuda_graphs = True  # fresh graphs
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        if way == "lazy, a pool each":  # a new pool at each capture, as before the pool was shared
            def fresh_pool(self, ctx, mode, begin=begin):
                self.pool = None
                return begin(self, ctx, mode)
            CudaGraphs.begin = fresh_pool
        try:
            start = time.perf_counter()
            for b in ([1] if way == "ahead" else buckets):
                decode(b)  # warm-up forward
                decode(b)  # the capture
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        finally:
            CudaGraphs.begin = begin
        graphs = compiled.runtime.executors()[0].cuda_graphs
        held = sum(s.bytes for s in graphs.steps.values())
        ms = {}
        for b in buckets:
            times = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                decode(b)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t))
            ms[b] = statistics.median(times)
        assert graphs.broken == set() and len(graphs.steps) == len(buckets), (graphs.broken, list(graphs.steps))
        print(f"{way:22s} {(torch.cuda.memory_reserved() - reserved) / 2**20:12.1f} {held / 2**20:10.1f} "
              f"{seconds:9.2f}  " + " ".join(f"{b}:{ms[b]:.2f}" for b in buckets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
