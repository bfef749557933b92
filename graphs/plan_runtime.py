"""The plan runtime: a model planned for a GPU target (sm90, sm100), run with torch and the CUDA driver alone.

Kernel nodes run the cubins built ahead of time (graphs/aot.py), launched through `graphs.launcher`, never compiled
again; the other nodes run their torch references on the GPU (graphs/executor.py). Steps of up to 512 tokens replay
their static segments as CUDA graphs (graphs/capture.py). For one step, the pools of its sequences store and load
cache entries with the cache kernels (kernels/cache/rows.py: one launch for what torch does in many), bit for
bit as their torch path, and the engine's draws launch the sampling kernel's cubins (kernels/sampling/gumbel_argmax.py).
Under expert parallelism (`split_experts`) the MoE nodes exchange their pairs with the other ranks.

Batch-invariant mode runs every kernel node with its plan's batch-invariant config (graphs/plan.py). The reference
nodes left in a plan need no invariant versions: the compressor's ratio-1 pooling only passes its rows through, and
the indexer's key projection over the compressed entries, whose rounding can follow the batch, only chooses
entries, so a row can differ only where two entries' scores tie that closely.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

import kernels.cache.rows as cache_kernels
from dsl.context import ForwardContext, SequenceState
from dsl.graph import Graph
from graphs import artifact
from graphs.aot import Built
from graphs.capture import CudaGraphs
from graphs.executor import EXCHANGED, Executor
from graphs.launcher import CubinLauncher
from graphs.plan import Plan
from graphs.runtime import select_graph
from graphs.segments import StepSegment, step_segments
from kernels.launch import use_launcher
from kernels.moe.expert_parallel_kernel import ParallelMoeKernel
from kernels.targets import cubin_targets, get_target


class PlanRuntime:
    """`specs` and `cubins` by launch key (`Launch.key()`); `built` where freshly compiled (what `save` writes);
    `draft`: the DSpark draft layers' graph and plan, sharing the main graph's weights and cubins. On a `device`
    other than CUDA (a check on a machine without a GPU) the kernels launch as they are, without cubins: Triton's
    interpreter on CPU tensors, every node eager."""

    def __init__(self, graph: Graph, plan: Plan, specs: dict[str, dict], cubins: dict[str, bytes],
                 params: dict[str, torch.Tensor], built: dict[str, Built] | None = None,
                 draft: tuple[Graph, Plan] | None = None, cuda_graphs: bool | None = None,
                 device: torch.device | str = "cuda") -> None:
        plan.check_graph(graph)
        if draft is not None:
            draft[1].check_graph(draft[0])
        self.graph, self.plan = graph, plan
        self.draft_graph, self.draft_plan = draft if draft is not None else (None, None)
        self.specs, self.cubins, self.built = specs, cubins, built
        self.device = torch.device(device)
        self.cache_kernels = True  # False: the pools keep their torch path (for comparisons)
        self.launcher: CubinLauncher | None = None  # made with the executors, on CUDA
        self._host_params = params
        self._executors: tuple[Executor, Executor | None] | None = None
        self.parallel_experts: ParallelMoeKernel | None = None  # expert parallelism: `split_experts`
        if cuda_graphs is None:
            cuda_graphs = os.environ.get("DEEPINFER_CUDA_GRAPHS", "1") != "0"
        self._cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._ahead = 0  # decode tokens whose buckets are captured ahead (`capture_ahead`)

    @property
    def params(self) -> dict[str, torch.Tensor]:
        """The weights, on the GPU once the executors are made (on the host before)."""
        return self._executors[0].params if self._executors is not None else self._host_params

    @property
    def cuda_graphs(self) -> bool:
        """Whether steps of up to 512 tokens replay their static segments as CUDA graphs: on by default on CUDA,
        `DEEPINFER_CUDA_GRAPHS=0` turns it off. Setting it drops any graphs captured so far."""
        return self._cuda_graphs

    @cuda_graphs.setter
    def cuda_graphs(self, on: bool) -> None:
        self._cuda_graphs = bool(on) and self.device.type == "cuda"
        for executor in self._executors or ():
            if executor is not None:
                executor.cuda_graphs = CudaGraphs(executor.graph, ahead=self._ahead, uncaptured=executor.uncaptured,
                                                  draws=executor.draws) if self._cuda_graphs else None

    def capture_ahead(self, tokens: int) -> None:
        """Capture the graphs of every bucket up to `tokens` (the most a decode step runs) when the first is
        captured, largest first, in one memory pool (graphs/capture.py); the engine sets it from its batch size."""
        self._ahead = tokens
        for executor in self._executors or ():
            if executor is not None and executor.cuda_graphs is not None:
                executor.cuda_graphs.ahead = tokens

    def ready(self) -> None:
        self.executors()

    def graph_segments(self, num_tokens: int, draft: bool = False) -> list[StepSegment]:
        """How a step of `num_tokens` tokens runs the main graph (the draft graph when `draft`): its CUDA-graph
        segments where graphs are on, and the nodes between them (graphs/segments.py)."""
        uncaptured = EXCHANGED if self.parallel_experts is not None else frozenset()
        return step_segments(self._graph(draft), num_tokens, self._cuda_graphs, uncaptured=uncaptured)

    def _graph(self, draft: bool) -> Graph:
        return select_graph(self.graph, self.draft_graph, draft)

    def split_experts(self, kernel: ParallelMoeKernel) -> None:
        """Run as one rank of several (expert parallelism; graphs/lockstep.py): the weights hold this rank's routed
        experts only, and every MoE node exchanges its pairs through `kernel`, outside the CUDA graphs. Before the
        first step (the executors are made with it)."""
        if self._executors is not None:
            raise RuntimeError("split_experts comes before the first step: the executors are made already")
        self.parallel_experts = kernel

    def executors(self) -> tuple[Executor, Executor | None]:
        """(the main graph's executor, the draft graph's or None), made on first use with the cubins' launcher."""
        if self._executors is None:
            if self.device.type == "cuda":
                self._check_gpu()
                self.launcher = CubinLauncher(self.specs, self.cubins)
            main = Executor(self.graph, self.plan, self._host_params, self.device, cuda_graphs=self._cuda_graphs,
                            parallel_experts=self.parallel_experts)
            draft = None
            if self.draft_graph is not None:  # the same weights on the device, converted once for both
                draft = Executor(self.draft_graph, self.draft_plan, main.params, self.device,
                                 formatted=main.formatted, cuda_graphs=self._cuda_graphs,
                                 parallel_experts=self.parallel_experts, draws=False)
            self._executors = (main, draft)
            self.capture_ahead(self._ahead)
        return self._executors

    def _check_gpu(self) -> None:
        if not get_target(self.plan.target).runnable:
            runnable = ", ".join(t.name for t in cubin_targets() if t.runnable)
            raise RuntimeError(f"a {self.plan.target} artifact runs on a {self.plan.target} GPU; this build runs "
                               f"{runnable} only")
        if not torch.cuda.is_available():
            raise RuntimeError("running a GPU artifact needs a CUDA device")

    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, batch_invariant: bool,
            draft: bool = False) -> dict[str, torch.Tensor]:
        main, drafts = self.executors()
        executor = drafts if draft else main
        if executor is None:
            raise RuntimeError("this model was compiled without DSpark drafting: compile(..., drafting=True)")
        with self.launches(), self.pools([c.state for c in ctx.chunks]):
            return executor.run({"input_ids": input_ids}, ctx, batch_invariant)

    @contextlib.contextmanager
    def pools(self, states: list[SequenceState]) -> Iterator[None]:
        """For one step: the pools of `states` store and load cache entries with the cache kernels (unless
        `cache_kernels` is off), their own writer and reader put back after it."""
        pools = {id(s.cache): s.cache for s in states if s.cache is not None} if self.cache_kernels else {}
        kept = {key: (cache.writer, cache.reader) for key, cache in pools.items()}
        for cache in pools.values():
            cache.writer, cache.reader = cache_kernels.store_rows, cache_kernels.load_rows
        try:
            yield
        finally:
            for key, cache in pools.items():
                cache.writer, cache.reader = kept[key]

    def launches(self) -> contextlib.AbstractContextManager:
        """Kernel launches to the cubins' launcher; before the first step made it, or off CUDA, as they are."""
        return contextlib.nullcontext() if self.launcher is None else use_launcher(self.launcher)

    def sampling(self) -> contextlib.AbstractContextManager:
        """`sample_plain` launches the sampling kernel from the artifact's cubins, built for fp32 logits of the
        config's vocabulary as a step returns them, no Triton needed."""
        return self.launches()

    def save(self, path: str | Path, model_config: dict, model_dir: str | None) -> None:
        """Write the artifact: manifest.json, plan.json (draft_plan.json too with drafting), tuning.json,
        kernels/*.cubin with launch specs."""
        if self.built is None:
            raise ValueError(f"cannot save to {path}: only a freshly compiled model can be saved; a loaded one is "
                             "on disk already")
        artifact.save(path, self.plan, self.built, model_config, model_dir, self.draft_plan)


__all__ = ["PlanRuntime"]
