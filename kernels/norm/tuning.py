"""The RMSNorm's config space (Triton's kernel: warps a row); no job measures it."""

from __future__ import annotations

from kernels.norm.lowering import RMS_NORM, NormStatic
from kernels.tuning import Tuning


def norm_configs(static: NormStatic, bucket: int, target: str) -> list[dict]:
    return [{"num_warps": w} for w in (4, 8, 16)]


TUNINGS = (Tuning(RMS_NORM.template, norm_configs),)

__all__ = ["TUNINGS", "norm_configs"]
