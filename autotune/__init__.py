"""Tuning: config spaces per kernel template, measurement with a reference check, the persistent cache.

Imports `dsl` and `kernels` only. `choose` is what planning calls: the cached config, else the heuristic.
"""

from __future__ import annotations

from collections.abc import Callable

from autotune.cache import TuningCache, cache_key, default_cache, source_hash, template_hash
from autotune.space import get_configs
from autotune.tune import tune
from kernels.targets import get_target


def choose(template: str, static: dict, bucket: int, target: str, src_hash: str, fallback: Callable[[], dict],
           cache: TuningCache | None = None, device: str | None = None) -> tuple[dict, str]:
    """(config, "tuned" | "heuristic") for one kernel node and token bucket."""
    cache = cache if cache is not None else default_cache(target)
    key = cache_key(template, static, bucket, target, device or get_target(target).tuning_device or "?", src_hash)
    config = cache.get(key)
    return (config, "tuned") if config is not None else (fallback(), "heuristic")


__all__ = ["choose", "get_configs", "tune", "TuningCache", "cache_key", "source_hash", "template_hash", "default_cache"]
