"""Where an sm90 decode step of the full-width slice spends its time, node by node: every node that runs eagerly and
every CUDA-graph replay is timed between two device synchronisations (so host and GPU time add up, without the
overlap a real step has), grouped by op.

    python bench/step_profile.py [--artifact artifacts/slice-sm90] [--batches 1,64] [--no-graphs] [--no-cache-kernels]
                                 [--top 14] [--kernels N] [--cprofile N] [--prefill 1024,8192]

--prefill T profiles a prefill of T tokens on a fresh sequence instead (after one untimed prefill of the same size).

--kernels N also traces 5 unsynchronised steps with torch's profiler and prints the N kernels of most GPU time and
the GPU's busy time a step, against the step's wall time: how far the step is from GPU-bound. --cprofile N prints
the N functions of most own host time over 5 unsynchronised steps. --syncs lists where one step makes the host wait
for the device (torch's sync debug mode: reads back, blocking copies), each place by the project's frames that led
to it: every such wait empties the GPU's queue, so the host's next launches find it idle.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_slice import PREFILL_CHUNK, slice_config, slice_weights, sm90_step  # noqa: E402
from node_timing import time_nodes, timer  # noqa: E402
from slice_caches import Caches  # noqa: E402

from deepinfer.models import DeepseekV41Flash  # noqa: E402
from dsl.passes import run_passes  # noqa: E402


def profile(step, executor, batch: list) -> tuple[collections.Counter, dict, float]:
    """(ms by group, calls by group, ms of the whole step) of one synchronised step over `batch`."""
    times, calls = collections.Counter(), collections.Counter()
    undo = time_nodes(executor, timer(times, calls))
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
    p.add_argument("--kernels", type=int, default=0, help="the N kernels of most GPU time over 5 traced steps")
    p.add_argument("--cprofile", type=int, default=0, help="the N functions of most own host time over 5 steps")
    p.add_argument("--prefill", default="", help="prefill token counts to profile (comma-separated), not decode")
    p.add_argument("--syncs", action="store_true", help="where a step makes the host wait for the device")
    args = p.parse_args()
    config = slice_config()
    model = DeepseekV41Flash(config, slice_weights(config, "cuda"))
    batches = [int(b) for b in args.batches.split(",")]
    step = sm90_step(model, args.artifact, "cuda", cuda_graphs=not args.no_graphs)
    compiled = step.__self__
    compiled.runtime.cache_kernels = not args.no_cache_kernels
    prefills = [int(t) for t in args.prefill.split(",") if t]
    caches = Caches(run_passes(model.graph()), True, max(batches), max([args.context + 16, *prefills]), "cuda")
    gen = torch.Generator().manual_seed(0)
    if prefills:
        return profile_prefills(step, compiled, caches, prefills, config.vocab_size, gen, args)
    context = caches.fresh(0)
    ids = torch.randint(0, config.vocab_size, (args.context,), generator=gen).tolist()
    for begin in range(0, len(ids), PREFILL_CHUNK):  # a long context in several prefill steps, as bench_slice's
        step([(context, ids[begin: begin + PREFILL_CHUNK])])
    for b in batches:
        states = caches.copies(context, b)

        def tokens(states=states) -> list:  # a random token each: one token for all would route every row alike
            return [(s, torch.randint(0, config.vocab_size, (1,), generator=gen).tolist()) for s in states]
        for _ in range(3):  # first sight of the token count, capture, one replay
            step(tokens())
        executor = compiled.runtime.executors()[0]
        times, calls, total = profile(step, executor, tokens())
        plain = []
        for _ in range(5):
            batch = tokens()
            torch.cuda.synchronize()
            t = time.perf_counter()
            step(batch)
            torch.cuda.synchronize()
            plain.append(1e3 * (time.perf_counter() - t))
        plain.sort()
        print(f"\ndecode B={b} ctx={args.context} graphs={not args.no_graphs} "
              f"cache kernels={compiled.runtime.cache_kernels}: step {plain[2]:.2f} ms "
              f"(median of 5), synchronised node by node {total:.2f} ms")
        print(f"{'op':34s} {'calls':>5s} {'ms':>8s} {'share':>6s}")
        for key, ms in times.most_common(args.top):
            print(f"{key:34s} {calls[key]:5d} {ms:8.2f} {100 * ms / total:5.1f}%")
        if args.kernels:
            trace_kernels(lambda: step(tokens()), args.kernels)
        if args.syncs:
            print_syncs(lambda: step(tokens()))
        if args.cprofile:
            profiler = cProfile.Profile()
            with profiler:
                for _ in range(5):
                    step(tokens())
                torch.cuda.synchronize()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.cprofile)
    return 0


def profile_prefills(step, compiled, caches, prefills: list[int], vocab: int, gen: torch.Generator, args) -> int:
    """Each prefill twice on a fresh sequence (the first loads its kernels), the second synchronised node by node."""
    for t in prefills:
        ids = torch.randint(0, vocab, (t,), generator=gen).tolist()
        for timed in (False, True, False):
            state = caches.fresh(1)
            if timed:
                times, calls = collections.Counter(), collections.Counter()
                undo = time_nodes(compiled.runtime.executors()[0], timer(times, calls))
            torch.cuda.synchronize()
            start = time.perf_counter()
            step([(state, ids)])
            torch.cuda.synchronize()
            ms = 1e3 * (time.perf_counter() - start)
            if timed:
                undo()
                total = ms
        print(f"\nprefill {t}: {ms:.2f} ms unsynchronised ({1e3 * t / ms:.0f} tok/s), "
              f"synchronised node by node {total:.2f} ms")
        print(f"{'op':34s} {'calls':>5s} {'ms':>8s} {'share':>6s}")
        for key, node_ms in times.most_common(args.top):
            print(f"{key:34s} {calls[key]:5d} {node_ms:8.2f} {100 * node_ms / total:5.1f}%")
        if args.kernels:
            trace_kernels(lambda: step([(caches.fresh(1), ids)]), args.kernels, steps=1)
    return 0


def print_syncs(run_step) -> None:
    """Run one step under torch's sync debug mode and print each place (the innermost three project frames) where the
    host waited for the device, with how many times."""
    places = collections.Counter()
    root = str(Path(__file__).resolve().parent.parent)

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        ours = [f for f in traceback.extract_stack()[:-1]
                if f.filename.startswith(root) and not f.filename.endswith("step_profile.py")]
        places[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in ours[::-1][:3]) or "(torch)"] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    print(f"host waits in one step: {sum(places.values())}")
    for where, count in places.most_common():
        print(f"  {count:4d}  {where}")


def trace_kernels(run_step, top: int, steps: int = 5) -> None:
    """Print the `top` kernels of most GPU time over `steps` traced steps, and the GPU's busy ms a step."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as traced:
        t = time.perf_counter()
        for _ in range(steps):
            run_step()
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t) / steps
    events = traced.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e3 / steps
    print(f"traced: {wall:.2f} ms a step (wall, profiler on), GPU busy {busy:.2f} ms a step ({100 * busy / wall:.0f}%)")
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))


if __name__ == "__main__":
    sys.exit(main())
