"""Where an sm90 decode step of the full-width slice spends its time, node by node: every node that runs eagerly and
every CUDA-graph replay is timed between two device synchronisations (so host and GPU time add up, without the
overlap a real step has), grouped by op.

    python bench/step_profile.py [--artifact artifacts/slice-sm90] [--batches 1,64] [--no-graphs] [--no-cache-kernels]
                                 [--top 14]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_slice import slice_config, slice_weights, sm90_step  # noqa: E402
from node_timing import time_nodes, timer  # noqa: E402
from slice_caches import Caches  # noqa: E402

from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.passes import run_passes  # noqa: E402


def profile(step, executor, states, vocab: int, gen: torch.Generator) -> tuple[collections.Counter, dict, float]:
    """(ms by group, calls by group, ms of the whole step) of one synchronised step."""
    times, calls = collections.Counter(), collections.Counter()
    undo = time_nodes(executor, timer(times, calls))
    batch = [(s, torch.randint(0, vocab, (1,), generator=gen).tolist()) for s in states]
    torch.cuda.synchronize()
    t = time.perf_counter()
    step(batch)
    torch.cuda.synchronize()
    total = 1e3 * (time.perf_counter() - t)
    undo()
    return times, calls, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", default="artifacts/slice-sm90")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--no-cache-kernels", action="store_true", help="the pools' torch encode/decode, not the kernels")
    p.add_argument("--top", type=int, default=14)
    args = p.parse_args()
    config = slice_config()
    model = DeepseekV41Flash(config, slice_weights(config, "cuda"))
    batches = [int(b) for b in args.batches.split(",")]
    step = sm90_step(model, args.artifact, "cuda", cuda_graphs=not args.no_graphs)
    compiled = step.__self__
    compiled.cache_kernels = compiled.cache_kernels and not args.no_cache_kernels
    caches = Caches(run_passes(model.graph()), True, max(batches), args.context + 16, "cuda")
    gen = torch.Generator().manual_seed(0)
    context = caches.fresh(0)
    step([(context, torch.randint(0, config.vocab_size, (args.context,), generator=gen).tolist())])
    for b in batches:
        states = caches.copies(context, b)
        for _ in range(3):  # first sight of the token count, capture, one replay
            step([(s, [1]) for s in states])
        executor = compiled._ready()[0]
        times, calls, total = profile(step, executor, states, config.vocab_size, gen)
        plain = []
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            step([(s, [1]) for s in states])
            torch.cuda.synchronize()
            plain.append(1e3 * (time.perf_counter() - t))
        plain.sort()
        print(f"\ndecode B={b} ctx={args.context} graphs={not args.no_graphs} cache kernels={compiled.cache_kernels}: "
              f"step {plain[2]:.2f} ms "
              f"(median of 5), synchronised node by node {total:.2f} ms")
        print(f"{'op':34s} {'calls':>5s} {'ms':>8s} {'share':>6s}")
        for key, ms in times.most_common(args.top):
            print(f"{key:34s} {calls[key]:5d} {ms:8.2f} {100 * ms / total:5.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
