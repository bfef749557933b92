"""`deepinfer autotune`: tune the kernels of a model config on this GPU and write the tuning cache.

What `python -m autotune.run` does, behind the command line: the config and flags are checked first (a wrong path,
field or template fails at once, GPU or not), then the GPU (it must be of the target's architecture), then every
job is tuned under a progress bar and the summary table printed. `deepinfer.compile` reads the cache it writes.
"""

from __future__ import annotations

import argparse


def add_autotune_parser(commands) -> None:
    from autotune.run import add_arguments

    tune = commands.add_parser("autotune", help="tune the kernels of a config on this GPU; write the tuning cache",
                               description="Tune the kernel tiles of a DeepSeek-V4.1 config's shapes on this GPU. "
                                           "Each candidate is checked against the reference before it is timed.")
    add_arguments(tune)
    tune.add_argument("--no-progress", action="store_true", help="no progress bar")


def autotune(args: argparse.Namespace) -> int:
    """Run `deepinfer autotune`; exits with a message on a bad config or flag, or without a suitable GPU."""
    from autotune.cache import TuningCache, default_cache
    from autotune.run import check_device, prepare, summary, tune_all

    try:
        cfg, work = prepare(args)
        check_device(args.target)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"deepinfer autotune: {e}") from None
    if not work:
        raise SystemExit("deepinfer autotune: no kernel shape matches --templates / --only")
    cache = TuningCache(args.out) if args.out else default_cache(args.target)
    rows = tune_all(work, cfg, args.target, cache, args.jobs, progress=not args.no_progress)
    print("\n" + summary(rows))
    print(f"wrote {cache.path} ({len(rows)} of {len(work)} jobs tuned)")
    return 0 if len(rows) == len(work) else 1


__all__ = ["add_autotune_parser", "autotune"]
