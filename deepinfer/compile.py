"""`deepinfer.compile(model, target)`: the model's DSL graph through the passes, planned for a target."""

from __future__ import annotations

import torch

from deepinfer.compiled import CompiledModel
from deepinfer.models.deepseek_v41 import DeepseekV41Flash
from dsl.passes import run_passes

TARGETS = {
    "cpu": "every op's torch reference; runs anywhere",
    "sm90": "Hopper: Triton and TileLang kernels, sm_90a cubins",
    "sm100": "Blackwell: sm_100a cubins, built anywhere",
    "ascend950": "reserved",
}
BUILT_TARGETS = ("cpu",)


def compile(model: DeepseekV41Flash, target: str = "cpu") -> CompiledModel:  # noqa: A001 - the public name
    """Lower `model` for `target` and return a `CompiledModel` ready to run."""
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; targets are {', '.join(TARGETS)}")
    if target not in BUILT_TARGETS:
        raise NotImplementedError(f"target {target!r} ({TARGETS[target]}) has no kernels in this build yet; "
                                  f"built targets: {', '.join(BUILT_TARGETS)}")
    graph = run_passes(model.graph())
    params = {name: _for_cpu(t) for name, t in model.params().items()}
    return CompiledModel(model.config, graph, params, target)


def _for_cpu(t: torch.Tensor) -> torch.Tensor:
    """Plain float weights become fp32 once, so no forward converts them again; quantised ones stay packed."""
    if t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.dtype != torch.float32:
        return t.float()
    return t
