"""Many decode steps of the full-width slice on its sm90 artifact: the median, p10 and p90 of each batch's steps,
steadier than bench_slice.py's median of at most five, with the memory roofline's share, the host's time to issue a
step (until `step` returns, before the GPU is waited for), the GPU's kernel time a step (torch's profiler over
`--busy` steps), and optionally a cProfile of the host's share by function. Runs from any tree that has
bench/bench_slice.py (an older commit's too, to compare two trees side by side: copy this file into it).

    python bench/slice_steps.py artifacts/slice-sm90 [--batches 1,16] [--context 1024] [--steps 150] [--profile 40]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench_slice as bs  # noqa: E402
from slice_caches import Caches  # noqa: E402

from dsl.passes import run_passes  # noqa: E402

CONTEXT = 1024  # tokens each sequence holds before its decode steps by default, as in bench_slice.py


def timed(step, states, steps: int, vocab: int, gen: torch.Generator) -> tuple[list[float], list[float]]:
    """Seconds of each of `steps` decode steps over `states` (one random token each), after 10 untimed, and of the
    host's part of each: until `step` returns (it returns logits on the device; the sampled tokens' read back is
    not in it)."""
    times, host = [], []
    for i in range(steps + 10):
        batch = [(s, [int(t)]) for s, t in zip(states, torch.randint(0, vocab, (len(states),), generator=gen))]
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(batch)
        issued = time.perf_counter()
        torch.cuda.synchronize()
        if i >= 10:
            times.append(time.perf_counter() - start)
            host.append(issued - start)
    return times, host


def kernel_seconds(step, states, steps: int, vocab: int, gen: torch.Generator) -> float:
    """The GPU's kernel time a step (summed kernel durations, torch's profiler) over `steps` decode steps."""
    from torch.profiler import ProfilerActivity, profile
    timed(step, states, 0, vocab, gen)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        timed(step, states, steps - 10, vocab, gen)
    total = sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return total / 1e6 / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", help="the slice's sm90 artifact (bench_slice.py --build-artifact)")
    p.add_argument("--batches", default="1,16", help="decode batch sizes")
    p.add_argument("--steps", type=int, default=150, help="timed steps a batch")
    p.add_argument("--context", type=int, default=CONTEXT, help="tokens each sequence holds before the steps")
    p.add_argument("--busy", type=int, default=20, help="steps a batch under the profiler for the kernel time")
    p.add_argument("--profile", type=int, default=0, help="then profile this many steps at the largest batch")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("slice_steps.py times the sm90 artifact: it needs a CUDA GPU")
    batches = [int(b) for b in args.batches.split(",")]
    config = bs.slice_config(False)
    model = bs.DeepseekV41Flash(config, bs.slice_weights(config, "cuda"))
    step = bs.make_step("sm90", model, args.artifact, "cuda")
    gen = torch.Generator().manual_seed(1)
    ctx = args.context
    caches = Caches(run_passes(model.graph()), True, max(batches) + 4,
                    ctx + args.steps + args.busy + args.profile + 32, "cuda")
    context = caches.fresh(0)
    prompt = torch.randint(0, config.vocab_size, (ctx,), generator=gen).tolist()
    for begin in range(0, ctx, 8192):  # the context's prefill in chunks, as the engine's would go
        step([(context, prompt[begin:begin + 8192])])
    params = dict(model.params())
    for batch in batches:
        states = caches.copies(context, batch)
        times, host = timed(step, states, args.steps, config.vocab_size, gen)
        busy = kernel_seconds(step, states, args.busy, config.vocab_size, gen) if args.busy else float("nan")
        median = statistics.median(times)
        roof = bs.roofline(config, params, bs.Case("decode", batch, 1, ctx))["roof_us"]
        q = statistics.quantiles(times, n=10)
        print(f"decode B={batch} ctx={ctx}: median {1e6 * median:.0f} us, p10 {1e6 * q[0]:.0f}, "
              f"p90 {1e6 * q[-1]:.0f} ({len(times)} steps); roof {roof:.0f} us ({100 * roof / 1e6 / median:.1f}%); "
              f"host {1e6 * statistics.median(host):.0f} us; kernels {1e6 * busy:.0f} us "
              f"({100 * busy / median:.0f}% busy)", flush=True)
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        timed(step, caches.copies(context, max(batches)), args.profile, config.vocab_size, gen)
        profile.disable()
        print(f"host time by function over {args.profile + 10} steps at B={max(batches)} "
              "(own s, with callees s, calls):")
        rows = sorted(pstats.Stats(profile).stats.items(), key=lambda kv: -kv[1][2])
        for (file, _, name), (_, calls, own, total, _) in rows[:25]:
            print(f"  {own:7.4f} {total:7.4f} {calls:6d} {'/'.join(file.split('/')[-2:])}:{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
