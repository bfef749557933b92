"""How many threads the cpu target's torch code runs on.

torch's default is one thread per core, which is right on an idle machine and ruinous on a busy one: its OpenMP
threads spin waiting for one another, and a thread that shares its core with another process holds up every op of
the forward (bench/RESULTS.md has the figures). So the cpu target uses the cores this process may run on less the
ones other processes keep busy (the one-minute load average, less this process's own running thread), at least one.
`OMP_NUM_THREADS`, when set, decides instead. The count holds while the model compiles and while the engine runs
(`cpu_threads`), and torch's own count comes back after, so the rest of the process is left as it was.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def choose_threads(cores: int, load: float) -> int:
    """Threads for `cores` usable cores under a one-minute `load` (this process's own thread included in it)."""
    busy = max(0.0, load - 1.0)
    return max(1, min(cores, round(cores - busy)))


def choose_cpu_threads() -> tuple[int | None, str]:
    """(threads, what was chosen and why) for the cpu target; None threads: leave torch's count (OMP_NUM_THREADS)."""
    if os.environ.get("OMP_NUM_THREADS"):
        return None, f"{torch.get_num_threads()} threads (OMP_NUM_THREADS)"
    cores = usable_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    threads = choose_threads(cores, load)
    plural = "s" if threads > 1 else ""
    return threads, f"{threads} thread{plural} ({cores} cores, load {load:.1f}; OMP_NUM_THREADS sets it)"


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[None]:
    """torch runs on `threads` threads inside the block (None: as it is), and on its own count again after it."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
