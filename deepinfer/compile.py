"""`deepinfer.compile(model, target)` and `deepinfer.load(dir)`: the model's DSL graph through the passes, planned
for a target, and the `CompiledModel` (graphs/compiled_model.py) that runs it."""

from __future__ import annotations

from pathlib import Path

import torch

from deepinfer.config import DeepseekV41Config
from deepinfer.models.deepseek_v41 import DeepseekV41Flash
from dsl.ops import invariant_references
from dsl.passes import run_passes
from graphs.compiled_model import CompiledModel
from graphs.engram_storage import HostEngramRows, choose_storage, is_engram_table
from graphs.interpreter import Interpreter
from kernels.targets import DEFAULT_TARGET, PLAN, get_built_target

Compiled = CompiledModel[DeepseekV41Config]


def compile(model: DeepseekV41Flash, target: str = DEFAULT_TARGET, *, dot_fp32: bool = False,  # noqa: A001 - public name
            buckets: tuple[int, ...] | None = None, drafting: bool = False, device: str = "cpu",
            fp8_activations: bool = False, engram_storage: str | None = None, replay: bool = False,
            expert_parallel: bool = False) -> Compiled:
    """Lower `model` for `target` and return a `CompiledModel` ready to run.

    GPU targets (kernels/targets.py) build cubins ahead of time, on any machine (no GPU needed): `.save(dir)` writes
    the artifact, `deepinfer.load(dir)` runs it. `dot_fp32` makes the kernels multiply in fp32 (exactness checks)
    instead of bf16; `buckets` are the token-count buckets that get a config and cubins each (default
    `graphs.plan.BUCKETS`). `drafting` adds the DSpark draft layers: every step writes their main keys, and `draft()`
    runs them (on GPU targets the draft graph is planned and built too). `device` is where the cpu target's torch
    code runs ("cuda": the references on a GPU, eagerly; for comparisons and the engine there). `fp8_activations`
    (GPU targets): linears over fp8 weights round their inputs to e4m3 with a power-of-two scale per token and
    multiply on the fp8 tensor cores (kernels/linear/fp8.py), trading accuracy for speed at prefill sizes
    (bench/RESULTS.md has both). `engram_storage` (the cpu target's runtime): "host" keeps the Engram tables in
    host memory and fetches each forward's rows while the first layers run (graphs/engram_storage.py), "device"
    moves them with the other weights; None: host where they take more than half of a GPU's free memory. `replay`
    builds the graph for bounded replay (`swa_replay_tokens`, deepinfer/replay.py): the decoder layers run from each
    sequence's `replay_from` on (a GPU target's forward runs its nodes after that boundary eagerly where it drops
    rows). `expert_parallel` (GPU targets) also builds the MoE kernel's
    launches for its experts split over ranks (kernels/moe/expert_parallel_kernel.py), which one rank of several runs
    (deepinfer/distributed/); the cpu target's runtime needs nothing built for it.
    """
    spec = get_built_target(target)
    if spec.runtime == PLAN:
        if engram_storage == "host":
            raise NotImplementedError(f"engram_storage='host': target {target!r}'s plans keep the Engram tables on "
                                      "the device; host storage runs on the cpu target's runtime (any device)")
        return _compile_plan(model, spec.name, dot_fp32, buckets, drafting, fp8_activations, expert_parallel,
                             replay)
    if fp8_activations:
        raise ValueError("fp8_activations is a GPU target's kernel path; the cpu target runs the exact references")
    graph = run_passes(model.graph(dspark=drafting, replay=replay))
    draft_graph = run_passes(model.draft_graph()) if drafting else None
    params = model.params()
    host = choose_storage(params, torch.device(device), engram_storage) == "host"
    params = {name: t if host and is_engram_table(name) else _for_cpu(t).to(device) for name, t in params.items()}
    overrides = HostEngramRows.from_graph(graph, params, torch.device(device)).overrides() if host else None
    runtime = Interpreter(graph, params, device, invariant_references(), draft_graph, overrides)
    return CompiledModel(model.config, graph, spec.name, runtime, draft_graph, model.model_dir)


def _for_cpu(t: torch.Tensor) -> torch.Tensor:
    """Plain float weights become fp32 once, so no forward converts them again; quantised ones stay packed."""
    if t.is_floating_point() and t.dtype != torch.float8_e4m3fn and t.dtype != torch.float32:
        return t.float()
    return t


