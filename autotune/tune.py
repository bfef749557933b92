"""Measuring candidates on a device: each config's output is checked against the reference before it is timed,
and a config that fails the check (or fails to compile or launch) is rejected, never chosen."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Trial:
    config: dict
    us: float | None  # None: rejected
    error: str = ""


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def time_us(fn: Callable[[], object], rep_ms: float = 20, graph: bool = True) -> float:
    """Median µs of `fn` replayed from a CUDA graph (no launch gaps), or timed with plain events when `graph` is
    False (for code that synchronizes with the host and so cannot be captured)."""
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return 1e3 * do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
    return 1e3 * do_bench(fn, warmup=5, rep=rep_ms, return_mode="median")


def tune(configs: list[dict], run: Callable[[dict], torch.Tensor], reference: torch.Tensor, tol: float,
         rep_ms: float = 20) -> tuple[dict | None, list[Trial]]:
    """The fastest of `configs` (median time) whose output `run(config)` is within `tol` of `reference`."""

    trials = []
    for config in configs:
        try:
            err = rel_l2(run(config), reference)
            if not err < tol:
                trials.append(Trial(config, None, f"rel_l2 {err:.2e} >= {tol:.0e}"))
                continue
            us = time_us(lambda c=config: run(c), rep_ms)
            trials.append(Trial(config, us))
        except Exception as e:  # a config the compiler or the device refuses
            trials.append(Trial(config, None, f"{type(e).__name__}: {str(e)[:80]}"))
    ok = [t for t in trials if t.us is not None]
    best = min(ok, key=lambda t: t.us) if ok else None
    return (best.config if best else None), trials


__all__ = ["tune", "time_us", "Trial"]
