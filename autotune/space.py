"""Config spaces per kernel template: each family's (kernels/<family>/tuning.py, filtered by what the hardware allows,
in the style of Triton's matmul tutorial `get_configs()`), found through kernels/registry.py."""

from __future__ import annotations

from kernels.registry import TUNINGS
from kernels.targets import DEFAULT_GPU_TARGET


def get_configs(template: str, static, bucket: int, target: str = DEFAULT_GPU_TARGET) -> list[dict]:
    """Every candidate config of `template` for these static shapes and token bucket (empty: nothing to tune)."""
    tuning = TUNINGS.get(template)
    return [] if tuning is None else tuning.space(static, bucket, target)


__all__ = ["get_configs"]
