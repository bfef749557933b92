"""`deepinfer.compile(model, target)`: the model's DSL graph through the passes, planned for a target."""

from __future__ import annotations

import torch

from deepinfer.compiled import CompiledModel
from deepinfer.models.deepseek_v41 import DeepseekV41Flash
from dsl.passes import run_passes
from kernels.targets import DEFAULT_TARGET, PLAN, built_targets, get_target


def compile(model: DeepseekV41Flash, target: str = DEFAULT_TARGET, *, dot_fp32: bool = False,  # noqa: A001 - public name
            buckets: tuple[int, ...] | None = None, drafting: bool = False, device: str = "cpu",
            fp8_activations: bool = False):
    """Lower `model` for `target` and return a `CompiledModel` ready to run.

    GPU targets (kernels/targets.py) build cubins ahead of time, on any machine (no GPU needed) and return a
    `GpuCompiledModel`: `.save(dir)` writes the artifact, `deepinfer.load(dir)` runs it. `dot_fp32` makes the
    kernels multiply in fp32 (exactness checks) instead of bf16; `buckets` are the token-count buckets that get
    a config and cubins each (default `graphs.plan.BUCKETS`). `drafting` adds the DSpark draft layers: every step
    writes their main keys, and `draft()` runs them (on GPU targets the draft graph is planned and built too).
    `device` is where the cpu target's torch code runs ("cuda": the references on a GPU, eagerly; for comparisons
    and the engine there). `fp8_activations` (GPU targets): linears over fp8 weights round their inputs to e4m3 with
    a power-of-two scale per token and multiply on the fp8 tensor cores (kernels/triton/linear_fp8.py): at
    prefill sizes on the H200 such a linear takes half the time of the exact path's bf16 GEMM, at the price of
    about 3e-2 relative error per linear (the reference multiplies exactly); the logits of the smooth fixture,
    quantized, move by 6e-2 relative L2 (92% argmax agreement), against 7e-3 for the default sm90 path.
    """
    spec = get_target(target)
    if not spec.is_built:
        raise NotImplementedError(f"target {target!r} ({spec.description}) has no kernels in this build yet; "
                                  f"built targets: {', '.join(t.name for t in built_targets())}")
    if spec.runtime == PLAN:
        return _compile_gpu(model, target, dot_fp32, buckets, drafting, fp8_activations)
    if fp8_activations:
        raise ValueError("fp8_activations is a GPU target's kernel path; the cpu target runs the exact references")
    graph = run_passes(model.graph(dspark=drafting))
    draft_graph = run_passes(model.draft_graph()) if drafting else None
    params = {name: _for_cpu(t).to(device) for name, t in model.params().items()}
    return CompiledModel(model.config, graph, params, target, draft_graph, device)


def _for_cpu(t: torch.Tensor) -> torch.Tensor:
    """Plain float weights become fp32 once, so no forward converts them again; quantised ones stay packed."""
    if t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.dtype != torch.float32:
        return t.float()
    return t


def _compile_gpu(model: DeepseekV41Flash, target: str, dot_fp32: bool, buckets: tuple[int, ...] | None,
                 drafting: bool, fp8_activations: bool):
    from deepinfer.compiled_gpu import GpuCompiledModel
    from dsl.cache import CacheSpec
    from graphs.aot import build, record_cache_launches, record_launches, record_sampling_launches
    from graphs.passes import make_plan
    from graphs.plan import BUCKETS

    graphs = [run_passes(model.graph(dspark=drafting))] + ([run_passes(model.draft_graph())] if drafting else [])
    params = model.params()
    plans = [make_plan(g, params, target, tuple(buckets or BUCKETS), dot_fp32, fp8_activations=fp8_activations)
             for g in graphs]
    launches = record_sampling_launches(model.config.vocab_size)  # the engine's draws
    for graph, plan in zip(graphs, plans, strict=True):  # the draft graph's launches mostly repeat the main one's
        launches |= record_launches(plan, {i: node.attrs for i, node in enumerate(graph.nodes)})
        launches |= record_cache_launches(CacheSpec.from_graph(graph))  # the pools' writer and reader
    built = build(launches, target)
    specs = {key: b.spec for key, b in built.items()}
    cubins = {key: b.cubin for key, b in built.items()}
    draft = (graphs[1], plans[1]) if drafting else None
    return GpuCompiledModel(model.config, graphs[0], plans[0], specs, cubins, params, model.model_dir, built, draft)


def load(path, model: DeepseekV41Flash | None = None):
    """Run a saved GPU artifact (see `deepinfer.compiled_gpu.load`)."""
    from deepinfer.compiled_gpu import load as load_artifact

    return load_artifact(path, model)
