"""What a kernel family gives the tuner (autotune/) for a template it lets tune: the candidate configs, a job that
measures one on fresh random inputs against the reference, and the static shapes a model config meets. A family
lists them as `TUNINGS` in its tuning.py; kernels/registry.py collects them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# run(config) -> output, the reference output, the relative L2 tolerance a candidate's output must meet
Job = tuple[Callable[[dict], torch.Tensor], torch.Tensor, float]


@dataclass(frozen=True)
class Tuning:
    """`template`: the template tuned. `space(static, bucket, target)`: every candidate config (filtered by the
    target's limits). `job(static, tokens, fields)`: a `Job` on the GPU for `tokens` tokens; `fields` are a model
    config's Hugging Face fields (the tuner's `load_config`). `shapes(fields)`: the static shapes of the template's
    nodes in such a model, in order. `warmup(static)`: a static shape whose kernels compile the same and whose inputs
    are smaller (for compiling candidates ahead of timing). A template without a job has a space only: nothing
    measures it."""

    template: str
    space: Callable[[Any, int, str], list[dict]]
    job: Callable[[Any, int, dict], Job] | None = None
    shapes: Callable[[dict], list[Any]] | None = None
    warmup: Callable[[Any], Any] | None = None


def rotation(w: torch.Tensor, total_bytes: int = 256 << 20) -> list[torch.Tensor]:
    """Copies of `w` (same values, separate memory) adding up to more than the L2, cycled through by timing."""
    count = max(2, -(-total_bytes // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(count - 1)]


__all__ = ["Job", "Tuning", "rotation"]
