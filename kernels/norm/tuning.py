"""The RMSNorm's config space (Triton's kernel: warps a row); no job measures it."""

from __future__ import annotations

from kernels.norm.lowering import RMS_NORM
from kernels.tuning import Tuning


def norm_configs(static, bucket: int, target: str) -> list[dict]:
    return [{"num_warps": w} for w in (4, 8, 16)]


TUNINGS = (Tuning(RMS_NORM.template, norm_configs),)

__all__ = ["TUNINGS", "norm_configs"]