def _launches(graphs: list, plans: list, vocab_size: int, expert_parallel: bool = False) -> dict:
    """Every kernel launch (by `Launch.key`) the plans of `graphs` (the main graph first) make: what `compile`
    builds, and what `load` checks an artifact holds."""
    from dsl.cache import CacheSpec
    from graphs.aot import record_attention_launches, record_cache_launches, record_launches, record_sampling_launches

    launches = record_sampling_launches(vocab_size)  # the engine's draws
    for graph, plan in zip(graphs, plans, strict=True):  # the draft graph's launches mostly repeat the main one's
        launches |= record_launches(plan, {i: node.attrs for i, node in enumerate(graph.nodes)}, expert_parallel)
        launches |= record_cache_launches(CacheSpec.from_graph(graph))  # the pools' writer and reader
        launches |= record_attention_launches(plan, graph, graphs[0])  # decode attention over the pools in place
    return launches


def _compile_plan(model: DeepseekV41Flash, target: str, dot_fp32: bool, buckets: tuple[int, ...] | None,
                  drafting: bool, fp8_activations: bool, expert_parallel: bool = False,
                  replay: bool = False) -> Compiled:
    from graphs.aot import build
    from graphs.passes import make_plan
    from graphs.plan import BUCKETS
    from graphs.plan_runtime import PlanRuntime

    graphs = [run_passes(model.graph(dspark=drafting, replay=replay))]
    graphs += [run_passes(model.draft_graph())] if drafting else []
    params = model.params()
    shards = model.shard.world_size if model.shard is not None else 1
    plans = [make_plan(g, params, target, tuple(buckets or BUCKETS), dot_fp32, fp8_activations=fp8_activations,
                       expert_shards=shards) for g in graphs]
    built = build(_launches(graphs, plans, model.config.vocab_size, expert_parallel), target)
    specs = {key: b.spec for key, b in built.items()}
    cubins = {key: b.cubin for key, b in built.items()}
    draft = (graphs[1], plans[1]) if drafting else None
    runtime = PlanRuntime(graphs[0], plans[0], specs, cubins, params, built, draft)
    return CompiledModel(model.config, graphs[0], target, runtime, graphs[1] if drafting else None, model.model_dir)


def load(path: str | Path, model: DeepseekV41Flash | None = None) -> Compiled:
    """Run an artifact saved by `compile(...).save(path)` (graphs/artifact.py says what it holds). The weights come
    from `model` (a DeepseekV41Flash), else from the checkpoint directory the artifact names."""
    from graphs import artifact
    from graphs.plan_runtime import PlanRuntime

    saved = artifact.read(path)
    if model is None:
        if not saved.manifest["model_dir"]:
            raise ValueError(f"{path} names no checkpoint: pass the model")
        model = DeepseekV41Flash.from_pretrained(saved.manifest["model_dir"])
    if artifact.config_hash(model.config.to_dict()) != saved.manifest["model_config_hash"]:
        raise ValueError(f"{path} was compiled for another model config")
    replay = any(n.op == "decoder_context" for n in saved.plan.nodes)  # compiled for bounded replay
    graph = run_passes(model.graph(dspark=saved.draft_plan is not None, replay=replay))
    draft = None if saved.draft_plan is None else (run_passes(model.draft_graph()), saved.draft_plan)
    for name, g, plan in [("plan.json", graph, saved.plan)] + ([("draft_plan.json", *draft)] if draft else []):
        try:
            plan.check_graph(g)
        except ValueError as e:
            raise artifact.ArtifactError(f"{Path(path) / name}: {e}") from None
    graphs, plans = [graph] + ([draft[0]] if draft else []), [saved.plan] + ([draft[1]] if draft else [])
    missing = sorted(set(_launches(graphs, plans, model.config.vocab_size)) - set(saved.specs))
    if missing:  # saved by another version of these kernels or of their lowerings: it would fail mid-step
        raise artifact.ArtifactError(
            f"{Path(path) / 'plan.json'}: holds no kernel for {len(missing)} launch(es) this build of DeepInfer makes, "
            f"{missing[0]}{' and more' if len(missing) > 1 else ''}: it was saved by another version; compile the "
            "model again")
    runtime = PlanRuntime(graph, saved.plan, saved.specs, saved.cubins, model.params(), draft=draft)
    return CompiledModel(model.config, graph, saved.plan.target, runtime, None if draft is None else draft[0],
                         model.model_dir)


__all__ = ["compile", "load"]
